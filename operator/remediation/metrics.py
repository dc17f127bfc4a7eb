"""One ``/metrics`` answer read: the engine's Prometheus text (or samples a replay file holds) -> a
:class:`Scrape`, and the engine's KV capacity and model shape from its info metrics.

Pure: no I/O and no clock. Deprecated metric names (``vllm:gpu_cache_usage_perc``) count as their
current ones. The latency histograms the demand rule reads (``vllm:time_to_first_token_seconds``,
``vllm:request_queue_time_seconds``) are optional: one that no healthy engine emits (a NaN or negative
sample, buckets that are not cumulative, no ``+Inf`` bucket, a count that is not the ``+Inf`` bucket's)
is dropped and named in ``Scrape.dropped``, so it is never acted on, and the scrape stays usable for
the signals that do not need it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as m

# The counter's creation time, exported next to it by prometheus-client (``<name>_created``).
PREEMPTIONS_CREATED = m.NUM_PREEMPTIONS_TOTAL.removesuffix("_total") + "_created"
# prometheus-client's ProcessCollector (``kvpilot serve`` and vLLM export it): moves on a restart.
PROCESS_START = "process_start_time_seconds"
# What one scrape must carry to count; the names as the engine exports them (aliases accepted).
REQUIRED = (m.NUM_PREEMPTIONS_TOTAL, m.KV_CACHE_USAGE_PERC, m.NUM_REQUESTS_WAITING, m.NUM_REQUESTS_RUNNING)
# Optional: what finished requests held (prompt + output tokens) and how many finished, from the
# ``vllm:request_prompt_tokens`` / ``vllm:request_generation_tokens`` histograms. The live relief sizes
# maxNumSeqs to the KV pool with their mean; without them it falls back to shrinking (policy).
REQUEST_TOKEN_SUMS = (m.REQUEST_PROMPT_TOKENS + "_sum", m.REQUEST_GENERATION_TOKENS + "_sum")
REQUESTS_FINISHED = m.REQUEST_GENERATION_TOKENS + "_count"
# Optional: the latency histograms of the demand rule that sees queues (signals.demand_of).
LATENCY_HISTOGRAMS = (m.TIME_TO_FIRST_TOKEN_SECONDS, m.REQUEST_QUEUE_TIME_SECONDS)
# The values a healthy engine can emit: (low, high) inclusive. Anything else is dropped as invalid.
VALID_RANGE = {
    m.NUM_PREEMPTIONS_TOTAL: (0.0, math.inf),
    m.KV_CACHE_USAGE_PERC: (0.0, 1.0),
    m.NUM_REQUESTS_WAITING: (0.0, math.inf),
    m.NUM_REQUESTS_RUNNING: (0.0, math.inf),
}


def is_valid_sample(canonical: str, value: float) -> bool:
    """Whether ``value`` is one a healthy engine emits for the required metric ``canonical``:
    finite and within ``VALID_RANGE`` (counters and counts non-negative, KV usage within 0..1)."""
    low, high = VALID_RANGE[canonical]
    return math.isfinite(value) and low <= value <= high


class MetricsParseError(ValueError):
    """A ``/metrics`` body is not Prometheus text exposition."""


@dataclasses.dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram, its series summed: ``buckets`` are (upper bound ``le``,
    cumulative count) pairs in bound order, ``+Inf`` last; ``sum`` and ``count`` its totals.

    Counts since the process started, or (the result of :meth:`increase`) over an interval.
    """

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    @property
    def bounds(self) -> tuple[float, ...]:
        return tuple(le for le, _ in self.buckets)

    def increase(self, before: Histogram) -> Histogram | None:
        """What was observed since ``before`` (an earlier scrape of the same process), or None when
        the two do not line up (other bucket bounds) or a count fell: the sum, the count, or the
        observations in any one bucket (then the difference would not be cumulative either)."""
        if before.bounds != self.bounds:
            return None
        buckets = tuple((le, c - b) for (le, c), (_, b) in zip(self.buckets, before.buckets, strict=True))
        delta = Histogram(buckets, self.sum - before.sum, self.count - before.count)
        counts = [0.0] + [c for _, c in buckets]
        if delta.sum < 0 or delta.count < 0 or any(b < a for a, b in zip(counts, counts[1:], strict=False)):
            return None
        return delta

    def __add__(self, other: Histogram) -> Histogram:
        """Two histograms with the same bucket bounds, bucket by bucket (other bounds: ValueError)."""
        if other.bounds != self.bounds:
            raise ValueError(f"bucket bounds differ: {self.bounds} vs {other.bounds}")
        buckets = tuple((le, a + b) for (le, a), (_, b) in zip(self.buckets, other.buckets, strict=True))
        return Histogram(buckets, self.sum + other.sum, self.count + other.count)


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """The ``q``-quantile (0 < q <= 1) of cumulative ``buckets``, as Prometheus' ``histogram_quantile``
    estimates it: linear interpolation within the bucket the rank falls in, the lowest bucket
    starting at 0 (when its bound is positive); a rank in the ``+Inf`` bucket gives the highest finite
    bound. None when the buckets hold no observation or cannot be interpolated (no ``+Inf`` bucket,
    fewer than two buckets). Raises ValueError for ``q`` outside (0, 1]."""
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], got {q}")
    if len(buckets) < 2 or buckets[-1][0] != math.inf:
        return None
    total = buckets[-1][1]
    if not total > 0:
        return None
    rank = q * total
    index = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0]
    end, count = buckets[index]
    if index == 0 and end <= 0:
        return end
    start = 0.0
    if index > 0:
        start, below = buckets[index - 1]
        count -= below
        rank -= below
    return start + (end - start) * (rank / count) if count > 0 else None


