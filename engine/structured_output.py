"""Structured outputs: a request's constraint compiled into a grammar, one matcher per sequence, and
the token masks the sampler applies (xgrammar underneath).

Three parts:

* ``check_constraint`` parses a ``StructuredOutputsParams`` without a tokenizer (the server calls it to
  answer a bad schema, regex or grammar with a 400 naming its own field);
* ``GrammarCompiler`` turns it into a grammar over the model's vocabulary, cached by (kind, spec) in a
  bounded LRU; the input processor compiles at admission, so a bad constraint is an
  ``InvalidRequestError`` before anything is queued and the engine loop never sees one;
* ``StructuredOutputs`` is the sampling rank's: one matcher per constrained sequence (``n > 1`` siblings
  each their own), advanced with every output token the runner holds, released with the request. Each
  step it fills a bitmask for the constrained rows on a worker thread, started before the forward and
  joined before sampling (the fill runs in C++ without the GIL)::

      main thread   update states -> start fill -> [ forward ................ ] -> join -> sample
      worker                          [ batched accept of the new tokens, batched fill ]

A matcher catches up from the sequence's output tokens (``output_token_ids[num_accepted:]``), so a
sequence that comes back after a recompute preemption (a new runner state holding the same output
tokens) gets a new matcher that replays them. A batch without constraints allocates nothing and starts
no thread.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from kvpilot.engine.runner_state import CachedRequestState

logger = logging.getLogger("kvpilot.engine")

# Compiled grammars kept (each holds the library's per-token mask cache for its grammar).
GRAMMAR_CACHE_SIZE = 128
# JSON whitespace: any whitespace between tokens, at most this many characters in a row, so that a
# model cannot spend its whole budget on blanks and every schema of bounded size ends.
MAX_JSON_WHITESPACE = 4
_LIB_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: .*? is false: )?")


def _library_message(exc: Exception) -> str:
    """xgrammar's message without its timestamp and source location."""
    return _LIB_PREFIX.sub("", str(exc).strip()).strip()


# xgrammar (0.2.9) lets two kinds of invalid JSON through its string rules: the characters of a string
# with minLength/maxLength are ``[^"\\\r\n]``, which admits raw control characters, and no string rule
# excludes the UTF-16 surrogates U+D800-U+DFFF, whose 3-byte "UTF-8" forms its byte-level matcher
# accepts (Python decodes each byte as U+FFFD). Both string classes get the strict JSON one here.
_LAX_STRING_CHARS = ('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]')
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n\\uD800-\\uDFFF]'


