"""The router's pure parts: the scorer (load, KV usage, prefix affinity, stale data, ties), the prompt's
canonical text and chained block hashes, the bounded prefix index, the metrics reader, the
``HOST:PORT`` parser; and the scraper against a stub ``/metrics`` (one read per replica per round, a
refused port counted)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from kvpilot.engine import metrics_names as m
from kvpilot.operator.router import scoring
from kvpilot.operator.router.discovery import backend_url, parse_host_port
from kvpilot.operator.router.prefix import PrefixConfig, PrefixIndex, block_hashes, prompt_text
from kvpilot.operator.router.proxy import BalancingProxy
from kvpilot.operator.router.scoring import Candidate, EngineLoad, ScoringConfig
from kvpilot.operator.router.scrape import MetricsScraper, engine_load
from tests.operator.conftest import serve_routes

NOW = 1000.0


def load(waiting=0.0, running=0.0, kv=0.0, age=0.0, in_flight_at_scrape=0) -> EngineLoad:
    return EngineLoad(waiting, running, kv, scraped_at=NOW - age, in_flight_at_scrape=in_flight_at_scrape)


def pick(*candidates: Candidate, **kwargs) -> scoring.Pick:
    return scoring.pick(list(candidates), now=NOW, **kwargs)


# ---------------------------------------------------------------------------------------------- load
def test_a_replica_with_a_queue_is_avoided():
    chosen = pick(Candidate("a", 0, load(waiting=3, running=2)), Candidate("b", 0, load(running=2)))
    assert (chosen.url, chosen.reason) == ("b", scoring.REASON_LOAD)
    # A queued request costs more than a running one (waiting_weight 2).
    assert chosen.costs == {"a": 2 + 3 + 3, "b": 2}


def test_the_doors_own_requests_since_the_scrape_count_until_the_next_one():
    # Both idle at the scrape; the door has since sent 3 to a: a is the busier one now.
    chosen = pick(Candidate("a", 3, load()), Candidate("b", 1, load(running=1, in_flight_at_scrape=1)))
    assert chosen.url == "b"
    assert chosen.costs == {"a": 3, "b": 1}
    # Requests finished since the scrape never make a replica look less loaded than its in-flight count.
    assert (
        scoring.load_cost(Candidate("c", 2, load(running=1, in_flight_at_scrape=5)), NOW, ScoringConfig())
        == 2
    )


def test_kv_usage_breaks_an_equal_queue():
    chosen = pick(Candidate("a", 0, load(running=1, kv=0.9)), Candidate("b", 0, load(running=1, kv=0.2)))
    assert chosen.url == "b"
    assert chosen.costs["a"] == pytest.approx(1 + 4 * 0.9)


def test_equal_costs_take_turns_and_no_candidate_is_none():
    a, b = Candidate("a", 1), Candidate("b", 1)
    assert [pick(a, b, turn=t).url for t in range(4)] == ["a", "b", "a", "b"]
    assert scoring.pick([], now=NOW) is None


# ---------------------------------------------------------------------------------------------- stale data
def test_stale_metrics_are_ignored_and_the_in_flight_count_alone_decides():
    config = ScoringConfig(max_metrics_age_s=1.0)
    stale_queue = Candidate("a", 0, load(waiting=50, running=8, kv=1.0, age=1.5))
    busy = Candidate("b", 1, load(running=1, age=0.5, in_flight_at_scrape=1))
    chosen = pick(stale_queue, busy, config=config)
    assert chosen.url == "a"
    assert chosen.costs["a"] == 0
    assert scoring.fresh_load(stale_queue, NOW, config) is None
    # The same numbers inside the bound send the request elsewhere.
    fresh_queue = Candidate("a", 0, load(waiting=50, running=8, kv=1.0, age=0.9))
    assert pick(fresh_queue, busy, config=config).url == "b"


# ---------------------------------------------------------------------------------------------- prefix
def test_the_replica_with_the_longest_prefix_wins_at_equal_load():
    chosen = pick(
        Candidate("a", 0, load(), prefix_blocks=2),
        Candidate("b", 0, load(), prefix_blocks=8),
        Candidate("c", 0, load()),
        prompt_blocks=10,
    )
    assert (chosen.url, chosen.reason) == ("b", scoring.REASON_PREFIX)
    assert chosen.costs == pytest.approx({"a": -0.8, "b": -3.2, "c": 0.0})


def test_a_prefix_holder_takes_extra_load_up_to_the_prefix_weight_then_load_decides():
    config = ScoringConfig(prefix_weight=4.0)
    idle = Candidate("idle", 0, load())
    some = Candidate("holder", 0, load(running=3), prefix_blocks=10)
    assert pick(some, idle, prompt_blocks=10, config=config).url == "holder"
    overloaded = Candidate("holder", 0, load(running=3, waiting=2), prefix_blocks=10)  # cost 7 - 4
    chosen = pick(overloaded, idle, prompt_blocks=10, config=config)
    assert (chosen.url, chosen.reason) == ("idle", scoring.REASON_LOAD)


def test_prefill_queued_at_a_replica_counts_against_it():
    """Equal request counts, but one replica still has 40 uncached prompt blocks to prefill: the
    next request goes to the other, and a prefix holder with that much prefill queued loses its
    bonus's worth (40 x 0.125 = 5 > 4)."""
    busy = Candidate("busy", 2, load(running=2, in_flight_at_scrape=2), pending_prefill_blocks=40)
    free = Candidate("free", 2, load(running=2, in_flight_at_scrape=2))
    chosen = pick(busy, free)
    assert chosen.url == "free" and chosen.costs["busy"] - chosen.costs["free"] == pytest.approx(5.0)
    holder = Candidate("busy", 2, load(running=2, in_flight_at_scrape=2), 10, pending_prefill_blocks=40)
    assert pick(holder, free, prompt_blocks=10).url == "free"
    light = dataclasses.replace(holder, pending_prefill_blocks=8)  # 1 < 4: the holder keeps it
    chosen = pick(light, free, prompt_blocks=10)
    assert chosen.url == "busy" and chosen.uncached_blocks == 0
    assert pick(free, prompt_blocks=10).uncached_blocks == 10


