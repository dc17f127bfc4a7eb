"""The router's pure parts: the scorer (its time-to-first-token prediction from the door's flights and the
replica's sizes and rates, prefix affinity, stale data, ties), the prompt's
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
from kvpilot.operator.router.prefix import (
    PrefixConfig,
    PrefixIndex,
    block_hashes,
    prompt_text,
    request_object,
)
from kvpilot.operator.router.proxy import BalancingProxy, max_tokens_of
from kvpilot.operator.router.scoring import Candidate, EngineLoad, Flight, ScoringConfig
from kvpilot.operator.router.scrape import (
    MIN_MATCHED_CHARS,
    RATE_HALF_LIFE_S,
    MetricsScraper,
    Work,
    engine_load,
    fleet_rates,
    tokens_per_char,
)
from tests.operator.conftest import serve_routes

NOW = 1000.0
# Round numbers for the arithmetic below: 1 ms per prefill token, 20 ms per decode step.
RATES = dict(max_num_seqs=8, max_num_batched_tokens=1000, prefill_s_per_token=0.001, decode_step_s=0.02)


def load(waiting=0.0, running=0.0, kv=0.0, age=0.0, in_flight_at_scrape=0, **rates) -> EngineLoad:
    return EngineLoad(
        waiting,
        running,
        kv,
        scraped_at=NOW - age,
        in_flight_at_scrape=in_flight_at_scrape,
        **{**RATES, **rates},
    )


def pick(*candidates: Candidate, **kwargs) -> scoring.Pick:
    kwargs.setdefault("typical_output", 16)
    kwargs.setdefault("typical_prompt", 100)
    return scoring.pick(list(candidates), now=NOW, **kwargs)


def ttft(candidate: Candidate, tokens: float, typical_output=16, typical_prompt=100, **kwargs) -> float:
    return scoring.predict_ttft(
        candidate, tokens, now=NOW, typical_output=typical_output, typical_prompt=typical_prompt, **kwargs
    )


# ------------------------------------------------------------------------------------ prediction
def test_an_idle_replica_answers_after_the_prompts_own_prefill():
    # 100 tokens at 1 ms, in one chunk of the 1,000-token budget carrying one 20 ms step.
    assert ttft(Candidate("a", (), load()), 100) == pytest.approx(0.1 + 0.02)
    # 2,500 tokens: three chunks.
    assert ttft(Candidate("a", (), load()), 2500) == pytest.approx(2.5 + 3 * 0.02)


def test_prefill_queued_ahead_is_served_first_one_engine_at_a_time():
    queued = [Flight(200), Flight(300)]  # sent, no output yet
    # 0.2 + 0.02, then 0.3 + 0.02, then this request's 0.1 + 0.02.
    assert ttft(Candidate("a", queued, load()), 100) == pytest.approx(0.66)
    # Once their first tokens came, their prefill is behind: only their sequence slots remain taken.
    for flight in queued:
        flight.prefilled = True
    assert ttft(Candidate("a", queued, load()), 100) == pytest.approx(0.12)


def test_a_full_batch_makes_the_request_wait_for_the_first_sequence_to_finish():
    # max_num_seqs 2, both running answers of a typical 32 tokens: 10 and 30 still to come; the
    # first slot frees after 10 steps.
    running = [Flight(0, outputs=22, prefilled=True), Flight(0, outputs=2, prefilled=True)]
    candidate = Candidate("a", running, load(max_num_seqs=2))
    assert ttft(candidate, 100, typical_output=32) == pytest.approx(10 * 0.02 + 0.12)
    # A bound below the typical answer counts: 5 - 2 = 3 tokens left.
    running[0] = Flight(0, max_tokens=5, outputs=2, prefilled=True)
    assert ttft(candidate, 100, typical_output=32) == pytest.approx(3 * 0.02 + 0.12)


def test_requests_admitted_together_decode_only_after_their_waves_prefill():
    # max_num_seqs 2: two 400-token prompts admitted at once are prefilled together (0.42 + 0.42 s);
    # neither decodes before that, so the first slot frees 16 steps after 0.84 s, not after 0.42 s.
    wave = [Flight(400), Flight(400)]
    assert ttft(Candidate("a", wave, load(max_num_seqs=2)), 100) == pytest.approx(0.84 + 16 * 0.02 + 0.12)


def test_requests_the_door_did_not_send_count_as_typical_ones():
    # The engine held 2 running and 1 waiting at a fresh scrape, when the door had sent it nothing.
    candidate = Candidate("a", (), load(waiting=1, running=2, max_num_seqs=4))
    assert scoring.unseen_requests(candidate, NOW, ScoringConfig()) == (2, 1)
    # The waiting one's 100-token typical prompt first, then this one's; the four slots not yet full.
    assert ttft(candidate, 100) == pytest.approx(0.12 + 0.12)
    # With max_num_seqs 2 the waiting one waits for a slot: a running one ends after 8 more of its 16
    # tokens, then the waiting one prefills (0.12), and this one behind it, in the slot the other
    # running one frees at the same time.
    assert ttft(Candidate("a", (), load(waiting=1, running=2, max_num_seqs=2)), 100) == pytest.approx(
        8 * 0.02 + 0.12 + 0.12
    )


def test_a_stale_scrape_keeps_the_sizes_and_rates_but_not_the_gauges():
    config = ScoringConfig(max_metrics_age_s=1.0)
    stale = Candidate("a", (), load(waiting=50, running=8, kv=1.0, age=1.5))
    assert scoring.fresh_load(stale, NOW, config) is None
    assert scoring.unseen_requests(stale, NOW, config) == (0, 0)
    assert ttft(stale, 100, config=config) == pytest.approx(0.12)  # the replica's own rates still
    fresh = Candidate("a", (), load(waiting=50, running=8, kv=1.0, age=0.9))
    assert ttft(fresh, 100, config=config) > 1.0


def test_without_a_report_the_configs_priors_stand_in():
    config = ScoringConfig(prefill_s_per_token=0.002, decode_step_s=0.05, max_num_batched_tokens=8192)
    assert ttft(Candidate("a"), 100, config=config) == pytest.approx(0.2 + 0.05)
    partial = EngineLoad(0, 0, 0, scraped_at=NOW, decode_step_s=0.01)  # vLLM: no config info
    rates = scoring.rates_of(partial, config)
    assert (rates.max_num_seqs, rates.prefill_s_per_token, rates.decode_step_s) == (256, 0.002, 0.01)


def test_a_nearly_full_kv_cache_is_charged_one_typical_generation():
    assert ttft(Candidate("a", (), load(kv=0.96)), 100) == pytest.approx(0.12 + 16 * 0.02)
    assert ttft(Candidate("a", (), load(kv=0.90)), 100) == pytest.approx(0.12)


def test_the_tail_past_the_replayed_flights_is_costed_at_its_mean():
    flights = [Flight(10) for _ in range(6)]
    config = ScoringConfig(max_simulated=4)
    exact = ttft(Candidate("a", flights, load(max_num_seqs=100)), 10)
    approx = ttft(Candidate("a", flights, load(max_num_seqs=100)), 10, config=config)
    # Every flight's prefill (0.01 + 0.02) counts either way; the tail adds its decode share too.
    assert exact == pytest.approx(7 * 0.03)
    assert approx == pytest.approx(7 * 0.03 + 2 * (16 * 0.02 / 100))


# ------------------------------------------------------------------------------------ the pick
def test_the_soonest_replica_is_picked_and_costs_look_one_request_ahead():
    busy = Candidate("a", [Flight(500)], load())
    chosen = pick(busy, Candidate("b", (), load()), prompt_tokens=100)
    assert (chosen.url, chosen.reason, chosen.uncached_tokens) == ("b", scoring.REASON_LOAD, 100)
    assert chosen.predicted == pytest.approx({"a": 0.52 + 0.12, "b": 0.12})
    # Sent to a: 0.64, and b stays free for the next (0.12). Sent to b: 0.12, and the next one's
    # best is b again, behind it (0.24), not a (0.64): the worse of each pair is the cost.
    assert chosen.costs == pytest.approx({"a": 0.64, "b": 0.24})


def test_a_prefix_holder_is_picked_while_its_queue_costs_less_than_the_prefill_it_saves():
    """600-token prompts; the holder has 560 of them cached (35 blocks of 16 tokens), so it prefills
    40 tokens (0.06 s) where the other prefills 600 (0.62 s)."""
    holder = Candidate("holder", [Flight(200)], load(), prefix_blocks=35)  # 0.22 s queued
    cold = Candidate("cold", (), load())
    chosen = pick(holder, cold, prompt_tokens=600, tokens_per_block=16)
    assert (chosen.url, chosen.reason, chosen.uncached_tokens) == ("holder", scoring.REASON_PREFIX, 40)
    # 700 tokens queued at the holder (0.72 s) outweigh the 0.56 s it would save for this request
    # alone; but sent cold, the next uncached prompt would wait behind it (1.24 s) where the holder
    # keeps it at 0.80: the holder takes it, and the cold replica stays free for the next.
    busier = dataclasses.replace(holder, flights=[Flight(700)])
    chosen = pick(busier, cold, prompt_tokens=600, tokens_per_block=16)
    assert chosen.predicted == pytest.approx({"holder": 0.72 + 0.06, "cold": 0.62})
    assert chosen.costs == pytest.approx({"holder": 0.78, "cold": 1.24})
    assert (chosen.url, chosen.uncached_tokens) == ("holder", 40)
    # 2,000 tokens queued there (2.02 s): the cold replica, both for this request and for the tail.
    busiest = dataclasses.replace(holder, flights=[Flight(2000)])
    chosen = pick(busiest, cold, prompt_tokens=600, tokens_per_block=16)
    assert (chosen.url, chosen.uncached_tokens) == ("cold", 600)


def test_a_burst_is_spread_by_the_work_each_request_brings():
    """Picking a burst one request at a time, each pick added to the chosen replica's flights (as the
    door does): the holder of a shared prompt takes the cheap shared requests, the cold prompts go
    where the least prefill waits, and neither replica ends with more than one cold prompt above
    the other."""
    replicas = {"a": [], "b": []}
    burst = ["shared"] * 4 + ["cold"] * 4
    for i, kind in enumerate(burst):
        candidates = [
            Candidate("a", replicas["a"], load(), prefix_blocks=35 if kind == "shared" else 0),
            Candidate("b", replicas["b"], load()),
        ]
        chosen = pick(*candidates, prompt_tokens=600, tokens_per_block=16, turn=i)
        replicas[chosen.url].append(Flight(chosen.uncached_tokens))
    shared_at = [len([f for f in flights if f.uncached_tokens == 40]) for flights in replicas.values()]
    cold_at = [len([f for f in flights if f.uncached_tokens == 600]) for flights in replicas.values()]
    assert shared_at == [4, 0]
    assert cold_at in ([2, 2], [1, 3])  # a's 4 x 40 shared tokens are worth about a third of a cold one
    work = [sum(f.uncached_tokens for f in flights) for flights in replicas.values()]
    assert abs(work[0] - work[1]) <= 600


def test_ties_go_to_the_longest_prefix_then_take_turns_and_no_candidate_is_none():
    a, b = Candidate("a", (), load()), Candidate("b", (), load())
    assert [pick(a, b, turn=t).url for t in range(4)] == ["a", "b", "a", "b"]
    # Both hold the whole 10-token prompt: equal predictions, the longer match wins.
    holder = dataclasses.replace(b, prefix_blocks=2)
    short = dataclasses.replace(a, prefix_blocks=1)
    assert {pick(short, holder, prompt_tokens=10, tokens_per_block=16, turn=t).url for t in range(4)} == {"b"}
    assert scoring.pick([], now=NOW) is None


def test_the_configs_bounds_are_checked():
    for bad in (dict(max_num_seqs=0), dict(decode_step_s=-1.0), dict(tie_s=float("nan"))):
        with pytest.raises(ValueError):
            ScoringConfig(**bad)


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
    got = engine_load(PAGE, NOW, in_flight=4).load
    assert got == EngineLoad(3.0, 2.0, 0.25, scraped_at=NOW, in_flight_at_scrape=4)
    assert engine_load(PAGE.replace(" 0.25", " 1.5"), NOW) is None  # KV usage above 1: not a healthy engine
    assert engine_load(PAGE.replace(m.NUM_REQUESTS_RUNNING, "other"), NOW) is None  # one missing
    assert engine_load("garbage {{{", NOW) is None


def step_page(prefill_s, prefill_tokens, decode_s, decode_steps, max_num_seqs=6) -> str:
    """PAGE plus kvpilot_config_info and the step counters, split over two batch classes each."""
    lines = [
        f"# TYPE {m.CONFIG_INFO} gauge",
        f'{m.CONFIG_INFO}{{max_num_seqs="{max_num_seqs}",max_num_batched_tokens="512",'
        'max_waiting_requests="",preemption_mode="recompute"} 1.0',
    ]
    for name, per_phase in (
        (m.ENGINE_STEP_SECONDS_TOTAL, {"prefill": prefill_s, "decode": decode_s}),
        (m.ENGINE_STEP_TOKENS_TOTAL, {"prefill": prefill_tokens, "decode": decode_steps * 4}),
        (m.ENGINE_STEPS_TOTAL, {"prefill": 3, "decode": decode_steps}),
    ):
        lines.append(f"# TYPE {name} counter")
        for phase, value in per_phase.items():
            for batch in ("1", "2"):
                lines.append(f'{name}{{engine="0",num_seqs="{batch}",phase="{phase}"}} {value / 2}')
    return PAGE + "\n".join(lines) + "\n"


def test_engine_load_reads_the_sizes_and_the_rates_from_the_recent_work():
    first = engine_load(step_page(2.0, 1000, 1.0, 50), NOW)
    assert (first.load.max_num_seqs, first.load.max_num_batched_tokens) == (6, 512)
    # From the start: 2 s over 1,000 prefill tokens; 1 s over 50 decode steps (summed over batch classes).
    assert first.load.prefill_s_per_token == pytest.approx(0.002)
    assert first.load.decode_step_s == pytest.approx(0.02)
    # 10 s later: +1 s over +1,000 tokens and +1 s over +25 steps, the earlier work decayed.
    keep = 0.5 ** (10 / RATE_HALF_LIFE_S)
    second = engine_load(step_page(3.0, 2000, 2.0, 75), NOW + 10, before=first)
    assert second.load.prefill_s_per_token == pytest.approx((2 * keep + 1) / (1000 * keep + 1000))
    assert second.load.decode_step_s == pytest.approx((1 * keep + 1) / (50 * keep + 25))
    # A restart (the counters fell): no new work, the rates stand.
    third = engine_load(step_page(0.1, 10, 0.1, 1), NOW + 20, before=second)
    assert third.load.prefill_s_per_token == pytest.approx(second.load.prefill_s_per_token)
    assert third.load.decode_step_s == pytest.approx(second.load.decode_step_s)
    # ... and the next scrape counts from the restarted counters.
    fourth = engine_load(step_page(0.6, 510, 0.1, 1), NOW + 20, before=third)
    assert fourth.work.prefill_tokens == pytest.approx(third.work.prefill_tokens + 500)


def class_page(classes: dict[str, tuple[float, float, float]]) -> str:
    """PAGE plus decode step counters by batch class: {class: (seconds, steps, sequences)}."""
    lines = []
    for i, name in enumerate((m.ENGINE_STEP_SECONDS_TOTAL, m.ENGINE_STEPS_TOTAL, m.ENGINE_STEP_SEQS_TOTAL)):
        lines.append(f"# TYPE {name} counter")
        for batch, values in classes.items():
            lines.append(f'{name}{{engine="0",num_seqs="{batch}",phase="decode"}} {values[i]}')
            lines.append(f'{name}{{engine="0",num_seqs="{batch}",phase="prefill"}} 7.0')
    return PAGE + "\n".join(lines) + "\n"


def test_the_decode_step_grows_with_the_batch_as_the_batch_classes_measured_it():
    # 20 steps of one sequence at 25 ms, 10 of eight at 60 ms: 5 ms per added sequence, around the
    # steps' mean batch of (20 + 80) / 30 sequences, whose mean step is 1.1 s / 30.
    first = engine_load(class_page({"1": (0.5, 20, 20), "5-8": (0.6, 10, 80)}), NOW).load
    assert first.decode_step_s == pytest.approx(1.1 / 30)
    assert first.decode_mean_seqs == pytest.approx(100 / 30)
    assert first.decode_step_per_seq_s == pytest.approx(0.005)
    rates = scoring.rates_of(first, ScoringConfig())
    assert rates.decode_step_at(1) == pytest.approx(0.025) and rates.decode_step_at(8) == pytest.approx(0.06)
    # 30 s later (half the earlier work kept): 10 more steps of eight, now at 100 ms.
    reading = engine_load(class_page({"1": (0.5, 20, 20), "5-8": (0.6, 10, 80)}), NOW)
    later = engine_load(class_page({"1": (0.5, 20, 20), "5-8": (1.6, 20, 160)}), NOW + 30, before=reading)
    assert dict((b, tuple(v)) for b, *v in later.work.decode_classes) == {
        "1": pytest.approx((0.25, 10, 10)),
        "5-8": pytest.approx((0.3 + 1.0, 15, 120)),
    }
    # Class means 25 ms at 1 and 1.3 / 15 s at 8: the line through them.
    assert later.load.decode_step_per_seq_s == pytest.approx((1.3 / 15 - 0.025) / 7)
    # Steps that got faster with more sequences (noise) are taken as flat; one class gives no line.
    falling = engine_load(class_page({"1": (0.6, 20, 20), "2": (0.4, 20, 40)}), NOW).load
    assert falling.decode_step_per_seq_s == 0.0 and falling.decode_step_s == pytest.approx(0.025)
    alone = engine_load(class_page({"1": (0.5, 20, 20), "5-8": (0.1, 2, 16)}), NOW).load  # 2 < 3 steps
    assert alone.decode_step_per_seq_s is None and alone.decode_mean_seqs is None
    # Pooled over replicas: one measured only single sequences, the other only batches of eight.
    works = [
        Work(0, 0, 0.5, 20, (("1", 0.5, 20, 20),)),
        Work(0, 0, 0.6, 10, (("5-8", 0.6, 10, 80),)),
    ]
    pooled = fleet_rates({"a": alone, "b": alone}, works)
    assert pooled["a"].decode_step_per_seq_s == pytest.approx(0.005)
    assert pooled["b"].decode_mean_seqs == pytest.approx(100 / 30)


def test_the_prediction_prices_decode_steps_at_the_batch_the_replica_will_run():
    # Two slots, both held by answers 10 tokens from their end: a request with nothing to prefill
    # waits 10 steps for a slot and takes one step to its first token, at a batch of two.
    flat = load(waiting=0, running=2, in_flight_at_scrape=2, max_num_seqs=2, decode_step_s=0.03)
    grows = dataclasses.replace(flat, decode_mean_seqs=1.0, decode_step_per_seq_s=0.01)
    flights = [Flight(0.0, outputs=6, prefilled=True)] * 2
    kwargs = dict(now=NOW, typical_output=16, typical_prompt=100)
    assert scoring.predict_ttft(Candidate("a", flights, flat), 0.0, **kwargs) == pytest.approx(11 * 0.03)
    assert scoring.predict_ttft(Candidate("a", flights, grows), 0.0, **kwargs) == pytest.approx(11 * 0.04)


def prompt_page(count: float, tokens: float) -> str:
    """PAGE plus the prompt-token histogram's count and sum (kvpilot and vLLM observe it at the end)."""
    name = m.REQUEST_PROMPT_TOKENS
    return PAGE + (
        f"# TYPE {name} histogram\n"
        f'{name}_bucket{{le="+Inf",model_name="x"}} {count}\n'
        f'{name}_count{{model_name="x"}} {count}\n'
        f'{name}_sum{{model_name="x"}} {tokens}\n'
    )