def histogram_from_parts(name: str, parts: dict[str, dict]) -> Histogram | str:
    """The histogram ``name`` from its summed samples (``parts``: "buckets" le -> count, "sum",
    "count"), or why no healthy engine exports it as it is."""
    buckets = sorted(parts.get("buckets", {}).items())
    if not buckets or buckets[-1][0] != math.inf:
        return f"{name}: no +Inf bucket"
    if "sum" not in parts or "count" not in parts:
        return f"{name}: lacks its _sum or _count"
    for (le_a, a), (le_b, b) in zip(buckets, buckets[1:], strict=False):
        if b < a:
            return f"{name}: buckets not cumulative (le={le_b:g}: {b:g} < le={le_a:g}: {a:g})"
    if parts["count"] != buckets[-1][1]:
        return f"{name}: _count {parts['count']:g} is not the +Inf bucket's {buckets[-1][1]:g}"
    return Histogram(tuple(buckets), parts["sum"], parts["count"])


def _histogram_sample(name: str) -> tuple[str, str] | None:
    """(histogram, part) for a sample of a latency histogram (part: bucket, sum, count), else None."""
    for histogram in LATENCY_HISTOGRAMS:
        for part in ("bucket", "sum", "count"):
            if name == f"{histogram}_{part}":
                return histogram, part
    return None


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One pod's ``/metrics`` at ``time`` (unix seconds).

    ``preemptions``: ``vllm:num_preemptions_total`` summed over its series; ``preemptions_created``:
    its ``_created`` timestamp when exported; ``process_start``: ``process_start_time_seconds`` when
    exported. ``kv_usage`` (0..1), ``waiting``, ``running``: the gauges. ``cache_info`` /
    ``model_info``: the labels of ``vllm:cache_config_info`` and ``kvpilot_model_config_info``.
    ``missing``: required metrics the response lacked. ``invalid``: ``"name=value"`` for each sample of
    a required metric dropped because no healthy engine emits it (NaN, infinite, negative, KV usage
    outside 0..1); a scrape with any is not used. ``request_tokens`` / ``requests_finished``: the
    prompt + output tokens of the requests finished so far and their count (None when not exported or
    not a finite non-negative number: optional, so they never make a scrape unusable).
    ``live_config``: the labels of ``kvpilot_config_info``, the run-time settings in force.
    ``ttft`` / ``queue_time``: the ``vllm:time_to_first_token_seconds`` and
    ``vllm:request_queue_time_seconds`` histograms (None when not exported or dropped as invalid);
    ``dropped``: why each optional histogram that no healthy engine emits was dropped.
    """

    time: float
    preemptions: float | None = None
    preemptions_created: float | None = None
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    cache_info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    model_info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    missing: tuple[str, ...] = ()
    invalid: tuple[str, ...] = ()
    process_start: float | None = None
    request_tokens: float | None = None
    requests_finished: float | None = None
    live_config: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ttft: Histogram | None = None
    queue_time: Histogram | None = None
    dropped: tuple[str, ...] = ()

    @property
    def started(self) -> tuple[float | None, float | None]:
        """What identifies the process that counted (start time, counter creation): a restart moves it."""
        return (self.process_start, self.preemptions_created)


def _samples_from_text(text: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        return [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        raise MetricsParseError(f"not Prometheus text exposition: {exc}") from exc


def _samples_from_json(value: Any) -> list[tuple[str, dict[str, str], float]]:
    """Parsed samples as a replay file may hold them: ``{"name": value}`` or a list of
    ``{"name", "labels", "value"}`` objects / ``[name, labels, value]`` triples."""
    out = []
    try:
        if isinstance(value, dict):
            return [(str(k), {}, float(v)) for k, v in value.items()]
        for item in value:
            if isinstance(item, dict):
                out.append((str(item["name"]), dict(item.get("labels") or {}), float(item["value"])))
            else:
                name, labels, number = item
                out.append((str(name), dict(labels or {}), float(number)))
    except (KeyError, TypeError, ValueError) as exc:
        raise MetricsParseError(f"not a list of samples: {exc}") from exc
    return out


def parse_scrape(metrics: str | list | dict, time: float) -> Scrape:
    """A :class:`Scrape` from Prometheus text (or already parsed samples, see ``_samples_from_json``).

    Deprecated names (``vllm:gpu_cache_usage_perc``) count as their current ones; where an engine
    exports both, the current name wins. Samples outside what an engine emits are dropped and listed
    in ``invalid`` (see :func:`is_valid_sample`). Raises MetricsParseError for an unparsable body.
    """
    samples = _samples_from_text(metrics) if isinstance(metrics, str) else _samples_from_json(metrics)
    sums: dict[str, float] = {}
    via_alias: dict[str, float] = {}
    cache_info: dict[str, str] = {}
    model_info: dict[str, str] = {}
    live_config: dict[str, str] = {}
    created: float | None = None
    started: float | None = None
    invalid: list[str] = []
    optional: dict[str, float] = {}
    histograms: dict[str, dict] = {}
    bad_histograms: dict[str, str] = {}
    for name, labels, value in samples:
        latency = _histogram_sample(name)
        if latency is not None:
            histogram, part = latency
            parts = histograms.setdefault(histogram, {})
            le = _bound(labels.get("le")) if part == "bucket" else 0.0
            if not (math.isfinite(value) and value >= 0) or le is None:
                bad_histograms.setdefault(histogram, f"{name}{_le(labels)}={value:g}")
            elif part == "bucket":
                buckets = parts.setdefault("buckets", {})
                buckets[le] = buckets.get(le, 0.0) + value  # series of one engine: summed
            else:
                parts[part] = parts.get(part, 0.0) + value
            continue
        if name in REQUEST_TOKEN_SUMS or name == REQUESTS_FINISHED:
            optional[name] = optional.get(name, 0.0) + value  # NaN or negative: dropped below
            continue
        if name == m.CACHE_CONFIG_INFO:
            cache_info = labels
            continue
        if name == m.CONFIG_INFO:
            live_config = labels
            continue
        if m.canonical_name(name) == m.MODEL_CONFIG_INFO:  # the new name or its alias
            model_info = labels
            continue
        if name in (PREEMPTIONS_CREATED, PROCESS_START):
            if math.isfinite(value) and value > 0:
                if name == PROCESS_START:
                    started = value
                else:
                    created = value if created is None else min(created, value)
            continue
        canonical = m.canonical_name(name)
        if canonical not in REQUIRED:
            continue
        if not is_valid_sample(canonical, value):
            invalid.append(f"{name}={value:g}")
            continue
        target = sums if canonical == name else via_alias
        if canonical == m.KV_CACHE_USAGE_PERC:  # one pool per engine: several series -> the fullest
            target[canonical] = max(target.get(canonical, 0.0), value)
        else:
            target[canonical] = target.get(canonical, 0.0) + value
    values = {**via_alias, **sums}
    token_sums = [optional.get(name) for name in REQUEST_TOKEN_SUMS]
    finished = optional.get(REQUESTS_FINISHED)
    healthy = all(v is not None and math.isfinite(v) and v >= 0 for v in (*token_sums, finished))
    latency: dict[str, Histogram] = {}
    for histogram, parts in histograms.items():
        result = bad_histograms.get(histogram) or histogram_from_parts(histogram, parts)
        if isinstance(result, str):
            bad_histograms[histogram] = result
        else:
            latency[histogram] = result
    return Scrape(
        time=float(time),
        preemptions=values.get(m.NUM_PREEMPTIONS_TOTAL),
        preemptions_created=created,
        kv_usage=values.get(m.KV_CACHE_USAGE_PERC),
        waiting=values.get(m.NUM_REQUESTS_WAITING),
        running=values.get(m.NUM_REQUESTS_RUNNING),
        cache_info=cache_info,
        model_info=model_info,
        missing=tuple(name for name in REQUIRED if name not in values),
        invalid=tuple(invalid),
        process_start=started,
        request_tokens=sum(token_sums) if healthy else None,
        requests_finished=finished if healthy else None,
        live_config=live_config,
        ttft=latency.get(m.TIME_TO_FIRST_TOKEN_SECONDS),
        queue_time=latency.get(m.REQUEST_QUEUE_TIME_SECONDS),
        dropped=tuple(bad_histograms[h] for h in LATENCY_HISTOGRAMS if h in bad_histograms),
    )


def _bound(le: str | None) -> float | None:
    """A bucket's upper bound from its ``le`` label (None: absent or not a number)."""
    try:
        bound = float(le)  # "+Inf" reads as inf
    except (TypeError, ValueError):
        return None
    return None if math.isnan(bound) else bound