def test_a_nearly_full_kv_cache_loses_the_prefix_bonus():
    full = Candidate("holder", 0, load(kv=0.96), prefix_blocks=10)
    assert scoring.prefix_bonus(full, 10, NOW, ScoringConfig()) == 0
    assert pick(full, Candidate("idle", 0, load(kv=0.5)), prompt_blocks=10).url == "idle"


def test_no_prompt_blocks_no_bonus():
    holder = Candidate("holder", 1, load(running=1, in_flight_at_scrape=1), prefix_blocks=3)
    assert pick(holder, Candidate("idle", 0, load()), prompt_blocks=0).url == "idle"


def chat(system: str, user: str, model: str = "m") -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": model, "messages": messages}).encode()


def test_prompt_text_renders_chat_and_completions_canonically():
    config = PrefixConfig(block_chars=16)
    system = "You are a careful assistant. " * 4
    one = block_hashes(prompt_text("/v1/chat/completions", chat(system, "first question " * 3)), config)
    two = block_hashes(prompt_text("/v1/chat/completions", chat(system, "other question " * 3)), config)
    shared = next(i for i, (x, y) in enumerate(zip(one, two, strict=True)) if x != y)
    assert len(system) // 16 <= shared < len(one)  # the system prompt's blocks are shared, the user's not
    other_model = block_hashes(
        prompt_text("/v1/chat/completions", chat(system, "first question", "n")), config
    )
    assert set(other_model).isdisjoint(one)  # chained from the model name on
    parts = [{"type": "text", "text": system}]
    as_parts = json.dumps({"model": "m", "messages": [{"role": "system", "content": parts}]}).encode()
    as_string = json.dumps({"model": "m", "messages": [{"role": "system", "content": system}]}).encode()
    assert prompt_text("/v1/chat/completions", as_parts) == prompt_text("/v1/chat/completions", as_string)
    assert prompt_text("/v1/completions", b'{"model": "m", "prompt": "abc"}') == "m\x1eabc"
    assert prompt_text("/v1/completions", b'{"model": "m", "prompt": [1, 22, 3]}') == "m\x1e1,22,3,"
    assert prompt_text("/v1/completions", b'{"model": "m", "prompt": ["x", "y"]}') == "m\x1ex"
    assert prompt_text("/v1/models", b"") is None
    assert prompt_text("/v1/completions", b"not json") is None
    assert prompt_text("/v1/chat/completions", b'{"messages": []}') is None


