"""The operator's import boundaries: no torch or transformers anywhere, no I/O in the pure modules."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.operator.conftest import REPO

PURE = [
    "names",
    "spec",
    "effective",
    "validation",
    "podspec",
    "builders",
    "status",
    "window",
    "policy",
    "pods",
    "remediation",
    "replay",
]
ALL = PURE + ["kube", "reconcile", "scrape", "autotuner", "handlers", "cli", "__main__"]


def imported_after(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('kvpilot.operator.' + name)\n"
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


def test_operator_never_imports_torch_or_transformers():
    loaded = imported_after(ALL)
    assert "kopf" in loaded  # the probe really imported the handlers
    assert {"torch", "transformers", "tokenizers", "safetensors", "triton", "numpy"} & loaded == set()


def test_pure_modules_import_no_kubernetes_client_or_http():
    loaded = imported_after(PURE)
    assert {"kopf", "aiohttp", "kubernetes", "kmock"} & loaded == set()
