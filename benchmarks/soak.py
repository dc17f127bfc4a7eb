"""Soak: ``kvpilot serve`` under minutes of mixed, partly hostile load, in each preemption mode.

Per mode (``recompute``, ``swap``): start ``kvpilot serve`` on a small checkpoint with a KV pool small
enough to preempt all the time and a bounded waiting queue; warm it up with the load itself; then
``--clients`` processes (``soak_load``) send requests for ``--duration`` seconds over loopback while this
process sends a plain probe request every half second and samples the engine's RSS.
After the load: wait for every KV block to be free, then read the engine's metrics.

Reported per mode: requests sent, completed, refused (429/503 with Retry-After), rejected (the 4xx a
hostile request must get), aborted (the client left), 5xx and other failures; the engine's RSS at
start, after warm-up, at its peak and at the end; KV blocks in use after the drain and how long freeing
them took; preemptions; the probe's p50/p99 latency; the server's finished and aborted sequences beside
the clients' completed and left ones. Pass (:func:`check`): no 5xx and no other failure, the server's
sequence counts within the clients' bounds (:func:`sequence_accounting`), every block free within 5 s
of the end, and the RSS at the end within ``--rss-margin-mib`` MiB (or 10 %,
whichever is larger) of the RSS after warm-up. The engine runs in bfloat16 by default (``--dtype``),
as users run it: its packed matmuls run at a bounded set of token-count buckets
(``engine/models/layers.py`` ``token_bucket``), so the memory oneDNN keeps per shape stops growing once
they have all been seen.

    python benchmarks/soak.py                      # two modes x 120 s on the 10m checkpoint
    python benchmarks/soak.py --duration 1800      # longer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

try:
    from benchmarks.serve import percentile
    from benchmarks.soak_load import FAILURES, OUTCOMES, LoadConfig, client_main
    from benchmarks.throughput import ensure_model
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    from serve import percentile
    from soak_load import FAILURES, OUTCOMES, LoadConfig, client_main
    from throughput import ensure_model

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_NAME = "soak"
DRAIN_LIMIT_S = 5.0
_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass(frozen=True)
class SoakConfig:
    """One mode's run. The pool (``num_gpu_blocks`` x 16 tokens) is far below what ``max_num_seqs``
    sequences of the mix need, so preemption never stops; ``max_waiting_requests`` makes refusals."""

    model_dir: str
    preemption_mode: str = "recompute"
    duration_s: float = 120.0
    warmup_s: float = 15.0
    num_clients: int = 4
    concurrency: int = 8  # per client
    num_gpu_blocks: int = 48
    max_model_len: int = 512
    max_num_seqs: int = 16
    max_waiting_requests: int = 32
    swap_space_gib: float = 0.05
    # float32: on CPU, bfloat16 kernels keep memory per distinct batch shape (bounded by the shapes, not
    # by the requests), which an RSS check over minutes would mistake for growth per request.
    dtype: str = "bfloat16"
    probe_interval_s: float = 0.5
    # How long the blocks may take to come free after the load (the pass criterion). The suite's short
    # soak widens it: there, the counts (no block held once drained) are the check, not the seconds.
    drain_limit_s: float = DRAIN_LIMIT_S
    rss_margin_mib: float = 64.0
    seed: int = 0
    log_dir: str = "build/soak"


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Engine:
    """A ``kvpilot serve`` subprocess on a free loopback port, its log in ``log_path``."""

    def __init__(self, cfg: SoakConfig, log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop()
        script = Path(sys.executable).with_name("kvpilot")
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvpilot.cli"]
        cmd += ["serve", cfg.model_dir, "--host", "127.0.0.1", "--port", "0", "--device", "cpu"]
        cmd += ["--served-model-name", MODEL_NAME, "--disable-access-log", "--disable-log-stats"]
        cmd += [
            "--num-gpu-blocks-override",
            str(cfg.num_gpu_blocks),
            "--max-model-len",
            str(cfg.max_model_len),
        ]
        cmd += [
            "--max-num-seqs",
            str(cfg.max_num_seqs),
            "--max-waiting-requests",
            str(cfg.max_waiting_requests),
        ]
        cmd += ["--preemption-mode", cfg.preemption_mode, "--swap-space", str(cfg.swap_space_gib)]
        cmd += ["--dtype", cfg.dtype]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.pop("KVPILOT_API_KEY", None)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = ""

    def wait_ready(self, timeout_s: float = 180.0) -> Engine:
        deadline = time.monotonic() + timeout_s
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvpilot serve did not start:\n{self.log_path.read_text()[-3000:]}")
            match = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
            else:
                time.sleep(0.1)
        return self

    def metrics(self) -> dict[str, float]:
        """Sample values by name, summed over label sets, plus ``num_gpu_blocks``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:request_success_total":
                    out[f"success:{s.labels['finished_reason']}"] = s.value
                elif s.name == "vllm:cache_config_info":
                    out["num_gpu_blocks"] = float(s.labels["num_gpu_blocks"])
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 20 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._log.close()
        return self.proc.returncode


