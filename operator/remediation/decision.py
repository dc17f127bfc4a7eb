"""What the remediation policy concludes and remembers: modes, actions and lever names, the
:class:`Decision` of one evaluation, and the :class:`Change` entries of ``status.remediations`` /
``status.recommendations`` that make up its history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot.operator.api.timefmt import format_time, parse_time

AUTO, RECOMMEND, OFF = "Auto", "Recommend", "Off"
NONE, APPLY, RECOMMEND_ACTION = "none", "apply", "recommend"

# Lever names (status.remediations[].lever), in ladder order.
RAISE_GPU_MEMORY = "raiseGpuMemoryUtilization"
LOWER_MAX_NUM_SEQS = "lowerMaxNumSeqs"
# Live levers of a storm's relief (policy): maxNumSeqs lowered in place at once, and restored in place
# once the restart lever (raiseGpuMemoryUtilization) that follows it has rolled out.
RELIEVE_MAX_NUM_SEQS = "relieveMaxNumSeqs"
RESTORE_MAX_NUM_SEQS = "restoreMaxNumSeqs"
LOWER_MAX_BATCHED_TOKENS = "lowerMaxNumBatchedTokens"
RAISE_TP = "raiseTensorParallelSize"
RAISE_PP = "raisePipelineParallelSize"
ADD_REPLICA = "addReplica"
REMOVE_REPLICA = "removeReplica"
REVERT = "revert"


@dataclasses.dataclass(frozen=True)
class Change:
    """One entry of ``status.remediations`` (applied) or ``status.recommendations`` (proposed)."""

    time: float
    lever: str
    field: str
    from_: float
    to: float
    reason: str = ""
    generation: int | None = None
    applied_by: str | None = None  # live | rollout (api.live), for applied changes
    path: str | None = None  # plan | ladder: how a storm's restart-lever change was chosen (planned)

    def to_status(self) -> dict[str, Any]:
        """The status entry (``from`` and ``to`` as JSON numbers, ``time`` RFC 3339)."""
        entry = {
            "time": format_time(self.time),
            "lever": self.lever,
            "field": self.field,
            "from": self.from_,
            "to": self.to,
            "reason": self.reason[:1024],
        }
        if self.generation is not None:
            entry["generation"] = self.generation
        if self.applied_by is not None:
            entry["appliedBy"] = self.applied_by
        if self.path is not None:
            entry["path"] = self.path
        return entry

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> Change | None:
        """Parse a status entry; None for an entry that is not one (hand-edited status)."""
        try:
            return cls(
                time=parse_time(entry["time"]),
                lever=str(entry["lever"]),
                field=str(entry["field"]),
                from_=entry["from"],
                to=entry["to"],
                reason=str(entry.get("reason", "")),
                generation=entry.get("generation"),
                applied_by=entry.get("appliedBy"),
                path=entry.get("path"),
            )
        except (KeyError, TypeError, ValueError):
            return None


def history_from_status(entries: Iterable[Mapping[str, Any]] | None) -> list[Change]:
    """``status.remediations`` (or ``recommendations``) as Changes, newest first."""
    changes = [c for c in (Change.from_status(e) for e in entries or []) if c is not None]
    return sorted(changes, key=lambda c: c.time, reverse=True)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the policy concluded at one evaluation.

    ``action``: ``none``, ``apply`` (Auto) or ``recommend`` (Recommend). ``lever``/``field``/``from_``/
    ``to`` describe the change (also filled for ``none`` when a change is held back, e.g. by the
    cooldown or mode Off: what would be done). ``pressure``: ``storm``, ``demand`` or None, what the
    window shows. ``exhausted``: pressure, but every lever is at its limit. ``reason``: for people.
    """

    action: str
    reason: str
    lever: str | None = None
    field: str | None = None
    from_: float | None = None
    to: float | None = None
    pressure: str | None = None
    exhausted: bool = False
    path: str | None = None  # plan | ladder, when the plan was consulted for this change
    plan: Any = None  # the planner's verdict (planned.PlanVerdict) behind ``path``, if consulted

    @property
    def is_change(self) -> bool:
        return self.action in (APPLY, RECOMMEND_ACTION)

    def change(self, now: float, generation: int | None) -> Change:
        """The history entry of this decision (only for apply / recommend)."""
        assert self.is_change and self.lever and self.field
        return Change(
            now, self.lever, self.field, self.from_, self.to, self.reason, generation, path=self.path
        )

    def to_json(self, time: float) -> dict[str, Any]:
        """The ``kvpilot replay --output json`` line."""
        return {
            "time": time,
            "action": self.action,
            "lever": self.lever if self.is_change else None,
            "field": self.field if self.is_change else None,
            "from": self.from_ if self.is_change else None,
            "to": self.to if self.is_change else None,
            "reason": self.reason,
            "path": self.path if self.is_change else None,
        }
