"""One ``/metrics`` answer read: the engine's Prometheus text (or samples a replay file holds) -> a
:class:`Scrape`, and the engine's KV capacity and model shape from its info metrics.

Pure: no I/O and no clock. Deprecated metric names (``vllm:gpu_cache_usage_perc``) count as their
current ones.
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
    for name, labels, value in samples:
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
    )


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
