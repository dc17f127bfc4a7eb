"""``kvpilot router --wake NAMESPACE/NAME``: ask for a replica of a service at zero through the
Kubernetes API, as the router pod's own service account.

One call is one JSON merge patch of the InferenceService's ``wake-requested-at`` annotation (RFC 3339,
now); remediation adds a replica 0 -> 1 for a stamp newer than its last change. The operator renders
the account, and a Role that allows exactly this (``render.wake``). The token is read again on every
call (the kubelet rotates projected tokens); the API server is the in-cluster one unless given.
"""

from __future__ import annotations

import json
import os
import ssl
import time
from pathlib import Path

import aiohttp

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from kvpilot.operator.api.timefmt import format_time

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT_S = 10.0


class WakeError(Exception):
    """The API server refused the wake (or could not be reached); the hold asks again later."""


def parse_target(value: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` -> (namespace, name); raises ValueError naming what is wrong."""
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"expected NAMESPACE/NAME, got {value!r}")
    return namespace, name


def in_cluster_server() -> str:
    """The API server a pod reaches (``KUBERNETES_SERVICE_HOST`` / ``_PORT``); raises ValueError
    outside a cluster."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ValueError("not in a cluster (KUBERNETES_SERVICE_HOST unset): pass --kube-server")
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{port}"


class ApiWaker:
    """Stamps ``wake-requested-at`` on the InferenceService ``target`` (``NAMESPACE/NAME``).
    ``server``: the API server's base URL (None: the in-cluster one); ``token_file`` and ``ca_file``:
    the bearer token and the CA bundle that signs the server's certificate (None: the system's)."""

    def __init__(
        self,
        target: str,
        *,
        server: str | None = None,
        token_file: Path = SERVICE_ACCOUNT_DIR / "token",
        ca_file: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt",
    ) -> None:
        self.namespace, self.name = parse_target(target)
        self.server = (server or in_cluster_server()).rstrip("/")
        self.token_file = Path(token_file)
        self.ca_file = ca_file
        self.path = object_path(names.API_VERSION, names.KIND, self.namespace, self.name)

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https://"):
            return False
        return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)

    async def __call__(self) -> None:
        """One stamp; raises :class:`WakeError` when it did not land."""
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise WakeError(f"no service-account token at {self.token_file}: {exc}") from None
        body = {"metadata": {"annotations": {names.ANNOTATION_WAKE: format_time(time.time())}}}
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"}
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.patch(
                    self.server + self.path, data=json.dumps(body), headers=headers, ssl=self._ssl()
                ) as answer,
            ):
                if answer.status >= 300:
                    text = (await answer.text())[:300]
                    raise WakeError(f"{answer.status} from {self.path}: {text}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WakeError(f"{self.server} unreachable: {exc!r}") from None
