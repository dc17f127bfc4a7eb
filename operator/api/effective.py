"""The effective configuration: ``spec`` ⊕ ``status.effective.overrides``.

The operator never writes ``spec`` (GitOps tools own it). What remediation changes lives in
``status.effective.overrides``, one entry per lever::

    status:
      effective:
        overrides:
          gpuMemoryUtilization: {value: 0.93, specValue: 0.9, time: ..., reason: ...}

An override applies only while the spec still holds ``specValue``, the value it was based on. When
the user edits that field the override stops applying — the user wins — without anyone having
to delete it first. The builders take the result (``Settings.effective``), never the raw spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvpilot.operator.api.spec import ENGINE_KEYS

# The levers remediation may override (CRD keys; ``replicas`` is ``spec.replicas``).
LEVERS = (
    "gpuMemoryUtilization",
    "maxNumSeqs",
    "maxNumBatchedTokens",
    "tensorParallelSize",
    "pipelineParallelSize",
    "replicas",
)
# What ``status.effective`` reports besides the levers (printer columns read these).
REPORTED_ENGINE_KEYS = (
    "gpuMemoryUtilization",
    "maxNumSeqs",
    "maxNumBatchedTokens",
    "maxModelLen",
    "tensorParallelSize",
    "pipelineParallelSize",
)


@dataclasses.dataclass(frozen=True)
class Effective:
    """What the pods should run.

    ``engine``: the ``spec.engine`` keys that are set (camelCase), overrides applied; unset keys
    are left to the engine's own defaults. ``replicas``: the Deployment's replica count.
    ``applied_overrides``: the override keys that took effect (the rest were superseded by spec
    edits or name unknown levers). ``generation``: the object's ``metadata.generation``, when known.
    """

    engine: dict[str, Any]
    replicas: int
    applied_overrides: tuple[str, ...] = ()
    generation: int | None = None

    def reported(self, generation: int | None) -> dict[str, Any]:
        """The ``status.effective`` fields the operator owns, engine defaults filled in."""
        result: dict[str, Any] = {}
        for key in REPORTED_ENGINE_KEYS:
            value = self.engine.get(key, ENGINE_KEYS[key].default)
            if value is not None:
                result[key] = value
        result["replicas"] = self.replicas
        if generation is not None:
            result["basedOnGeneration"] = generation
        return result


def _coerce(key: str, value: Any) -> Any:
    if key == "replicas" or str(ENGINE_KEYS[key].type).split("|")[0].strip() == "int":
        return int(value)
    return float(value)


def resolve_effective(isvc: dict[str, Any], spec: dict[str, Any]) -> Effective:
    """``spec`` ⊕ ``status.effective.overrides`` of the InferenceService ``isvc`` (pure).

    ``spec``: ``isvc``'s spec with its defaults applied (``Settings.spec``).
    """
    engine = dict(spec.get("engine") or {})
    replicas = int(spec["replicas"])
    overrides = ((isvc.get("status") or {}).get("effective") or {}).get("overrides") or {}
    applied: list[str] = []
    for key in LEVERS:
        override = overrides.get(key)
        if not isinstance(override, dict) or override.get("value") is None:
            continue
        spec_value = replicas if key == "replicas" else engine.get(key)
        if override.get("specValue") != spec_value:
            continue  # the user changed this field after the override was made: the spec wins
        value = _coerce(key, override["value"])
        if key == "replicas":
            replicas = value
        else:
            engine[key] = value
        applied.append(key)
    generation = (isvc.get("metadata") or {}).get("generation")
    return Effective(
        engine=engine, replicas=replicas, applied_overrides=tuple(applied), generation=generation
    )