def test_block_hashes_are_chained_full_blocks_and_bounded():
    config = PrefixConfig(block_chars=4, max_blocks=3)
    assert block_hashes("abc", config) == []
    assert len(block_hashes("abcdefgh" + "xy", config)) == 2  # the partial block is not hashed
    assert len(block_hashes("a" * 400, config)) == 3
    # Same block, different history: different hashes.
    assert block_hashes("xxxxabcd", config)[1] != block_hashes("yyyyabcd", config)[1]
    assert block_hashes("abcdefgh", config) == block_hashes("abcdefgh", config)


def test_the_prefix_index_finds_the_longest_prefix_per_replica():
    index = PrefixIndex(PrefixConfig(capacity=100))
    index.record([1, 2, 3], "a")
    index.record([1, 2], "b")
    assert dict(index.matches([1, 2, 3, 4])) == {"a": 3, "b": 2}
    assert dict(index.matches([9, 2])) == {"a": 2, "b": 2}  # chained hashes: block 2 implies block 1
    assert index.matches([7]) == {}
    index.forget({"a"})
    assert dict(index.matches([1, 2, 3])) == {"b": 2}
    assert len(index) == 2


def test_the_prefix_index_is_bounded_and_evicts_the_least_recently_used():
    index = PrefixIndex(PrefixConfig(capacity=4, replicas_per_block=2))
    index.record([1, 2], "a")
    index.record([3, 4], "b")
    index.record([1], "c")  # touches block 1: block 2 is now the oldest
    index.record([5], "a")
    assert len(index) == 4
    assert index.matches([2]) == {}  # evicted
    assert dict(index.matches([3])) == {"b": 1}
    assert dict(index.matches([1])) == {"a": 1, "c": 1}
    index.record([1], "d")  # at most two replicas per block: the oldest goes
    assert dict(index.matches([1])) == {"c": 1, "d": 1}
    for n in range(100):
        index.record([1000 + n], "a")
    assert len(index) == 4


# ---------------------------------------------------------------------------------------------- reading
PAGE = f"""# HELP {m.NUM_REQUESTS_WAITING} Waiting.
# TYPE {m.NUM_REQUESTS_WAITING} gauge
{m.NUM_REQUESTS_WAITING}{{engine="0",model_name="x"}} 3.0
# HELP {m.NUM_REQUESTS_RUNNING} Running.
# TYPE {m.NUM_REQUESTS_RUNNING} gauge
{m.NUM_REQUESTS_RUNNING}{{engine="0",model_name="x"}} 2.0
# HELP {m.GPU_CACHE_USAGE_PERC} Deprecated KV usage.
# TYPE {m.GPU_CACHE_USAGE_PERC} gauge
{m.GPU_CACHE_USAGE_PERC}{{engine="0",model_name="x"}} 0.25
# HELP vllm:e2e_request_latency_seconds Latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="x"}} 1.0
vllm:e2e_request_latency_seconds_count{{model_name="x"}} 1.0
vllm:e2e_request_latency_seconds_sum{{model_name="x"}} 0.5
"""


def test_engine_load_reads_the_three_gauges_aliases_included():
    got = engine_load(PAGE, NOW, in_flight=4)
    assert got == EngineLoad(3.0, 2.0, 0.25, scraped_at=NOW, in_flight_at_scrape=4)
    assert engine_load(PAGE.replace(" 0.25", " 1.5"), NOW) is None  # KV usage above 1: not a healthy engine
    assert engine_load(PAGE.replace(m.NUM_REQUESTS_RUNNING, "other"), NOW) is None  # one missing
    assert engine_load("garbage {{{", NOW) is None


