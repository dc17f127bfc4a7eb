"""Whether a live child differs from what the operator renders: its config hash, or any field the
operator renders drifted on it (``kubectl set image``, edited args or env, a hand-scaled Deployment),
compared the way the API server merges (lists of objects by their merge key, as server-side apply
does), and whether a live object is this InferenceService's to write.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.spec import parse_quantity


def is_controlled_by(obj: dict[str, Any], isvc: dict[str, Any]) -> bool:
    """Whether ``obj`` has a controller reference to this very InferenceService (same uid)."""
    uid = isvc["metadata"].get("uid")
    return any(
        ref.get("controller") and ref.get("uid") == uid and ref.get("kind") == names.KIND
        for ref in obj["metadata"].get("ownerReferences") or []
    )


def _same_scalar(desired: Any, live: Any) -> bool:
    if desired == live and type(desired) is type(live):
        return True
    if isinstance(desired, bool) or isinstance(live, bool):
        return False
    # The API server returns quantities in canonical form ("1" for 1, "500m" for "0.5").
    if isinstance(desired, str | int | float) and isinstance(live, str | int | float):
        try:
            return parse_quantity(desired) == parse_quantity(live)
        except (ValueError, ArithmeticError):
            return False
    return False


# The lists of the kinds the operator renders that server-side apply merges by key
# (``x-kubernetes-list-type: map`` in the built-in schemas), by field name: entries another field
# manager adds (a webhook's env var, a mesh's sidecar, a CSI volume) live beside the operator's and
# are not drift. A key missing from an entry takes the API server's default. ``ports`` is a Container's
# (containerPort, protocol) or a Service's (port, protocol), told apart by which key the entry has.
# Every other list is atomic: it drifts when it differs in length or in any entry.
MERGE_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "containers": (("name",),),
    "initContainers": (("name",),),
    "ephemeralContainers": (("name",),),
    "env": (("name",),),
    "volumes": (("name",),),
    "volumeMounts": (("mountPath",),),
    "volumeDevices": (("devicePath",),),
    "imagePullSecrets": (("name",),),
    "resourceClaims": (("name",),),
    "schedulingGates": (("name",),),
    "hostAliases": (("ip",),),
    "topologySpreadConstraints": (("topologyKey", "whenUnsatisfiable"),),
    "ports": (("containerPort", "protocol"), ("port", "protocol")),
}
_KEY_DEFAULTS = {"protocol": "TCP"}


def _merge_key(field: str, entry: Any) -> tuple | None:
    """The key SSA merges ``entry`` of list ``field`` by, or None when the list is atomic."""
    if not isinstance(entry, dict):
        return None
    for keys in MERGE_KEYS.get(field, ()):
        if keys[0] in entry:
            return (keys, tuple(entry.get(k, _KEY_DEFAULTS.get(k)) for k in keys))
    return None


def drifted(desired: Any, live: Any, path: str = "") -> str | None:
    """The first field the operator renders (a key of ``desired``, at any depth) whose live value
    differs, as a dotted path; None when ``live`` holds all of ``desired``. Fields the API server or
    other controllers add (defaults, status, annotations of their own, entries of merge-keyed lists
    such as another manager's env var or sidecar container) are not drift."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return path or "."
        for key, value in desired.items():
            where = drifted(value, live.get(key), f"{path}.{key}" if path else key)
            if where is not None:
                return where
        return None
    if isinstance(desired, list):
        if not isinstance(live, list):
            return path
        field = path.rsplit(".", 1)[-1]
        keys = [_merge_key(field, want) for want in desired]
        if desired and all(key is not None for key in keys):
            by_key = {_merge_key(field, have): have for have in live}
            for key, want in zip(keys, desired, strict=True):
                where = drifted(want, by_key.get(key), f"{path}[{'/'.join(map(str, key[1]))}]")
                if where is not None:
                    return where
            return None
        if len(live) != len(desired):
            return path
        for index, (want, have) in enumerate(zip(desired, live, strict=True)):
            where = drifted(want, have, f"{path}[{index}]")
            if where is not None:
                return where
        return None
    return None if _same_scalar(desired, live) else path


def needs_write(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Whether applying ``desired`` would change ``live``: it is missing, its config hash differs, or a
    field the operator renders drifted (edited by hand: the operator owns it and restores it)."""
    if live is None:
        return True
    key = names.ANNOTATION_CONFIG_HASH
    live_meta = live.get("metadata") or {}
    if (live_meta.get("annotations") or {}).get(key) != desired["metadata"]["annotations"][key]:
        return True
    return drifted({k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}, live) is not None
