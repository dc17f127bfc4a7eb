"""Field ownership for the Kubernetes API fake: a simplified but faithful server-side apply.

Each field manager owns a set of leaf field paths (a path ends at a scalar, a list or an empty
map: lists are atomic here, where the API server merges some by key). The sets live on the
object as ``metadata.managedFields`` (``fieldsV1``: ``{"f:spec": {"f:replicas": {}}}``), one
entry per (manager, operation), as on a real API server:

- an update (create, merge or JSON patch) by M makes M own every leaf it changed (operation
  ``Update``) and takes those leaves from every other manager;
- an apply by M sets the leaves M sends, takes from the object the leaves M applied before and
  no longer sends (unless another manager owns them too), and owns exactly what it sent
  (operation ``Apply``); sending a leaf another manager owns with a different value is a
  conflict (409) unless ``force``, which moves the leaf to M.

System metadata, ``apiVersion``, ``kind`` and ``status`` are nobody's fields here.

Where this model would disagree with a real API server it refuses instead: a real server merges the
lists marked ``x-kubernetes-list-type: map`` (containers, env, ports, volumes, ...) item by item by
their keys, so two managers can each own entries of one list. Here a list is one leaf, so an apply
that sends such a list while another manager owns it with other items raises
:class:`KeyedListNotModelled`: that behaviour is tested on the real control plane (tests/k8s).
"""

from __future__ import annotations

import copy
from typing import Any

Path = tuple[str, ...]
Owners = dict[tuple[str, str], set[Path]]  # (manager, operation) -> leaf paths

_SYSTEM_METADATA = {
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
}


def merge_diff(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_diff(old[key], value)
    return patch


class FieldConflict(Exception):
    """An apply would change leaves other managers own: ``conflicts`` lists (path, manager)."""

    def __init__(self, conflicts: list[tuple[Path, str]]) -> None:
        self.conflicts = conflicts
        super().__init__(
            "Apply failed with {} conflict(s): {}".format(
                len(conflicts),
                "; ".join(f'conflict with "{manager}": .{".".join(path)}' for path, manager in conflicts),
            )
        )


# Lists a real API server merges by key (the built-in kinds' list-map fields this fake is used with).
KEYED_LISTS = frozenset(
    {"containers", "initContainers", "ephemeralContainers", "env", "ports", "volumes", "volumeMounts",
     "volumeDevices", "imagePullSecrets", "hostAliases", "topologySpreadConstraints", "resourceClaims"}
)  # fmt: skip


class KeyedListNotModelled(Exception):
    """An apply would drop items another manager put in a list a real API server merges by key."""


def _item_key(item: Any) -> Any:
    if not isinstance(item, dict):
        return repr(item)
    for key in ("name", "mountPath", "devicePath", "ip"):
        if key in item:
            return item[key]
    if "containerPort" in item:
        return (item["containerPort"], item.get("protocol", "TCP"))
    return repr(sorted(item.items()))


def _items_dropped(live: Any, sent: Any) -> bool:
    """Whether ``live`` (a keyed list) has an item, or a nested keyed list's item, ``sent`` lacks."""
    if not isinstance(live, list) or not isinstance(sent, list):
        return False
    by_key = {_item_key(item): item for item in sent}
    for item in live:
        match = by_key.get(_item_key(item))
        if match is None:
            return True
        if isinstance(item, dict) and isinstance(match, dict):
            for key, value in item.items():
                if key in KEYED_LISTS and _items_dropped(value, match.get(key) or []):
                    return True
    return False


def leaves(obj: dict[str, Any]) -> dict[Path, Any]:
    """Every owned leaf of ``obj`` and its value."""
    found: dict[Path, Any] = {}

    def walk(value: Any, path: Path) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(item, (*path, key))
        else:
            found[path] = value

    for key, value in obj.items():
        if key in ("apiVersion", "kind", "status"):
            continue
        if key == "metadata":
            for meta_key, meta_value in (value or {}).items():
                if meta_key not in _SYSTEM_METADATA:
                    walk(meta_value, ("metadata", meta_key))
        else:
            walk(value, (key,))
    return found


def _to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def _from_fields_v1(tree: dict[str, Any], path: Path = ()) -> set[Path]:
    if not tree:
        return {path} if path else set()
    paths: set[Path] = set()
    for key, sub in tree.items():
        paths |= _from_fields_v1(sub, (*path, key[2:]))
    return paths


def owners_of(obj: dict[str, Any] | None) -> Owners:
    """The (manager, operation) -> leaf paths recorded in ``obj``'s ``managedFields``."""
    owners: Owners = {}
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        owners[(entry["manager"], entry["operation"])] = _from_fields_v1(entry.get("fieldsV1") or {})
    return owners


def with_owners(obj: dict[str, Any], owners: Owners) -> dict[str, Any]:
    """``obj`` with ``managedFields`` set from ``owners`` (managers owning nothing are dropped)."""
    live = set(leaves(obj))
    obj["metadata"]["managedFields"] = [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": obj.get("apiVersion"),
            "fieldsType": "FieldsV1",
            "fieldsV1": _to_fields_v1(paths & live),
        }
        for (manager, operation), paths in sorted(owners.items())
        if paths & live
    ]
    return obj


