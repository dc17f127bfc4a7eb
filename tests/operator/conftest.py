"""Shared fixtures of the operator tests: InferenceService builders, the CRD, tools, a local API."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.kmock_apiserver import ApiServerThread

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferenceservice.yaml"
CHART = REPO / "charts" / "kvpilot"
EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
K8S_VERSION = "1.33.0"  # kubernetes-validate schemas checked against (a recent, widely deployed release)

# A short window and the ladder's first lever a rollout (the tests of the operator's own loop and
# metrics; the live order has its tests in test_policy and test_remediation_live_kmock).
FAST_ROLLOUT_REMEDIATION: dict[str, Any] = {
    "mode": "Auto",
    "preemptionRate": 0.5,
    "window": "4s",
    "cooldown": "60s",
    "liveLevers": False,
}
BASE_ISVC: dict[str, Any] = {
    "apiVersion": "serving.kvpilot.io/v1alpha1",
    "kind": "InferenceService",
    "metadata": {
        "name": "llama",
        "namespace": "llm",
        "uid": "0f3c3c8e-1111-4a5b-9c1d-000000000001",
        "generation": 3,
    },
    "spec": {
        "model": {"source": "pvc://models/llama-3.1-8b"},
        "image": "registry.example.com/kvpilot/engine:0.1.0",
        "replicas": 2,
        "engine": {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.9},
    },
}


def _set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for key in keys[:-1]:
        obj = obj.setdefault(key, {})
    if value is _DELETE:
        obj.pop(keys[-1], None)
    else:
        obj[keys[-1]] = value


_DELETE = object()


@pytest.fixture
def make_isvc() -> Callable[..., dict[str, Any]]:
    """``make_isvc({"spec.engine.maxNumSeqs": 64, "metadata.uid": DELETE})`` -> a fresh object."""

    def make(changes: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
        isvc = copy.deepcopy(BASE_ISVC)
        isvc["spec"].update(copy.deepcopy(spec))
        for dotted, value in (changes or {}).items():
            _set_path(isvc, dotted, value if value is _DELETE else copy.deepcopy(value))
        return isvc

    make.DELETE = _DELETE
    return make


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def find_tool(name: str) -> str:
    """A tool from .tools/ (fetched by `make test-operator-prereqs`) or PATH.

    Missing: fails under make (KVPILOT_REQUIRE_TOOLS=1), skips otherwise; never passes silently.
    """
    local = REPO / ".tools" / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    # kubectl is only ever taken from .tools/: one already on the machine may carry a kubeconfig.
    found = shutil.which(name) if name != "kubectl" else None
    if found:
        return found
    message = f"{name} not found in .tools/ or PATH; run `make test-operator-prereqs`"
    if os.environ.get("KVPILOT_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


async def serve_routes(*routes: tuple[str, str, Callable[..., Any]]) -> tuple[Any, str]:
    """An aiohttp app with ``(method, path, handler)`` routes on a free port of 127.0.0.1: (runner,
    base URL); ``await runner.cleanup()`` stops it. A fake replica behind the router's tests."""
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


class OperatorProcess:
    """``python -m kvpilot.operator operator`` against the local API, its log kept for failures."""

    def __init__(self, api: ApiServerThread, tmp: Path, namespaces: list[str], extra: list[str] = ()) -> None:
        self.log_path = tmp / f"operator-{time.monotonic_ns()}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(api.kubeconfig(tmp / "kubeconfig"))
        args = [sys.executable, "-m", "kvpilot.operator", "operator", "--verbose", *extra]
        for namespace in namespaces:
            args += ["--namespace", namespace]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def api() -> Iterator[ApiServerThread]:
    """A Kubernetes API on 127.0.0.1 (kmock plus the behaviours in kmock_apiserver) with the CRD."""
    with ApiServerThread(CRD_PATH) as server:
        yield server


@pytest.fixture(scope="module")
def start_operator(
    api: ApiServerThread, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
):
    """Start operator processes for the module; each is stopped (and its log shown on failure)."""
    started: list[OperatorProcess] = []
    tmp = tmp_path_factory.mktemp("operator")

    def start(namespaces: list[str], extra: list[str] = ()) -> OperatorProcess:
        proc = OperatorProcess(api, tmp, namespaces, list(extra))
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
        sys.stderr.write(f"\n--- operator log ({proc.log_path}) tail ---\n{proc.log[-4000:]}\n")
