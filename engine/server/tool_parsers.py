"""Parsers that turn generated text into OpenAI-shaped tool calls, whole or as it streams.

Names and formats follow the ``--tool-call-parser`` choices of vLLM so that a server started with the
same flags answers the same way:

* ``hermes``: Hermes/Qwen models wrap each call in
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
* ``llama3_json``: Llama 3 emits one or more JSON objects ``{"name": ..., "parameters": {...}}``
  (``;``-separated), optionally preceded by ``<|python_tag|>``.

Beside them, :func:`parse_required` reads what ``tool_choice: "required"`` constrains the output to: a
JSON array of ``{"name": ..., "parameters": {...}}`` objects (vLLM's schema for it).

A parser never raises on malformed output: text that does not decode as a call is returned as plain
content, because a model's mistake must not turn into a server error. Arguments are sent as
``json.dumps(arguments, ensure_ascii=False)`` of what the model wrote (vLLM's form).

Streaming (:class:`ToolCallStream`) reads the same formats one text delta at a time. It sends text
that cannot be part of a call as content at once, holds back what may still become a call (a partial
``<tool_call>`` tag), announces a call as soon as its name is complete, and streams its arguments in
the same canonical form as they arrive (``json_stream``). When the output ends it compares
what it sent with the whole-text parse and sends what is missing, so that the accumulated deltas equal
the non-streamed result whenever the output is well formed. A call whose name was already sent is not
withdrawn if the rest of it turns out malformed (vLLM behaves the same).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.server.json_stream import JSON_SPACE, CallObject


def new_tool_call_id() -> str:
    """A tool-call id as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def as_dict(self) -> dict[str, Any]:
        """The call as a message's ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedOutput:
    """Text before the first call (or all text if none) and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


