"""JSON merge patch (RFC 7386), the one way status and objects are patched here.

The API server applies it to what the operator sends; ``kvpilot replay`` and the in-memory API of the
local platform apply it themselves with :func:`merge_patch`, so all three reach the same state.
"""

from __future__ import annotations

import copy
from typing import Any


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply a JSON merge patch to a copy of ``target``: ``None`` deletes a key, objects merge, anything
    else replaces. Neither argument is modified."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result
