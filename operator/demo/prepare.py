"""The demo's set-up: a model, a calibration probe, and an InferenceService with a KV pool too small.

On CPU the KV pool is ``gpuMemoryUtilization x cpuMemoryBudgetBytes - weights - activations``. One probe
``kvpilot serve`` (fraction 1.0 of a known budget) reports the pool it got, and so what weights and
activations take; from that :func:`calibrate` picks a budget and a fraction that leave ~20 blocks of 16
tokens while the demo's load needs 8 x 7 = 56, each 0.01 of the fraction adding ~4 blocks: the load fits
~0.09 above the starting fraction, so one 0.05 step of the remediation ladder (~40 blocks) leaves the
storm on and a second (~60) ends it, while a plan can go there in one change. The limit
(``maxGpuMemoryUtilization``) is 0.15 above the start, room for the plan's safety margin. A model whose
weights take more than ~300 blocks cannot start that low (the fraction stays <= 0.85), so each step
adds more blocks: the requests then run longer (up to 10 blocks, 144 generated tokens, so that two
still fit the starting pool under a relief), the load fitting ~1.7 steps above the start.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvpilot.engine.config import to_cli_args
from kvpilot.operator.api import names
from kvpilot.operator.api.spec import engine_snake_args
from kvpilot.operator.local.process import die_with_parent
from kvpilot.operator.remediation.metrics import parse_scrape

THRESHOLD = 1.0  # preemptions/s per replica that count as a storm
SHAPE = {"maxModelLen": 256, "maxNumBatchedTokens": 256, "maxNumSeqs": 16, "enablePrefixCaching": False}
BLOCKS_BEFORE = 20.5  # the starting pool; two requests still fit under a relief
BLOCKS_PER_HUNDREDTH = 4  # blocks each 0.01 of the fraction adds: the load fits ~0.09 above the start
MAX_START_FRACTION = 0.85
LIMIT_ABOVE_START = 0.15  # maxGpuMemoryUtilization: three ladder rungs, or a plan with its margin
LADDER_STEP = 0.05  # the remediation ladder's step of the memory fraction (levers.GPU_MEMORY_STEP)
BLOCK_SIZE = 16
CONCURRENCY = 8  # the demo's streaming clients
PROMPT_LEN = 16  # tokens per prompt
STREAM_BLOCKS = 7  # blocks a request holds at full length (112 tokens: 96 generated) ...
RUNGS_TO_FIT = 1.7  # ... or more, so that the load fits this many ladder steps above the start
STREAM_BLOCKS_MAX = int(BLOCKS_BEFORE // 2)  # two requests still fit the starting pool
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LISTEN_LINE = re.compile(r"listening on (http://\S+)")


def ensure_model(model: str | None, out: Path, size: str) -> Path:
    """``model`` when given, else the synthetic checkpoint of ``size`` under ``out`` (built once)."""
    if model:
        path = Path(model).resolve()
        if not (path / "config.json").is_file():
            raise SystemExit(f"error: {model} is not a Hugging Face model directory (no config.json)")
        return path
    path = (out / f"llama-{size}").resolve()
    if not (path / "config.json").is_file():
        print(f"building a random-weight Llama checkpoint ({size}) in {path} (once)...", flush=True)
        command = [sys.executable, "-m", "kvpilot.engine.models.synthetic", "--size", size]
        subprocess.run([*command, "--dtype", "float32", "--out", str(path)], check=True, capture_output=True)
    return path


def start_process(command: list[str], log_path: Path, new_session: bool) -> subprocess.Popen:
    """Start ``command`` (one intra-op thread), output to ``log_path``; it dies with this process."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=new_session,
            preexec_fn=die_with_parent(os.getpid()),
        )


