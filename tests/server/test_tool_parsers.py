"""Unit tests for the tool-call output parsers, whole and streamed (no model, no server)."""

from __future__ import annotations

import json
import random

import pytest

from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.server.tool_choice import ToolPlan
from kvpilot.engine.server.tool_parsers import (
    PARSERS,
    DeltaOutput,
    ToolCallStream,
    parse_hermes,
    parse_llama3_json,
    parse_required,
)


def test_hermes_single_call_with_text_before() -> None:
    out = parse_hermes('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert out.content == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("f", {"x": 1})]


def test_hermes_several_calls_and_unicode() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"city": "Zürich 東京"}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    out = parse_hermes(text)
    assert out.content is None
    assert [c.name for c in out.tool_calls] == ["a", "b"]
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Zürich 東京"}
    assert "Zürich" in out.tool_calls[0].arguments


def test_hermes_malformed_is_content() -> None:
    text = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    out = parse_hermes(text)
    assert out.content == text and out.tool_calls == []
    assert parse_hermes("plain").content == "plain"


def test_llama3_json_tag_and_several_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"q": "é"}}; {"name": "b", "parameters": {}}'
    out = parse_llama3_json(text)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("a", {"q": "é"}),
        ("b", {}),
    ]


def test_llama3_json_malformed_or_text_is_content() -> None:
    for text in ['{"name": "a", "parameters": {', "hello", '{"x": 1}']:
        out = parse_llama3_json(text)
        assert out.content == text and out.tool_calls == []


# ---------------------------------------------------------------------------------------------- streaming

HERMES_TEXT = (
    "Let me check. "
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich", "days": 3, '
    '"opts": {"unit": "c", "alerts": [true, null, 1.50]}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Z\\u00fcrich \\ud83d\\ude00 \\"q\\""}}\n'
    "</tool_call>"
)
LLAMA3_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima",  "days": 2}};'
    ' {"name": "get_time", "parameters": {}}'
)
REQUIRED_TEXT = '[{"name": "a", "parameters": {"x": ["é", -0.0]}}, {"name": "b", "parameters": {}}]'


def token_deltas(tokenizer, text: str) -> list[str]:
    """``text`` tokenised, then detokenised one token at a time by the engine's detokenizer: the text
    deltas the server's stream sees."""
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, sent = [], 0
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        detok.add_token(token_id)
        full = detok.text
        deltas.append(full[sent:])
        sent = len(full)
    assert "".join(deltas) == text
    return deltas


def accumulate(outs: list[DeltaOutput]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) per call from streamed deltas, checking OpenAI's delta shape:
    a call's first piece has id, type and name, later pieces only arguments, indexes in order."""
    content, calls = "", []
    for out in outs:
        content += out.content
        for piece in out.tool_calls:
            d = piece.as_dict()
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                assert d["id"].startswith("chatcmpl-tool-") and d["function"]["name"]
                calls.append([d["function"]["name"], d["function"]["arguments"]])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                assert 0 <= d["index"] == len(calls) - 1
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for c in calls]


def stream_through(reader: ToolCallStream, deltas: list[str]) -> list[DeltaOutput]:
    """What the server does per delta: ``feed`` each, ``finish`` with the last."""
    outs = [reader.feed(d) for d in deltas]
    outs.append(reader.finish())
    return outs


@pytest.mark.parametrize("parser, text", [("hermes", HERMES_TEXT), ("llama3_json", LLAMA3_TEXT)])
def test_token_by_token_stream_equals_the_whole_parse(tokenizer_dir, parser, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    deltas = token_deltas(tokenizer, text)
    assert len(deltas) > 20  # the tags and the JSON arrive in many pieces
    reader = ToolPlan("auto", tools=[], parser=parser).stream()
    outs = stream_through(reader, deltas)
    whole = PARSERS[parser].parse(text)
    content, calls = accumulate(outs)
    assert content == (whole.content or "")
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert [json.loads(args) for _, args in calls][0]["city"] in ("Zürich", "Lima")
    # Streamed as it came: the calls were complete before the output ended, and nothing of a tag
    # ever went out as content.
    assert not outs[-1]
    assert all("<" not in out.content and "{" not in out.content for out in outs)
    # The name goes out as soon as it is complete, before the arguments are.
    first = next(i for i, out in enumerate(outs) if out.tool_calls)
    assert outs[first].tool_calls[0].name == "get_weather"
    assert "".join(deltas[: first + 1]).count('"days"') == 0


def test_partial_tag_is_held_back_then_flushed_as_content():
    reader = PARSERS["hermes"].stream()
    assert reader.feed("a < b, and <tool").content == "a < b, and "
    assert reader.feed("_c").content == ""
    assert reader.feed("at").content == "<tool_cat"  # no tag after all: released at once
    assert not reader.finish()
    reader = PARSERS["hermes"].stream()
    sent = "".join(o.content for o in stream_through(reader, ["x <tool", "_c", "at> y"]))
    assert sent == "x <tool_cat> y"


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", HERMES_TEXT),
        ("hermes", "no call < here"),
        ("hermes", "ends in <tool_ca"),
        ("hermes", '<tool_call>{"name": "f"}</tool_call>'),
        ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "late"}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}'),  # unclosed last block
        ("llama3_json", LLAMA3_TEXT),
        ("llama3_json", '{"x": 1}'),
        ("llama3_json", "  plain text"),
        ("llama3_json", "<|python_tag|>"),
        ("required", REQUIRED_TEXT),
        (
            "required",
            '[ {"name":"a","parameters":{"u":"c\\n\\t"}} ,\n{"name": "b", "parameters": {"n": 1e2}} ]',
        ),
    ],
)
def test_random_chunking_equals_the_whole_parse(parser, text):
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        if parser == "required":
            reader, whole = ToolPlan("required", tools=[]).stream(), parse_required(text)
        else:
            reader, whole = PARSERS[parser].stream(), PARSERS[parser].parse(text)
        content, calls = accumulate(stream_through(reader, deltas))
        assert content == (whole.content or "")
        assert calls == [(c.name, c.arguments) for c in whole.tool_calls]


def test_required_output_parses_into_calls():
    out = parse_required(REQUIRED_TEXT)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("a", {"x": ["é", -0.0]}),
        ("b", {}),
    ]
    for text in ['[{"name": "a", "parameters": {"x": 1', '{"name": "a", "parameters": {}}', "[1]"]:
        assert parse_required(text).tool_calls == [] and parse_required(text).content == text


def test_a_call_cut_short_is_not_sent_again_as_content():
    # Output cut by max_tokens inside the arguments: the whole parse finds no call; the stream had
    # announced it already, and does not send the raw text on top of it.
    text = '[{"name": "a", "parameters": {"u": "c'
    reader = ToolPlan("required", tools=[]).stream()
    content, calls = accumulate(stream_through(reader, [text[:20], text[20:]]))
    assert parse_required(text).tool_calls == []
    assert content == "" and calls == [("a", '{"u": "c')]
