"""Incremental detokenization and stop-string matching.

A Hugging Face fast tokenizer is decoded with ``tokenizers``' ``DecodeStream``: one call into Rust per
token, which decodes only the few tokens since the last emitted text. Any other tokenizer (a slow one,
or one whose ``decode`` post-processes the text) falls back to two ``decode`` calls per token over a
window kept by prefix/read offsets. Both emit the text a full decode of the sequence shows.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

try:
    from tokenizers import Tokenizer as _BackendTokenizer
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21 has no DecodeStream: every tokenizer takes the fallback
    _BackendTokenizer = _DecodeStream = None

# Prompt tokens kept as left context so that tokenizers which depend on it (SentencePiece's leading
# space) decode the first output tokens the way a full decode would.
_CONTEXT_TOKENS = 5
# Further back (up to this many prompt tokens) for a context that decodes without a replacement
# character: a context that starts or ends inside a character decodes differently once the rest of it
# arrives.
_MAX_CONTEXT_TOKENS = 24
_REPLACEMENT = "\ufffd"

# ``DecodeStream(ids=...)`` (primed with context in one call) arrived after ``DecodeStream`` itself;
# without it the stream is primed by stepping through the context.
_HAS_PREFILL = False
if _DecodeStream is not None:
    try:
        _DecodeStream(ids=[], skip_special_tokens=True)
        _HAS_PREFILL = True
    except TypeError:
        pass

# The message ``DecodeStream.step`` raises when the window's new decode no longer starts with the text
# it already emitted (byte-fallback runs that turn out invalid UTF-8 are decoded anew, one replacement
# character per byte).
_INVALID_PREFIX = "Invalid prefix encountered"

# Text that ``clean_up_tokenization_spaces`` would change: a tokenizer whose ``decode`` leaves it as its
# backend decodes it can be streamed (cached per tokenizer).
_CLEANUP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're j ' k"
_cleanup_is_noop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stream_backend(tokenizer) -> _BackendTokenizer | None:
    """The ``tokenizers.Tokenizer`` that a ``DecodeStream`` can decode ``tokenizer``'s ids with, so that
    the streamed text equals ``tokenizer.decode``; None when the fallback must be used: no
    ``DecodeStream`` in the installed ``tokenizers``, a slow (Python) tokenizer, or one whose ``decode``
    cleans up tokenization spaces (the backend does not)."""
    if _DecodeStream is None or not getattr(tokenizer, "is_fast", False):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, _BackendTokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        try:
            noop = _cleanup_is_noop.get(tokenizer)
        except TypeError:  # not weakly referenceable: probe every time
            noop = None
        if noop is None:
            ids = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
            noop = tokenizer.decode(ids) == backend.decode(ids)
            try:
                _cleanup_is_noop[tokenizer] = noop
            except TypeError:
                pass
        if not noop:
            return None
    return backend


class StopStrings:
    """A request's stop strings indexed by their last character: built once per request and shared by
    its ``n`` sequences. Looking for a match costs O(new characters x stops ending in each x their
    length), never a scan of the whole text."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self.strings = tuple(stop_strings)
        self.max_len = max((len(s) for s in self.strings), default=0)
        self._by_last: dict[str, list[tuple[int, str]]] = {}
        for k, s in enumerate(self.strings):
            self._by_last.setdefault(s[-1], []).append((k, s))

    def __bool__(self) -> bool:
        return bool(self.strings)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The match in ``text`` that ends at or after ``new_from`` (the first new character) and starts
        first (ties: the stop listed first), as (start index, stop string); None without one."""
        best: tuple[int, int, str] | None = None
        by_last = self._by_last
        for end in range(max(new_from, 0), len(text)):
            for k, s in by_last.get(text[end], ()):
                start = end + 1 - len(s)
                if start >= 0 and text.startswith(s, start) and (best is None or (start, k) < best[:2]):
                    best = (start, k, s)
        return None if best is None else (best[0], best[2])


_NO_STOPS = StopStrings(())


def _left_context(prompt_token_ids: Sequence[int], decode) -> tuple[list[int], str]:
    """The prompt's last tokens to decode the output after, and their text (``decode``): the shortest
    suffix of at least ``_CONTEXT_TOKENS`` tokens (up to ``_MAX_CONTEXT_TOKENS``) that decodes without a
    replacement character, else the last ``_CONTEXT_TOKENS``. A context that starts inside a character
    would spoil a byte-fallback decoder's run of byte tokens that the output continues."""
    n = len(prompt_token_ids)
    shortest = min(_CONTEXT_TOKENS, n)
    for i in range(shortest, min(n, _MAX_CONTEXT_TOKENS) + 1):
        context = list(prompt_token_ids[n - i :])
        text = decode(context)
        if _REPLACEMENT not in text:
            return context, text
    context = list(prompt_token_ids[n - shortest :])
    return context, decode(context)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per token.

    A token that ends in the middle of a multi-byte character yields no text until the character
    completes. Stop strings are searched in the text as it grows (only where the new text can complete
    one); on a match the text is cut (before the stop string, or after it with
    ``include_stop_str_in_output``) and ``stop_string`` is set. ``pop_delta`` hands out streamed text,
    holding back the last ``len(longest stop) - 1`` characters so that no streamed text ever has to be
    taken back. ``stop_strings`` may be a shared ``StopStrings`` (the ``n`` sequences of a request).

    A fast tokenizer (see ``stream_backend``) is decoded with a ``DecodeStream`` primed with the
    prompt's last tokens (``uses_decode_stream``); any other with two ``decode`` calls per token.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop_strings: StopStrings | Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if stop_strings is None:
            stop_strings = _NO_STOPS
        elif not isinstance(stop_strings, StopStrings):
            stop_strings = StopStrings(stop_strings)
        self.stops = stop_strings
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = stop_strings.max_len
        # The decode window: ``_ids[_prefix_offset:_read_offset]`` was decoded into text already emitted
        # (left context), ``_ids[_read_offset:]`` has not produced text yet.
        self._prefix_offset = 0
        self._backend = stream_backend(tokenizer)
        self._stream = None
        if self._backend is None:
            self._ids = _left_context(prompt_token_ids, self._decode)[0]
            self._read_offset = len(self._ids)
        else:
            self._restart(*_left_context(prompt_token_ids, self._backend_decode))
        # The text as pieces (joined on demand): appending a piece never copies what came before.
        self._pieces: list[str] = []
        self._len = 0
        self.stop_string: str | None = None
        self._emitted = 0

    @property
    def uses_decode_stream(self) -> bool:
        """Whether tokens are decoded by a ``tokenizers`` ``DecodeStream`` (else by the fallback)."""
        return self._stream is not None

    @property
    def text(self) -> str:
        """All the text so far (cut at a matched stop string)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> None:
        """Append one token. After a stop-string match ``stop_string`` is set; later tokens are ignored."""
        if self.stop_string is not None:
            return
        new = self._stream_text(token_id) if self._stream is not None else self._offsets_text(token_id)
        if not new:
            return
        old_len = self._len
        self._pieces.append(new)
        self._len += len(new)
        if self.stops:
            self._match_stop(old_len, new)

    # ------------------------------------------------------------------------- the two-decode fallback
    def _offsets_text(self, token_id: int) -> str | None:
        """The text ``token_id`` completes: the window's decode past the decode of its emitted part."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return None
        # The offsets only move forward: the decoded window stays a few tokens long.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    # ------------------------------------------------------------------------- the DecodeStream path
    def _backend_decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _restart(self, context: list[int], text: str, hold_incomplete: bool = True) -> None:
        """A new stream whose left context is ``context`` (decoding to ``text``), counted as emitted.

        A context whose text ends inside a character is stepped through, so that the output tokens
        complete (and emit) that character as a full decode would show it; without
        ``hold_incomplete`` (its text was emitted already) the stream starts empty instead."""
        if text.endswith(_REPLACEMENT) and not hold_incomplete:
            context, text = [], ""
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        if _HAS_PREFILL and not text.endswith(_REPLACEMENT):
            self._stream = _DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        else:
            self._stream = _DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self._replay(context)

    def _replay(self, token_ids: list[int]) -> str:
        """Step ``token_ids`` through the stream (outside the window's book-keeping); their text. A
        refused token starts an empty stream."""
        pieces = []
        for token_id in token_ids:
            try:
                new = self._stream.step(self._backend, token_id)
            except Exception as e:
                if not str(e).startswith(_INVALID_PREFIX):
                    raise
                self._stream = _DecodeStream(skip_special_tokens=self.skip_special_tokens)
                new = self._stream.step(self._backend, token_id)
            if new is not None:
                pieces.append(new)
        return "".join(pieces)

    def _stream_text(self, token_id: int) -> str | None:
        """The text ``token_id`` completes, from the stream; the window is kept alongside (without any
        decoding) for the rare token the stream refuses."""
        ids = self._ids
        ids.append(token_id)
        try:
            new = self._stream.step(self._backend, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            return self._recover()
        if new is not None:
            del ids[: self._read_offset]
            self._read_offset = len(ids)
        return new

    def _recover(self) -> str | None:
        """After the stream refused the last token (a new decode of its window no longer starts with the
        text it emitted): that token's text as the fallback computes it, the window's decode past the
        decode of its emitted part, so no text is lost; then a new stream primed with the window.

        Text already handed out is never taken back, so where the full decode rewrote it (byte-fallback
        bytes that turn out to be invalid UTF-8), the text keeps what was emitted."""
        ids, read = self._ids, self._read_offset
        prefix = self._backend_decode(ids[:read])
        full = self._backend_decode(ids)
        if full.endswith(_REPLACEMENT):
            # Nothing complete at the end of this window (the stream's own, a suffix of it, was): the
            # emitted part as context, the rest stepped through again.
            held = ids[read:]
            self._restart(ids[:read], prefix)
            new = self._replay(held)
            self._ids += held
            if new:
                self._read_offset = len(self._ids)
            return new or None
        window = ids[read:]
        self._restart(window, self._backend_decode(window), hold_incomplete=False)
        return full[len(prefix) :] or None

    def pop_delta(self, final: bool = False) -> str:
        """Text not handed out yet (all of it when ``final`` or after a stop match)."""
        end = self._len
        if not final and self.stop_string is None and self.max_stop_len:
            end -= self.max_stop_len - 1
        if end <= self._emitted:
            return ""
        delta = self._slice(self._emitted, end)
        self._emitted = end
        return delta

    def _slice(self, start: int, end: int) -> str:
        """``text[start:end]`` reading only the pieces it spans (the tail, for a delta)."""
        parts = []
        pos = self._len
        for piece in reversed(self._pieces):
            pos -= len(piece)
            if pos < end:
                parts.append(piece[max(start - pos, 0) : end - pos])
            if pos <= start:
                break
        return "".join(reversed(parts))

    def _match_stop(self, old_len: int, new: str) -> None:
        # Only the tail that the new text could complete needs searching: the new text and the
        # ``max_stop_len - 1`` characters before it.
        tail_start = max(0, old_len - self.max_stop_len + 1)
        tail = self._slice(tail_start, self._len)
        hit = self.stops.find(tail, old_len - tail_start)
        if hit is not None:
            i, s = hit
            cut = tail_start + i + (len(s) if self.include_stop else 0)
            self._pieces = [self._slice(0, cut)]
            self._len = cut
            self._emitted = min(self._emitted, cut)
            self.stop_string = s
