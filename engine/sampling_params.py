"""Per-request sampling parameters (torch-free; validated at the edge)."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field

from kvpilot.engine.errors import SamplingParamsError

# Engine-side bounds on what one request may ask for (the server may set tighter ones). Stop strings
# are matched against every new piece of text of every sequence, so their count and length bound the
# per-token work of the engine loop; ``n`` bounds the sequences one prompt queues.
MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_LEN = 1024  # characters
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 1024
# OpenAI's bounds on ``logit_bias``: at most 300 tokens, each biased by a value in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
# Structured-output specs are compiled into a grammar per request: their size bounds that work.
MAX_STRUCTURED_SPEC_CHARS = 64 << 10
MAX_CHOICES = 1024

_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output, mirroring vLLM's ``StructuredOutputsParams``: exactly one of
    a JSON schema (``json``: a dict, or its JSON text), a regular expression, a list of ``choice``
    strings, an EBNF ``grammar`` (the grammar library's dialect) or ``json_object`` (any JSON object).
    Raises ``SamplingParamsError`` when none or several are set, or a value has the wrong type; whether
    a schema, regex or grammar compiles is checked when the request is admitted
    (``structured_output.StructuredOutputManager``). A ``choice`` list becomes a tuple."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise SamplingParamsError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or json_object; "
                f"got {', '.join(set_kinds) if set_kinds else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise SamplingParamsError(
                "structured_outputs.json must be a JSON schema object or its JSON text, got "
                + type(self.json).__name__
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"structured_outputs.{name} must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError("structured_outputs.json_object must be a boolean")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple):
                raise SamplingParamsError("structured_outputs.choice must be a list of strings")
            if not self.choice:
                raise SamplingParamsError("structured_outputs.choice must hold at least one string")
            if len(self.choice) > MAX_CHOICES:
                raise SamplingParamsError(
                    f"structured_outputs.choice may hold at most {MAX_CHOICES} strings, "
                    f"got {len(self.choice)}"
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError("structured_outputs.choice must hold non-empty strings")
            if isinstance(self.choice, list):
                object.__setattr__(self, "choice", tuple(self.choice))
        spec_len = len(self.spec)
        if spec_len > MAX_STRUCTURED_SPEC_CHARS:
            raise SamplingParamsError(
                f"structured_outputs.{self.kind} is {spec_len} characters long; at most "
                f"{MAX_STRUCTURED_SPEC_CHARS} are allowed"
            )

    @property
    def kind(self) -> str:
        """The constraint set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (a schema as compact JSON text, its keys in the given order:
        properties are generated in the order the schema declares them; the choices as a JSON array):
        with ``kind``, the key compiled grammars are cached by."""
        kind = self.kind
        if kind == "json":
            if isinstance(self.json, str):
                return self.json
            try:
                return _json.dumps(self.json, separators=(",", ":"))
            except (TypeError, ValueError) as exc:
                raise SamplingParamsError(
                    f"structured_outputs.json is not JSON-serialisable: {exc}"
                ) from None
        if kind == "choice":
            return _json.dumps(list(self.choice))
        if kind == "json_object":
            return ""
        return getattr(self, kind)


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, mirroring vLLM's ``SamplingParams``. Raises
    ``SamplingParamsError`` (an ``InvalidRequestError``) naming the first parameter out of range.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``seed`` makes the
    request's samples reproducible whatever else is in the batch. ``logprobs=k`` returns the
    sampled token's log-probability and the top-k alternatives at each step (of the model's own
    distribution, before ``logit_bias`` and the constraint's mask). ``logit_bias`` maps token ids to a
    value in [-100, 100] added to their logits before anything else. ``structured_outputs`` constrains
    the output to a schema, regex, choice or grammar.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by __post_init__ from ``stop`` (which becomes a tuple too, as does ``stop_token_ids``):
    # immutable, so that ``dataclasses.replace`` (the n > 1 siblings) shares them instead of copying.
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    # ``stop_token_ids`` as a set, for the per-token check.
    stop_token_id_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(msg)

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            check(isinstance(value, int | float), f"{name} must be a number, got {value!r}")
        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(self.n <= MAX_N, f"n must be at most {MAX_N}, got {self.n}")
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}",
        )
        if self.top_k == -1:
            self.top_k = 0
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        if self.max_tokens is not None:
            check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
        )
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        self._check_stops()
        self._check_logit_bias()
        check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams, got "
            + type(self.structured_outputs).__name__,
        )

    def _check_logit_bias(self) -> None:
        """Keys: token ids (non-negative integers; the vocabulary bound is the input processor's).
        Values: finite numbers in [-100, 100]. An empty dict becomes None (the fast path)."""
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise SamplingParamsError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}"
            )
        for token_id, value in bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise SamplingParamsError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}"
                )
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
            ):
                raise SamplingParamsError(
                    f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token_id}"
                )
        if not bias:
            self.logit_bias = None

    def _check_stops(self) -> None:
        if self.stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(self.stop, str):
            stops = (self.stop,)
        elif isinstance(self.stop, tuple):
            stops = self.stop
        elif isinstance(self.stop, list):
            stops = self.stop = tuple(self.stop)
        else:
            raise SamplingParamsError(
                "stop must be a string or a list of strings, got " + type(self.stop).__name__
            )
        if len(stops) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}"
            )
        for s in stops:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_LEN:
                raise SamplingParamsError(
                    f"stop strings must be at most {MAX_STOP_STRING_LEN} characters, got one of {len(s)}"
                )
        self.stop_strings = stops
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif not isinstance(ids, tuple | list):
            raise SamplingParamsError(f"stop_token_ids must be a list of integers, got {type(ids).__name__}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(ids)}"
            )
        if not all(isinstance(t, int) and t >= 0 for t in ids):
            raise SamplingParamsError("stop_token_ids must be non-negative integers")
        self.stop_token_ids = ids if isinstance(ids, tuple) else tuple(ids)
        self.stop_token_id_set = frozenset(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
