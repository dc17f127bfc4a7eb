"""How long one engine step takes, fitted from what the engine reports (torch-free, no numpy).

The model::

    step_seconds = a + b * num_batched_tokens + c * num_seqs
                   + d * decode_context_tokens + e * prefill_attention_pairs

``a`` is the fixed cost of a step (scheduling, launch, sampling setup), ``b`` the cost of one token
through the model's dense layers, ``c`` the cost of one sequence in the batch (the sampler, per-request
bookkeeping), ``d`` the cost of one KV position a one-token slice (a decode) reads, ``e`` the cost of
one causal (query, key) pair of a longer chunk (a prompt's prefill: quadratic in its length). All are
kept non-negative. The shape terms are ``SchedulerOutput``'s own (``decode_context_tokens``,
``prefill_attention_pairs``), so the simulator prices a step with the same arithmetic the engine
counted it with.

It is fitted by weighted least squares over windows, each a :class:`StepWindow`: ``num_steps`` steps
with their totals. Two sources, best first:

* kvpilot's engine counts its steps by phase and batch class (``kvpilot_engine_step*_total``): each
  (interval, class) series is one window with every total exact, the attention terms included. The
  classes spread the windows over batch sizes and prompt lengths even when every interval of a
  recording looks alike (a storm), which is what lets the per-sequence and attention terms be told
  apart from the fixed cost.
* Any engine (vLLM too): the steps and their batched tokens from the ``vllm:iteration_tokens_total``
  histogram (count, sum), the sequences that sampled from ``vllm:generation_tokens_total``, and the
  time those steps took -- the interval's length when the engine was busy throughout it, else the
  mean ``vllm:inter_token_latency_seconds`` per step. No attention terms (their totals are unknown:
  ``shape_known`` False), so ``d`` and ``e`` are not fitted.

Each window weighs as many steps as it holds.

**Variation over time** (``with_variation``). The fit is a mean: on a busy box the same steps run
slower for a while (other processes on the cores, the server's share of the interpreter) and the
queue behind them grows, which is where a TTFT p99 comes from. Each scrape interval with at least
``MIN_VARIATION_STEPS`` steps gives the ratio of the time its steps took to the time the fit gives
them (pods that overlap in time pool their steps); the simulator multiplies a step's time by the
ratio of the interval its clock is in (the recording's clock, from its start, repeated past its end;
1 outside the measured intervals). So the simulation runs through the slow stretches the recording
had, at the times it had them, under every candidate. Only where the windows know their shape
(kvpilot's counters): without the attention terms, what the fit misses is mostly the steps' shape,
not the box. What it cannot see: slowdowns shorter than a scrape interval, which the interval's mean
smooths out.

**Spread around the mean** (``with_jitter``). The fit and the variation are means over many steps; a
single step can take longer than its mean (the server's turn at the interpreter, a collector's pause)
and a short TTFT feels that. kvpilot's engine exports each decode step's wall time over the mean of the
earlier decode steps of its shape: its batch size and its context's quarter octave
(``kvpilot_engine_step_time_ratio``). Where the recording holds at least ``MIN_JITTER_STEPS`` of them,
``kvpilot plan --step-spread`` (``Workload.step_time(spread=True)``) has the simulator draw a factor
for every step from that histogram (uniform within a bucket, the distribution's mean scaled to 1 so the
fit's mean stays) and add its excess over 1 times the recorded mean decode step (``jitter_scale_s``;
a step shorter than that, times its own time): a stall costs a 40 ms prefill step what it cost a
decode step, not forty times as much. The replayed variation over time is left out: the ratio's
baseline is the mean since the engine started, so the spread already holds the slow stretches, and
replaying them at their recorded times as well would count them twice (and tie every candidate to the
moments the settings in force were slow). It is not the default: measured on the fidelity benchmark,
the replayed variation holds TTFT p99 within 25 % in as many settings and in more single runs, and
the spread drawn on the very requests (a trace) in fewer.

What the fit cannot capture: CUDA-graph batch-size buckets,
swap and copy time, and anything the recording never exercised (shapes outside those seen extrapolate
linearly in the terms). With fewer distinct windows than terms, the terms the data cannot tell apart
are dropped (``terms``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from kvpilot.operator.remediation.metrics import Histogram

TERMS = ("a", "b", "c", "d", "e")
# An interval gives a variation factor only with this many steps: fewer are one request's jitter,
# not a slow stretch.
MIN_VARIATION_STEPS = 20
# The step-time ratios a recording needs before the simulator draws step times from them.
MIN_JITTER_STEPS = 200
# The order terms are given up in when the data cannot support them: the finest first.
_DROP_ORDER = ("e", "d", "c", "b", "a")


class StepTimeError(ValueError):
    """No step-time model can be fitted from the data; the message says why."""


@dataclasses.dataclass(frozen=True)
class StepWindow:
    """``num_steps`` engine steps that fed ``num_batched_tokens`` tokens in all, ran
    ``num_sampled_tokens`` sequence slots in all (one sampled token each; the sequences of the steps)
    and took ``seconds`` in all; with ``shape_known``, also the KV positions their one-token slices read
    (``decode_context_tokens``) and the causal pairs of their longer chunks (``prefill_attention_pairs``)."""

    num_steps: float
    num_batched_tokens: float
    num_sampled_tokens: float
    seconds: float
    decode_context_tokens: float = 0.0
    prefill_attention_pairs: float = 0.0
    shape_known: bool = False

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

    def features(self) -> dict[str, float]:
        """The per-step means the model's terms multiply."""
        n = self.num_steps
        return {
            "a": 1.0,
            "b": self.num_batched_tokens / n,
            "c": self.num_sampled_tokens / n,
            "d": self.decode_context_tokens / n,
            "e": self.prefill_attention_pairs / n,
        }