def test_prompt_tokens_per_character_are_learned_where_the_engine_finished_what_the_door_saw_end():
    first = engine_load(prompt_page(2, 300), NOW, ended=(2, 1000.0))
    assert first.matched == (0.0, 0.0)  # no interval yet
    # 3 more finished, and the door saw exactly 3 end, with 1,500 characters: 450 tokens for them.
    second = engine_load(prompt_page(5, 750), NOW + 1, before=first, ended=(5, 2500.0))
    assert second.matched == (450.0, 1500.0)
    # The engine finished one the door has not seen end (another client's, or not yet relayed): skipped.
    third = engine_load(prompt_page(7, 1000), NOW + 2, before=second, ended=(6, 3000.0))
    assert third.matched == second.matched
    # A restart: the counters fell, nothing is attributed.
    fourth = engine_load(prompt_page(1, 100), NOW + 3, before=third, ended=(7, 3500.0))
    assert fourth.matched == second.matched
    # The ratio is pooled over the replicas, and trusted only past MIN_MATCHED_CHARS characters.
    assert tokens_per_char([second]) is None
    other = dataclasses.replace(second, matched=(1200.0, MIN_MATCHED_CHARS))
    assert tokens_per_char([second, other]) == pytest.approx(1650 / (1500 + MIN_MATCHED_CHARS))


