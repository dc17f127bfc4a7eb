"""Status conditions as Kubernetes writes them, shared by the two writers of an InferenceService's
status: the reconciler (``Ready``, ``Progressing``, ``SpecValid``) and remediation (``KVCachePressure``,
``Remediating``). Each replaces its own conditions and keeps everybody else's.
"""

from __future__ import annotations

import datetime
from typing import Any

from kvpilot.operator.api.timefmt import rfc3339


def condition(type_: str, is_true: bool, reason: str, message: str) -> dict[str, Any]:
    """A condition without its timestamps (``merge_conditions`` adds them)."""
    return {"type": type_, "status": "True" if is_true else "False", "reason": reason, "message": message}


def merge_conditions(
    current: list[dict[str, Any]] | None,
    updates: list[dict[str, Any]],
    generation: int | None,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Replace the owned conditions in ``current`` by ``updates``, keeping everybody else's.

    ``lastTransitionTime`` moves only when a condition's status changes.
    """
    merged = [dict(c) for c in current or []]
    positions = {c.get("type"): i for i, c in enumerate(merged)}
    for update in updates:
        index = positions.get(update["type"])
        previous = merged[index] if index is not None else None
        stamped = dict(update)
        if previous is not None and previous.get("status") == update["status"]:
            stamped["lastTransitionTime"] = previous.get("lastTransitionTime") or rfc3339(now)
        else:
            stamped["lastTransitionTime"] = rfc3339(now)
        if generation is not None:
            stamped["observedGeneration"] = generation
        if index is None:  # keep every condition in place so that an unchanged list compares equal
            positions[update["type"]] = len(merged)
            merged.append(stamped)
        else:
            merged[index] = stamped
    return merged


def find_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    """The condition of ``type_`` in a conditions list, or None."""
    for item in conditions or []:
        if item.get("type") == type_:
            return item
    return None
