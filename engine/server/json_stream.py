"""Incremental reading of the JSON in tool calls, one character at a time, for streamed responses.

:class:`CanonicalJson` re-writes one JSON value as ``json.dumps(json.loads(value), ensure_ascii=False)``
would, piece by piece, so that streamed arguments add up to exactly what the whole-text parse returns.
:class:`CallObject` reads one ``{"name": ..., "arguments": {...}}`` object and reports the call to a
:class:`CallSink` as soon as its name is complete, then its arguments as they arrive.
"""

from __future__ import annotations

import json
import re
from typing import Protocol


class CallSink(Protocol):
    """Where a :class:`CallObject` reports: a new call (with the arguments read so far), then more
    arguments text for it."""

    def start_call(self, name: str, arguments: str) -> None: ...

    def add_arguments(self, text: str) -> None: ...


JSON_SPACE = " \t\r\n"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"true", "false", "null", "NaN", "Infinity"}  # json.loads takes the last two as well
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JsonString:
    """Decodes the body of a JSON string (after its opening quote), one character at a time."""

    def __init__(self) -> None:
        self.closed = False
        self.error = False
        self._escape: str | None = None  # "" after a backslash, then the hex digits of a \\u escape
        self._high: str | None = None  # a decoded high surrogate waiting for its low half

    def feed(self, ch: str) -> str:
        """The decoded characters ``ch`` completes ("" while inside an escape)."""
        if self._escape is not None:
            if self._escape == "" and ch != "u":
                self._escape = None
                if ch not in _ESCAPES:
                    self.error = True
                    return ""
                return self._flush_high() + _ESCAPES[ch]
            if self._escape == "":
                self._escape = "u"
                return ""
            if ch not in "0123456789abcdefABCDEF":
                self.error = True
                return ""
            self._escape += ch
            if len(self._escape) < 5:
                return ""
            code = int(self._escape[1:], 16)
            self._escape = None
            if self._high is not None and 0xDC00 <= code <= 0xDFFF:
                high, self._high = self._high, None
                return chr(0x10000 + ((ord(high) - 0xD800) << 10) + (code - 0xDC00))
            pending = self._flush_high()
            if 0xD800 <= code <= 0xDBFF:
                self._high = chr(code)
                return pending
            return pending + chr(code)
        if ch == "\\":
            self._escape = ""
            return ""
        if ch == '"':
            self.closed = True
            return self._flush_high()
        if ch < " ":
            self.error = True  # a raw control character: json.loads refuses it
            return ""
        return self._flush_high() + ch

    def _flush_high(self) -> str:
        high, self._high = self._high, None
        return high or ""


def _dump_chars(text: str) -> str:
    """``text`` as it stands inside ``json.dumps(..., ensure_ascii=False)``'s quotes."""
    if '"' in text or "\\" in text or any(c < " " for c in text):
        return json.dumps(text, ensure_ascii=False)[1:-1]
    return text


class CanonicalJson:
    """One JSON value read one character at a time and written back as
    ``json.dumps(json.loads(value), ensure_ascii=False)`` writes it (``", "`` and ``": "``
    separators, escapes decoded and re-encoded, numbers normalised), so that the pieces it returns
    add up to the whole-text parse's arguments. Duplicate keys are written twice (``json.loads`` keeps
    the last); malformed input sets ``error`` and ends the reading."""

    def __init__(self) -> None:
        self.done = False
        self.error = False
        self._stack: list[str] = []  # "{" or "[" per open container
        self._expect = "value"  # value | first_value | key | first_key | colon | next
        self._string: JsonString | None = None
        self._scalar = ""  # a number or literal being read

    def feed(self, ch: str) -> tuple[str, bool]:
        """The output ``ch`` adds, and whether ``ch`` belongs to the value (False: the value had
        ended before it, as a top-level number ends at the next character)."""
        out = ""
        if self._scalar:
            if ch in _NUMBER_CHARS or ch.isalpha():
                self._scalar += ch
                return "", True
            out = self._end_scalar()
            if self.done or self.error:
                return out, False
        if self._string is not None:
            text = self._string.feed(ch)
            if self._string.error:
                self.error = True
                return out, True
            out += _dump_chars(text)
            if self._string.closed:
                self._string = None
                out += '"'
                self._after_value()
            return out, True
        if ch in JSON_SPACE:
            return out, True
        expect = self._expect
        if expect in ("value", "first_value"):
            if ch == "]" and expect == "first_value":
                self._stack.pop()
                self._after_value()
                return out + "]", True
            if ch in "{[":
                self._stack.append(ch)
                self._expect = "first_key" if ch == "{" else "first_value"
                return out + ch, True
            if ch == '"':
                self._string = JsonString()
                return out + '"', True
            if ch in _NUMBER_CHARS or ch.isalpha():
                self._scalar = ch
                return out, True
        elif expect in ("key", "first_key"):
            if ch == '"':
                self._string = JsonString()
                self._expect = "key_string"
                return out + '"', True
            if ch == "}" and expect == "first_key":
                self._stack.pop()
                self._after_value()
                return out + "}", True
        elif expect == "colon" and ch == ":":
            self._expect = "value"
            return out + ": ", True
        elif expect == "next":
            if ch == ",":
                self._expect = "key" if self._stack[-1] == "{" else "value"
                return out + ", ", True
            closer = "}" if self._stack[-1] == "{" else "]"
            if ch == closer:
                self._stack.pop()
                self._after_value()
                return out + ch, True
        self.error = True
        return out, True

    def _after_value(self) -> None:
        if self._expect == "key_string":
            self._expect = "colon"
        elif not self._stack:
            self.done = True
        else:
            self._expect = "next"

    def _end_scalar(self) -> str:
        token, self._scalar = self._scalar, ""
        if token in _LITERALS:
            out = token
        elif _NUMBER.fullmatch(token):
            out = json.dumps(json.loads(token))
        else:
            self.error = True
            return ""
        self._after_value()
        return out


