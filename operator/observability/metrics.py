"""The operator's own metrics: what remediation decided, changed and saw, per InferenceService.

Every series is labelled ``namespace`` and ``inferenceservice``; the only other labels take values
from fixed sets (outcomes, reason classes, levers, directions, fields, error kinds, modes), so the
number of series grows with the number of InferenceServices and nothing else. :meth:`OperatorMetrics.forget`
removes every series of an InferenceService that is gone.

==============================================================  =========  =================================
name                                                            type       extra labels
==============================================================  =========  =================================
kvpilot_operator_decisions_total                                counter    outcome, reason
kvpilot_operator_remediations_total                             counter    lever, direction
kvpilot_operator_reverts_total                                  counter    field
kvpilot_operator_effective_gpu_memory_utilization_ratio         gauge
kvpilot_operator_effective_max_num_seqs                         gauge
kvpilot_operator_effective_max_num_batched_tokens               gauge
kvpilot_operator_effective_tensor_parallel_size                 gauge
kvpilot_operator_effective_pipeline_parallel_size               gauge
kvpilot_operator_effective_replicas                             gauge
kvpilot_operator_signal_preemptions_per_second                  gauge      (per replica, window mean)
kvpilot_operator_signal_kv_cache_usage_ratio                    gauge
kvpilot_operator_signal_requests_waiting                        gauge      (per replica)
kvpilot_operator_signal_window_complete                         gauge      (1: the policy may act)
kvpilot_operator_preemption_storm                               gauge      (1: a sustained storm)
kvpilot_operator_levers_exhausted                               gauge      (1: every lever at its limit)
kvpilot_operator_remediation_mode                               gauge      mode (1 for the mode in force)
kvpilot_operator_scrapes_total                                  counter
kvpilot_operator_scrape_errors_total                            counter    kind
kvpilot_operator_reconcile_duration_seconds                     histogram
kvpilot_operator_tick_duration_seconds                          histogram  (no labels: one tick, all)
kvpilot_operator_last_tick_timestamp_seconds                    gauge      (no labels)
==============================================================  =========  =================================

Decision outcomes: ``acted`` (Auto applied a change), ``recommended`` (Recommend proposed one),
``held`` (a change is called for but not made) and ``stable`` (nothing to do). Reason classes of a
held decision: ``cooldown``, ``settling`` (waiting for a full window after a change), ``stale_data``,
``bad_data``, ``mid_rollout``, ``pods_failing``, ``at_limit``, ``mode_off``; of an acted or
recommended one, what it answers: ``storm``, ``demand``, ``idle``, ``pods_failing`` (a revert) or
``recovered`` (a live relief ended: maxNumSeqs restored after the restart lever rolled out); of a
stable one, ``none``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.operator.api.settings import Settings
from kvpilot.operator.api.spec import ENGINE_KEYS
from kvpilot.operator.remediation.decision import (
    ADD_REPLICA,
    APPLY,
    AUTO,
    LOWER_MAX_BATCHED_TOKENS,
    LOWER_MAX_NUM_SEQS,
    OFF,
    RAISE_GPU_MEMORY,
    RAISE_PP,
    RAISE_TP,
    RECOMMEND,
    RECOMMEND_ACTION,
    RELIEVE_MAX_NUM_SEQS,
    REMOVE_REPLICA,
    RESTORE_MAX_NUM_SEQS,
    REVERT,
    Decision,
    history_from_status,
)
from kvpilot.operator.remediation.signals import is_storm
from kvpilot.operator.remediation.window import MetricWindow

PREFIX = "kvpilot_operator_"
LABELS = ("namespace", "inferenceservice")

OUTCOMES = ("acted", "recommended", "held", "stable")
HELD_REASONS = (
    "cooldown",
    "settling",
    "stale_data",
    "bad_data",
    "mid_rollout",
    "pods_failing",
    "at_limit",
    "mode_off",
)
ACTED_REASONS = ("storm", "demand", "idle", "pods_failing", "recovered")
MODES = (AUTO, RECOMMEND, OFF)
# Scrape error kinds (``scrape.Result.kind``) plus ``invalid``: an answer that could not be used.
SCRAPE_ERROR_KINDS = ("timeout", "http_status", "connection", "body", "invalid")

# The directions each lever moves its field in (remediations_total is created at 0 for these).
LEVER_DIRECTIONS = (
    (RAISE_GPU_MEMORY, "up"),
    (LOWER_MAX_NUM_SEQS, "down"),
    (RELIEVE_MAX_NUM_SEQS, "down"),
    (RESTORE_MAX_NUM_SEQS, "up"),
    (LOWER_MAX_BATCHED_TOKENS, "down"),
    (RAISE_TP, "up"),
    (RAISE_PP, "up"),
    (ADD_REPLICA, "up"),
    (REMOVE_REPLICA, "down"),
)

# status.effective field -> (metric suffix, description).
EFFECTIVE = {
    "gpuMemoryUtilization": (
        "effective_gpu_memory_utilization_ratio",
        "The memory fraction the engine pods run with (spec, remediation overrides applied).",
    ),
    "maxNumSeqs": ("effective_max_num_seqs", "The max_num_seqs the engine pods run with."),
    "maxNumBatchedTokens": (
        "effective_max_num_batched_tokens",
        "The max_num_batched_tokens (token budget per step) the engine pods run with.",
    ),
    "tensorParallelSize": ("effective_tensor_parallel_size", "The tensor parallel size of the pods."),
    "pipelineParallelSize": ("effective_pipeline_parallel_size", "The pipeline parallel size of the pods."),
    "replicas": ("effective_replicas", "The number of engine replicas the operator runs."),
}

# Reconcile passes are API round trips (tens of ms); a tick scrapes every pod (up to the timeout).
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TICK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def classify_decision(
    decision: Decision,
    window: MetricWindow,
    settings: Settings,
    now: float,
    *,
    mid_rollout: bool = False,
    bad_data: bool = False,
) -> tuple[str, str]:
    """The ``(outcome, reason)`` labels of one decision (see the module docstring for the values).

    ``mid_rollout``: pods are not all ready on the current configuration; ``bad_data``: a pod's
    newest answer could not be used. Both only refine why an incomplete window held the policy back.
    """
    if decision.action in (APPLY, RECOMMEND_ACTION):
        outcome = "acted" if decision.action == APPLY else "recommended"
        if decision.lever == REVERT:
            return outcome, "pods_failing"
        if decision.lever == RESTORE_MAX_NUM_SEQS:
            return outcome, "recovered"
        if decision.pressure in ("storm", "demand"):
            return outcome, decision.pressure
        return outcome, "idle"
    if window.not_running:
        return "held", "pods_failing"
    if not window.is_complete:
        if mid_rollout:
            return "held", "mid_rollout"
        return "held", "bad_data" if bad_data else "stale_data"
    if decision.exhausted:
        return "held", "at_limit"
    if decision.lever is None:
        return "stable", "none"
    s = settings.remediation
    if s.mode == OFF:
        return "held", "mode_off"
    key = "recommendations" if s.mode == RECOMMEND else "remediations"
    history = history_from_status((settings.isvc.get("status") or {}).get(key))
    if history and now - history[0].time < s.cooldown_s:
        return "held", "cooldown"
    return "held", "settling"


def direction_of(lever: str, from_: float | None, to: float | None) -> str:
    """``up`` or ``down``: which way a change moved its field."""
    if lever == ADD_REPLICA:
        return "up"
    if lever == REMOVE_REPLICA:
        return "down"
    return "up" if (to or 0) > (from_ or 0) else "down"


def effective_values(settings: Settings, window: MetricWindow | None = None) -> dict[str, float]:
    """The effective value of each lever field: the spec's (overrides applied), else what the engines
    report running with (``window.shape``: max_num_seqs, max_num_batched_tokens, which they derive),
    else the engine default; a field known by none of these is left out."""
    effective = settings.effective
    shape = window.shape if window is not None else None
    reported = {
        "maxNumSeqs": shape.max_num_seqs if shape else None,
        "maxNumBatchedTokens": shape.max_num_batched_tokens if shape else None,
    }
    out: dict[str, float] = {"replicas": float(effective.replicas)}
    for field in EFFECTIVE:
        if field == "replicas":
            continue
        value = effective.engine.get(field)
        if value is None:
            value = reported.get(field)
        if value is None and field in ENGINE_KEYS:
            value = ENGINE_KEYS[field].default
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[field] = float(value)
    return out


class OperatorMetrics:
    """The operator's metrics in one registry (``registry``: a fresh one unless given).

    The remediation loop calls :meth:`observe_evaluation`, :meth:`observe_scrape`,
    :meth:`observe_tick` and :meth:`retain`; the reconciler :meth:`observe_reconcile` and
    :meth:`forget`. Thread-safe (prometheus-client's metrics are).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry

        def gauge(suffix: str, text: str) -> Gauge:
            return Gauge(PREFIX + suffix, text, LABELS, registry=r)

        self.decisions = Counter(
            PREFIX + "decisions",
            "Remediation decisions, by outcome (acted, recommended, held, stable) and reason class.",
            (*LABELS, "outcome", "reason"),
            registry=r,
        )
        self.remediations = Counter(
            PREFIX + "remediations",
            "Changes remediation applied (Auto), by lever and direction (reverts excluded).",
            (*LABELS, "lever", "direction"),
            registry=r,
        )
        self.reverts = Counter(
            PREFIX + "reverts",
            "Remediation changes undone because the pods of the new configuration failed, by field.",
            (*LABELS, "field"),
            registry=r,
        )
        self.effective = {field: gauge(suffix, text) for field, (suffix, text) in EFFECTIVE.items()}
        self.preemptions = gauge(
            "signal_preemptions_per_second",
            "Preemptions per second per replica over the last window, as the policy saw it.",
        )
        self.kv_usage = gauge(
            "signal_kv_cache_usage_ratio",
            "KV cache usage (0-1, mean over the window and the replicas), as the policy saw it.",
        )
        self.waiting = gauge(
            "signal_requests_waiting",
            "Requests waiting per replica (mean over the window), as the policy saw it.",
        )
        self.complete = gauge(
            "signal_window_complete",
            "1 when the last window was complete and fresh (the policy may act on it), else 0.",
        )
        self.storm = gauge(
            "preemption_storm", "1 while the last complete window shows a sustained preemption storm, else 0."
        )
        self.exhausted = gauge(
            "levers_exhausted",
            "1 while there is pressure and every remediation lever is at its limit, else 0.",
        )
        self.mode = Gauge(
            PREFIX + "remediation_mode",
            "1 for the remediation mode in force (Auto, Recommend, Off), 0 for the others.",
            (*LABELS, "mode"),
            registry=r,
        )
        self.scrapes = Counter(
            PREFIX + "scrapes", "Scrapes of engine pods' /metrics, failed ones included.", LABELS, registry=r
        )
        self.scrape_errors = Counter(
            PREFIX + "scrape_errors",
            "Scrapes of engine pods that yielded no usable metrics, by kind "
            "(timeout, http_status, connection, body, invalid).",
            (*LABELS, "kind"),
            registry=r,
        )
        self.reconcile_duration = Histogram(
            PREFIX + "reconcile_duration_seconds",
            "Time of one reconcile pass over an InferenceService.",
            LABELS,
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.tick_duration = Histogram(
            PREFIX + "tick_duration_seconds",
            "Time of one remediation tick (list, scrape and evaluate every InferenceService in scope).",
            buckets=TICK_BUCKETS,
            registry=r,
        )
        self.last_tick = Gauge(
            PREFIX + "last_tick_timestamp_seconds",
            "When the last remediation tick completed (unix seconds).",
            registry=r,
        )
        # Label tuples created per InferenceService, per labelled metric with extra labels: what
        # forget() must remove.
        self._children: dict[tuple[str, str], set[tuple[Any, tuple[str, ...]]]] = {}
        self._initialised: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # the loop ingests in a worker thread

    def _ensure(self, namespace: str, name: str) -> None:
        """Create the counters an alert or panel takes ``increase()`` of at 0, so their first
        increment shows (a series that appears at 1 has no increase to Prometheus)."""
        with self._lock:
            if (namespace, name) in self._initialised:
                return
            self._initialised.add((namespace, name))
        for field in EFFECTIVE:
            self._child(self.reverts, namespace, name, field)
        for lever, direction in LEVER_DIRECTIONS:
            self._child(self.remediations, namespace, name, lever, direction)
        for kind in SCRAPE_ERROR_KINDS:
            self._child(self.scrape_errors, namespace, name, kind)
        self._child(self.scrapes, namespace, name)

    def _child(self, metric: Any, namespace: str, name: str, *extra: str) -> Any:
        with self._lock:
            self._children.setdefault((namespace, name), set()).add((metric, extra))
            return metric.labels(namespace, name, *extra)

    def observe_evaluation(
        self,
        settings: Settings,
        window: MetricWindow,
        decision: Decision,
        now: float,
        *,
        mid_rollout: bool = False,
        bad_data: bool = False,
    ) -> tuple[str, str]:
        """Record one evaluation (``settings`` as evaluated; ``decision`` what the policy concluded,
        counted as acted only when its status write went through: pass a decision of action ``none``
        otherwise). Returns the ``(outcome, reason)`` it was counted under."""
        meta = settings.meta
        ns, name = meta["namespace"], meta["name"]
        self._ensure(ns, name)
        outcome, reason = classify_decision(
            decision, window, settings, now, mid_rollout=mid_rollout, bad_data=bad_data
        )
        self._child(self.decisions, ns, name, outcome, reason).inc()
        if decision.action == APPLY and decision.lever:
            if decision.lever == REVERT:
                self._child(self.reverts, ns, name, decision.field or "").inc()
            else:
                direction = direction_of(decision.lever, decision.from_, decision.to)
                self._child(self.remediations, ns, name, decision.lever, direction).inc()
        for mode in MODES:
            self._child(self.mode, ns, name, mode).set(1.0 if settings.remediation.mode == mode else 0.0)
        self.observe_effective(settings, window)
        self._child(self.complete, ns, name).set(1.0 if window.is_complete else 0.0)
        if window.pods:
            self._child(self.preemptions, ns, name).set(window.preemption_rate)
            self._child(self.kv_usage, ns, name).set(window.kv_usage)
            self._child(self.waiting, ns, name).set(window.waiting)
        storm = window.is_complete and is_storm(window, settings.remediation)
        self._child(self.storm, ns, name).set(1.0 if storm else 0.0)
        self._child(self.exhausted, ns, name).set(1.0 if decision.exhausted else 0.0)
        return outcome, reason

    def observe_effective(self, settings: Settings, window: MetricWindow | None = None) -> None:
        """Set the effective-value gauges from ``settings`` (and what ``window``'s engines report)."""
        meta = settings.meta
        for field, value in effective_values(settings, window).items():
            self._child(self.effective[field], meta["namespace"], meta["name"]).set(value)

    def observe_scrape(self, namespace: str, name: str, error_kind: str | None) -> None:
        """Count one scrape of a pod of the InferenceService; ``error_kind`` when it failed."""
        self._ensure(namespace, name)
        self._child(self.scrapes, namespace, name).inc()
        if error_kind is not None:
            if error_kind not in SCRAPE_ERROR_KINDS:
                raise ValueError(f"unknown scrape error kind {error_kind!r} (one of {SCRAPE_ERROR_KINDS})")
            self._child(self.scrape_errors, namespace, name, error_kind).inc()

    def observe_reconcile(self, namespace: str, name: str, seconds: float) -> None:
        """Record the duration of one reconcile pass."""
        self._child(self.reconcile_duration, namespace, name).observe(seconds)

    def observe_tick(self, seconds: float, finished_at: float) -> None:
        """Record one remediation tick."""
        self.tick_duration.observe(seconds)
        self.last_tick.set(finished_at)

    def known(self) -> set[tuple[str, str]]:
        """The ``(namespace, name)`` of every InferenceService with series."""
        with self._lock:
            return set(self._children)

    def forget(self, namespace: str, name: str) -> None:
        """Remove every series of the InferenceService (it was deleted or left the scope)."""
        with self._lock:
            self._initialised.discard((namespace, name))
            for metric, extra in self._children.pop((namespace, name), set()):
                try:
                    metric.remove(namespace, name, *extra)
                except KeyError:
                    pass  # never created (or removed already)

    def retain(self, keys: Iterable[tuple[str, str]]) -> None:
        """Forget every InferenceService not in ``keys`` (those a complete listing found)."""
        keep = set(keys)
        for key in self.known() - keep:
            self.forget(*key)