def wait_for_line(proc: subprocess.Popen, log_path: Path, pattern: re.Pattern, timeout_s: float) -> str:
    """The first group of ``pattern`` once it appears in the log; SystemExit when ``proc`` ends first."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text(errors="replace")
        match = pattern.search(text)
        if match:
            return match.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(text.splitlines()[-15:])
            raise SystemExit(f"error: {proc.args[2:4]} did not start (see {log_path}):\n{tail}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen, sig: int, timeout_s: float) -> int:
    """Signal a process this demo started; SIGKILL after ``timeout_s``; its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def calibrate(model: Path, out: Path) -> dict[str, Any]:
    """Probe the engine once; the budget and memory fraction that undersize the pool (module docstring)."""
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    probe_budget = int(weights * 1.5) + (512 << 20)
    engine = {**SHAPE, "device": "cpu", "cpuMemoryBudgetBytes": probe_budget, "gpuMemoryUtilization": 1.0}
    args = [str(model), "--port", "0", "--disable-log-stats", *to_cli_args(engine_snake_args(engine))]
    log_path = out / "logs" / "calibration-probe.log"
    proc = start_process([sys.executable, "-m", "kvpilot.cli", "serve", *args], log_path, new_session=True)
    try:
        url = wait_for_line(proc, log_path, LISTEN_LINE, 180)
        with urllib.request.urlopen(url + names.METRICS_PATH, timeout=10) as response:
            scrape = parse_scrape(response.read().decode(), time.time())
    finally:
        stop_process(proc, signal.SIGTERM, 15)
    cache, info = scrape.cache_info, scrape.model_info
    bytes_per_block = (
        2
        * int(info["num_hidden_layers"])
        * int(cache["block_size"])
        * int(info["num_key_value_heads"])
        * int(info["head_dim"])
        * DTYPE_BYTES[info["dtype"]]
    )
    fixed = probe_budget - int(cache["num_gpu_blocks"]) * bytes_per_block  # weights + activations
    # Each 0.01 of the fraction adds BLOCKS_PER_HUNDREDTH blocks, unless the fraction would then start
    # above MAX_START_FRACTION (a large model): a larger budget, so more blocks per step.
    needed = fixed + BLOCKS_BEFORE * bytes_per_block
    budget = max(round(100 * BLOCKS_PER_HUNDREDTH * bytes_per_block), round(needed / MAX_START_FRACTION))
    fraction = round(needed / budget, 4)
    limit = min(1.0, round(fraction + LIMIT_ABOVE_START, 4))

    def blocks_at(value: float) -> int:
        return int((round(value, 4) * budget - fixed) // bytes_per_block)

    rungs = [blocks_at(min(limit, fraction + k * LADDER_STEP)) for k in (1, 2)]
    # Where a step adds more blocks than the BLOCKS_PER_HUNDREDTH calibration gives (a fraction that
    # starts at MAX_START_FRACTION), requests run longer, so that one step still leaves the storm on.
    step_blocks = blocks_at(fraction + LADDER_STEP) - blocks_at(fraction)
    stream_blocks = max(STREAM_BLOCKS, math.ceil((BLOCKS_BEFORE + RUNGS_TO_FIT * step_blocks) / CONCURRENCY))
    stream_blocks = min(stream_blocks, STREAM_BLOCKS_MAX)
    load_blocks = CONCURRENCY * stream_blocks
    fits = next((k / 100 for k in range(1, 101) if blocks_at(fraction + k / 100) >= load_blocks), None)
    return {
        "budget": budget,
        "fraction": fraction,
        "max_fraction": limit,
        "bytes_per_block": bytes_per_block,
        "fixed_bytes": fixed,
        "expected_blocks": [blocks_at(fraction), *rungs],
        "load_blocks": load_blocks,
        "max_tokens": stream_blocks * BLOCK_SIZE - PROMPT_LEN,
        "fits_above_start": fits,
        "dtype": info["dtype"],
    }


def write_manifest(
    path: Path,
    model: Path,
    cal: dict[str, Any],
    window_s: int,
    cooldown_s: int,
    live: bool = True,
    plan: bool = True,
) -> dict:
    """The demo's InferenceService (also usable by hand: ``kvpilot up -f`` it). ``live``:
    ``spec.remediation.liveLevers`` (relief in place first, then the restart lever); ``plan``:
    ``spec.remediation.plan.enabled`` (false: the ladder alone, one 0.05 rung per cooldown)."""
    isvc = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {
            "model": {"source": f"file://{model}", "name": model.name},
            "image": "kvpilot-engine:local",
            "replicas": 1,
            "resources": {"gpusPerReplica": 0, "cpu": "1"},
            "engine": {
                "device": "cpu",
                "cpuMemoryBudgetBytes": cal["budget"],
                "gpuMemoryUtilization": cal["fraction"],
                **SHAPE,
            },
            "rollout": {"maxSurge": 1, "maxUnavailable": 0},
            "remediation": {
                "mode": "Auto",
                "preemptionRate": THRESHOLD,
                "window": f"{window_s}s",
                "cooldown": f"{cooldown_s}s",
                "liveLevers": live,
                "plan": {"enabled": plan},
                "limits": {
                    "maxGpuMemoryUtilization": cal["max_fraction"],
                    "minReplicas": 1,
                    "maxReplicas": 1,
                    # A relief may go down to what the pool holds (2 requests of 7-10 blocks in ~20).
                    "minMaxNumSeqs": 1,
                    "minMaxNumBatchedTokens": 128,
                },
            },
        },
    }
    header = (
        "# Written by `make demo`: a KV pool too small for the load (operator/demo/prepare.py).\n"
        "# On CPU, gpuMemoryUtilization is a fraction of cpuMemoryBudgetBytes: raising it grows the pool.\n"
        f"#   kvpilot up -f {path} --local\n"
    )
    path.write_text(header + yaml.safe_dump(isvc, sort_keys=False))
    return isvc
