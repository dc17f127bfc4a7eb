"""The SSE event encoding: one ``data:`` line per event for every line reader, the text unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpilot.engine.server.streaming import sse_event


@pytest.mark.parametrize(
    "text", ["a\x85b", "line\u2028sep", "para\u2029sep", "\u2028\u2029\x85", "\n\r\x0b\x0c\x1c"]
)
def test_generated_line_breaks_stay_inside_one_data_line(text):
    """Python's ``str.splitlines`` (httpx's ``iter_lines``) breaks lines at U+0085, U+2028, U+2029 and
    at the C0 separators; an event holding them in its text must still read as one line, whose JSON
    gives back the same text."""
    event = sse_event({"choices": [{"index": 0, "text": text}]})
    assert event.endswith("\n\n")
    lines = event.splitlines()
    assert lines == [event[:-2], ""], lines  # the event's line, then the blank line that ends it
    assert lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :])["choices"][0]["text"] == text


def test_other_text_goes_out_raw_as_utf8():
    """Only the line-breaking characters are escaped: the rest of the text is sent as UTF-8."""
    event = sse_event({"text": "café ☕ 日本\u2028"})
    assert "café ☕ 日本" in event
    assert "\\u2028" in event and "\u2028" not in event


def test_the_stream_backend_loads_at_start_up_not_on_the_first_stream():
    """anyio imports its asyncio backend on the first task group, milliseconds of imports that would land
    on the first streamed request's TTFT (the engine thread waits for the interpreter). The server's
    lifespan loads it before it listens. A fresh interpreter, as the server's own: importing the app
    does not load it, starting the app does."""
    script = """
import asyncio, sys
from kvpilot.engine.server import app as server_app

class Engine:
    started = stopped = False
    def start(self):
        self.started = True
    def shutdown(self):
        self.stopped = True

class State:
    engine = Engine()
    model_name = "m"

backend = "anyio._backends._asyncio"
assert backend not in sys.modules, "loaded by the import alone"
app = server_app.build_app(State())

async def main():
    async with app.router.lifespan_context(app):
        assert State.engine.started
        assert backend in sys.modules, "not loaded at start-up"
    assert State.engine.stopped

asyncio.run(main())
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")
