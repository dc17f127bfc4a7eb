"""The local front door passes a client's disconnect on to the replica, streamed or not: the replica
aborts the request (``finished_reason="abort"``), frees its KV blocks, and the door's in-flight count
drops back to 0; the door's default policy scores on the replica's scraped gauges. The replica is a real
``kvpilot serve`` on a tiny checkpoint; the door runs in-process on its own event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from urllib.parse import urlparse

import httpx
import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.local.frontdoor import FrontDoor
from tests.conftest import build_checkpoint
from tests.operator.conftest import wait_for
from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
MODEL = "tiny-llama"  # the name ServerProcess serves


@pytest.fixture(scope="module")
def replica(tmp_path_factory, tokenizer_dir):
    model = build_checkpoint(
        tmp_path_factory.mktemp("door-model"), tokenizer_dir, max_position_embeddings=4096
    )
    proc = ServerProcess(
        model,
        tmp_path_factory.mktemp("door-logs") / "replica.log",
        ["--num-gpu-blocks-override", "512", "--max-model-len", "4096"],
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def door(replica):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    front = FrontDoor(lambda: [replica.url], dict, port=0, logger=logging.getLogger("test.frontdoor"))
    asyncio.run_coroutine_threadsafe(front.start(), loop).result(30)
    try:
        yield front
    finally:
        asyncio.run_coroutine_threadsafe(front.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A request sent on a raw socket, so that the test decides when the client leaves."""
    parsed = urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_disconnect_at_the_door_aborts_at_the_replica(replica, door, stream):
    before = replica.metrics()
    body = {
        "model": MODEL,
        "prompt": "a long answer please",
        "max_tokens": 3500,
        "ignore_eos": True,
        "stream": stream,
    }
    sock = _raw_post(door.url, "/v1/completions", body)
    try:
        replica.wait_metric(m.NUM_REQUESTS_RUNNING, lambda v: v == 1, timeout_s=20)
        assert sum(door.in_flight.values()) == 1
    finally:
        sock.close()  # the client leaves before its answer is done
    replica.wait_metric(m.NUM_REQUESTS_RUNNING, lambda v: v == 0, timeout_s=5)
    replica.wait_metric(m.KV_CACHE_USAGE_PERC, lambda v: v == 0.0, timeout_s=5)
    after = replica.metrics()

    def delta(reason: str) -> float:
        name = m.REQUEST_SUCCESS_TOTAL
        return after.value(name, finished_reason=reason) - before.value(name, finished_reason=reason)

    assert delta("abort") == 1
    assert delta("length") == 0
    generated = after.value(m.GENERATION_TOKENS_TOTAL) - before.value(m.GENERATION_TOKENS_TOTAL)
    assert generated < 3500
    wait_for(lambda: sum(door.in_flight.values()) == 0, timeout=5, what="the door's in-flight count to drop")


def test_the_door_scores_on_the_replicas_scraped_gauges(replica, door):
    # The default policy reads the replica's /metrics in the background, not per request.
    wait_for(lambda: door.scraper.rounds >= 2, timeout=10, what="two scrape rounds")
    load = door.scraper.loads[replica.url]
    assert (load.num_requests_running, load.num_requests_waiting) == (0, 0)
    before = door.picks["load"]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    response = httpx.post(door.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    snapshot = door.snapshot()
    assert snapshot["policy"] == "score"
    assert snapshot["picks"]["load"] == before + 1  # a prompt shorter than a block: load decides
    assert httpx.get(door.url + "/metrics", timeout=10).status_code == 404  # metrics stay per replica