def test_parse_host_port_and_backend_urls():
    assert parse_host_port("0.0.0.0:8000") == ("0.0.0.0", 8000)
    assert parse_host_port("isvc-engine.ns.svc:8000") == ("isvc-engine.ns.svc", 8000)
    assert parse_host_port("[::1]:9") == ("::1", 9)
    for bad in ("8000", ":80", "host:http", "host:70000"):
        with pytest.raises(ValueError):
            parse_host_port(bad)
    assert backend_url("10.0.0.7", 8000) == "http://10.0.0.7:8000"
    assert backend_url("fd00::7", 8000) == "http://[fd00::7]:8000"


def test_the_round_robin_policy_ignores_load_and_the_score_policy_does_not():
    urls = ["http://a", "http://b"]
    rr = BalancingProxy(lambda: urls, logger=None, policy="round_robin")
    rr.in_flight["http://a"] = 9
    assert [rr.pick() for _ in range(4)] == urls * 2
    scored = BalancingProxy(lambda: urls, logger=None)
    scored.scraper.loads["http://a"] = EngineLoad(5, 2, 0.5, scraped_at=float("inf"))  # never stale
    assert {scored.pick() for _ in range(4)} == {"http://b"}
    with pytest.raises(ValueError, match="policy"):
        BalancingProxy(lambda: urls, logger=None, policy="random")


def test_the_door_counts_a_requests_uncached_blocks_until_its_first_output():
    """A fake replica streams a chat answer: the role-only event at once, the first token when the
    test says so. Until that token the request's uncached prompt blocks count against the replica;
    from it on, and after the answer, nothing does."""

    async def scenario() -> None:
        release = asyncio.Event()

        async def chat_completions(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n')
            await release.wait()
            await response.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
            await asyncio.sleep(0.2)
            await response.write(b"data: [DONE]\n\n")
            return response

        runner, replica = await serve_routes(("POST", "/v1/chat/completions", chat_completions))
        door = BalancingProxy(lambda: [replica], port=0, logger=None)
        url = await door.start()
        body = chat("x" * 640, "a question")  # 10 full blocks of 64 characters, and more
        blocks = len(block_hashes(prompt_text("/v1/chat/completions", body), door.prefix_config))
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(url + "/v1/chat/completions", data=body) as answer:
                    await answer.content.readline()  # the role event has come through
                    assert blocks >= 10 and door.pending_prefill[replica] == blocks
                    release.set()
                    await answer.content.readline()
                    await answer.content.readline()  # the first token's event
                    assert door.pending_prefill[replica] == 0 and door.in_flight[replica] == 1
                    await answer.read()
                # The same prompt again: the replica holds it, nothing is pending for it.
                release.clear()
                async with client.post(url + "/v1/chat/completions", data=body) as again:
                    await again.content.readline()
                    assert door.pending_prefill[replica] == 0
                    release.set()
                    await again.read()
            assert door.pending_prefill[replica] == 0 and door.in_flight[replica] == 0
        finally:
            await door.close()
            await runner.cleanup()

    asyncio.run(scenario())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_scraper_reads_each_replica_once_a_round_and_counts_a_refusal():
    async def scenario():
        hits = []

        async def metrics(request):
            hits.append(request.host)
            return web.Response(text=PAGE)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        up = f"http://127.0.0.1:{runner.addresses[0][1]}"
        down = f"http://127.0.0.1:{_free_port()}"
        refused = []
        scraper = MetricsScraper(
            lambda: [up, down], lambda url: 7, interval_s=0.01, on_refused=refused.append
        )
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(scraper.run(session))
            while scraper.rounds < 3:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
        return scraper, hits, refused, up, down

    scraper, hits, refused, up, down = asyncio.run(scenario())
    assert scraper.rounds <= len(hits) <= scraper.rounds + 1  # one read per round (one maybe cut short)
    assert scraper.loads[up].num_requests_waiting == 3.0
    assert scraper.loads[up].in_flight_at_scrape == 7
    assert down not in scraper.loads
    assert scraper.errors[down] >= 3 and scraper.errors[up] == 0
    assert set(refused) == {down}
