"""Cold start from zero: time to first token for a request that arrives while a service is at zero
replicas, against the same request on a warm replica, in one run.

The local platform (``kvpilot up --local``'s :class:`LocalPlatform`, in this process) serves a
random-weight checkpoint built here with ``limits.minReplicas: 0`` and a short ``idleAfter``. Each
round: a warm streamed request (TTFT on the running replica), then no traffic until remediation has
scaled the service to zero and the replica's process is gone, then the same streamed request through
the front door, which holds it, asks for a replica (``wake-requested-at``), and releases it once the
new replica is ready. Reported per round and as medians: the cold TTFT (request sent -> first content
chunk), split into the wait for a ready replica (the door's hold) and the rest, and the warm TTFT.
What a cold start costs here is mostly ``kvpilot serve`` starting (load, KV pool, warm-up) plus
remediation's tick (``--scrape-interval``); on a GPU the model load dominates. Prints a table (the
CPU's ISA line first) and writes ``benchmarks/results/cold_start.json``.

    cd /tmp && python /path/to/benchmarks/cold_start.py --rounds 3 --size 10m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench"
PROMPT = "Tell me about the harbour at dawn, the lanterns and the tide."


def isvc(model: Path, scrape_s: float, idle_after_s: float) -> dict[str, Any]:
    from kvpilot.operator.api import names

    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": MODEL, "namespace": "bench"},
        "spec": {
            "model": {"source": f"file://{model}", "name": MODEL},
            "replicas": 1,
            "resources": {"gpusPerReplica": 0, "cpu": "1"},
            "engine": {"device": "cpu", "maxModelLen": 512, "maxNumBatchedTokens": 512},
            "probes": {"startupTimeoutSeconds": 300},
            "remediation": {
                "mode": "Auto",
                "window": f"{max(2.0, 3 * scrape_s):g}s",
                "cooldown": f"{max(2.0, 3 * scrape_s):g}s",
                "idleAfter": f"{idle_after_s:g}s",
                "limits": {"minReplicas": 0, "maxReplicas": 1},
            },
        },
    }


def first_output(event: dict) -> bool:
    """Whether a chat stream's event carries output: the opening role-only event ("content": ""),
    sent before the prefill, does not."""
    choices = event.get("choices") or []
    return bool(choices and choices[0].get("delta", {}).get("content"))


async def first_token(client: httpx.AsyncClient, url: str, max_tokens: int) -> float:
    """Seconds from sending a streamed chat request to its first content chunk (raises on a failure)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if ttft is None and line.startswith("data: {") and first_output(json.loads(line[6:])):
                ttft = time.perf_counter() - sent
    if ttft is None:
        raise RuntimeError("no content streamed")
    return ttft


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g}s")
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace, model: Path, log_dir: Path) -> list[dict[str, float]]:
    from kvpilot.operator.local.platform import LocalPlatform

    platform = LocalPlatform(
        isvc(model, args.scrape_interval, args.idle_after),
        log_dir=log_dir,
        port=0,
        scrape_interval=args.scrape_interval,
        status_interval=3600,
        logger=logging.getLogger("bench"),
    )
    url = await platform.start()
    rounds = []
    try:
        async with httpx.AsyncClient(timeout=600) as client:
            await wait_for(lambda: bool(platform.endpoints()), 300, "a ready replica")
            await first_token(client, url, args.max_tokens)  # warm-up
            for k in range(args.rounds):
                warm = await first_token(client, url, args.max_tokens)
                await wait_for(lambda: not platform.kubelet.snapshot(), 300, "scale to zero")
                held_before = sum(platform.door.hold.held_seconds)
                cold = await first_token(client, url, args.max_tokens)
                held = sum(platform.door.hold.held_seconds) - held_before
                row = {"round": k + 1, "cold_ttft_s": cold, "held_s": held, "after_ready_s": cold - held}
                row["warm_ttft_s"] = warm
                rounds.append(row)
                print(
                    f"round {k + 1}: cold TTFT {cold:.2f} s (held {held:.2f} s for a replica, "
                    f"{cold - held:.3f} s after it) vs warm {warm * 1000:.0f} ms",
                    flush=True,
                )
    finally:
        await platform.close()
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10m", help="synthetic checkpoint size (engine/models/synthetic.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--scrape-interval", type=float, default=1.0, help="remediation's tick, seconds")
    ap.add_argument("--idle-after", type=float, default=3.0, help="spec.remediation.idleAfter, seconds")
    ap.add_argument("--out", type=Path, default=RESULTS / "cold_start.json")
    args = ap.parse_args()
    from kvpilot.engine.models.synthetic import build_checkpoint
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        model = build_checkpoint(Path(tmp) / "model", size=args.size, max_position_embeddings=2048)
        rounds = asyncio.run(run(args, model, Path(tmp) / "logs"))
    summary = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("cold_ttft_s", "held_s", "after_ready_s", "warm_ttft_s")
    }
    print(f"{args.size} checkpoint, scrape interval {args.scrape_interval:g} s, medians of {len(rounds)}:")
    print("cold TTFT s | held for a replica s | after ready s | warm TTFT ms")
    print(
        f"{summary['cold_ttft_s']:11.2f} | {summary['held_s']:20.2f} | {summary['after_ready_s']:13.3f} | "
        f"{summary['warm_ttft_s'] * 1000:12.1f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = {"isa": isa.describe(), "config": config, "rounds": rounds, "median": summary}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