def test_the_replicas_rates_are_pooled_over_their_work():
    # One replica prefilled 1,000 tokens in 1 s, the other 3,000 in 6 s: 7 s / 4,000 tokens for both.
    loads = {"a": EngineLoad(0, 0, 0, NOW, prefill_s_per_token=0.001), "b": EngineLoad(0, 0, 0, NOW)}
    works = [Work(1.0, 1000.0, 0.0, 0.0), Work(6.0, 3000.0, 0.0, 0.0)]
    pooled = fleet_rates(loads, works)
    assert [pooled[u].prefill_s_per_token for u in "ab"] == [pytest.approx(7 / 4000)] * 2
    assert pooled["a"].decode_step_s is None  # nobody measured a decode step: left as it was
    assert pooled["a"].num_requests_waiting == 0 and fleet_rates({}, works) == {}


def test_an_engine_without_step_counters_gets_its_decode_step_from_the_inter_token_latency():
    itl = m.INTER_TOKEN_LATENCY_SECONDS
    page = PAGE + (
        f"# TYPE {itl} histogram\n"
        f'{itl}_bucket{{le="+Inf",model_name="x"}} 200.0\n'
        f'{itl}_count{{model_name="x"}} 200.0\n'
        f'{itl}_sum{{model_name="x"}} 5.0\n'
    )
    got = engine_load(page, NOW).load
    assert got.decode_step_s == pytest.approx(0.025)
    assert got.prefill_s_per_token is None and got.max_num_seqs is None


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