class CallObject:
    """One ``{"name": ..., <arguments key>: {...}}`` object read incrementally: the call is announced
    once its name is complete and its arguments stream as they come (held until then if they come
    first). The first of ``args_keys`` present is the arguments (``{}`` when none is)."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.ended = False
        self._args_keys = args_keys
        self._expect = "{"  # { | first_key | key | colon | value | name | in_value | next | "" (stopped)
        self._key: JsonString | None = None
        self._key_text = ""
        self._name: JsonString | None = None
        self._name_text = ""
        self._value: CanonicalJson | None = None  # the value being read (arguments or another key's)
        self._value_is_args = False
        self._announced = False
        self._seen_args = False
        self._pending_args = ""

    def feed(self, text: str, pos: int, sink: CallSink) -> int:
        """Read ``text`` from ``pos`` until the object ends or the text does; returns the characters
        read. Announcements and argument pieces go to ``sink``."""
        start = pos
        while pos < len(text) and self._expect:
            ch = text[pos]
            if self._value is not None:
                out, consumed = self._value.feed(ch)
                if self._value_is_args:
                    self._args(out, sink)
                if self._value.error:
                    self._expect = ""
                    break
                if not consumed:
                    self._value = None
                    self._expect = "next"
                    continue
                pos += 1
                if self._value.done:
                    self._value = None
                    self._expect = "next"
                continue
            pos += 1
            if self._key is not None or self._name is not None:
                self._read_string(ch, sink)
                continue
            if ch in JSON_SPACE:
                continue
            self._step(ch, sink)
        return pos - start

    def _read_string(self, ch: str, sink: CallSink) -> None:
        reader = self._key if self._key is not None else self._name
        assert reader is not None
        piece = reader.feed(ch)
        if reader.error:
            self._expect = ""
        elif reader is self._key:
            self._key_text += piece
            if reader.closed:
                self._key = None
                self._expect = "colon"
        else:
            self._name_text += piece
            if reader.closed:
                self._name = None
                self._expect = "next"
                self._announced = True
                sink.start_call(self._name_text, self._pending_args)

    def _step(self, ch: str, sink: CallSink) -> None:
        expect = self._expect
        if expect == "{" and ch == "{":
            self._expect = "first_key"
        elif expect in ("key", "first_key") and ch == '"':
            self._key, self._key_text = JsonString(), ""
        elif expect == "colon" and ch == ":":
            self._expect = "value"
        elif expect == "value":
            self._start_value(ch, sink)
        elif (expect == "next" and ch == "}") or (expect == "first_key" and ch == "}"):
            self._end(sink)
        elif expect == "next" and ch == ",":
            self._expect = "key"
        else:
            self._expect = ""  # not a call object: left to finish()

    def _start_value(self, ch: str, sink: CallSink) -> None:
        key = self._key_text
        if key == "name" and not self._announced:
            if ch != '"':
                self._expect = ""
                return
            self._name, self._name_text = JsonString(), ""
            self._expect = "name"
            return
        self._value = CanonicalJson()
        self._value_is_args = key in self._args_keys and not self._seen_args
        if self._value_is_args:
            self._seen_args = True
            if ch != "{":
                self._expect = ""  # arguments must be an object
                return
        self._expect = "in_value"
        out, _ = self._value.feed(ch)
        if self._value_is_args:
            self._args(out, sink)

    def _args(self, text: str, sink: CallSink) -> None:
        if self._announced:
            sink.add_arguments(text)
        else:
            self._pending_args += text

    def _end(self, sink: CallSink) -> None:
        self._expect = ""
        if not self._announced:
            return  # no name: not a call
        if not self._seen_args:
            sink.add_arguments("{}")
        self.ended = True
