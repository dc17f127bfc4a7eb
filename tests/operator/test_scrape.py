"""The scraper: concurrent, bounded by short timeouts and a size cap; failures are values, not raises."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpilot.operator.remediation.pods import Target
from kvpilot.operator.remediation.scrape import Scraper
from tests.operator.engine_metrics import EngineMetrics


class SlowServer:
    """Answers every GET with ``body`` after ``delay`` seconds."""

    def __init__(self, body: bytes, delay: float = 0.0, status: int = 200) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                time.sleep(outer.delay)
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                try:
                    self.wfile.write(outer.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args) -> None:
                pass

        self.body, self.delay, self.status = body, delay, status
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def target(self, name: str) -> Target:
        return Target("ns", name, f"uid-{name}", f"http://127.0.0.1:{self.server.server_address[1]}/metrics")

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers():
    started: list[SlowServer] = []

    def start(*args, **kwargs) -> SlowServer:
        started.append(SlowServer(*args, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def scrape(targets: list[Target], **options) -> tuple[list, float]:
    async def run():
        scraper = Scraper(**options)
        try:
            began = time.monotonic()
            results = await scraper.scrape(targets)
            return results, time.monotonic() - began
        finally:
            await scraper.close()

    return asyncio.run(run())


def test_targets_are_scraped_concurrently(servers):
    text = EngineMetrics().text().encode()
    targets = [servers(text, delay=0.4).target(f"p{i}") for i in range(6)]
    results, elapsed = scrape(targets, timeout_s=3.0)
    assert [r.target.name for r in results] == [f"p{i}" for i in range(6)]
    assert all(r.error is None and r.text == text.decode() for r in results)
    assert elapsed < 1.5, "six 0.4 s answers must overlap"


def test_failures_are_reported_per_target_within_the_timeout(servers):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    refused = Target("ns", "refused", "u", f"http://127.0.0.1:{closed_port}/metrics")
    slow = servers(b"x", delay=2.0).target("slow")
    broken = servers(b"engine error", status=500).target("broken")
    huge = servers(b"#" * 5000).target("huge")
    good = servers(EngineMetrics().text().encode()).target("good")
    results, elapsed = scrape([refused, slow, broken, huge, good], timeout_s=0.5, max_bytes=4096)
    errors = {r.target.name: r.error for r in results}
    assert errors["good"] is None
    assert errors["slow"] == "no answer within 0.5s"
    assert errors["broken"] == "HTTP 500"
    assert errors["huge"] == "response larger than 4096 bytes"
    assert errors["refused"].startswith("ClientConnectorError")
    assert elapsed < 1.5
