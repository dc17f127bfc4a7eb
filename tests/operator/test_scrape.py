"""The scraper: concurrent, bounded by short timeouts and a size cap; failures are values, not raises."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpilot.operator.remediation.pods import Target
from kvpilot.operator.remediation.scrape import Scraper
from tests.operator.engine_metrics import EngineMetrics


class SlowServer:
    """Answers every GET with ``body`` after ``delay`` seconds, and once ``gate`` lets it through (a
    ``threading.Barrier`` all requests must reach, or an ``Event`` the test sets)."""

    def __init__(self, body: bytes, delay: float = 0.0, status: int = 200, gate=None) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                time.sleep(outer.delay)
                if isinstance(outer.gate, threading.Barrier):
                    outer.gate.wait(timeout=10)
                elif outer.gate is not None:
                    outer.gate.wait(timeout=30)
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                try:
                    self.wfile.write(outer.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args) -> None:
                pass

        self.body, self.delay, self.status, self.gate = body, delay, status, gate
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


def scrape(targets: list[Target], **options) -> list:
    async def run():
        scraper = Scraper(**options)
        try:
            return await scraper.scrape(targets)
        finally:
            await scraper.close()

    return asyncio.run(run())


def test_targets_are_scraped_concurrently(servers):
    """Each server answers only once all six requests have arrived: scraped one after another, the
    first would wait for the others and time out."""
    text = EngineMetrics().text().encode()
    all_arrived = threading.Barrier(6)
    targets = [servers(text, gate=all_arrived).target(f"p{i}") for i in range(6)]
    results = scrape(targets, timeout_s=5.0)
    assert [r.target.name for r in results] == [f"p{i}" for i in range(6)]
    assert [r.error for r in results] == [None] * 6
    assert all(r.text == text.decode() for r in results)


def test_failures_are_reported_per_target_within_the_timeout(servers):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    refused = Target("ns", "refused", "u", f"http://127.0.0.1:{closed_port}/metrics")
    released = threading.Event()  # the slow server answers only after the scrape has returned
    slow = servers(b"x", gate=released).target("slow")
    broken = servers(b"engine error", status=500).target("broken")
    huge = servers(b"#" * 5000).target("huge")
    good = servers(EngineMetrics().text().encode()).target("good")
    results = scrape([refused, slow, broken, huge, good], timeout_s=0.5, max_bytes=4096)
    released.set()
    errors = {r.target.name: r.error for r in results}
    assert errors["good"] is None
    assert errors["slow"] == "no answer within 0.5s"
    assert errors["broken"] == "HTTP 500"
    assert errors["huge"] == "body too large: more than 4096 bytes (the per-pod cap)"
    assert errors["refused"].startswith("ClientConnectorError")


class PiecesServer:
    """Writes ``body`` in ``pieces`` raw TCP writes, ``pause`` seconds apart; ``length`` (default: the
    body's) as Content-Length, or none at all (the body ends with the connection)."""

    def __init__(self, body: bytes, pieces: int, pause: float, length: int | None | str = "auto") -> None:
        self.body, self.pieces, self.pause = body, pieces, pause
        self.length = len(body) if length == "auto" else length
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):  # the client may hang up first (a refused body)
                conn.recv(65536)
                head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                if self.length is not None:
                    head += f"Content-Length: {self.length}\r\n"
                conn.sendall((head + "\r\n").encode())
                step = -(-len(self.body) // self.pieces)
                for start in range(0, len(self.body), step):
                    conn.sendall(self.body[start : start + step])
                    time.sleep(self.pause)

    def target(self) -> Target:
        return Target("ns", "pieces", "u", f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics")

    def stop(self) -> None:
        self.sock.close()


def engine_body(size: int) -> bytes:
    """An engine exposition padded with comment lines to about ``size`` bytes, info metrics last."""
    text = EngineMetrics().text()
    pad = "".join(f"# padding line {i:06d}\n" for i in range(max(0, size - len(text)) // 22))
    return (pad + text).encode()


@pytest.mark.parametrize("length", ["auto", None])
def test_a_body_written_in_slow_pieces_is_read_to_the_end(length):
    body = engine_body(24_806)
    server = PiecesServer(body, pieces=2, pause=0.2, length=length)
    try:
        (result,) = scrape([server.target()], timeout_s=3.0)
    finally:
        server.stop()
    assert result.error is None and result.text == body.decode()
    assert result.text.rstrip().endswith("1.0")  # the info metrics, which come last, arrived


def test_a_body_shorter_than_its_length_is_an_error_not_a_short_scrape():
    body = engine_body(5_000)
    server = PiecesServer(body, pieces=2, pause=0.05, length=len(body) + 100)
    try:
        (result,) = scrape([server.target()], timeout_s=3.0)
    finally:
        server.stop()
    assert result.text is None and result.error


def test_a_body_without_length_over_the_cap_is_refused():
    server = PiecesServer(b"#" * 20_000, pieces=4, pause=0.01, length=None)
    try:
        (result,) = scrape([server.target()], timeout_s=3.0, max_bytes=8_192)
    finally:
        server.stop()
    assert result.error == "body too large: more than 8192 bytes (the per-pod cap)"
