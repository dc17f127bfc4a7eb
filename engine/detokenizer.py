"""Incremental detokenization and stop-string matching."""

from __future__ import annotations

# Prompt tokens kept as left context so that tokenizers which depend on it (SentencePiece's leading
# space) decode the first output tokens the way a full decode would.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per token.

    A token that ends in the middle of a multi-byte character yields no text until the character
    completes. Stop strings are searched in the text as it grows; on a match the text is cut (before
    the stop string, or after it with ``include_stop_str_in_output``) and ``stop_string`` is set.
    ``pop_delta`` hands out streamed text, holding back the last ``len(longest stop) - 1`` characters
    so that no streamed text ever has to be taken back.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop_strings: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings or []
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.stop_string: str | None = None
        self._emitted = 0

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
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self.stop_strings:
            self._match_stop(old_len)

    def pop_delta(self, final: bool = False) -> str:
        """Text not handed out yet (all of it when ``final`` or after a stop match)."""
        end = len(self.text)
        if not final and self.stop_string is None and self.max_stop_len:
            end -= self.max_stop_len - 1
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _match_stop(self, old_len: int) -> None:
        # Only the tail that the new text could complete needs searching.
        search_from = max(0, old_len - self.max_stop_len + 1)
        best = None
        for s in self.stop_strings:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stop_string = s
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
