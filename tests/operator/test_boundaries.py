"""The operator's import boundaries, checked per folder: nothing imports torch or transformers, and the
pure folders import no Kubernetes client, kopf or HTTP library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.operator.conftest import REPO

OPERATOR = REPO / "operator"
# Folders that import no client: api, render and remediation decide; reconcile acts only through the
# API client it is handed (``api.rest.Kube``), so it imports none either.
PURE_FOLDERS = ("api", "render", "reconcile", "remediation")
# The remediation loop, its scraper and its live-change poster do the I/O of remediation; the rest is pure.
IO_MODULES = {"remediation.loop", "remediation.scrape", "remediation.live"}
# matplotlib too: the demo imports it only when it draws the plot.
HEAVY = {"torch", "transformers", "tokenizers", "safetensors", "triton", "numpy", "matplotlib"}
# Folders only `kvpilot up` and `make demo` use; the operator image leaves them out.
LOCAL_ONLY = ("local", "demo")
CLIENTS = {"kopf", "aiohttp", "kubernetes", "kmock", "requests", "httpx", "urllib3"}


def modules(folder=None) -> list[str]:
    """Dotted names (relative to kvpilot.operator) of every module under ``folder`` (or all)."""
    root = OPERATOR if folder is None else OPERATOR / folder
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(OPERATOR).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if parts:
            found.append(".".join(parts))
    return found


def loaded_after(names: list[str]) -> set[str]:
    """Every module a fresh interpreter holds after importing ``names`` (under kvpilot.operator)."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module('kvpilot.operator.' + name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


def imported_after(names: list[str]) -> set[str]:
    """The top-level packages loaded by importing ``names``."""
    return {m.split(".")[0] for m in loaded_after(names)}


def test_every_operator_module_is_found():
    names = modules()
    assert "handlers" in names and "remediation.policy" in names and "api.spec" in names


def test_operator_never_imports_torch_or_transformers():
    loaded = imported_after(modules())
    assert {"kopf", "aiohttp"} <= loaded  # the probe really imported the handlers and the local platform
    assert HEAVY & loaded == set()


def test_the_cluster_operator_needs_neither_the_local_platform_nor_the_demo():
    # The operator image removes both folders (Dockerfile): nothing else may import them.
    cluster = [n for n in modules() if n.split(".")[0] not in LOCAL_ONLY]
    loaded = {m for m in loaded_after(cluster) if m.startswith("kvpilot.operator.")}
    assert "kvpilot.operator.handlers" in loaded
    assert {m for m in loaded if m.split(".")[2] in LOCAL_ONLY} == set()
    dockerfile = (REPO / "Dockerfile").read_text()
    for folder in LOCAL_ONLY:
        assert f"kvpilot/operator/{folder}" in dockerfile, f"the operator image keeps {folder}/"


@pytest.mark.parametrize("folder", PURE_FOLDERS)
def test_pure_folders_import_no_kubernetes_client_or_http(folder):
    names = [n for n in modules(folder) if n not in IO_MODULES]
    assert names
    loaded = imported_after(names)
    assert CLIENTS & loaded == set(), f"{folder}/ imports {sorted(CLIENTS & loaded)}"
