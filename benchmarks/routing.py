"""Routing benchmark: the same workload through the front door under each picking policy, in one run.

``--replicas`` ``kvpilot serve`` processes (a random-weight checkpoint built here, prefix caching on,
one thread each) sit behind :class:`kvpilot.operator.local.frontdoor.FrontDoor`, started in this
process once per policy (``round_robin``, ``least_in_flight``, ``score``). The workload is seeded:
``--shared-fraction`` of the requests (70 %) open with one of 8 system prompts of ``--system-chars``
characters (several KV blocks), the rest with a system prompt of their own; each asks a short question
and streams exactly ``--output-len`` tokens. Requests arrive as a Poisson stream at ``--rate`` per
second, then ``--burst`` arrive at once. Within a round every policy gets the same arrivals and the
same pattern of shared prompts, in words of its own, so no policy reads another's prompts from the
replicas' prefix caches.

Per policy: TTFT p50/p99 (request sent -> first content chunk), the prefix-cache hit rate (the
increase over all replicas of ``vllm:prefix_cache_hits_total`` over that of
``vllm:prefix_cache_queries_total``), output tokens/s over the policy's wall time, and the door's
picks by reason. ``--rounds`` repeats every policy (in a rotated order, on new arrivals each round);
the table shows each number's median over the rounds, and the TTFT p99 over every request of every
round (pooled). Prints a table (the CPU's ISA line first) and
writes ``benchmarks/results/routing.json``.

    cd /tmp && python /path/to/benchmarks/routing.py --replicas 4 --requests 96
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench"
POLICIES = ("round_robin", "least_in_flight", "score")
NUM_SHARED_PROMPTS = 8
_LISTENING = re.compile(r"listening on (http://\S+)")
WORDS = (
    "tide river harbour lantern meadow granite orchard compass ledger signal beacon summit valley "
    "archive furnace quarry canvas mirror thistle copper engine rudder glacier prairie"
).split()


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def text_of(rng: random.Random, chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def make_workload(args, shape_seed: int, text_seed: int) -> list[tuple[float, list[dict]]]:
    """(arrival offset in s, chat messages) per request: a Poisson stream, then a burst at once.

    ``shape_seed`` draws the arrivals and which requests open with which shared prompt (the same for
    every policy in a round: the same offered load); ``text_seed`` draws the words (a policy's own, so
    that no policy finds another's prompts in the replicas' prefix caches)."""
    shape, words = random.Random(shape_seed), random.Random(text_seed)
    shared = [f"System {k}. " + text_of(words, args.system_chars) for k in range(NUM_SHARED_PROMPTS)]
    requests, at = [], 0.0
    for i in range(args.requests):
        if i < args.requests - args.burst:
            at += shape.expovariate(args.rate)
        elif i == args.requests - args.burst:
            at += 1.0
        pick = shape.randrange(NUM_SHARED_PROMPTS) if shape.random() < args.shared_fraction else None
        system = shared[pick] if pick is not None else text_of(words, args.system_chars)
        question = f"Question {i}: " + text_of(words, 80)
        requests.append((at, [{"role": "system", "content": system}, {"role": "user", "content": question}]))
    return requests


class Replica:
    """One ``kvpilot serve`` subprocess on a free port."""

    def __init__(self, model_dir: Path, log_path: Path, args) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        flags = [
            "--host", "127.0.0.1", "--port", "0", "--served-model-name", MODEL, "--device", "cpu",
            "--max-model-len", "2048", "--num-gpu-blocks-override", str(args.num_blocks),
            "--max-num-seqs", str(args.max_num_seqs), "--enable-prefix-caching",
        ]  # fmt: skip
        if args.max_num_batched_tokens:
            flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "kvpilot.cli", "serve", str(model_dir), *flags]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent
        )
        self.url = ""

    def wait_ready(self, timeout_s: float = 300.0) -> Replica:
        deadline = time.monotonic() + timeout_s
        while not (match := _LISTENING.search(self.log_path.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"kvpilot serve did not start:\n{self.log_path.read_text(errors='replace')}"
                )
            time.sleep(0.1)
        self.url = match.group(1)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


async def prefix_counters(client: httpx.AsyncClient, urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over the replicas."""
    hits = queries = 0.0
    for url in urls:
        text = (await client.get(url + "/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], args) -> tuple[float, int]:
    """(TTFT in s, output tokens) of one streamed chat completion."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": args.output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = math.nan, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            # The first output: a chat stream opens with a role-only event ("content": "") that the
            # server sends before the prefill, so an empty content is not a token yet.
            if math.isnan(ttft) and choices and choices[0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - start
    return ttft, tokens


async def run_policy(policy: str, urls: list[str], args, shape_seed: int, text_seed: int) -> dict:
    from kvpilot.operator.local.frontdoor import FrontDoor

    door = FrontDoor(lambda: urls, dict, port=0, logger=logging.getLogger("bench.door"), policy=policy)
    await door.start()
    workload = make_workload(args, shape_seed, text_seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.sleep(0.5)  # the scorer's first scrapes
        hits0, queries0 = await prefix_counters(client, urls)
        start = time.perf_counter()

        async def timed(at: float, messages: list[dict]):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            return await one_request(client, door.url, messages, args)

        results = await asyncio.gather(*(timed(at, msgs) for at, msgs in workload), return_exceptions=True)
        duration = time.perf_counter() - start
        hits1, queries1 = await prefix_counters(client, urls)
    await door.close()
    ok = [r for r in results if not isinstance(r, BaseException)]
    ttfts = [r[0] * 1000 for r in ok if not math.isnan(r[0])]
    tokens = sum(r[1] for r in ok)
    queries = queries1 - queries0
    return {
        "policy": policy,
        "requests": len(workload),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "ttfts_ms": ttfts,
        "prefix_cache_hit_rate": (hits1 - hits0) / queries if queries else math.nan,
        "output_tokens_per_s": tokens / duration,
        "served": {f"replica{urls.index(u)}": n for u, n in door.served.items()},
        "picks": dict(door.picks),
    }


def summarize(policy: str, runs: list[dict]) -> dict:
    """One policy's row: the median over its rounds of each number, failures summed, picks and
    requests served summed over the rounds."""
    row: dict = {"policy": policy, "rounds": len(runs), "failed": sum(r["failed"] for r in runs)}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "prefix_cache_hit_rate", "output_tokens_per_s", "duration_s"):
        row[key] = statistics.median(r[key] for r in runs)
    # The tail over every request of every round: a p99 over one round's few requests is its maximum.
    pooled = [t for r in runs for t in r["ttfts_ms"]]
    row["pooled_ttft_p50_ms"] = percentile(pooled, 50)
    row["pooled_ttft_p99_ms"] = percentile(pooled, 99)
    for key in ("served", "picks"):
        total: dict[str, int] = {}
        for run in runs:
            for name, count in run[key].items():
                total[name] = total.get(name, 0) + count
        row[key] = total
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4, help="engine replicas (2-4)")
    ap.add_argument("--size", default="10m", help="synthetic checkpoint size (engine/models/synthetic.py)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--burst", type=int, default=24, help="requests of the total arriving at once at the end")
    ap.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals per second before the burst")
    ap.add_argument("--shared-fraction", type=float, default=0.7)
    ap.add_argument("--system-chars", type=int, default=1500)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks (16 tokens) per replica")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="the replicas' token budget per step (0: the engine's default, 8192)",
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every policy; the table shows medians")
    ap.add_argument("--out", type=Path, default=RESULTS / "routing.json")
    args = ap.parse_args()
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    machine = f"{os.cpu_count()} CPU cores; every replica, the door and the client share them"
    print(f"{machine}; {args.replicas} replicas of the {args.size} checkpoint", flush=True)
    from kvpilot.engine.models.synthetic import build_checkpoint

    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        model = build_checkpoint(Path(tmp) / "model", size=args.size, max_position_embeddings=2048)
        replicas = [Replica(model, Path(tmp) / f"replica-{i}.log", args) for i in range(args.replicas)]
        try:
            urls = [r.wait_ready().url for r in replicas]
            policies = args.policies.split(",")
            runs: list[dict] = []
            for round_ in range(args.rounds):
                # Each round runs every policy, in an order rotated per round (no policy always first
                # on a cold box), each on its own words.
                order = policies[round_ % len(policies) :] + policies[: round_ % len(policies)]
                for policy in order:
                    shape_seed = args.seed * 1000 + round_
                    text_seed = shape_seed * 10 + policies.index(policy)
                    run = asyncio.run(run_policy(policy, urls, args, shape_seed, text_seed))
                    run["round"] = round_
                    runs.append(run)
                    print(
                        f"  round {round_} {policy:<15} TTFT p50 {run['ttft_p50_ms']:7.1f} ms  "
                        f"p99 {run['ttft_p99_ms']:7.1f} ms  hits {run['prefix_cache_hit_rate']:6.1%}  "
                        f"{run['output_tokens_per_s']:6.1f} tok/s",
                        flush=True,
                    )
            rows = [summarize(policy, [r for r in runs if r["policy"] == policy]) for policy in policies]
        finally:
            for replica in replicas:
                replica.stop()
    print(
        f"{args.requests} requests ({args.burst} in a burst), {args.shared_fraction:.0%} on 8 shared system"
    )
    print(f"prompts of {args.system_chars} chars, {args.output_len} output tokens each")
    print(f"medians over {args.rounds} round(s):")
    print(
        "policy          | TTFT p50 ms | TTFT p99 ms | pooled p99 ms | prefix hit rate | output tok/s "
        "| failed | served"
    )
    for row in rows:
        print(
            f"{row['policy']:<15} | {row['ttft_p50_ms']:11.1f} | {row['ttft_p99_ms']:11.1f} | "
            f"{row['pooled_ttft_p99_ms']:13.1f} | "
            f"{row['prefix_cache_hit_rate']:15.1%} | {row['output_tokens_per_s']:12.1f} | "
            f"{row['failed']:6d} | {row['served']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(
        json.dumps(
            {"isa": isa.describe(), "machine": machine, "config": config, "rows": rows, "runs": runs},
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
