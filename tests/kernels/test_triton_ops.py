"""Runs the Triton kernel suite (``triton_cases.py``) in child pytest processes.

On CPU the children get ``TRITON_INTERPRET=1`` in their environment from the start, so the
interpreter is used whatever this session has imported; the suite is split over the cores.
On CUDA one child runs the compiled kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from . import triton_cases
from .conftest import DEVICE, missing_dependency, require_modules

SUITE = Path(__file__).with_name("triton_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_torch_reference(tmp_path):
    require_modules("triton")
    if DEVICE == "cpu":
        require_modules("numpy")
    env = dict(os.environ, KVPILOT_TEST_DEVICE=DEVICE)
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    num_shards = min(2, os.cpu_count() or 1) if DEVICE == "cpu" else 1
    children = []
    for i in range(num_shards):
        report = tmp_path / f"shard{i}.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(SUITE),
            "-q",
            "-rfE",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
        ]
        child = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(env, KVPILOT_TEST_SHARD=f"{i}/{num_shards}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        children.append((child, report))
    outputs, passed, failures, skipped = [], 0, [], []
    for child, report in children:
        outputs.append(child.communicate(timeout=900)[0])
        assert report.exists(), f"the child pytest wrote no report:\n{outputs[-1][-4000:]}"
        for case in ET.parse(report).iter("testcase"):
            name = case.get("name")
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failures.append(f"{name}: {bad.get('message', '')[:600]}")
            elif case.find("skipped") is not None:
                skipped.append(name)
            else:
                passed += 1
    judge_suite(passed, failures, skipped, "\n".join(outputs))


def judge_suite(passed: int, failures: list[str], skipped: list[str], output: str) -> None:
    """The verdict on the children's reports: any failure fails; a suite that only skipped (a
    dependency missing in the children) skips, and fails under ``KVPILOT_REQUIRE_TOOLS=1``; a
    partial skip or fewer cases than the suite holds fails."""
    assert not failures, "\n".join(failures) + "\n\n" + output[-3000:]
    if skipped and not passed:
        missing_dependency(f"Triton suite skipped: {skipped[0]}")
    assert not skipped, f"skipped in the Triton suite: {skipped}"
    assert passed >= len(triton_cases.ATTENTION_CASES) + 10, output


@pytest.mark.parametrize("required", [False, True])
def test_a_missing_kernel_dependency_skips_and_fails_under_make(monkeypatch, required):
    monkeypatch.setenv("KVPILOT_REQUIRE_TOOLS", "1" if required else "0")
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match="needs kvpilot_no_such_module"):
        require_modules("numpy", "kvpilot_no_such_module")
    with pytest.raises(outcome, match="Triton suite skipped: case_a"):
        judge_suite(0, [], ["case_a", "case_b"], "")
    require_modules("pytest")  # present: neither skips nor fails


def test_a_suite_that_ran_nothing_or_skipped_part_fails():
    with pytest.raises(AssertionError):
        judge_suite(0, [], [], "")
    with pytest.raises(AssertionError, match="skipped in the Triton suite"):
        judge_suite(len(triton_cases.ATTENTION_CASES) + 10, [], ["case_a"], "")
    judge_suite(len(triton_cases.ATTENTION_CASES) + 10, [], [], "")
