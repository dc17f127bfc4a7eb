"""Live levers: the engine settings kvpilot's engine changes at run time (``POST /admin/config``).

Pure. For ``spec.runtime: kvpilot`` the two scheduler bounds, ``maxNumSeqs`` and
``maxNumBatchedTokens``, may go down (and back up to their start-up values) in a running engine; the
engine refuses anything above the value it started with, because that sized its memory. So the
operator splits the effective configuration in two:

- the *start-up* values, which the Deployment's pod template carries (the spec's values: a live
  override below them does not enter the template, so it rolls nothing out);
- the *live* values, which the operator posts to the running pods and keeps in the InferenceService's
  live-config ConfigMap, which every pod applies at start (``kvpilot serve --live-config-file``).

An override above the start-up value (or any override of the other levers) stays in the template: a
rollout lever. ``spec.runtime: vllm`` has no such endpoint; every lever is a rollout lever there, as
with ``spec.remediation.liveLevers: false``.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.effective import Effective
from kvpilot.operator.api.runtime import RUNTIME_VLLM
from kvpilot.operator.api.spec import ENGINE_KEYS

# CRD key -> the engine's snake_case name (``engine.live_config.LIVE_KEYS``).
LIVE_FIELDS = {"maxNumSeqs": "max_num_seqs", "maxNumBatchedTokens": "max_num_batched_tokens"}
LIVE, ROLLOUT = "live", "rollout"


def supports_live(spec: dict[str, Any]) -> bool:
    """Whether live levers apply: the pods can change settings at run time (kvpilot's engine; vLLM
    cannot) and ``spec.remediation.liveLevers`` is not false."""
    remediation = spec.get("remediation") or {}
    return spec.get("runtime") != RUNTIME_VLLM and remediation.get("liveLevers") is not False


def startup_value(spec: dict[str, Any], field: str) -> int | None:
    """The value the pods start with for a live field: the spec's, else the engine's default
    (None: the engine derives it, as ``maxNumBatchedTokens`` by default)."""
    value = (spec.get("engine") or {}).get(field)
    if value is None:
        value = ENGINE_KEYS[field].default
    return None if value is None else int(value)


def is_live(spec: dict[str, Any], field: str, value: Any) -> bool:
    """Whether setting ``field`` to ``value`` is a live change: a live field, a runtime that changes it
    in place, and not above the start-up value (the engine refuses that without a restart).

    With no known start-up value (``maxNumBatchedTokens`` left to the engine) the change is tried
    live; the pod's answer decides, and a refusal reverts it."""
    if not supports_live(spec) or field not in LIVE_FIELDS or value is None:
        return False
    ceiling = startup_value(spec, field)
    return ceiling is None or float(value) <= ceiling


def applied_by(spec: dict[str, Any], field: str, value: Any) -> str:
    """``status.remediations[].appliedBy`` of a change setting ``field`` to ``value``."""
    return LIVE if is_live(spec, field, value) else ROLLOUT


def live_values(spec: dict[str, Any], effective: Effective) -> dict[str, int]:
    """The live settings in force (snake_case, as ``POST /admin/config`` takes them): the effective
    value of each live field that differs from its start-up value and can change live."""
    out: dict[str, int] = {}
    for field, key in LIVE_FIELDS.items():
        value = effective.engine.get(field)
        if value is None or value == (spec.get("engine") or {}).get(field):
            continue
        if is_live(spec, field, value):
            out[key] = int(value)
    return out


def in_force(spec: dict[str, Any], effective: Effective) -> dict[str, int]:
    """What every pod of the current configuration should report for each live field (snake_case):
    the effective value (live, or carried by the pod template), else the start-up value; fields whose
    start-up value the engine derives (unset, no override) are left out. Empty when live levers do not
    apply."""
    if not supports_live(spec):
        return {}
    out: dict[str, int] = {}
    for field, key in LIVE_FIELDS.items():
        value = effective.engine.get(field)
        value = startup_value(spec, field) if value is None else value
        if value is not None:
            out[key] = int(value)
    return out


def startup_engine(spec: dict[str, Any], effective: Effective) -> dict[str, Any]:
    """``effective.engine`` as the pod template carries it: live values replaced by their spec values
    (dropped where the spec leaves them unset)."""
    engine = dict(effective.engine)
    spec_engine = spec.get("engine") or {}
    for field, key in LIVE_FIELDS.items():
        if key not in live_values(spec, effective):
            continue
        if spec_engine.get(field) is None:
            engine.pop(field, None)
        else:
            engine[field] = spec_engine[field]
    return engine
