"""The scoring front door against two real ``kvpilot serve`` replicas on the tiny checkpoint: it avoids
a replica with a queue (where least-in-flight would not), it keeps a repeated system prompt on one
replica whose prefix cache then hits (where round robin spreads it), and ``kvpilot router`` does both
end to end with ``--backend`` URLs and with ``--backends-dns localhost:PORT``, exporting its own
``kvpilot_router_*`` metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
import threading
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.local.frontdoor import FrontDoor
from tests.conftest import build_checkpoint
from tests.operator.conftest import wait_for
from tests.server.conftest import Metrics, ServerProcess, kvpilot_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
MODEL = "tiny-llama"  # the name ServerProcess serves
_LISTENING = re.compile(r"listening on (http://\S+)")


def system_prompt(topic: str) -> str:
    """A system prompt of ~700 characters (many KV blocks of the tiny tokenizer)."""
    return f"You answer questions about {topic}. " + " ".join(
        f"Rule {i}: be brief about {topic}." for i in range(30)
    )


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tokenizer_dir):
    model = build_checkpoint(
        tmp_path_factory.mktemp("router-model"), tokenizer_dir, max_position_embeddings=4096
    )
    logs = tmp_path_factory.mktemp("router-logs")
    flags = ["--num-gpu-blocks-override", "512", "--max-model-len", "4096", "--max-num-seqs", "2"]
    procs = [ServerProcess(model, logs / f"replica-{i}.log", flags) for i in range(2)]  # load in parallel
    try:
        yield [proc.wait_ready() for proc in procs]
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
def make_door():
    """Front doors on one event loop in a thread, closed after the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    doors = []

    def make(urls: list[str], **options) -> FrontDoor:
        door = FrontDoor(lambda: urls, dict, port=0, logger=logging.getLogger("test.router"), **options)
        asyncio.run_coroutine_threadsafe(door.start(), loop).result(30)
        doors.append(door)
        return door

    try:
        yield make
    finally:
        for door in doors:
            asyncio.run_coroutine_threadsafe(door.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A request sent on a raw socket, so that the test decides when the client leaves."""
    parsed = urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _short_completions(url: str, count: int) -> None:
    for i in range(count):
        body = {"model": MODEL, "prompt": f"short {i}", "max_tokens": 2}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text


def _chat(url: str, system: str, count: int) -> None:
    for i in range(count):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text


def test_the_door_avoids_a_replica_with_a_queue(replicas, make_door):
    busy, idle = replicas
    urls = [busy.url, idle.url]
    scored = make_door(urls)
    least = make_door(urls, policy="least_in_flight")
    # Three long requests straight to `busy` (max 2 running): one queues there, unseen by the doors'
    # in-flight counts.
    long = {"model": MODEL, "prompt": "a long answer", "max_tokens": 3000, "ignore_eos": True}
    socks = [_raw_post(busy.url, "/v1/completions", long) for _ in range(3)]
    try:
        busy.wait_metric(m.NUM_REQUESTS_WAITING, lambda v: v >= 1, timeout_s=30)
        wait_for(
            lambda: (load := scored.scraper.loads.get(busy.url)) and load.num_requests_waiting >= 1,
            timeout=10,
            what="the door to scrape the queue",
        )
        _short_completions(scored.url, 6)
        _short_completions(least.url, 6)
    finally:
        for sock in socks:
            sock.close()
    assert (scored.served[busy.url], scored.served[idle.url]) == (0, 6)
    assert dict(scored.picks) == {"load": 6}
    assert (least.served[busy.url], least.served[idle.url]) == (3, 3)  # in-flight counts alone: turns
    busy.wait_metric(m.NUM_REQUESTS_RUNNING, lambda v: v == 0, timeout_s=15)


def test_a_repeated_system_prompt_stays_on_one_replica_and_hits_its_prefix_cache(replicas, make_door):
    urls = [r.url for r in replicas]
    door = make_door(urls)
    before = [r.metrics().value(m.PREFIX_CACHE_HITS_TOTAL) for r in replicas]
    _chat(door.url, system_prompt("tides"), 6)
    served = [door.served[u] for u in urls]
    assert sorted(served) == [0, 6]
    assert dict(door.picks) == {"load": 1, "prefix": 5}
    holder = served.index(6)
    hits = [r.metrics().value(m.PREFIX_CACHE_HITS_TOTAL) - b for r, b in zip(replicas, before, strict=True)]
    assert hits[1 - holder] == 0
    assert hits[holder] >= 5 * 5 * 16  # each repeat reads (at least) five full 16-token blocks from cache
    # Round robin spreads the same kind of traffic over both replicas.
    rr = make_door(urls, policy="round_robin")
    _chat(rr.url, system_prompt("winds"), 6)
    assert [rr.served[u] for u in urls] == [3, 3]


def test_the_door_learns_the_replicas_prompt_tokens_per_character(replicas, make_door):
    """The ratio the door learns from the replicas' vllm:request_prompt_tokens equals what the
    replicas counted for the prompts it sent, over the characters of those prompts."""
    urls = [r.url for r in replicas]
    door = make_door(urls)
    tokens_before = sum(r.metrics().value(m.REQUEST_PROMPT_TOKENS + "_sum") for r in replicas)
    assert door.scraper.tokens_per_char is None
    for i in range(8):
        _chat(door.url, system_prompt(f"topic {i}"), 1)
    wait_for(lambda: door.scraper.tokens_per_char is not None, timeout=10, what="a learned ratio")
    tokens = sum(r.metrics().value(m.REQUEST_PROMPT_TOKENS + "_sum") for r in replicas) - tokens_before
    chars = sum(door.flights.ended_of(u)[1] for u in urls)
    # Intervals where a request ended at the engine before its answer reached the door are skipped,
    # so the learned ratio covers most of the traffic, not necessarily all of it.
    assert door.scraper.tokens_per_char == pytest.approx(tokens / chars, rel=0.1)


def test_the_door_prices_the_decode_step_by_batch_from_the_replicas_counters(replicas, make_door):
    """The door's line of decode step time against batch size comes from the replicas' own step
    counters by batch class: its mean batch is what they counted (sequences over steps)."""
    urls = [r.url for r in replicas]
    door = make_door(urls)
    body = {"model": MODEL, "prompt": "count", "max_tokens": 24, "ignore_eos": True}
    # Four answers at once over two replicas of two slots: decode steps of two sequences, then of one
    # as the answers end.
    threads = [
        threading.Thread(target=lambda: httpx.post(door.url + "/v1/completions", json=body, timeout=60))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    def line():
        load = door.scraper.loads.get(urls[0])
        return load if load is not None and load.decode_step_per_seq_s is not None else None

    load = wait_for(line, timeout=10, what="the door's decode line")
    steps = seqs = 0.0
    for replica in replicas:
        metrics = replica.metrics()
        for batch in ("1", "2"):
            labels = {"phase": "decode", m.LABEL_NUM_SEQS: batch}
            steps += metrics.value(m.ENGINE_STEPS_TOTAL, **labels)
            seqs += metrics.value(m.ENGINE_STEP_SEQS_TOTAL, **labels)
    # The door decays older work by half every 30 s, so its mean batch is near the counters' own.
    assert 1.0 < load.decode_mean_seqs < 2.0
    assert load.decode_mean_seqs == pytest.approx(seqs / steps, rel=0.2)
    assert load.decode_step_per_seq_s >= 0.0
    # Pooled: every replica gets the same line from one scrape round (one snapshot of the loads).
    snapshot = door.scraper.loads
    assert snapshot[urls[1]].decode_mean_seqs == snapshot[urls[0]].decode_mean_seqs is not None


class RouterProcess:
    """``kvpilot router`` as a subprocess on a free port, its log in a file."""

    def __init__(self, flags: list[str], log_path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [*kvpilot_command(), "router", "--listen", "127.0.0.1:0", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (match := _LISTENING.search(log_path.read_text())):
            assert self.proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        self.url = match.group(1)

    def metrics(self) -> Metrics:
        response = httpx.get(self.url + "/metrics", timeout=10)
        assert response.status_code == 200
        return Metrics(response.text)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()
        return self.proc.returncode


def test_kvpilot_router_over_backend_urls(replicas, tmp_path):
    router = RouterProcess([f"--backend={r.url}" for r in replicas], tmp_path / "router.log")
    try:
        assert httpx.get(router.url + "/health", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        system = system_prompt("rivers")
        for i in range(4):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]
            answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
            assert answer.choices[0].finish_reason in ("length", "stop")
        stream = client.completions.create(model=MODEL, prompt="stream me", max_tokens=4, stream=True)
        assert len([chunk for chunk in stream if chunk.choices]) >= 1
        metrics = router.metrics()
        assert metrics.value("kvpilot_router_backends") == 2
        per_backend = [metrics.value("kvpilot_router_requests_total", backend=r.url) for r in replicas]
        assert sorted(per_backend) in ([0, 5], [1, 4])  # the chats on one; the stream anywhere
        assert metrics.value("kvpilot_router_picks_total", reason="prefix") == 3
        assert metrics.value("kvpilot_router_picks_total", reason="load") == 2
        assert metrics.value("kvpilot_router_scrape_errors_total", backend=replicas[0].url) == 0
    finally:
        assert router.stop() == 0


def test_kvpilot_router_over_dns_records(replicas, tmp_path):
    port = urlparse(replicas[0].url).port
    router = RouterProcess(
        ["--backends-dns", f"localhost:{port}", "--dns-refresh-s", "0.5"], tmp_path / "r.log"
    )
    try:
        response = httpx.post(
            router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert response.status_code == 200, response.text
        metrics = router.metrics()
        # localhost's records (127.0.0.1 on this machine, ::1 where it resolves too): the replica is one.
        backends = {s.labels["backend"] for s in metrics.samples if s.name == "kvpilot_router_in_flight"}
        assert f"http://127.0.0.1:{port}" in backends
        assert metrics.value("kvpilot_router_backends") == len(backends)
        assert metrics.value("kvpilot_router_requests_total", backend=f"http://127.0.0.1:{port}") == 1
        # Answered: no prefill is pending there any more.
        assert metrics.value("kvpilot_router_pending_prefill_tokens", backend=f"http://127.0.0.1:{port}") == 0
    finally:
        assert router.stop() == 0


def test_kvpilot_router_without_backends_exits_2():
    from kvpilot.cli import main

    assert main(["router", "--listen", "127.0.0.1:0"]) == 2
