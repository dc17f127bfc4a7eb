"""``kvpilot up --local`` with ``spec.runtime: vllm``: a real vLLM server started by the local kubelet
with exactly the rendered args (host, port and model directory made local), serving through the front
door, its KV pool the one the spec asks for, and nothing left behind after the stop."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from benchmarks.vllm_storm import bytes_per_block
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.local import process
from kvpilot.operator.remediation.metrics import capacity_of, parse_scrape
from kvpilot.operator.render.builders import build_deployment
from tests.operator.conftest import wait_for
from tests.operator.local_support import PlatformThread, leftovers
from tests.operator.test_vllm_args import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BLOCKS = 48


def isvc(model: Path, budget: int) -> dict:
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "local"},
        "spec": {
            "runtime": "vllm",
            "model": {"source": f"file://{model}", "name": "llm"},
            "resources": {"gpusPerReplica": 0, "cpu": "1"},
            "engine": {
                "gpuMemoryUtilization": 0.1,
                "cpuMemoryBudgetBytes": budget,
                "blockSize": 32,
                "maxModelLen": 512,
                "enablePrefixCaching": False,
                "dtype": "bfloat16",
            },
            "probes": {"startupTimeoutSeconds": 600},
            "remediation": {"mode": "Off"},
        },
    }


def test_kvpilot_up_local_runs_vllm_with_the_rendered_args(tmp_path: Path) -> None:
    from kvpilot.engine.models.synthetic import build_checkpoint

    python = vllm_python()
    model = build_checkpoint(tmp_path / "model", size="10m", seed=0, dtype="bfloat16")
    manifest = isvc(model, int(BLOCKS * bytes_per_block(model) / 0.1))
    platform = PlatformThread(manifest, tmp_path, vllm_python=python).start()
    pids: list[int] = []
    try:
        (replica,) = wait_for(lambda: platform.ready_replicas(1), timeout=420, what="a ready vLLM replica")
        pids.append(replica["pid"])
        # The process runs vLLM's module with the container's args as the kubelet makes them local.
        cmdline = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")[:-1]
        argv = [part.decode() for part in cmdline]
        (container,) = build_deployment(resolve(manifest))["spec"]["template"]["spec"]["containers"]
        port = int(replica["url"].rsplit(":", 1)[1])
        expected, _ = process.local_args(container, port, gpu=False)
        assert argv == [python, "-m", "vllm.entrypoints.openai.api_server", *expected]
        # The pool the spec asked for, by vLLM's own account.
        text = httpx.get(replica["url"] + "/metrics", timeout=10).text
        assert capacity_of(parse_scrape(text, 0.0)).num_gpu_blocks == BLOCKS
        # Served through the front door, under the spec's model name.
        answer = httpx.post(
            platform.url + "/v1/completions",
            json={"model": "llm", "prompt": "hello", "max_tokens": 8, "ignore_eos": True},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        assert platform.status()["frontDoor"]["served"]
    finally:
        platform.stop()
    assert leftovers(pids) == []