def record_update(current: dict[str, Any] | None, new: dict[str, Any], manager: str) -> dict[str, Any]:
    """``new`` (written by an update of ``manager``) with its ownership recorded."""
    before = leaves(current or {"metadata": {}})
    changed = {p for p, v in leaves(new).items() if p not in before or before[p] != v}
    owners = owners_of(current)
    for paths in owners.values():
        paths -= changed
    owners.setdefault((manager, "Update"), set()).update(changed)
    return with_owners(new, owners)


def _remove(obj: dict[str, Any], path: Path) -> None:
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(parents) - 1, 0, -1):  # maps left empty by the removal go too
        if parents[depth]:
            break
        parents[depth - 1].pop(path[depth - 1], None)


def _set(obj: dict[str, Any], path: Path, value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = copy.deepcopy(value)


def apply(
    current: dict[str, Any] | None, applied: dict[str, Any], manager: str, force: bool
) -> dict[str, Any]:
    """The object after ``manager`` applies ``applied`` to ``current`` (None: create); raises
    FieldConflict when it would change another manager's leaves without ``force``."""
    sent = leaves(applied)
    if current is not None:
        base = copy.deepcopy(current)
    else:
        applied_meta = applied.get("metadata") or {}
        base = {
            "metadata": {
                k: applied_meta[k] for k in ("name", "generateName", "namespace") if k in applied_meta
            }
        }
    for key in ("apiVersion", "kind"):
        if key in applied:
            base[key] = applied[key]
    live = leaves(base)
    owners = owners_of(current)
    conflicts = sorted(
        (path, other)
        for (other, _), paths in owners.items()
        if other != manager
        for path in paths & set(sent)
        if live.get(path) != sent[path]
    )
    shared = sorted(
        (path, other)
        for (other, _), paths in owners.items()
        if other != manager
        for path in paths & set(sent)
        if path[-1] in KEYED_LISTS and _items_dropped(live.get(path), sent[path])
    )
    if shared:
        path, other = shared[0]
        raise KeyedListNotModelled(
            f"{manager} applies .{'.'.join(path)} without items {other} has in it: a real API server "
            "merges that list by key and keeps them; not modelled here (see tests/k8s)"
        )
    if conflicts and not force:
        raise FieldConflict(conflicts)
    others = set().union(*(p for (m, _), p in owners.items() if m != manager)) if owners else set()
    for path in owners.get((manager, "Apply"), set()) - set(sent) - others:
        _remove(base, path)
    for path, value in sent.items():
        _set(base, path, value)
    for (other, _), paths in owners.items():
        if other != manager:
            paths -= {p for p, _ in conflicts}
    owners[(manager, "Apply")] = set(sent)
    return with_owners(base, owners)