def _call_from_obj(obj: object, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedOutput:
    """Extract every ``<tool_call>`` block; an unclosed last block counts."""
    start = text.find(HERMES_START)
    if start < 0:
        return ParsedOutput(text, [])
    calls: list[ToolCall] = []
    for m in _HERMES.finditer(text, start):
        try:
            call = _call_from_obj(json.loads(m.group(1).strip()), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
    return ParsedOutput(text[:start] or None, calls)


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedOutput:
    """Decode ``;``-separated JSON objects, after an optional python tag."""
    body = text.removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return ParsedOutput(text, [])
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        call = _call_from_obj(obj, "parameters")
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in _LLAMA3_SEPARATORS:
            pos += 1
    return ParsedOutput(None, calls)


_LLAMA3_SEPARATORS = " \t\r\n;"


def parse_required(text: str) -> ParsedOutput:
    """The output of ``tool_choice: "required"``: a JSON array of ``{"name", "parameters"}`` objects.
    Anything else (output cut short by ``max_tokens``, say) is content."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return ParsedOutput(text, [])
    if not isinstance(items, list):
        return ParsedOutput(text, [])
    calls = [_call_from_obj(item, "parameters") for item in items]
    if any(call is None for call in calls):
        return ParsedOutput(text, [])
    return ParsedOutput(None, calls)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- streaming
@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first piece carries ``id`` and ``name``, later ones only
    ``arguments`` text to append."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's ``delta.tool_calls`` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class DeltaOutput:
    """What one text delta adds: content text and call pieces (both may be empty)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: DeltaOutput) -> None:
        self.content += other.content
        for piece in other.tool_calls:
            self.add(piece)

    def add(self, piece: ToolCallDelta) -> None:
        """Append ``piece``, merged into the last one when it only continues that call's arguments."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == piece.index and piece.name is None:
            last.arguments += piece.arguments
        else:
            self.tool_calls.append(piece)


class ToolCallStream(ABC):
    """Incremental parsing of one choice's output. :meth:`feed` takes each text delta in order and
    returns what to send for it; :meth:`finish`, once the output ended, returns what is still owed
    (held-back text, whatever the incremental reading missed) so that everything sent adds up to the
    whole-text parse."""

    def __init__(self, parse: Callable[[str], ParsedOutput]) -> None:
        self._parse = parse
        self.text = ""
        self._pos = 0  # characters of ``text`` already read
        self._sent_content = ""
        self._sent_calls: list[list[str]] = []  # [name, arguments sent] per call
        self._out = DeltaOutput()

    @property
    def num_calls(self) -> int:
        """Calls announced so far."""
        return len(self._sent_calls)

    def feed(self, delta: str) -> DeltaOutput:
        self.text += delta
        self._advance()
        out, self._out = self._out, DeltaOutput()
        return out

    def finish(self) -> DeltaOutput:
        final = self._parse(self.text)
        out, self._out = self._out, DeltaOutput()
        content = final.content or ""
        # Calls already announced that the whole text does not hold (a malformed one): the raw text
        # is not sent again as content on top of them.
        if self._sent_calls and not final.tool_calls:
            content = self._sent_content
        if content.startswith(self._sent_content) and len(content) > len(self._sent_content):
            out.content += content[len(self._sent_content) :]
        for i, call in enumerate(final.tool_calls):
            if i >= len(self._sent_calls):
                out.add(ToolCallDelta(i, call.arguments, new_tool_call_id(), call.name))
                self._sent_calls.append([call.name, call.arguments])
                continue
            name, sent = self._sent_calls[i]
            if name == call.name and call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                out.add(ToolCallDelta(i, call.arguments[len(sent) :]))
                self._sent_calls[i][1] = call.arguments
        return out

    # What readers report to (subclasses and their CallObject, a json_stream.CallSink).
    def _content(self, text: str) -> None:
        if text:
            self._sent_content += text
            self._out.content += text

    def start_call(self, name: str, arguments: str) -> None:
        index = len(self._sent_calls)
        self._sent_calls.append([name, arguments])
        self._out.add(ToolCallDelta(index, arguments, new_tool_call_id(), name))

    def add_arguments(self, text: str) -> None:
        if text:
            self._sent_calls[-1][1] += text
            self._out.add(ToolCallDelta(len(self._sent_calls) - 1, text))

    @abstractmethod
    def _advance(self) -> None:
        """Read ``text`` from ``_pos`` as far as it can be decided."""


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with (``"..<tool_"`` -> 6)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesStream(ToolCallStream):
    """``<tool_call>{...}</tool_call>`` blocks; text before the first is content, text between and
    after blocks is dropped (as :func:`parse_hermes` drops it)."""

    def __init__(self) -> None:
        super().__init__(parse_hermes)
        self._call: CallObject | None = None
        self._in_calls = False

    def _advance(self) -> None:
        text = self.text
        while self._pos < len(text):
            if self._call is not None:
                self._pos += self._call.feed(text, self._pos, self)
                if not self._call.ended:
                    return
                self._call = None
                continue
            start = text.find(HERMES_START, self._pos)
            if start < 0:
                # Hold back a possible start of the tag; before the first call the rest is content.
                safe = len(text) - partial_tag_overlap(text[self._pos :], HERMES_START)
                if not self._in_calls:
                    self._content(text[self._pos : safe])
                self._pos = safe
                return
            if not self._in_calls:
                self._content(text[self._pos : start])
            self._in_calls = True
            self._pos = start + len(HERMES_START)
            self._call = CallObject(("arguments",))


class Llama3JsonStream(ToolCallStream):
    """JSON call objects from the first character on (after an optional python tag), separated by
    ``;`` or white space; output that starts with anything else is content."""

    def __init__(self) -> None:
        super().__init__(parse_llama3_json)
        self._mode = "start"  # start | text | calls | invalid
        self._call: CallObject | None = None

    def _advance(self) -> None:
        text = self.text
        if self._mode == "start":
            if PYTHON_TAG.startswith(text):
                return  # the tag, or the start of one
            body_at = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
            body = text[body_at:].lstrip()
            if not body:
                return
            if body[0] != "{":
                self._mode = "text"
            else:
                self._mode = "calls"
                self._pos = len(text) - len(body)
        if self._mode == "text":
            self._content(text[self._pos :])
            self._pos = len(text)
            return
        while self._mode == "calls" and self._pos < len(text):
            if self._call is not None:
                self._pos += self._call.feed(text, self._pos, self)
                if not self._call.ended:
                    return
                self._call = None
            elif text[self._pos] in _LLAMA3_SEPARATORS:
                self._pos += 1
            elif text[self._pos] == "{":
                self._call = CallObject(("parameters", "arguments"))
            else:
                self._mode = "invalid"  # left to finish()


class RequiredStream(ToolCallStream):
    """The JSON array ``tool_choice: "required"`` constrains the output to."""

    def __init__(self) -> None:
        super().__init__(parse_required)
        self._expect = "["  # "[" | "item" | "item_or_end" | "comma_or_end" | "" (done or invalid)
        self._call: CallObject | None = None

    def _advance(self) -> None:
        text = self.text
        while self._expect and self._pos < len(text):
            if self._call is not None:
                self._pos += self._call.feed(text, self._pos, self)
                if not self._call.ended:
                    return
                self._call = None
                self._expect = "comma_or_end"
                continue
            ch = text[self._pos]
            if ch in JSON_SPACE:
                self._pos += 1
            elif self._expect == "[" and ch == "[":
                self._expect = "item_or_end"
                self._pos += 1
            elif self._expect in ("item", "item_or_end") and ch == "{":
                self._call = CallObject(("parameters", "arguments"))
            elif self._expect == "comma_or_end" and ch == ",":
                self._expect = "item"
                self._pos += 1
            else:
                self._expect = ""  # "]", or not the array: the rest is left to finish()


class NamedStream(ToolCallStream):
    """A named ``tool_choice``: the whole output is the arguments of that one function (sent as the
    model writes them, as vLLM sends them)."""

    def __init__(self, name: str) -> None:
        super().__init__(lambda text: parse_named(name, text))
        self._name = name

    def _advance(self) -> None:
        if not self._sent_calls:
            if not self.text.strip():
                return  # no call yet: an output of blanks only is none
            self.start_call(self._name, self.text)
        else:
            self.add_arguments(self.text[self._pos :])
        self._pos = len(self.text)


def parse_named(name: str, text: str) -> ParsedOutput:
    """A named ``tool_choice``: one call of ``name`` whose arguments are the output (none for an
    empty output, as vLLM)."""
    if not text.strip():
        return ParsedOutput(text, [])
    return ParsedOutput(None, [ToolCall(name=name, arguments=text)])


@dataclass(frozen=True)
class ToolParser:
    """A ``--tool-call-parser``: the whole-text parse and the streaming reader of one format."""

    parse: Callable[[str], ParsedOutput]
    stream: Callable[[], ToolCallStream]


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser(parse_hermes, HermesStream),
    "llama3_json": ToolParser(parse_llama3_json, Llama3JsonStream),
}