@dataclasses.dataclass(frozen=True)
class LinearStepTime:
    """``step_seconds = a + b * tokens + c * seqs + d * decode_context + e * prefill_pairs``;
    ``terms``: the coefficients the fit estimated (the others are 0 because the data could not tell them
    apart), ``rmse_s`` the step-weighted root-mean-square error over the windows it was fitted on (None:
    not fitted)."""

    a: float
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0
    e: float = 0.0
    terms: tuple[str, ...] = TERMS[:3]
    num_windows: int = 0
    rmse_s: float | None = None
    # The recorded variation (``with_variation``): segments (start, end, factor) in seconds from the
    # recording's start, in time order; empty: none (every step at the fit's time).
    variation: tuple[tuple[float, float, float], ...] = ()
    # The spread of single steps around the model (``with_jitter``): per bucket with observations,
    # (cumulative probability at its top, low, high) of the factor, scaled to a mean of 1; empty: none.
    jitter: tuple[tuple[float, float, float], ...] = ()
    jitter_steps: float = 0.0  # the decode steps the spread was measured on
    # The mean decode step the spread was measured around (seconds; 0: the factor multiplies the whole
    # step). A drawn factor f adds (f - 1) x min(step, jitter_scale_s) to a step: a stall or a turn of
    # the server at the interpreter costs a long prefill step what it cost a decode step, not a multiple.
    jitter_scale_s: float = 0.0

    def __post_init__(self) -> None:
        values = (self.a, self.b, self.c, self.d, self.e)
        if not all(math.isfinite(v) and v >= 0 for v in values) or sum(values) <= 0:
            raise StepTimeError(f"step-time coefficients must be finite, >= 0 and not all 0, got {values}")
        if not all(math.isfinite(f) and f > 0 and end > start for start, end, f in self.variation):
            raise StepTimeError("step-time variation segments need end > start and a factor > 0")
        if not all(0 < p <= 1 + 1e-9 and 0 <= low <= high for p, low, high in self.jitter):
            raise StepTimeError("step-time jitter buckets need a probability in (0, 1] and 0 <= low <= high")
        if not (math.isfinite(self.jitter_scale_s) and self.jitter_scale_s >= 0):
            raise StepTimeError(f"the jitter's scale must be finite and >= 0, got {self.jitter_scale_s!r}")
        # Where each segment starts, for factor_at's search (not a field: derived from variation).
        object.__setattr__(self, "_starts", [start for start, _, _ in self.variation])
        object.__setattr__(self, "_jitter_tops", [p for p, _, _ in self.jitter])

    @property
    def uses_attention_shape(self) -> bool:
        """Whether a step's attention totals change its time (the simulator counts them only then)."""
        return self.d > 0 or self.e > 0

    def step_seconds(
        self,
        num_batched_tokens: int,
        num_seqs: int,
        decode_context_tokens: int = 0,
        prefill_attention_pairs: int = 0,
    ) -> float:
        seconds = (
            self.a
            + self.b * num_batched_tokens
            + self.c * num_seqs
            + self.d * decode_context_tokens
            + self.e * prefill_attention_pairs
        )
        # A step always takes some time: without a fixed cost, one token of one sequence is the floor.
        return seconds if seconds > 0 else self.b + self.c + self.d

    def factor_at(self, t: float) -> float:
        """How much slower than the fit a step starting at ``t`` (seconds from the recording's start)
        runs: the factor of the recorded segment holding ``t``, the recording repeated past its end;
        1.0 without variation or outside every segment."""
        if not self.variation:
            return 1.0
        first, last = self.variation[0][0], self.variation[-1][1]
        if t >= last and last > first:
            t = first + (t - first) % (last - first)
        i = bisect.bisect_right(self._starts, t) - 1
        if i < 0:
            return 1.0
        start, end, factor = self.variation[i]
        return factor if start <= t < end else 1.0

    def jitter_factor(self, u: float) -> float:
        """The spread factor at ``u`` (uniform in [0, 1)): inverse of the piecewise-uniform distribution
        ``jitter`` holds (1.0 without one)."""
        if not self.jitter:
            return 1.0
        tops = self._jitter_tops
        i = min(bisect.bisect_right(tops, u), len(tops) - 1)
        below = tops[i - 1] if i else 0.0
        _, low, high = self.jitter[i]
        share = (u - below) / (tops[i] - below) if tops[i] > below else 0.0
        return low + (high - low) * min(1.0, max(0.0, share))

    def jittered(self, seconds: float, u: float) -> float:
        """A step the model gives ``seconds``, spread by the factor at ``u`` (``jitter_factor``): the
        factor's excess over 1 applies to at most ``jitter_scale_s`` of it (to all of it without a
        scale)."""
        excess = self.jitter_factor(u) - 1.0
        scale = self.jitter_scale_s
        return seconds + excess * (min(seconds, scale) if scale > 0 else seconds)

    def describe(self) -> str:
        parts = [f"{self.a * 1e3:.3f} ms", f"{self.b * 1e6:.3f} us/token", f"{self.c * 1e6:.3f} us/seq"]
        if self.d or "d" in self.terms:
            parts.append(f"{self.d * 1e9:.3f} ns/context token")
        if self.e or "e" in self.terms:
            parts.append(f"{self.e * 1e9:.3f} ns/prefill pair")
        return (
            f"step = {' + '.join(parts)} "
            f"(fitted on {self.num_windows} window(s), terms {'+'.join(self.terms)}"
            + (f", rmse {self.rmse_s * 1e3:.3f} ms)" if self.rmse_s is not None else ")")
            + (self._describe_variation() if self.variation else "")
            + (self._describe_jitter() if self.jitter else "")
        )

    def _describe_jitter(self) -> str:
        p10, p90 = self.jitter_factor(0.1), self.jitter_factor(0.9)
        scale = self.jitter_scale_s
        return (
            f"; each step x{p10:.2f}-x{p90:.2f} (10th-90th percentile, the spread of "
            f"{self.jitter_steps:.0f} recorded decode steps"
            + (f", of at most the {scale * 1e3:.3f} ms they took on average)" if scale > 0 else ")")
        )

    def _describe_variation(self) -> str:
        factors = [f for _, _, f in self.variation]
        return (
            f"; the recording's variation replayed: x{min(factors):.2f}-x{max(factors):.2f} "
            f"over {len(factors)} segment(s)"
        )


