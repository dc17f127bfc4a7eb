"""Pure builders for the router's right to wake its InferenceService from zero.

With ``spec.router.frontDoor`` and ``spec.remediation.limits.minReplicas: 0`` (and no
``spec.autoscaling``: an autoscaler owns replicas then), the router holds requests while no engine
pod is ready and stamps the ``wake-requested-at`` annotation so that remediation adds a replica
(``kvpilot router --wake NAMESPACE/NAME``). That one write is all the router may do: a ServiceAccount
``<name>-router``, a Role allowing ``get`` and ``patch`` on this InferenceService alone (by
``resourceNames``), and a RoleBinding between them. Without scale to zero the router pod mounts no
token at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.settings import Settings

RBAC_GROUP = "rbac.authorization.k8s.io"
RBAC_API_VERSION = f"{RBAC_GROUP}/v1"


def router_wakes(settings: Settings) -> bool:
    """Whether the router asks for a replica at zero: a front door, scale to zero allowed, and
    replicas remediation's to change (no ``spec.autoscaling``)."""
    router = settings.spec.get("router") or {}
    return (
        "frontDoor" in router
        and settings.remediation.limits.min_replicas == 0
        and settings.autoscaling_kind is None
    )


def wake_target(settings: Settings) -> str:
    """``NAMESPACE/NAME`` of the InferenceService, as ``kvpilot router --wake`` takes it."""
    meta = settings.isvc["metadata"]
    return f"{meta.get('namespace') or 'default'}/{meta['name']}"


def build_router_access(
    settings: Settings, make: Callable[[str, str], dict[str, Any]]
) -> list[dict[str, Any]]:
    """The ServiceAccount, Role and RoleBinding that let the router stamp its InferenceService and
    nothing else. ``make(api_version, kind)`` returns each object with its metadata (the router's
    name ``<name>-router``, labels, owner)."""
    account = make("v1", "ServiceAccount")
    account["automountServiceAccountToken"] = False  # mounted by the router pod alone
    role = make(RBAC_API_VERSION, "Role")
    role["rules"] = [
        {
            "apiGroups": [names.GROUP],
            "resources": [names.PLURAL],
            "resourceNames": [settings.isvc["metadata"]["name"]],
            "verbs": ["get", "patch"],
        }
    ]
    binding = make(RBAC_API_VERSION, "RoleBinding")
    binding["roleRef"] = {"apiGroup": RBAC_GROUP, "kind": "Role", "name": role["metadata"]["name"]}
    subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"]}
    if account["metadata"].get("namespace"):
        subject["namespace"] = account["metadata"]["namespace"]
    binding["subjects"] = [subject]
    return [account, role, binding]
