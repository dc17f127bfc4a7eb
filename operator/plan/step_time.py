"""How long one engine step takes, fitted from what the engine reports (torch-free, no numpy).

The model::

    step_seconds = a + b * num_batched_tokens + c * num_seqs

``a`` is the fixed cost of a step (scheduling, launch, sampling setup), ``b`` the cost of one token
through the model (prefill-dominated steps), ``c`` the cost of one sequence in the batch (attention
over its KV, the sampler, per-request bookkeeping). All three are kept non-negative.

It is fitted by weighted least squares over the windows of a recording (the intervals between two
scrapes of one pod), each a :class:`StepWindow` read from counters every engine exports, kvpilot
and vLLM alike: the steps and their batched tokens from the ``vllm:iteration_tokens_total``
histogram (count, sum), the sequences that sampled from ``vllm:generation_tokens_total`` (one token
per sampling sequence per step), and the time those steps took -- the window's length when the
engine was busy throughout it (requests running at both ends), else the mean
``vllm:inter_token_latency_seconds`` (each inter-token gap spans one step of the request's batch).
Each window weighs as many steps as it holds.

What it captures: the linear trend of step time in tokens per step and batch size, which is what
decides how fast a queue drains and how long a request holds its KV blocks. What it cannot capture:
the curvature of attention in context length (long contexts cost more per sequence than short
ones), the difference between a prefill token and a decode token beyond the per-sequence term,
CUDA-graph batch-size buckets, swap and copy time, and anything the recording never exercised
(batch sizes or token counts outside those seen extrapolate linearly). Windows are averages, so
the fit sees per-window means, not single steps; with fewer distinct windows than terms the terms
the data cannot tell apart are dropped (``terms``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

TERMS = ("a", "b", "c")


class StepTimeError(ValueError):
    """No step-time model can be fitted from the data; the message says why."""


@dataclasses.dataclass(frozen=True)
class StepWindow:
    """One interval of a recording: ``num_steps`` engine steps that fed ``num_batched_tokens`` tokens
    in all, sampled ``num_sampled_tokens`` tokens in all and took ``seconds`` in all."""

    num_steps: float
    num_batched_tokens: float
    num_sampled_tokens: float
    seconds: float

    @property
    def tokens_per_step(self) -> float:
        return self.num_batched_tokens / self.num_steps

    @property
    def seqs_per_step(self) -> float:
        return self.num_sampled_tokens / self.num_steps

    @property
    def step_seconds(self) -> float:
        return self.seconds / self.num_steps

    @property
    def output_tokens_per_s(self) -> float:
        """Generation throughput in the window, at its batch size ``seqs_per_step``."""
        return self.num_sampled_tokens / self.seconds


@dataclasses.dataclass(frozen=True)
class LinearStepTime:
    """``step_seconds = a + b * num_batched_tokens + c * num_seqs``; ``terms``: the coefficients the
    fit estimated (the others are 0 because the data could not tell them apart), ``rmse_s`` the
    step-weighted root-mean-square error over the windows it was fitted on (None: not fitted)."""

    a: float
    b: float = 0.0
    c: float = 0.0
    terms: tuple[str, ...] = TERMS
    num_windows: int = 0
    rmse_s: float | None = None

    def __post_init__(self) -> None:
        values = (self.a, self.b, self.c)
        if not all(math.isfinite(v) and v >= 0 for v in values) or self.a + self.b + self.c <= 0:
            raise StepTimeError(f"step-time coefficients must be finite, >= 0 and not all 0, got {values}")

    def step_seconds(self, num_batched_tokens: int, num_seqs: int) -> float:
        seconds = self.a + self.b * num_batched_tokens + self.c * num_seqs
        # A step always takes some time: without a fixed cost, one token of one sequence is the floor.
        return seconds if seconds > 0 else self.b + self.c

    def describe(self) -> str:
        return (
            f"step = {self.a * 1e3:.3f} ms + {self.b * 1e6:.3f} us/token + {self.c * 1e6:.3f} us/seq "
            f"(fitted on {self.num_windows} window(s), terms {'+'.join(self.terms)}"
            + (f", rmse {self.rmse_s * 1e3:.3f} ms)" if self.rmse_s is not None else ")")
        )


def fit_step_time(windows: Sequence[StepWindow]) -> LinearStepTime:
    """The non-negative weighted least-squares fit of :class:`LinearStepTime` to ``windows``
    (weights: their step counts). Windows without steps or time are skipped. Terms whose estimate
    comes out negative, or that the windows cannot separate from the others, are dropped one at a
    time (the per-sequence term first, then the per-token one, then the intercept) and the rest
    refitted; with one term left that still fails, the model is the step-weighted mean step time.

    Raises StepTimeError when no window holds a step."""
    usable = [
        w
        for w in windows
        if w.num_steps > 0
        and w.seconds > 0
        and math.isfinite(w.seconds)
        and math.isfinite(w.num_batched_tokens)
    ]
    if not usable:
        raise StepTimeError("no window of the recording holds engine steps with their time")
    terms = list(TERMS)
    while True:
        solution = _weighted_lstsq(usable, terms)
        if solution is not None and all(v >= 0 for v in solution.values()) and sum(solution.values()) > 0:
            break
        if len(terms) == 1:
            # The intercept alone: the step-weighted mean step time, positive by construction.
            terms, solution = ["a"], {"a": sum(w.seconds for w in usable) / sum(w.num_steps for w in usable)}
            break
        if solution is None:  # the windows cannot separate the terms: the finer ones go first
            drop = next(t for t in ("c", "b", "a") if t in terms)
        else:
            drop = next(t for t in ("c", "b", "a") if t in terms and solution[t] < 0)
        terms.remove(drop)
    model = LinearStepTime(
        a=solution.get("a", 0.0), b=solution.get("b", 0.0), c=solution.get("c", 0.0), terms=tuple(terms)
    )
    total_steps = sum(w.num_steps for w in usable)
    sse = sum(
        w.num_steps * (w.step_seconds - _predict(model, w.tokens_per_step, w.seqs_per_step)) ** 2
        for w in usable
    )
    return dataclasses.replace(model, num_windows=len(usable), rmse_s=math.sqrt(sse / total_steps))


def _predict(model: LinearStepTime, tokens: float, seqs: float) -> float:
    return model.a + model.b * tokens + model.c * seqs


def _features(w: StepWindow, terms: Sequence[str]) -> list[float]:
    values = {"a": 1.0, "b": w.tokens_per_step, "c": w.seqs_per_step}
    return [values[t] for t in terms]


def _weighted_lstsq(windows: Sequence[StepWindow], terms: Sequence[str]) -> dict[str, float] | None:
    """Solve the normal equations of the step-weighted fit over ``terms``; None when they are singular
    (the windows do not separate the terms)."""
    k = len(terms)
    xtx = [[0.0] * k for _ in range(k)]
    xty = [0.0] * k
    for w in windows:
        x = _features(w, terms)
        for i in range(k):
            xty[i] += w.num_steps * x[i] * w.step_seconds
            for j in range(k):
                xtx[i][j] += w.num_steps * x[i] * x[j]
    solution = _solve(xtx, xty)
    return None if solution is None else dict(zip(terms, solution, strict=True))


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a (numerically) singular system."""
    k = len(rhs)
    rows = [row[:] + [value] for row, value in zip(matrix, rhs, strict=True)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    if scale == 0:
        return None
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(k):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][k] / rows[i][i] for i in range(k)]
