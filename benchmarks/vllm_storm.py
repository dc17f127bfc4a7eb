"""A real vLLM server under a preemption storm, and its ``/metrics`` recorded for ``kvpilot replay``.

Starts upstream vLLM (``python -m vllm.entrypoints.openai.api_server``, from vLLM's own virtual
environment, its cwd outside any checkout) on a local checkpoint with a KV pool far too small for the
load, and scrapes ``/metrics`` once a second through three phases:

1. calm: one short request at a time;
2. storm: many concurrent long requests (the pool holds a few of them; vLLM preempts the rest);
3. calm again.

Every scrape becomes one line in the operator's recording format (``kvpilot operator --record``), so
the file replays through the same policy the operator runs. The replay test in
``tests/operator/test_vllm_replay.py`` reads the committed recording this script made::

    python benchmarks/vllm_storm.py --vllm-python ~/.cache/kvpilot/vllm-venv-*/bin/python \\
        --out tests/operator/fixtures/vllm-0.32-cpu-storm.jsonl.gz

The near-threshold recording (``fixtures/vllm-0.32-cpu-near-threshold.jsonl.gz``: a pool just short of
24 streams of varied lengths, 2 s scrapes) came from::

    python benchmarks/vllm_storm.py --vllm-python ... --kv-blocks 224 --calm-s 12 --storm-s 90 \\
        --storm-concurrency 24 --scrape-interval 2 --max-tokens 96 --max-tokens-spread 288 \\
        --out tests/operator/fixtures/vllm-0.32-cpu-near-threshold.jsonl.gz

The preemption rate is steep in the pool's size here (200 blocks gave 7/s, 235 gave 0.4/s, 260 none).

Without ``--model`` it builds the ~7M random-weight checkpoint (``engine/models/synthetic.py``, size
``10m``: head size 32, the smallest vLLM's CPU attention supports).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def bytes_per_block(model_dir: Path, block_size: int = BLOCK_SIZE, dtype_bytes: int = 2) -> int:
    """KV bytes of one block: K and V, every layer, every KV head."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * block_size * dtype_bytes


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (loopback only)
        return response.read().decode()


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (loopback only)
        return json.loads(response.read())


class VllmServer:
    """One ``vllm`` API server process in its own process group, its log kept in ``log_path``."""

    def __init__(
        self, python: str, args: list[str], *, port: int, workdir: Path, env: dict[str, str] | None = None
    ):
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = workdir / f"vllm-{port}.log"
        full_env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [python, "-m", "vllm.entrypoints.openai.api_server", *args],
                cwd=workdir,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()

    def wait_healthy(self, timeout: float = 600.0) -> float:
        """Seconds until ``/health`` answered 200; raises with the log's tail if the server died."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                get(self.url + "/health", timeout=2)
                return time.monotonic() - self.started
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def vllm_server(python: str, args: list[str], *, port: int, workdir: Path, env=None) -> Iterator[VllmServer]:
    server = VllmServer(python, args, port=port, workdir=workdir, env=env)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def completion(url: str, model: str, prompt_tokens: int, max_tokens: int, seed: int) -> int:
    """One greedy completion of exactly ``max_tokens`` tokens; returns the tokens generated."""
    prompt = [(seed * 7919 + i * 31) % 2000 + 10 for i in range(prompt_tokens)]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    answer = post_json(url + "/v1/completions", body)
    return int(answer["usage"]["completion_tokens"])


def run_load(
    url: str,
    model: str,
    *,
    requests: int,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    duration_s: float | None = None,
    max_tokens_spread: int = 0,
) -> dict:
    """Send ``requests`` completions, ``concurrency`` at a time (with ``duration_s``: keep
    ``concurrency`` in flight until that many seconds have passed instead); count what came back and
    what failed. ``max_tokens_spread``: each request asks for ``max_tokens`` plus 0 to this many more,
    by its seed, so that the requests' KV needs drift apart instead of growing in step."""
    done = failed = tokens = 0

    def length(seed: int) -> int:
        return max_tokens + (seed * 7919) % (max_tokens_spread + 1)

    deadline = time.monotonic() + duration_s if duration_s is not None else None

    def stream(first_seed: int) -> tuple[int, int, int]:
        ok = bad = generated = 0
        seed = first_seed
        while time.monotonic() < deadline:
            try:
                generated += completion(url, model, prompt_tokens, length(seed), seed)
                ok += 1
            except (OSError, urllib.error.URLError, KeyError, ValueError):
                bad += 1
            seed += concurrency
        return ok, bad, generated

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        if deadline is not None:
            futures = [pool.submit(stream, i) for i in range(concurrency)]
            for future in concurrent.futures.as_completed(futures):
                ok, bad, generated = future.result()
                done, failed, tokens = done + ok, failed + bad, tokens + generated
            return {"completed": done, "failed": failed, "completion_tokens": tokens}
        futures = [
            pool.submit(completion, url, model, prompt_tokens, length(seed), seed) for seed in range(requests)
        ]
        for future in concurrent.futures.as_completed(futures):
            try:
                tokens += future.result()
                done += 1
            except (OSError, urllib.error.URLError, KeyError, ValueError):
                failed += 1
    return {"completed": done, "failed": failed, "completion_tokens": tokens}