def fit_step_time(windows: Sequence[StepWindow]) -> LinearStepTime:
    """The non-negative weighted least-squares fit of :class:`LinearStepTime` to ``windows``
    (weights: their step counts). Windows without steps or time are skipped. The attention terms are
    fitted only when every window knows its shape. Terms whose estimate comes out negative, or that
    the windows cannot separate from the others, are dropped one at a time (the finest first:
    prefill pairs, decode context, per sequence, per token, then the intercept) and the rest refitted;
    with one term left that still fails, the model is the step-weighted mean step time.

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
    terms = list(TERMS if all(w.shape_known for w in usable) else TERMS[:3])
    while True:
        solution = _weighted_lstsq(usable, terms)
        if solution is not None and all(v >= 0 for v in solution.values()) and sum(solution.values()) > 0:
            break
        if len(terms) == 1:
            # The intercept alone: the step-weighted mean step time, positive by construction.
            terms, solution = ["a"], {"a": sum(w.seconds for w in usable) / sum(w.num_steps for w in usable)}
            break
        if solution is None:
            # The windows cannot separate the terms: drop the finest one whose removal lets them (a
            # column no window exercises, or one that moves in step with another), else the finest.
            drop = next(
                (
                    t
                    for t in _DROP_ORDER
                    if t in terms and _weighted_lstsq(usable, [u for u in terms if u != t])
                ),
                next(t for t in _DROP_ORDER if t in terms),
            )
        else:
            drop = next(t for t in _DROP_ORDER if t in terms and solution[t] < 0)
        terms.remove(drop)
    model = LinearStepTime(**{t: solution.get(t, 0.0) for t in TERMS}, terms=tuple(terms))
    total_steps = sum(w.num_steps for w in usable)
    sse = sum(w.num_steps * (w.step_seconds - _predict(model, w)) ** 2 for w in usable)
    return dataclasses.replace(model, num_windows=len(usable), rmse_s=math.sqrt(sse / total_steps))


def _predict(model: LinearStepTime, w: StepWindow) -> float:
    x = w.features()
    return sum(getattr(model, t) * x[t] for t in TERMS)


def _weighted_lstsq(windows: Sequence[StepWindow], terms: Sequence[str]) -> dict[str, float] | None:
    """Solve the normal equations of the step-weighted fit over ``terms``; None when they are singular
    (the windows do not separate the terms). Each column is scaled to a largest value of 1 first: the
    attention totals run to millions per step where the intercept's column is 1."""
    k = len(terms)
    rows = [([w.features()[t] for t in terms], w.num_steps, w.step_seconds) for w in windows]
    scale = [max(abs(x[i]) for x, _, _ in rows) for i in range(k)]
    if any(s == 0 for s in scale):
        return None  # a term no window exercises
    xtx = [[0.0] * k for _ in range(k)]
    xty = [0.0] * k
    for x, weight, y in rows:
        x = [v / s for v, s in zip(x, scale, strict=True)]
        for i in range(k):
            xty[i] += weight * x[i] * y
            for j in range(k):
                xtx[i][j] += weight * x[i] * x[j]
    solution = _solve(xtx, xty)
    if solution is None:
        return None
    return {t: v / s for t, v, s in zip(terms, solution, scale, strict=True)}


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