def run_load(cfg: SoakConfig, engine: Engine, duration_s: float, seed: int) -> dict[str, Any]:
    """``cfg.num_clients`` processes of load for ``duration_s``, while this process probes and samples
    RSS; returns the summed outcomes, the probe latencies and the RSS samples."""
    loads = [
        LoadConfig(engine.url, MODEL_NAME, duration_s, cfg.concurrency, seed * 1000 + i, cfg.max_model_len)
        for i in range(cfg.num_clients)
    ]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with ctx.Pool(cfg.num_clients) as pool:
        pending = pool.map_async(client_main, loads)
        probe = asyncio.run(_probe_and_sample(cfg, engine, pending))
        results = pending.get(timeout=duration_s + 300)
    counts = {k: sum(r["counts"].get(k, 0) for r in results) for k in OUTCOMES}
    seqs = {k: sum(r["seqs"].get(k, 0) for r in results) for k in ("completed", "left", "left_finished")}
    examples: dict[str, list[str]] = {}
    for r in results:
        for k, v in r["examples"].items():
            examples.setdefault(k, []).extend(v)
    return {"counts": counts, "examples": examples, "seqs": seqs, **probe}


async def _probe_and_sample(cfg: SoakConfig, engine: Engine, pending) -> dict[str, Any]:
    latencies, refused, failed, rss = [], 0, 0, []
    body = {"model": MODEL_NAME, "prompt": "probe", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
        while not pending.ready():
            rss.append(rss_mib(engine.proc.pid))
            t0 = time.monotonic()
            try:
                response = await http.post("/v1/completions", json=body)
            except httpx.HTTPError:
                failed += 1
            else:
                if response.status_code == 200:
                    latencies.append(time.monotonic() - t0)
                elif response.status_code == 503 and response.headers.get("retry-after"):
                    refused += 1
                else:
                    failed += 1
            await asyncio.sleep(max(0.0, cfg.probe_interval_s - (time.monotonic() - t0)))
    return {"probe_latencies_s": latencies, "probe_refused": refused, "probe_failed": failed, "rss_mib": rss}


def drain(engine: Engine, limit_s: float = DRAIN_LIMIT_S) -> tuple[float, dict[str, float]]:
    """Seconds until no block is held and nothing runs or waits (or ``limit_s`` passed), and the
    metrics then."""
    t0 = time.monotonic()
    while True:
        m = engine.metrics()
        idle = sum(m.get(k, 0.0) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting")) == 0
        if (idle and m.get("vllm:kv_cache_usage_perc", 1.0) == 0.0) or time.monotonic() - t0 > limit_s:
            return time.monotonic() - t0, m
        time.sleep(0.05)


def run_mode(cfg: SoakConfig) -> dict[str, Any]:
    """One mode's soak; the result (see the module docstring) with ``failures`` from :func:`check`."""
    engine = Engine(cfg, Path(cfg.log_dir) / f"engine-{cfg.preemption_mode}.log")
    try:
        engine.wait_ready()
        rss_start = rss_mib(engine.proc.pid)
        run_load(cfg, engine, cfg.warmup_s, cfg.seed + 1)
        drain(engine)
        rss_warm = rss_mib(engine.proc.pid)
        before = engine.metrics()
        t0 = time.monotonic()
        load = run_load(cfg, engine, cfg.duration_s, cfg.seed + 2)
        elapsed = time.monotonic() - t0
        drain_s, after = drain(engine, cfg.drain_limit_s)
        rss_end = rss_mib(engine.proc.pid)
        healthy = httpx.get(engine.url + "/health", timeout=10).status_code == 200
    finally:
        exit_code = engine.stop()
    lat = load.pop("probe_latencies_s")
    counts = load["counts"]
    seqs = load["seqs"]
    finished = {
        k: after[k] - before.get(k, 0)
        for k in after
        if k.startswith("success:") and after[k] > before.get(k, 0)
    }
    result = {
        "preemption_mode": cfg.preemption_mode,
        "duration_s": round(elapsed, 1),
        "sent": sum(counts.values()),
        **counts,
        "examples": load["examples"],
        "server_aborts": finished.get("success:abort", 0),
        "server_finished": sum(finished.values()),
        "completed_seqs": seqs["completed"],
        "left_seqs": seqs["left"],
        "left_finished_seqs": seqs["left_finished"],
        "preemptions": after.get("vllm:num_preemptions_total", 0)
        - before.get("vllm:num_preemptions_total", 0),
        "kv_blocks_in_use_after": round(
            after.get("vllm:kv_cache_usage_perc", 0) * after.get("num_gpu_blocks", 0)
        ),
        "drain_s": round(drain_s, 2),
        "rss_start_mib": round(rss_start, 1),
        "rss_warm_mib": round(rss_warm, 1),
        "rss_peak_mib": round(max([rss_warm, rss_end, *load["rss_mib"]]), 1),
        "rss_end_mib": round(rss_end, 1),
        "rss_series_mib": [round(v) for v in load["rss_mib"][:: max(1, len(load["rss_mib"]) // 40)]],
        "probe_p50_ms": round(1000 * percentile(lat, 50), 1),
        "probe_p99_ms": round(1000 * percentile(lat, 99), 1),
        "probe_ok": len(lat),
        "probe_refused": load["probe_refused"],
        "probe_failed": load["probe_failed"],
        "healthy_after": healthy,
        "exit_code": exit_code,
        "config": {k: v for k, v in vars(cfg).items() if k != "log_dir"},
    }
    result["failures"] = check(result, cfg.rss_margin_mib, cfg.drain_limit_s)
    return result


def sequence_accounting(r: dict[str, Any]) -> list[str]:
    """The server's finished sequences (``vllm:request_success_total`` over the load, every reason)
    against what the clients know. A request a client left may have been aborted, finished before the
    disconnect reached the server, or (a whole request that timed out in transit) never admitted, so
    the left ones give bounds, not an equality:

    * every completed sequence (the clients' and the probes') finished other than by abort;
    * the server finished no sequence that nobody sent: at most completed + left;
    * it aborted only what clients left, and not the streams whose every choice had finished before
      the client left them: at most ``left_seqs - left_finished_seqs``.
    """
    out = []
    completed = r["completed_seqs"] + r["probe_ok"]
    if r["server_finished"] - r["server_aborts"] < completed:
        out.append(
            f"{completed} sequences completed, the server finished {r['server_finished']} "
            f"({r['server_aborts']} of them aborted)"
        )
    if r["server_finished"] > completed + r["left_seqs"]:
        out.append(
            f"the server finished {r['server_finished']} sequences, more than the "
            f"{completed} completed and {r['left_seqs']} left"
        )
    if r["server_aborts"] > r["left_seqs"] - r["left_finished_seqs"]:
        out.append(
            f"the server aborted {r['server_aborts']} sequences; clients left "
            f"{r['left_seqs'] - r['left_finished_seqs']} unfinished ones"
        )
    return out


def check(r: dict[str, Any], rss_margin_mib: float, drain_limit_s: float = DRAIN_LIMIT_S) -> list[str]:
    """The pass criteria; one line per violation (empty: passed)."""
    out = [f"{r[k]} {k} request(s): {r['examples'].get(k, [])}" for k in FAILURES if r[k]]
    if r["probe_failed"]:
        out.append(f"{r['probe_failed']} probe request(s) failed")
    if r["kv_blocks_in_use_after"] or r["drain_s"] > drain_limit_s:
        out.append(f"{r['kv_blocks_in_use_after']} KV blocks still in use {r['drain_s']} s after the load")
    margin = max(rss_margin_mib, 0.1 * r["rss_warm_mib"])
    if r["rss_end_mib"] > r["rss_warm_mib"] + margin:
        out.append(
            f"RSS grew from {r['rss_warm_mib']} MiB after warm-up to {r['rss_end_mib']} (margin {margin:.0f})"
        )
    out += sequence_accounting(r)
    if not r["healthy_after"] or r["exit_code"] not in (0, -signal.SIGTERM):  # uvicorn re-raises it
        out.append(f"the engine was unhealthy after the load or exited {r['exit_code']}")
    return out


COLUMNS = (
    "sent completed refused rejected aborted server_error unexpected failed completed_seqs left_seqs "
    "left_finished_seqs server_finished server_aborts preemptions "
    "kv_blocks_in_use_after drain_s rss_start_mib rss_warm_mib rss_peak_mib rss_end_mib probe_p50_ms "
    "probe_p99_ms"
).split()


def print_table(results: list[dict[str, Any]]) -> None:
    modes = [r["preemption_mode"] for r in results]
    print(f"\n{'':24s}" + "".join(f"{m:>12s}" for m in modes))
    for col in COLUMNS:
        print(f"{col:24s}" + "".join(f"{r[col]:>12}" for r in results))
    for r in results:
        print(
            f"{r['preemption_mode']}: "
            + ("PASS" if not r["failures"] else "FAIL: " + "; ".join(r["failures"]))
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face model directory (default: a random checkpoint of --size)")
    ap.add_argument("--size", default="10m", choices=["10m", "100m"])
    ap.add_argument("--modes", default="recompute,swap")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load per mode")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the RSS baseline")
    ap.add_argument("--clients", type=int, default=4, help="client processes")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight per client")
    ap.add_argument("--num-gpu-blocks", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"])
    ap.add_argument("--max-waiting-requests", type=int, default=32)
    ap.add_argument("--rss-margin-mib", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = ap.parse_args(argv)
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    base = SoakConfig(
        model_dir=ensure_model(args),
        duration_s=args.duration,
        warmup_s=args.warmup,
        num_clients=args.clients,
        concurrency=args.concurrency,
        num_gpu_blocks=args.num_gpu_blocks,
        max_waiting_requests=args.max_waiting_requests,
        rss_margin_mib=args.rss_margin_mib,
        seed=args.seed,
        dtype=args.dtype,
    )
    results = []
    for mode in args.modes.split(","):
        print(f"soaking {mode} for {args.duration:g} s ...", flush=True)
        results.append(run_mode(replace(base, preemption_mode=mode)))
    print_table(results)
    out = args.out or RESULTS / f"soak-{Path(base.model_dir).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"isa": isa.describe(), "model": base.model_dir, "results": results}, indent=2))
    print(f"wrote {out}")
    return 0 if all(not r["failures"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
