"""What the engine's steps cost by their shape, as counters (``metrics_names.ENGINE_STEP_COUNTERS``),
for a planner to fit step time on (``kvpilot plan``'s ``step_time``).

One series per (phase, batch class) and quantity: the steps, their wall seconds
(``IterationStats.wall_s``), the tokens they fed, their sequences, the KV positions their one-token
slices read and the causal pairs of their longer chunks. A series' increase over a window is the exact
sum over its steps, so a per-class mean needs no histogram and no bucket interpolation. Every series
up to the start-up ``max_num_seqs`` is exported at 0 from the start (run-time changes stay within it).

Beside them, ``kvpilot_engine_step_time_ratio``: a histogram of each decode step's wall time over the
mean wall time of the decode steps of the same shape before it -- the same batch size, and a context
(KV positions read) within the same quarter octave -- from the ``STEP_TIME_RATIO_WARMUP``-th on. The
sums give a planner each class's mean and its cost per context token; the ratio gives the spread around
them -- the event loop's turns, a collector's pause -- which shorter steps feel as latency. Its baseline
knows the context so that the spread does not hold what the planner's step-time model already prices:
a batch size's steps over 300 and over 800 tokens of context differ by their shape, not by chance.

And the server's turns (``ServerTurns``): the time between two requests' arrivals, a burst's requests
reaching the engine one server turn apart; the server's time on each request it took in alone; and its
time on each /metrics scrape. A planner spaces a simulated burst by the first two and takes the scrapes
as turns of their own.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpilot.engine import metrics_names as names
from kvpilot.engine.stats import IterationStats

_BY = "by phase and batch class"
_DOCS = {
    names.ENGINE_STEPS_TOTAL: f"Engine steps, {_BY}.",
    names.ENGINE_STEP_SECONDS_TOTAL: f"Wall seconds the engine's steps held it, {_BY}.",
    names.ENGINE_STEP_TOKENS_TOTAL: f"Tokens the engine's steps fed the model, {_BY}.",
    names.ENGINE_STEP_SEQS_TOTAL: f"Sequences in the engine's steps, {_BY}.",
    names.ENGINE_STEP_DECODE_CONTEXT_TOTAL: f"KV positions read by one-token slices in steps, {_BY}.",
    names.ENGINE_STEP_PREFILL_PAIRS_TOTAL: f"Causal query-key pairs of prompt chunks, {_BY}.",
}


def engine_histogram(
    registry: CollectorRegistry, engine_labels: tuple[str, str], name: str, doc: str, buckets
) -> Any:
    """A histogram of one engine in ``registry``, with vLLM's ``{engine, model_name}`` labels set to
    ``engine_labels``."""
    family = Histogram(
        name, doc, [names.LABEL_ENGINE, names.LABEL_MODEL_NAME], buckets=buckets, registry=registry
    )
    return family.labels(*engine_labels)


class StepShapeCounters:
    """The step counters of one engine in ``registry``; ``engine_labels``: the values of vLLM's
    ``{engine, model_name}`` labels, which every series carries before ``phase`` and ``num_seqs``."""

    def __init__(
        self, registry: CollectorRegistry, engine_labels: tuple[str, str], max_num_seqs: int
    ) -> None:
        label_names = [names.LABEL_ENGINE, names.LABEL_MODEL_NAME, names.LABEL_PHASE, names.LABEL_NUM_SEQS]
        self._families = [
            Counter(name.removesuffix("_total"), _DOCS[name], label_names, registry=registry)
            for name in names.ENGINE_STEP_COUNTERS
        ]
        self._engine_labels = engine_labels
        self._ratio = engine_histogram(
            registry,
            engine_labels,
            names.ENGINE_STEP_TIME_RATIO,
            "Decode step wall time over the mean of the earlier decode steps of its batch size and context.",
            names.STEP_TIME_RATIO_BUCKETS,
        )
        # Decode steps by (batch size, context class): (steps, wall seconds) so far (the ratio's baseline).
        self._decode_means: dict[tuple[int, int], tuple[int, float]] = {}
        self._series: dict[tuple[str, str], tuple[Any, ...]] = {}
        for phase in names.PHASES:
            for batch in names.batch_classes(max_num_seqs):
                self._of((phase, batch))

    def _of(self, key: tuple[str, str]) -> tuple[Any, ...]:
        series = self._series.get(key)
        if series is None:
            series = tuple(family.labels(*self._engine_labels, *key) for family in self._families)
            self._series[key] = series
        return series

    def record(self, it: IterationStats) -> None:
        """Count one step (nothing for a step without its wall time or without sequences)."""
        if it.wall_s is None or it.num_running_seqs <= 0:
            return
        phase = names.PHASE_PREFILL if it.num_prefill_seqs else names.PHASE_DECODE
        steps, seconds, tokens, seqs, context, pairs = self._of(
            (phase, names.batch_class(it.num_running_seqs))
        )
        wall_s = max(0.0, it.wall_s)
        steps.inc()
        seconds.inc(wall_s)
        tokens.inc(it.num_batched_tokens)
        seqs.inc(it.num_running_seqs)
        if it.decode_context_tokens:
            context.inc(it.decode_context_tokens)
        if it.prefill_attention_pairs:
            pairs.inc(it.prefill_attention_pairs)
        if phase == names.PHASE_DECODE:
            self._observe_ratio((it.num_running_seqs, context_class(it.decode_context_tokens)), wall_s)

    def _observe_ratio(self, shape: tuple[int, int], wall_s: float) -> None:
        """Observe ``wall_s`` over the mean of the earlier decode steps of ``shape`` (batch size, context
        class), once there are enough of them; then count it into that mean."""
        steps, seconds = self._decode_means.get(shape, (0, 0.0))
        if steps >= names.STEP_TIME_RATIO_WARMUP and seconds > 0:
            self._ratio.observe(wall_s * steps / seconds)
        self._decode_means[shape] = (steps + 1, seconds + wall_s)


def context_class(context_tokens: int) -> int:
    """The quarter octave a decode step's context (KV positions its sequences read) falls in: steps
    in one class differ by less than a factor of 2 ** (1/4), about 19 %. 0 for no context."""
    return 1 + int(4 * math.log2(context_tokens)) if context_tokens > 0 else 0


class ServerTurns:
    """The server's turns on the interpreter the steps share, for a planner to draw:
    ``kvpilot_engine_arrival_gap_seconds``, each request's arrival stamp less the latest one before it
    (0 for a stamp no later than it: the prompts of one call share theirs; the first request has no
    gap), ``kvpilot_engine_request_intake_seconds``, each request taken in alone, and
    ``kvpilot_engine_metrics_render_seconds``, each /metrics answer."""

    def __init__(self, registry: CollectorRegistry, engine_labels: tuple[str, str]) -> None:
        self._gaps = engine_histogram(
            registry,
            engine_labels,
            names.ENGINE_ARRIVAL_GAP_SECONDS,
            "Seconds between a request's arrival and the arrival before it.",
            names.ARRIVAL_GAP_BUCKETS,
        )
        self._last: float | None = None
        self._intakes = engine_histogram(
            registry,
            engine_labels,
            names.ENGINE_REQUEST_INTAKE_SECONDS,
            "Seconds the server took to take in one generation request it had to itself, from reaching "
            "the application to its hand-off to the engine.",
            names.REQUEST_INTAKE_BUCKETS,
        )
        self._renders = engine_histogram(
            registry,
            engine_labels,
            names.ENGINE_METRICS_RENDER_SECONDS,
            "Seconds the server took to answer one /metrics scrape (routing, rendering, sending).",
            names.METRICS_RENDER_BUCKETS,
        )

    def record_arrival(self, arrival_time: float) -> None:
        last = self._last
        if last is not None:
            self._gaps.observe(max(0.0, arrival_time - last))
        self._last = arrival_time if last is None else max(last, arrival_time)

    def record_intake(self, seconds: float) -> None:
        self._intakes.observe(seconds)

    def record_scrape(self, seconds: float) -> None:
        self._renders.observe(seconds)
