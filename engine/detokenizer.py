"""Incremental detokenization and stop-string matching."""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens kept as left context so that tokenizers which depend on it (SentencePiece's leading
# space) decode the first output tokens the way a full decode would.
_CONTEXT_TOKENS = 5


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


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per token.

    A token that ends in the middle of a multi-byte character yields no text until the character
    completes. Stop strings are searched in the text as it grows (only where the new text can complete
    one); on a match the text is cut (before the stop string, or after it with
    ``include_stop_str_in_output``) and ``stop_string`` is set. ``pop_delta`` hands out streamed text,
    holding back the last ``len(longest stop) - 1`` characters so that no streamed text ever has to be
    taken back. ``stop_strings`` may be a shared ``StopStrings`` (the ``n`` sequences of a request).
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
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The text as pieces (joined on demand): appending a piece never copies what came before.
        self._pieces: list[str] = []
        self._len = 0
        self.stop_string: str | None = None
        self._emitted = 0

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
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        new = full[len(prefix) :]
        old_len = self._len
        self._pieces.append(new)
        self._len += len(new)
        # The offsets only move forward: the decoded window stays a few tokens long.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self.stops:
            self._match_stop(old_len, new)

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
