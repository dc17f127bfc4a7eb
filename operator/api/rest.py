"""The Kubernetes REST API as the operator addresses it: object paths, the error an API server answers
with, and the calls the reconciler and the remediation loop make (:class:`Kube`).

Pure: no HTTP client here. ``kube.KubeClient`` speaks this protocol to an API server, the local
platform's ``LocalApi`` to a dict; the reconcile pass and the remediation loop take either.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvpilot.operator.api import names

# kind -> plural for the kinds the operator reads or writes.
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "Event": "events",
    "Pod": "pods",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "InferencePool": "inferencepools",
    "HTTPRoute": "httproutes",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    names.KIND: names.PLURAL,
}


class ApiError(Exception):
    """The API server refused a request (``status`` is the HTTP status; 0 for no answer)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def is_transient(self) -> bool:
        """Whether retrying later can succeed (no answer, throttling, server errors)."""
        return self.status == 0 or self.status == 429 or self.status >= 500


def object_path(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of an object (or of the collection when ``name`` is None)."""
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def path_of(obj: dict[str, Any], subresource: str | None = None) -> str:
    """The REST path of ``obj`` (from its apiVersion, kind, namespace and name)."""
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"], subresource)


class Kube(Protocol):
    """The API calls the operator makes (``KubeClient`` documents each)."""

    async def request(
        self, method: str, path: str, *, params: dict[str, str] | None = None, body: Any = None
    ) -> dict[str, Any]: ...

    async def get(self, path: str) -> dict[str, Any] | None: ...

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]: ...

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]: ...

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]: ...

    async def delete(self, path: str) -> None: ...
