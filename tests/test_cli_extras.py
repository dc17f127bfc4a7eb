"""``kvpilot`` without an optional extra: a subcommand that needs one says which in one line and exits 1
(no traceback); ``render`` and ``replay`` run on the base install.

Each case runs ``kvpilot.cli.main`` in a fresh interpreter where the named top-level modules cannot be
found, as on a machine where their packages were never installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "inferenceservice.yaml"
ENGINE = ["torch", "numpy", "transformers", "tokenizers", "safetensors", "tqdm", "fastapi", "uvicorn"]
OPERATOR = ["kopf", "aiohttp"]

_RUN_WITHOUT = """
import json, sys

blocked = set(json.loads(sys.argv[1]))


class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Uninstalled())
from kvpilot.cli import main

code = main(json.loads(sys.argv[2]))
loaded = sorted(b for b in blocked if any(m == b or m.startswith(b + ".") for m in sys.modules))
assert not loaded, f"imported although blocked: {loaded}"
sys.exit(code)
"""


def run_without(blocked: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT, json.dumps(blocked), json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,  # never the repository root
    )


@pytest.mark.parametrize(
    "blocked, argv, line",
    [
        (
            ["uvicorn"],
            ["serve", "/models/m"],
            "kvpilot serve needs the engine extra: pip install 'kvpilot[engine]' (missing: uvicorn)",
        ),
        (
            ENGINE,
            ["serve", "/models/m", "--port", "0"],
            "kvpilot serve needs the engine extra: pip install 'kvpilot[engine]' "
            "(missing: torch, numpy, transformers, tokenizers, safetensors, tqdm, fastapi, uvicorn)",
        ),
        (
            ["kopf"],
            ["operator", "-A"],
            "kvpilot operator needs the operator extra: pip install 'kvpilot[operator]' (missing: kopf)",
        ),
        (
            OPERATOR,
            ["operator", "--help"],
            "kvpilot operator needs the operator extra: pip install 'kvpilot[operator]' "
            "(missing: kopf, aiohttp)",
        ),
        (
            ["aiohttp"],
            ["up", "-f", "isvc.yaml", "--local"],
            "kvpilot up needs the engine and operator extras: pip install 'kvpilot[engine,operator]' "
            "(missing: aiohttp)",
        ),
        (
            ["torch", "kopf"],  # kopf is not needed by `up`; torch is (its replicas are `kvpilot serve`)
            ["up", "-f", "isvc.yaml", "--local"],
            "kvpilot up needs the engine and operator extras: pip install 'kvpilot[engine,operator]' "
            "(missing: torch)",
        ),
        (
            # The slim operator image deletes the local platform: `up` says so instead of a usage error.
            ["kvpilot.operator.local"],
            ["up", "-f", "isvc.yaml", "--local"],
            "kvpilot up is not part of this installation (kvpilot.operator.local.platform is absent)",
        ),
    ],
)
def test_a_missing_extra_is_one_line_and_exit_1(tmp_path, blocked, argv, line):
    result = run_without(blocked, argv, tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [line]
    assert result.stdout == ""


def test_render_needs_no_extra(tmp_path):
    result = run_without(ENGINE + OPERATOR, ["render", "-f", str(EXAMPLE)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "kind: Deployment" in result.stdout and "kind: Service" in result.stdout


def test_replay_needs_no_extra(tmp_path):
    text = "".join(
        f'# TYPE {name} {kind}\n{name}{{model_name="m"}} {value}\n'
        for name, kind, value in (
            ("vllm:num_preemptions_total", "counter", 0.0),
            ("vllm:kv_cache_usage_perc", "gauge", 0.5),
            ("vllm:num_requests_waiting", "gauge", 0.0),
            ("vllm:num_requests_running", "gauge", 1.0),
        )
    )
    samples = tmp_path / "samples.jsonl"
    t0 = 1_735_787_045.0
    samples.write_text(
        "".join(
            json.dumps(
                {"time": t0 + 15 * k, "tick": t0 + 15 * k, "pod": "p-0", "ready": True, "metrics": text}
            )
            + "\n"
            for k in range(3)
        )
    )
    result = run_without(
        ENGINE + OPERATOR, ["replay", "-f", str(EXAMPLE), "--metrics", str(samples)], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "3 evaluation(s)" in result.stdout


def test_with_the_extras_installed_nothing_is_reported():
    from kvpilot.cli import REQUIRED_EXTRAS, missing_extras_message

    # This test environment installs every extra.
    for command in REQUIRED_EXTRAS:
        assert missing_extras_message(command) is None, command
    assert missing_extras_message("render") is None
