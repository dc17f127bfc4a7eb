"""What the remediation policy gets back when it asks for a plan (``spec.remediation.plan``).

The policy stays pure: it is handed a :data:`Planner`, a function of the question only (which levers may
move, from which settings, whether the window shows a storm), which the operator's loop and
``kvpilot replay`` bind to the traffic the pods served since the last change
(``kvpilot.operator.plan.advise``). The answer is a :class:`PlanVerdict`: the one change the simulation
says ends the storm, or why the plan is not to be trusted, so that the ladder answers instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

PLAN, LADDER = "plan", "ladder"


@dataclasses.dataclass(frozen=True)
class PlannedChange:
    """One lever to its planned value, and what the simulation predicts with it (``prediction``:
    per replica unless named service-wide; keys as ``status.recommendation.prediction``)."""

    field: str
    from_: float
    to: float
    prediction: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class PlanVerdict:
    """``change``: the planned change (None: the plan is not used). ``reason``: why, in words (for a
    used plan its prediction; otherwise why it cannot be trusted). ``in_force``: the check of the
    settings in force, predicted beside what the pods served (empty when it never ran)."""

    change: PlannedChange | None
    reason: str
    in_force: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def trusted(self) -> bool:
        return self.change is not None


@dataclasses.dataclass(frozen=True)
class PlanQuestion:
    """What the policy asks: a single change of one of ``levers`` (in the order they are preferred,
    each within the limits and not reverted) that ends the storm; ``base``: lever values to plan from
    where they differ from those in force (after a live relief: the maxNumSeqs it restores);
    ``storm``: whether the window shows a storm (the settings in force must be predicted to storm
    exactly then)."""

    levers: tuple[str, ...]
    storm: bool
    base: Mapping[str, float] = dataclasses.field(default_factory=dict)


Planner = Callable[[PlanQuestion], PlanVerdict]


def describe_prediction(prediction: Mapping[str, Any]) -> str:
    """The prediction in words, for reasons and Events."""
    parts = []
    if "maxPreemptionsPerSecond" in prediction:
        parts.append(f"{prediction['maxPreemptionsPerSecond']:.2g} preemptions/s at worst")
    if "kvCacheUsage" in prediction:
        parts.append(f"KV cache {prediction['kvCacheUsage']:.0%}")
    if "ttftP99Seconds" in prediction:
        parts.append(f"TTFT p99 {prediction['ttftP99Seconds']:.2g}s")
    if "outputTokensPerSecond" in prediction:
        parts.append(f"{prediction['outputTokensPerSecond']:.0f} output tok/s")
    return ", ".join(parts)