def test_the_door_keeps_each_flight_current_as_its_answer_streams():
    """A fake replica streams a chat answer: the role-only event at once, the first token when the
    test says so. Until that token the request's uncached prompt tokens count as prefill queued at the
    replica; from it on they do not, its output is counted, and the answer's length, once it ends,
    is the door's typical answer."""

    async def scenario() -> None:
        release = asyncio.Event()

        async def chat_completions(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n')
            await release.wait()
            for token in ("hi", " there", "!"):
                await response.write(
                    b'data: {"choices": [{"delta": {"content": "%s"}}]}\n\n' % token.encode()
                )
                await asyncio.sleep(0.05)
            await response.write(b"data: [DONE]\n\n")
            return response

        runner, replica = await serve_routes(("POST", "/v1/chat/completions", chat_completions))
        door = BalancingProxy(lambda: [replica], port=0, logger=None)
        url = await door.start()
        body = chat("x" * 640, "a question")  # 10 full blocks of 64 characters, and more
        chars = len(prompt_text("/v1/chat/completions", body))
        blocks = len(block_hashes(prompt_text("/v1/chat/completions", body), door.prefix_config))
        try:
            async with aiohttp.ClientSession() as client:
                async with client.post(url + "/v1/chat/completions", data=body) as answer:
                    await answer.content.readline()  # the role event has come through
                    assert blocks >= 10
                    assert door.flights.pending_prefill_tokens(replica) == pytest.approx(chars / 4)
                    (flight,) = door.flights.of(replica)
                    assert (flight.prefilled, flight.outputs) == (False, 0)
                    release.set()
                    await answer.content.readline()
                    await answer.content.readline()  # the first token's event
                    assert door.flights.pending_prefill_tokens(replica) == 0 and door.in_flight[replica] == 1
                    assert flight.prefilled and flight.outputs >= 1
                    await answer.read()
                assert door.flights.typical_output == 3 and door.flights.of(replica) == []
                assert door.flights.ended_of(replica) == (1, chars)  # for the tokens-per-character ratio
                # The same prompt again: the replica holds its full blocks; only the rest is pending.
                release.clear()
                async with client.post(url + "/v1/chat/completions", data=body) as again:
                    await again.content.readline()
                    pending = door.flights.pending_prefill_tokens(replica)
                    assert pending == pytest.approx((chars - 64 * blocks) / 4)
                    release.set()
                    await again.read()
            assert door.flights.pending_prefill_tokens(replica) == 0 and door.in_flight[replica] == 0
        finally:
            await door.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_max_tokens_of_reads_the_requests_output_bound():
    assert max_tokens_of(request_object(b'{"max_tokens": 7}')) == 7
    assert max_tokens_of(request_object(b'{"max_completion_tokens": 9, "max_tokens": 7}')) == 9
    for body in (b'{"max_tokens": 0}', b'{"max_tokens": true}', b"[1]", b"not json", b"{}"):
        assert max_tokens_of(request_object(body)) is None


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