def counter(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text (every label set)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Recorder(threading.Thread):
    """Scrapes ``/metrics`` every ``interval`` seconds into recording lines until stopped."""

    def __init__(self, url: str, pod: str, namespace: str, name: str, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.pod, self.namespace, self.name, self.interval = url, pod, namespace, name, interval
        self.lines: list[dict[str, Any]] = []
        self.phase = "calm"
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            now = time.time()
            try:
                text, error = get(self.url + "/metrics"), None
            except (OSError, urllib.error.URLError) as exc:
                text, error = None, f"{type(exc).__name__}: {exc}"
            line = {
                "time": round(now, 3),
                "tick": round(now, 3),
                "namespace": self.namespace,
                "inferenceService": self.name,
                "pod": self.pod,
                "ready": True,
                "metrics": text,
                "phase": self.phase,
            }
            if error:
                line["error"] = error
            self.lines.append(line)
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def server_args(model_dir: Path, served: str, port: int, kv_blocks: int) -> list[str]:
    kv_bytes = kv_blocks * bytes_per_block(model_dir)
    return [
        "--model", str(model_dir), "--served-model-name", served, "--host", HOST, "--port", str(port),
        "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", "32", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(kv_bytes),
        "--gpu-memory-utilization", "0.5", "--seed", "0",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the interpreter of vLLM's virtual environment")
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: build the ~7M one)")
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON Lines recording to write (gzipped when it ends in .gz)"
    )
    parser.add_argument("--kv-blocks", type=int, default=24, help=f"KV pool in {BLOCK_SIZE}-token blocks")
    parser.add_argument("--calm-s", type=float, default=12.0, help="seconds of each calm phase")
    parser.add_argument("--storm-requests", type=int, default=160)
    parser.add_argument("--storm-concurrency", type=int, default=16)
    parser.add_argument(
        "--storm-s", type=float, help="keep --storm-concurrency requests in flight this long (not a count)"
    )
    parser.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--max-tokens", type=int, default=224, help="output tokens of a storm request")
    parser.add_argument(
        "--max-tokens-spread", type=int, default=0, help="up to this many more, varying by request"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="vllm-storm-") as tmp:
        workdir = Path(tmp)
        model_dir = args.model
        if model_dir is None:
            from kvpilot.engine.models.synthetic import build_checkpoint

            model_dir = workdir / "model"
            build_checkpoint(model_dir, size="10m", seed=0, dtype="bfloat16")
        port = free_port()
        served = "llm"
        with vllm_server(
            args.vllm_python, server_args(model_dir, served, port, args.kv_blocks), port=port, workdir=workdir
        ) as server:
            recorder = Recorder(
                server.url, pod="llm-vllm-0", namespace="llm", name=served, interval=args.scrape_interval
            )
            recorder.start()
            calm_until = time.monotonic() + args.calm_s
            seed = 10_000
            while time.monotonic() < calm_until:  # one short request at a time
                completion(server.url, served, 16, 8, seed)
                seed += 1
            recorder.phase = "storm"
            storm = run_load(
                server.url,
                served,
                requests=args.storm_requests,
                concurrency=args.storm_concurrency,
                prompt_tokens=96,
                max_tokens=args.max_tokens,
                duration_s=args.storm_s,
                max_tokens_spread=args.max_tokens_spread,
            )
            recorder.phase = "calm-after"
            time.sleep(args.calm_s)
            recorder.stop()
            version = subprocess.run(
                [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                capture_output=True,
                text=True,
                cwd=workdir,
                check=True,
            ).stdout.strip()
    metrics = [line["metrics"] or "" for line in recorder.lines]
    summary = {
        "vllm": version,
        "kv_blocks": args.kv_blocks,
        "block_size": BLOCK_SIZE,
        "storm": storm,
        "storm_concurrency": args.storm_concurrency,
        "max_tokens": [args.max_tokens, args.max_tokens + args.max_tokens_spread],
        "scrape_interval_s": args.scrape_interval,
        "scrapes": len(recorder.lines),
        "preemptions_total": counter(metrics[-1], "vllm:num_preemptions_total") if metrics else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if args.out.suffix == ".gz" else open
    with opener(args.out, "wt") as out:
        for line in recorder.lines:
            out.write(json.dumps(line) + "\n")
    print(json.dumps(summary))
    return 0 if storm["failed"] == 0 and summary["preemptions_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