def _json_grammar(schema: str) -> str:
    """``schema`` as EBNF text, whitespace bounded (``MAX_JSON_WHITESPACE``), strings valid JSON."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
    )
    ebnf = str(grammar)
    for lax in _LAX_STRING_CHARS:
        ebnf = ebnf.replace(lax, _JSON_STRING_CHARS)
    return ebnf


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``: EBNF string literals take JSON's escapes."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_constraint(so: StructuredOutputsParams) -> None:
    """Parse ``so``'s schema, regex or grammar (no tokenizer needed: microseconds to milliseconds).
    Raises ``InvalidRequestError`` (param ``structured_outputs``) with the library's message."""
    import xgrammar as xgr

    kind = so.kind
    try:
        if kind == "json":
            _json_grammar(so.spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(so.regex)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(so.grammar if kind == "grammar" else _choice_grammar(so.choice))
    except Exception as exc:  # the library raises RuntimeError / ValueError subclasses of its own
        raise InvalidRequestError(
            f"structured_outputs.{kind} is not a valid {_KIND_NAMES[kind]}: {_library_message(exc)}",
            param="structured_outputs",
        ) from None


_KIND_NAMES = {
    "json": "JSON schema",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "EBNF grammar",
    "json_object": "JSON object",
}


class GrammarCompiler:
    """Compiles constraints over one tokenizer's vocabulary (``vocab_size``: the model's, which may pad
    the tokenizer's), keeping the last ``cache_size`` grammars by (kind, spec). The library loads on
    first use. ``eos_token_id`` is the token that ends a complete output; without one (a model with no
    EOS) structured outputs are refused. Used from the engine thread only."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_id: int | None, cache_size: int = GRAMMAR_CACHE_SIZE
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._compiler = None
        self.num_compiled = 0  # compilations done (cache misses)

    def _library_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=[self.eos_token_id]
            )
            # Our own bounded cache replaces the library's unbounded one.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of ``so`` (cached). Raises ``InvalidRequestError`` naming
        ``structured_outputs`` for a constraint the library refuses, or when the model has no EOS."""
        if self.eos_token_id is None:
            raise InvalidRequestError(
                "structured outputs need an end-of-sequence token, and this model has none",
                param="structured_outputs",
            )
        key = (so.kind, so.spec)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        compiler = self._library_compiler()
        kind = so.kind
        try:
            if kind in ("json", "json_object"):
                grammar = compiler.compile_grammar(_json_grammar(key[1] or '{"type": "object"}'))
            elif kind == "regex":
                grammar = compiler.compile_regex(so.regex)
            elif kind == "choice":
                grammar = compiler.compile_grammar(_choice_grammar(so.choice))
            else:
                grammar = compiler.compile_grammar(so.grammar)
        except Exception as exc:
            raise InvalidRequestError(
                f"structured_outputs.{kind} is not a valid {_KIND_NAMES[kind]}: {_library_message(exc)}",
                param="structured_outputs",
            ) from None
        self.num_compiled += 1
        self._cache[key] = grammar
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._cache)


@dataclass
class TokenMasks:
    """The step's constraint masks, for the sampler: ``rows`` are the indices (into the step's sampling
    rows) of the constrained rows, ``bitmask`` their allowed tokens, [len(rows), ceil(vocab / 32)]
    int32 on the CPU, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed."""

    rows: list[int]
    bitmask: torch.Tensor


@dataclass
class MaskTimings:
    """Where the mask work of the constrained steps went: ``fill_s`` on the worker thread (catching
    matchers up and filling bitmasks), ``wait_s`` the main thread waiting for it after the forward.
    ``fill_s - wait_s`` of it overlapped the forward."""

    num_steps: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0


class _Tracked:
    """One sequence's matcher and how many of its output tokens it has accepted; ``state`` is the
    runner state it follows (a state replaced after a preemption gets a new matcher)."""

    __slots__ = ("failed", "matcher", "num_accepted", "state")

    def __init__(self, state: CachedRequestState, matcher) -> None:
        self.state = state
        self.matcher = matcher
        self.num_accepted = 0
        self.failed = False


