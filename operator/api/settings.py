"""One InferenceService, resolved once: the spec with its defaults, its problems, what the pods run,
and the remediation settings.

``resolve(isvc)`` is the one place a reconcile pass, a remediation tick, ``kvpilot render`` and
``kvpilot replay`` apply the defaults and validate; everything downstream (the builders, the policy,
the status it writes) takes the :class:`Settings` it returns and re-derives nothing. When only the
status changed (remediation wrote an override), :meth:`Settings.with_status` gives the settings of
the new object without resolving the unchanged spec again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from kvpilot.operator.api.effective import Effective, resolve_effective
from kvpilot.operator.api.live import supports_live
from kvpilot.operator.api.platform import DEFAULT_PLATFORM, Platform
from kvpilot.operator.api.spec import apply_defaults, parse_duration
from kvpilot.operator.api.validation import override_problems, spec_problems


@dataclasses.dataclass(frozen=True)
class Limits:
    """``spec.remediation.limits``: the bounds the policy stays within."""

    max_gpu_memory_utilization: float
    min_max_num_seqs: int
    min_max_num_batched_tokens: int
    min_replicas: int
    max_replicas: int
    max_tensor_parallel_size: int
    max_pipeline_parallel_size: int


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """``spec.remediation.plan``: whether a storm's restart-lever change is planned by simulation, and
    when the plan is trusted (``remediation.planner``)."""

    enabled: bool
    max_prediction_error: float
    min_requests: int
    lookback_s: float


@dataclasses.dataclass(frozen=True)
class RemediationSettings:
    """``spec.remediation`` (durations in seconds) and the GPUs per replica the parallelism levers need.

    Every value comes from the spec with its defaults applied: the defaults live in ``spec.DEFAULTS``
    only.
    """

    mode: str
    preemption_rate: float
    window_s: float
    cooldown_s: float
    limits: Limits
    kv_usage_high: float
    waiting_high: float
    kv_usage_idle: float
    waiting_min: float  # the queue-latency demand rule: requests waiting per replica at every scrape...
    queue_time_high_s: float  # ...and a mean queue time above this, without a TTFT SLO
    ttft_p99_slo_s: float | None  # ...or a TTFT p99 above this (spec.remediation.slo; None: no SLO)
    gpus_per_replica: int
    live: bool  # live levers apply (api.live.supports_live): a live relief first, the restart lever after
    plan: PlanSettings  # spec.remediation.plan
    idle_after_s: float  # with minReplicas 0: no request for this long, and the last replica goes

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RemediationSettings:
        """Read a spec that has its defaults applied and passed validation."""
        rem = spec["remediation"]
        limits, thresholds = rem["limits"], rem["thresholds"]
        slo = (rem.get("slo") or {}).get("ttftP99Seconds")
        return cls(
            mode=rem["mode"],
            preemption_rate=float(rem["preemptionRate"]),
            window_s=parse_duration(rem["window"]),
            cooldown_s=parse_duration(rem["cooldown"]),
            limits=Limits(
                max_gpu_memory_utilization=float(limits["maxGpuMemoryUtilization"]),
                min_max_num_seqs=int(limits["minMaxNumSeqs"]),
                min_max_num_batched_tokens=int(limits["minMaxNumBatchedTokens"]),
                min_replicas=int(limits["minReplicas"]),
                max_replicas=int(limits["maxReplicas"]),
                max_tensor_parallel_size=int(limits["maxTensorParallelSize"]),
                max_pipeline_parallel_size=int(limits["maxPipelineParallelSize"]),
            ),
            kv_usage_high=float(thresholds["kvCacheUsageHigh"]),
            waiting_high=float(thresholds["requestsWaitingHigh"]),
            kv_usage_idle=float(thresholds["kvCacheUsageIdle"]),
            waiting_min=float(thresholds["requestsWaitingMin"]),
            queue_time_high_s=float(thresholds["queueTimeHighSeconds"]),
            ttft_p99_slo_s=None if slo is None else float(slo),
            gpus_per_replica=int(spec["resources"]["gpusPerReplica"]),
            live=supports_live(dict(spec)),
            idle_after_s=parse_duration(rem["idleAfter"]),
            plan=PlanSettings(
                enabled=bool(rem["plan"]["enabled"]),
                max_prediction_error=float(rem["plan"]["maxPredictionError"]),
                min_requests=int(rem["plan"]["minRequests"]),
                lookback_s=parse_duration(rem["plan"]["lookback"]),
            ),
        )


@dataclasses.dataclass(frozen=True)
class Settings:
    """An InferenceService as every pure function downstream reads it.

    ``isvc``: the object as read (not copied; never modified here). ``spec``: its spec with the CRD's
    defaults applied. ``problems``: every reason it cannot be reconciled (empty: valid).
    ``effective``: spec ⊕ status overrides, what the pods should run (None while there are problems).
    ``spec_is_valid``: the spec itself passed validation (the overrides may still be rejected).
    """

    isvc: dict[str, Any]
    spec: dict[str, Any]
    problems: tuple[str, ...] = ()
    effective: Effective | None = None
    spec_is_valid: bool = False

    @property
    def is_valid(self) -> bool:
        """Whether the children may be rendered and remediation may act."""
        return not self.problems

    @property
    def meta(self) -> dict[str, Any]:
        """The object's ``metadata``."""
        return self.isvc.get("metadata") or {}

    @property
    def autoscaling_kind(self) -> str | None:
        """``"keda"`` or ``"hpa"``: which autoscaler ``spec.autoscaling`` hands the engine Deployment's
        replicas to (the operator then never writes them, and remediation's replica lever stands
        down); None without one."""
        autoscaling = self.spec.get("autoscaling")
        if not isinstance(autoscaling, dict):
            return None
        for kind in ("keda", "hpa"):
            if isinstance(autoscaling.get(kind), dict):
                return kind
        return None

    @functools.cached_property
    def remediation(self) -> RemediationSettings:
        """``spec.remediation`` as typed values (read on first use; the spec must be valid)."""
        return RemediationSettings.from_spec(self.spec)

    def with_status(self, isvc: dict[str, Any]) -> Settings:
        """The settings of ``isvc``, a newer read of the same object whose spec is unchanged: only the
        overrides in its status are resolved again. Raises ValueError when the spec differs."""
        if isvc.get("spec") != self.isvc.get("spec"):
            raise ValueError("the spec changed: resolve the object again")
        if not self.spec_is_valid:
            return dataclasses.replace(self, isvc=isvc)
        effective = resolve_effective(isvc, self.spec)
        problems = tuple(override_problems(effective))
        return dataclasses.replace(
            self, isvc=isvc, problems=problems, effective=None if problems else effective
        )


def resolve(isvc: Any, platform: Platform = DEFAULT_PLATFORM) -> Settings:
    """Apply the defaults to ``isvc``'s spec, validate it and resolve its effective configuration.

    ``platform``: the operator's configuration; its default image for the spec's runtime fills an
    unset ``spec.image`` and its allowlists are checked. Never raises for a manifest of any shape:
    what is wrong is in ``Settings.problems``.
    """
    raw = isvc.get("spec") if isinstance(isvc, dict) else None
    spec = apply_defaults(raw) if isinstance(raw, dict) else {}
    if isinstance(raw, dict) and raw.get("image") is None:
        spec["image"] = platform.image_for(str(spec.get("runtime") or "kvpilot"))
    front_door = (spec.get("router") or {}).get("frontDoor") if isinstance(spec.get("router"), dict) else None
    if isinstance(front_door, dict) and not front_door.get("image"):
        front_door["image"] = platform.router_image
    problems = tuple(spec_problems(isvc, spec))
    if not problems:
        problems = tuple(platform.problems(spec))
    settings = Settings(isvc=isvc, spec=spec, problems=problems, spec_is_valid=not problems)
    return settings if problems else settings.with_status(isvc)
