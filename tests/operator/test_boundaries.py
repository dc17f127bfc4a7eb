"""The operator's import boundaries, checked per folder: nothing imports torch or transformers, and the
pure folders import no Kubernetes client, kopf or HTTP library."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.operator.conftest import REPO

OPERATOR = REPO / "operator"
# Folders whose job is pure: they decide, the modules outside them act.
PURE_FOLDERS = ("api", "render", "remediation")
# The remediation loop and its scraper do the I/O of remediation; everything else there is pure.
IO_MODULES = {"remediation.loop", "remediation.scrape"}
# matplotlib too: the demo imports it only when it draws the plot.
HEAVY = {"torch", "transformers", "tokenizers", "safetensors", "triton", "numpy", "matplotlib"}
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


def imported_after(names: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module('kvpilot.operator.' + name)\n"
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


def test_every_operator_module_is_found():
    names = modules()
    assert "handlers" in names and "remediation.policy" in names and "api.spec" in names


def test_operator_never_imports_torch_or_transformers():
    loaded = imported_after(modules())
    assert {"kopf", "aiohttp"} <= loaded  # the probe really imported the handlers and the local platform
    assert HEAVY & loaded == set()


@pytest.mark.parametrize("folder", PURE_FOLDERS)
def test_pure_folders_import_no_kubernetes_client_or_http(folder):
    names = [n for n in modules(folder) if n not in IO_MODULES]
    assert names
    loaded = imported_after(names)
    assert CLIENTS & loaded == set(), f"{folder}/ imports {sorted(CLIENTS & loaded)}"