def _le(labels: Mapping[str, str]) -> str:
    return f'{{le="{labels["le"]}"}}' if "le" in labels else ""


@dataclasses.dataclass(frozen=True)
class Capacity:
    """KV capacity of one engine (``vllm:cache_config_info`` and the model's ``max_model_len``)."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int | None = None
    explicit_size: bool = False  # num_gpu_blocks_override set: the memory fraction does not size the pool

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def max_concurrency(self) -> float | None:
        """How many ``max_model_len``-long requests fit at once."""
        return self.kv_cache_tokens / self.max_model_len if self.max_model_len else None


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What ``kvpilot_model_config_info`` says about the model and the engine's running limits."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_hidden_layers: int | None = None
    intermediate_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None


def _int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, TypeError, ValueError):
        return None


def capacity_of(scrape: Scrape) -> Capacity | None:
    """The engine's KV capacity from its info metrics, or None when they are absent."""
    blocks, block_size = _int(scrape.cache_info, "num_gpu_blocks"), _int(scrape.cache_info, "block_size")
    if blocks is None or block_size is None:
        return None
    override = scrape.cache_info.get("num_gpu_blocks_override")
    return Capacity(
        num_gpu_blocks=blocks,
        block_size=block_size,
        max_model_len=_int(scrape.model_info, "max_model_len"),
        explicit_size=override not in (None, "", "None"),
    )


def shape_of(scrape: Scrape) -> ModelShape | None:
    """The model shape from ``kvpilot_model_config_info``, or None when absent."""
    if not scrape.model_info:
        return None
    info = scrape.model_info
    return ModelShape(
        num_attention_heads=_int(info, "num_attention_heads"),
        num_key_value_heads=_int(info, "num_key_value_heads"),
        num_hidden_layers=_int(info, "num_hidden_layers"),
        intermediate_size=_int(info, "intermediate_size"),
        max_num_seqs=_int(info, "max_num_seqs"),
        max_num_batched_tokens=_int(info, "max_num_batched_tokens"),
        max_model_len=_int(info, "max_model_len"),
    )
