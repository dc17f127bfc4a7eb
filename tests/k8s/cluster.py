"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (simulated nodes), built by `make k8s-tools` (mk/k8s.mk) into .tools/k8s and
.tools/kwok.

The API server runs as a cluster's does in the ways the operator depends on: RBAC authorization,
the default admission plugins, service-account tokens signed with a key of its own (TokenRequest),
server-side apply with the built-in kinds' merge keys, and watches served from etcd. The
administrator authenticates with a static token in ``system:masters``; every other identity (the
operator's ServiceAccount) gets only what RBAC grants it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.operator.conftest import CRD_PATH, REPO, wait_for

BIN = REPO / ".tools" / "k8s"
KWOK = REPO / ".tools" / "kwok" / "kwok"
KWOK_CONFIG = Path(__file__).with_name("kwok.yaml")
KUBECTL = REPO / ".tools" / "kubectl"
CRD_NAME = "inferenceservices.serving.kvpilot.io"
# The simulated nodes (kwok.yaml): pods on SIMULATED turn Ready at once; pods on ENGINES run a real
# engine process (engine_node.py) bound to their pod IP, from the node's loopback range.
SIMULATED_NODE, ENGINES_NODE = "kwok-0", "kwok-engines"
NODE_CIDRS = {SIMULATED_NODE: "127.1.0.0/16", ENGINES_NODE: "127.0.2.0/24"}
ENGINES_TAINT = {"key": "kvpilot.dev/engines", "value": "true", "effect": "NoSchedule"}
ADMIN_TOKEN = "kvpilot-admin-token"  # noqa: S105 - a loopback test cluster's static tokens
OPERATOR_TOKEN = "kvpilot-operator-token"  # noqa: S105
OPERATOR_USER = "kvpilot-operator-admin"  # an operator run with full rights (RBAC tests use the chart's)
STANDBY_TOKEN = "kvpilot-standby-token"  # noqa: S105 - a second replica, told apart in the audit log
STANDBY_USER = "kvpilot-operator-standby"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "nonResourceURLs": ["/readyz", "/livez", "/healthz"]},
        # Status writes with their bodies, to say what a write changed.
        {
            "level": "Request",
            "verbs": ["patch", "update"],
            "resources": [{"group": "serving.kvpilot.io", "resources": ["inferenceservices/status"]}],
        },
        {"level": "Metadata"},
    ],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """The control plane in ``root`` (a fresh folder); ``start()`` returns once the API is ready."""

    def __init__(self, root: Path, controllers: bool = True, nodes: bool = False) -> None:
        self.root = root
        self.controllers = controllers
        self.nodes = nodes
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.etcd_port = free_port()
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.ca = root / "certs" / "apiserver.crt"
        self.audit_log = root / "audit.log"

    # -- processes --------------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        with log.open("a") as out:
            self.procs[name] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=self.root)

    def start(self) -> Cluster:
        (self.root / "certs").mkdir(parents=True, exist_ok=True)
        key = self.root / "sa.key"
        if not key.exists():
            subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        (self.root / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},kvpilot-admin,1,"system:masters"\n{OPERATOR_TOKEN},{OPERATOR_USER},2,"system:masters"\n'
            f'{STANDBY_TOKEN},{STANDBY_USER},3,"system:masters"\n'
        )
        (self.root / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        self.start_etcd()
        self.start_apiserver()
        self.write_kubeconfig(self.root / "admin.kubeconfig", token=ADMIN_TOKEN)
        if self.controllers:
            common = [
                f"--kubeconfig={self.root / 'admin.kubeconfig'}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
            ]
            self._spawn(
                "kube-controller-manager",
                [
                    str(BIN / "kube-controller-manager"),
                    *common,
                    f"--secure-port={free_port()}",
                    "--controllers=*,-serviceaccount-token",
                    f"--root-ca-file={self.ca}",
                    "--concurrent-gc-syncs=5",
                ],
            )
            self._spawn(
                "kube-scheduler", [str(BIN / "kube-scheduler"), *common, f"--secure-port={free_port()}"]
            )
        if self.nodes:
            self.start_kwok()
        return self

    def start_kwok(self) -> None:
        """kwok with the stages of kwok.yaml, managing the nodes it creates here (annotated
        ``kwok.x-k8s.io/node: fake``); returns once both are Ready."""
        self._spawn(
            "kwok",
            [
                str(KWOK),
                f"--config={KWOK_CONFIG}",
                f"--kubeconfig={self.root / 'admin.kubeconfig'}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{free_port()}",
            ],
        )
        for name, cidr in NODE_CIDRS.items():
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok"},
                },
                "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
            }
            if name == ENGINES_NODE:
                node["spec"]["taints"] = [ENGINES_TAINT]
            self.kubectl("apply", "-f", "-", input=json.dumps(node))
        self.kubectl("wait", "--for=condition=Ready", "--timeout=60s", "node", *NODE_CIDRS)

    def start_etcd(self) -> None:
        self._spawn(
            "etcd",
            [
                str(BIN / "etcd"),
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )

    def start_apiserver(self) -> None:
        key = self.root / "sa.key"
        self._spawn(
            "kube-apiserver",
            [
                str(BIN / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={self.root / 'certs'}",
                f"--token-auth-file={self.root / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={key}",
                f"--service-account-signing-key-file={key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--watch-cache=true",
                f"--audit-policy-file={self.root / 'audit-policy.yaml'}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-maxsize=0",
                "--v=1",
            ],
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")
            try:
                if self.request("GET", "/readyz").get("_text") == "ok":
                    return
            except (OSError, urllib.error.URLError, ssl.SSLError, ValueError) as exc:
                last = exc
            time.sleep(0.25)
        raise RuntimeError(
            f"kube-apiserver not ready after {timeout}s ({last}):\n{self.tail('kube-apiserver')}"
        )

    def stop_process(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart_apiserver(self) -> None:
        """Stop and start kube-apiserver on the same port: every watch is cut and its cache is lost."""
        self.stop_process("kube-apiserver")
        self.start_apiserver()

    def stop(self) -> None:
        for name in ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            self.stop_process(name)

    def tail(self, name: str, chars: int = 3000) -> str:
        path = self.logs.get(name)
        return path.read_text()[-chars:] if path and path.exists() else ""

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def audit(self, user: str | None = None, **match: str) -> list[dict[str, Any]]:
        """The API server's audit events (one per completed request), by ``user`` and objectRef fields
        (``resource``, ``name``, ``namespace``, ``subresource``), oldest first."""
        events = []
        if not self.audit_log.exists():
            return events
        for line in self.audit_log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("stage") != "ResponseComplete":
                    continue
                if user is not None and event.get("user", {}).get("username") != user:
                    continue
                ref = event.get("objectRef") or {}
                if all(ref.get(key) == value for key, value in match.items()):
                    events.append(event)
        return events

    # -- clients ----------------------------------------------------------------------------------

    def write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "test", "cluster": {"server": self.server, "certificate-authority": str(self.ca)}}
            ],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [
                {"name": "test", "context": {"cluster": "test", "user": "user", "namespace": namespace}}
            ],
            "current-context": "test",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def kubeconfig(self, path: Path) -> Path:
        """An administrator's kubeconfig (the interface of the fake's ``ApiServerThread``)."""
        return self.write_kubeconfig(path, token=ADMIN_TOKEN)

    def identity(self, token: str) -> Identity:
        """The cluster as ``token``'s holder sees it (what ``OperatorProcess`` takes)."""
        return Identity(self, token)

    def install_crd(self, *namespaces: str) -> Cluster:
        """The CRD applied server-side and Established, and ``namespaces`` created."""
        self.kubectl("apply", "--server-side", "-f", str(CRD_PATH))
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
        for namespace in namespaces:
            self.kubectl("create", "namespace", namespace)
        return self

    def provide_volume(self, namespace: str, claim: str = "models") -> None:
        """A PersistentVolume and the claim ``claim`` bound to it (kube-controller-manager binds them),
        so that pods reading a ``pvc://`` model source can be scheduled."""
        volume = f"{claim}-{namespace}"
        access = ["ReadOnlyMany", "ReadWriteOnce"]
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": access,
                "storageClassName": "",
                "hostPath": {"path": "/tmp"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
        pvc = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": access,
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
        self.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]})
        )
        self.kubectl(
            "wait", "-n", namespace, "--for=jsonpath={.status.phase}=Bound", "--timeout=60s", f"pvc/{claim}"
        )

    def get(self, namespace: str, what: str) -> dict | None:
        """``what`` (``kind/name``) in ``namespace`` as JSON, None when it does not exist."""
        done = self.kubectl("get", "-n", namespace, what, "-o", "json", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def wait_exists(self, namespace: str, what: str, timeout: float = 60) -> dict:
        return wait_for(lambda: self.get(namespace, what), timeout, f"{namespace}/{what}")

    def request(
        self, method: str, path: str, body: Any = None, token: str = ADMIN_TOKEN, **headers: str
    ) -> dict:
        """One API call as ``token``'s identity; the decoded body (``_text`` for a plain one)."""
        context = ssl.create_default_context(cafile=str(self.ca)) if self.ca.exists() else None
        data = None
        if body is not None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {token}", **headers},
        )
        try:
            with urllib.request.urlopen(req, context=context, timeout=30) as resp:  # noqa: S310 - loopback
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode()
            with contextlib.suppress(ValueError):
                parsed = json.loads(text)
                parsed["_status"] = exc.code
                return parsed
            return {"_status": exc.code, "_text": text}
        try:
            return json.loads(text)
        except ValueError:
            return {"_text": text}

    def kubectl(
        self, *args: str, input: str | None = None, kubeconfig: Path | None = None, check: bool = True
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(kubeconfig or self.root / "admin.kubeconfig")
        done = subprocess.run(
            [str(KUBECTL), *args],
            input=input,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr}")
        return done


class Identity:
    """A kubeconfig with one identity's token, for ``OperatorProcess``."""

    def __init__(self, cluster: Cluster, token: str) -> None:
        self.cluster, self.token = cluster, token

    def kubeconfig(self, path: Path) -> Path:
        return self.cluster.write_kubeconfig(path, token=self.token)