class StructuredOutputs:
    """The sampling rank's matchers and the per-step mask fill (see the module docstring).

    ``start(states)`` begins the fill for a step's sampling rows on the worker thread and returns a
    ``PendingMasks`` (None when no row is constrained: nothing is allocated); ``release`` forgets
    requests the scheduler finished, aborted or preempted."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.eos_token_id = compiler.eos_token_id
        self._matchers: dict[str, _Tracked] = {}
        # Matchers are made on the main thread and touched only by the worker between ``start`` and
        # ``PendingMasks.result``; ``release`` only drops dict entries, never while a fill runs.
        self._pool: ThreadPoolExecutor | None = None
        self._batch = None  # the library's batched accept and fill, made with the pool
        self.timings = MaskTimings()

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def release(self, req_ids: list[str]) -> None:
        """Drop the matchers of ``req_ids`` (unknown ids are ignored)."""
        if not self._matchers:
            return
        for req_id in req_ids:
            self._matchers.pop(req_id, None)

    def start(self, states: list[CachedRequestState]) -> PendingMasks | None:
        """Begin filling the masks of the constrained rows among ``states`` (the step's sampling rows,
        in order). Matchers are made here, on the calling thread (compiling is a cache hit: the input
        processor compiled at admission)."""
        rows: list[int] = []
        tracked: list[_Tracked] = []
        for i, state in enumerate(states):
            params = state.sampling_params
            so = params.structured_outputs if params is not None else None
            if so is None:
                continue
            entry = self._matchers.get(state.req_id)
            if entry is None or entry.state is not state:
                entry = _Tracked(state, self._new_matcher(so))
                self._matchers[state.req_id] = entry
            rows.append(i)
            tracked.append(entry)
        if not rows:
            return None
        import xgrammar as xgr

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpilot-grammar")
            self._batch = xgr.BatchGrammarMatcher(max_threads="auto")

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        future = self._pool.submit(self._fill, tracked, bitmask)
        return PendingMasks(self, rows, bitmask, future)

    def _new_matcher(self, so: StructuredOutputsParams):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiler.compile(so))

    def _fill(self, tracked: list[_Tracked], bitmask: torch.Tensor) -> float:
        """On the worker: catch every matcher up with its sequence's output tokens, then fill its row.
        A finished grammar (or a matcher that refused a token, which the masks make impossible) allows
        only EOS, so that its sequence ends. Returns the seconds spent."""
        import torch

        t0 = time.perf_counter()
        with torch.inference_mode():  # the bitmask is an inference tensor when the runner made it
            self._fill_rows(tracked, bitmask)
        return time.perf_counter() - t0

    def _fill_rows(self, tracked: list[_Tracked], bitmask: torch.Tensor) -> None:
        # The usual step gives each row one new token: one batched accept and one batched fill, two
        # calls that drop the GIL, instead of two per row (each of which would wait for the GIL again
        # while the main thread runs the forward's Python).
        eos = self.eos_token_id
        singles: list[_Tracked] = []
        for entry in tracked:
            out = entry.state.output_token_ids
            pending = len(out) - entry.num_accepted
            if entry.failed or pending == 0 or entry.matcher.is_terminated():
                entry.num_accepted = len(out)
            elif pending == 1:
                singles.append(entry)
            else:  # a new matcher replaying the tokens kept over a preemption
                for token in out[entry.num_accepted :]:
                    if entry.matcher.is_terminated():
                        break
                    if not entry.matcher.accept_token(token):
                        self._refused(entry, token)
                        break
                entry.num_accepted = len(out)
        if singles:
            tokens = [e.state.output_token_ids[e.num_accepted] for e in singles]
            accepted = self._batch.batch_accept_token([e.matcher for e in singles], tokens)
            for entry, token, ok in zip(singles, tokens, accepted, strict=True):
                entry.num_accepted += 1
                if not ok:
                    self._refused(entry, token)
        live_rows: list[int] = []
        live: list = []
        for row, entry in enumerate(tracked):
            if entry.failed or entry.matcher.is_terminated():
                bitmask[row].zero_()
                bitmask[row, eos // 32] = _bit(eos % 32)
            else:
                live_rows.append(row)
                live.append(entry.matcher)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)

    @staticmethod
    def _refused(entry: _Tracked, token: int) -> None:
        entry.failed = True
        logger.warning(
            "request %s: token %d is outside its constraint; ending the sequence", entry.state.req_id, token
        )

    def shutdown(self) -> None:
        """Stop the worker thread (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as the signed value torch stores (bit 31 is negative)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


class PendingMasks:
    """A step's mask fill in flight; ``result()`` waits for it (after the forward) and returns the
    ``TokenMasks``."""

    def __init__(
        self, owner: StructuredOutputs, rows: list[int], bitmask: torch.Tensor, future: Future
    ) -> None:
        self._owner = owner
        self._rows = rows
        self._bitmask = bitmask
        self._future = future

    def result(self) -> TokenMasks:
        t0 = time.perf_counter()
        fill_s = self._future.result()
        timings = self._owner.timings
        timings.num_steps += 1
        timings.fill_s += fill_s
        timings.wait_s += time.perf_counter() - t0
        return TokenMasks(self._rows, self._bitmask)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """``bitmask`` ([rows, words] int32) as [rows, vocab] booleans on ``device``, True where allowed."""
    import torch

    words = bitmask.to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.view(words.shape[0], -1)[:, :vocab].bool()
