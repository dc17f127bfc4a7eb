"""Per-request sampling parameters (torch-free; validated at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.errors import SamplingParamsError

# Engine-side bounds on what one request may ask for (the server may set tighter ones). Stop strings
# are matched against every new piece of text of every sequence, so their count and length bound the
# per-token work of the engine loop; ``n`` bounds the sequences one prompt queues.
MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_LEN = 1024  # characters
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 1024


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop, mirroring vLLM's ``SamplingParams``. Raises
    ``SamplingParamsError`` (an ``InvalidRequestError``) naming the first parameter out of range.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``seed`` makes the
    request's samples reproducible whatever else is in the batch. ``logprobs=k`` returns the
    sampled token's log-probability and the top-k alternatives at each step.
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
