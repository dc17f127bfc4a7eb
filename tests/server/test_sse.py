"""The SSE event encoding: one ``data:`` line per event for every line reader, the text unchanged."""

from __future__ import annotations

import json

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