def with_variation(
    model: LinearStepTime,
    intervals: Sequence[tuple[float, float, Sequence[StepWindow]]],
    min_steps: float = MIN_VARIATION_STEPS,
) -> LinearStepTime:
    """``model`` with the variation over time of ``intervals`` (start, end in seconds from the
    recording's start, and the step windows measured in it; see the module doc): for each stretch
    between two interval bounds, the time the steps of the intervals covering it took over the time
    ``model`` gives them, from the intervals with at least ``min_steps`` steps whose windows know their
    shape (kvpilot's step counters). Stretches no such interval covers keep the fit's time. Without
    any such interval the model is returned as it is.

    Only shaped windows count: where the fit has no attention terms (another engine's counters), what
    it leaves unexplained is mostly the steps' shape -- a stretch of recomputed prompts after a
    preemption -- which a candidate that does not preempt would not repeat; replaying it would slow
    that candidate for the settings in force's misfortune."""
    usable = []
    for start, end, windows in intervals:
        steps = sum(w.num_steps for w in windows)
        if end > start and steps >= min_steps and all(w.shape_known for w in windows):
            took = sum(w.seconds for w in windows)
            given = sum(_predict(model, w) * w.num_steps for w in windows)
            if took > 0 and given > 0:
                usable.append((start, end, took, given))
    if not usable:
        return model
    # A sweep over the bounds: between two, the intervals open there pool their steps' times.
    events = sorted(
        [(start, 1, took, given) for start, _, took, given in usable]
        + [(end, -1, took, given) for _, end, took, given in usable]
    )
    segments: list[tuple[float, float, float]] = []
    open_intervals, took_sum, given_sum = 0, 0.0, 0.0
    for (at, sign, took, given), following in zip(events, [*events[1:], None], strict=True):
        open_intervals += sign
        took_sum += sign * took
        given_sum += sign * given
        if following is not None and following[0] > at and open_intervals > 0 and given_sum > 0:
            segments.append((at, following[0], took_sum / given_sum))
    return dataclasses.replace(model, variation=tuple(segments))


def with_jitter(
    model: LinearStepTime,
    ratios: Histogram,
    min_steps: float = MIN_JITTER_STEPS,
    scale_s: float = 0.0,
) -> LinearStepTime:
    """``model`` with single steps spread as the recorded step-time ratios ``ratios`` (a histogram of
    a step's wall time over its mean; see the module doc), without replayed variation; ``model`` as it
    is when they hold fewer than ``min_steps`` observations. Each bucket's factors are uniform between
    its bounds (the lowest from half its bound; the ``+Inf`` bucket at the highest finite bound), and
    all are scaled so that their mean is 1. ``scale_s``: the mean decode step the ratios were measured
    on (``LinearStepTime.jitter_scale_s``; 0: the factors multiply whole steps)."""
    if ratios.count < min_steps:
        return model
    pieces = []
    below_le, below_count = None, 0.0
    for le, cumulative in ratios.buckets:
        count = cumulative - below_count
        if count > 0:
            if math.isinf(le):
                low = high = below_le if below_le is not None else 1.0
            else:
                low, high = (le / 2 if below_le is None else below_le), le
            pieces.append([count, low, high])
        below_count = cumulative
        if not math.isinf(le):
            below_le = le
    total = sum(c for c, _, _ in pieces)
    mean = sum(c * (low + high) / 2 for c, low, high in pieces) / total if total > 0 else 0.0
    if not (total > 0 and mean > 0):
        return model
    jitter, cumulative = [], 0.0
    for count, low, high in pieces:
        cumulative += count / total
        jitter.append((min(1.0, cumulative), low / mean, high / mean))
    return dataclasses.replace(
        model, variation=(), jitter=tuple(jitter), jitter_steps=ratios.count, jitter_scale_s=scale_s
    )
