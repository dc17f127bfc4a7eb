"""``kvpilot up --local`` as a user runs it (a process of its own), and ``make demo``'s short run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from kvpilot.cli import main
from tests.operator.conftest import REPO, wait_for
from tests.operator.local_support import leftovers, tiny_isvc, write_manifest

URL_LINE = re.compile(r"OpenAI API on (http://\S+)/v1")


def test_up_refuses_what_it_cannot_run(tmp_path, tiny_llama, make_isvc, capsys):
    manifest = write_manifest(tmp_path / "isvc.yaml", tiny_isvc(tiny_llama))
    assert main(["up", "-f", str(manifest)]) == 2
    assert "pass --local" in capsys.readouterr().err
    pvc = write_manifest(tmp_path / "pvc.yaml", make_isvc())
    assert main(["up", "-f", str(pvc), "--local"]) == 1
    assert "pvc:// model source needs a cluster" in capsys.readouterr().err
    invalid = tiny_isvc(tiny_llama)
    invalid["spec"]["engine"]["maxNumSeqs"] = 0
    assert main(["up", "-f", str(write_manifest(tmp_path / "bad.yaml", invalid)), "--local"]) == 1
    assert "maxNumSeqs" in capsys.readouterr().err


class Up:
    """``kvpilot up -f MANIFEST --local --port 0`` in a process of its own."""

    def __init__(self, manifest, tmp_path) -> None:
        self.log_path = tmp_path / "up.log"
        command = [sys.executable, "-m", "kvpilot.cli", "up", "-f", str(manifest), "--local", "--port", "0"]
        command += ["--log-dir", str(tmp_path / "logs"), "--scrape-interval", "1"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        match = wait_for(lambda: URL_LINE.search(self.log()), timeout=30, what="the front door")
        self.url = match.group(1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def replica_pids(self, count: int) -> list[int]:
        def ready():
            replicas = httpx.get(self.url + "/local/status", timeout=10).json()["replicas"]
            return (
                [r["pid"] for r in replicas]
                if len(replicas) == count and all(r["ready"] for r in replicas)
                else None
            )

        return wait_for(ready, timeout=90, what=f"{count} ready replica(s)")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_stops_every_replica_and_its_process_group(tmp_path, tiny_llama):
    manifest = write_manifest(tmp_path / "isvc.yaml", tiny_isvc(tiny_llama, replicas=2))
    up = Up(manifest, tmp_path)
    try:
        pids = up.replica_pids(2)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0, up.log()
        assert leftovers(pids) == [], "SIGTERM must stop every engine (process groups included)"
        assert "stopped: every replica has exited" in up.log()
    finally:
        up.close()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_demo_quick_closes_the_loop(tmp_path, tiny_llama):
    """``KVPILOT_DEMO_QUICK=1 make demo`` with a given model, as CI runs it (the module the target runs)."""
    env = {**os.environ, "KVPILOT_DEMO_QUICK": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvpilot.operator.demo.run",
            "--model",
            str(tiny_llama),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "PASS: the loop closed" in output and ">> remediation relieveMaxNumSeqs" in output
    summary = json.loads((tmp_path / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    threshold = 1.0
    assert before["preemptions_per_s_per_replica"] > threshold > after["preemptions_per_s_per_replica"]
    assert before["num_gpu_blocks"] < 56 <= after["num_gpu_blocks"], (
        "the planned change makes room for the load"
    )
    # Relief in place first, the restart lever after it, then the relief ends in place.
    relief, durable, restore = summary["remediations"]
    assert (relief["lever"], relief["appliedBy"]) == ("relieveMaxNumSeqs", "live")
    assert relief["to"] < relief["from"] == 16
    assert (durable["field"], durable["appliedBy"]) == ("gpuMemoryUtilization", "rollout")
    # The pool is calibrated so that one 0.05 rung is not enough: the plan goes straight to the fix.
    assert durable.get("path") == "plan", durable["reason"]
    assert durable["to"] >= durable["from"] + 0.08
    assert (restore["lever"], restore["appliedBy"], restore["from"], restore["to"]) == (
        "restoreMaxNumSeqs",
        "live",
        relief["to"],
        16,
    )
    # The relief came without a restart, before the rollout even began.
    assert summary["relief_applied_by"] == "live"
    assert 0 <= summary["storm_to_relief_s"] < durable["t"] - relief["t"]
    assert summary["rollout_lever"] == "raiseGpuMemoryUtilization" and summary["rollout_s"] > 0
    assert "storm -> relief" in output and "in place, no restart" in output
    assert summary["orphans"] == [] and summary["clean_exit"]
    # The rollover to the new args refuses and cuts short no request (latency belongs to the benchmark).
    assert summary["refused_requests"] == 0, "the rollover must refuse no request"
    # matplotlib is part of what `make venv` installs (the demo extra): the plot is always drawn.
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
