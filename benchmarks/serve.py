"""Serving benchmark: a bounded-concurrency sweep against a running OpenAI-compatible server.

For each concurrency level C, ``--num-prompts`` streaming ``/v1/completions`` requests run with at most C
in flight. The workload is fixed and seeded: random token-id prompts of ``--input-len`` tokens (fresh ones per
level, so that no level reads another's from the prefix cache) and exactly ``--output-len`` output
tokens each (``ignore_eos``), so every level does the same work. Per request the
client records TTFT (request sent -> first token) and the arrival time of every token; tokens per SSE
chunk come from ``stream_options.continuous_usage_stats`` (a chunk carrying k tokens after a gap g counts
as k inter-token latencies of g/k). Per level: request and token throughput, TTFT and ITL p50/p99, e2e
latency. Output: a table, JSON under ``benchmarks/results/``, and a PNG when matplotlib is installed.

    kvpilot serve /models/llama-100m --served-model-name llama-100m &
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --concurrency 1,4,16,64 --num-prompts 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_output_tokens: int = 0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    num_failed: int
    duration_s: float
    request_throughput: float  # requests/s
    output_throughput: float  # generated tokens/s
    total_throughput: float  # (prompt + generated) tokens/s
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float  # per request: (e2e - ttft) / (output tokens - 1), averaged
    e2e_p50_s: float
    e2e_p99_s: float


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def make_prompts(num: int, input_len: int, max_token_id: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, max_token_id) for _ in range(input_len)] for _ in range(num)]


async def one_request(client: httpx.AsyncClient, args, prompt: list[int]) -> RequestResult:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    start = time.perf_counter()
    last = start
    seen = 0
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    return result
                usage = chunk.get("usage") or {}
                total = usage.get("completion_tokens")
                if total is None:  # a server without continuous usage: one token per chunk with text
                    total = seen + (1 if chunk.get("choices") and chunk["choices"][0].get("text") else 0)
                new = total - seen
                if new <= 0:
                    continue
                now = time.perf_counter()
                if seen == 0:
                    result.ttft_s = now - start
                    new_itl = new - 1  # tokens that arrived together with the first one
                else:
                    new_itl = new
                if new_itl > 0:
                    result.itls_s.extend([(now - last) / new_itl if seen else 0.0] * new_itl)
                seen, last = total, now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.num_output_tokens = seen
    result.ok = seen == args.output_len or not args.strict_length
    if not result.ok:
        result.error = f"got {seen} tokens, expected {args.output_len}"
    return result


async def run_level(
    args, prompts: list[list[int]], concurrency: int
) -> tuple[LevelResult, list[RequestResult]]:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=_headers(args), timeout=args.timeout, limits=limits
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                results.append(await one_request(client, args, prompt))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.num_output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls_s]
    tpots = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    level = LevelResult(
        concurrency=concurrency,
        num_requests=len(results),
        num_failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_throughput=(output_tokens + len(ok) * args.input_len) / duration,
        ttft_p50_ms=1e3 * percentile([r.ttft_s for r in ok], 50),
        ttft_p99_ms=1e3 * percentile([r.ttft_s for r in ok], 99),
        itl_p50_ms=1e3 * percentile(itls, 50),
        itl_p99_ms=1e3 * percentile(itls, 99),
        tpot_mean_ms=1e3 * (sum(tpots) / len(tpots)) if tpots else math.nan,
        e2e_p50_s=percentile([r.e2e_s for r in ok], 50),
        e2e_p99_s=percentile([r.e2e_s for r in ok], 99),
    )
    return level, results


def _headers(args) -> dict[str, str]:
    key = args.api_key or os.environ.get("KVPILOT_API_KEY") or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_info(args) -> dict:
    """What the server says about itself: version, model list, cache/model configuration from /metrics."""
    info: dict = {}
    with httpx.Client(base_url=args.base_url, headers=_headers(args), timeout=30) as client:
        info["version"] = client.get("/version").json()
        info["models"] = [m["id"] for m in client.get("/v1/models").json()["data"]]
        try:
            from prometheus_client.parser import text_string_to_metric_families

            for family in text_string_to_metric_families(client.get("/metrics").text):
                if family.name.endswith("_config_info"):
                    info[family.name] = family.samples[0].labels
        except ImportError:
            pass
    return info


def print_table(levels: list[LevelResult]) -> None:
    head = (
        f"{'conc':>5} {'reqs':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'TPOT':>7} {'e2e p50':>8}"
    )
    print(head)
    print(
        f"{'':>5} {'':>5} {'':>4} {'':>7} {'':>10} {'ms':>9} {'ms':>9} {'ms':>8} {'ms':>8} {'ms':>7} {'s':>8}"
    )
    for lv in levels:
        print(
            f"{lv.concurrency:>5} {lv.num_requests:>5} {lv.num_failed:>4} {lv.request_throughput:>7.2f} "
            f"{lv.output_throughput:>10.1f} {lv.ttft_p50_ms:>9.1f} {lv.ttft_p99_ms:>9.1f} "
            f"{lv.itl_p50_ms:>8.1f} {lv.itl_p99_ms:>8.1f} {lv.tpot_mean_ms:>7.1f} {lv.e2e_p50_s:>8.2f}"
        )


def plot(levels: list[LevelResult], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    conc = [lv.concurrency for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(conc, [lv.output_throughput for lv in levels], marker="o")
    axes[0].set(title="output throughput", xlabel="concurrency", ylabel="tokens/s", xscale="log")
    axes[1].plot(conc, [lv.ttft_p50_ms for lv in levels], marker="o", label="p50")
    axes[1].plot(conc, [lv.ttft_p99_ms for lv in levels], marker="o", label="p99")
    axes[1].set(title="time to first token", xlabel="concurrency", ylabel="ms", xscale="log")
    axes[2].plot(conc, [lv.itl_p50_ms for lv in levels], marker="o", label="p50")
    axes[2].plot(conc, [lv.itl_p99_ms for lv in levels], marker="o", label="p99")
    axes[2].set(title="inter-token latency", xlabel="concurrency", ylabel="ms", xscale="log")
    for ax in axes[1:]:
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the server's first)")
    ap.add_argument("--api-key", default=None, help="default: $KVPILOT_API_KEY or $OPENAI_API_KEY")
    ap.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-token-id", type=int, default=1000, help="prompt token ids are drawn below this")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--strict-length",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count a request with fewer than --output-len tokens as failed",
    )
    ap.add_argument("--label", default=None, help="name of the result files (default: the model name)")
    args = ap.parse_args(argv)
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    levels_wanted = [int(c) for c in args.concurrency.split(",") if c.strip()]

    info = server_info(args)
    args.model = args.model or info["models"][0]
    label = args.label or os.path.basename(args.model.rstrip("/")) or "model"
    print(
        f"server {args.base_url} (kvpilot {info['version'].get('version', '?')}), model {args.model}; "
        f"{args.num_prompts} requests x {args.input_len} prompt + {args.output_len} output tokens per level"
    )

    # Warm-up: first-request costs stay out of the numbers.
    asyncio.run(run_level(args, make_prompts(2, args.input_len, args.max_token_id, args.seed - 1), 2))
    levels = []
    for i, concurrency in enumerate(levels_wanted):
        # Fresh prompts per level (same lengths): no level reuses another's prompts from the prefix cache.
        prompts = make_prompts(args.num_prompts, args.input_len, args.max_token_id, args.seed + 1000 * i)
        level, results = asyncio.run(run_level(args, prompts, concurrency))
        levels.append(level)
        failures = [r.error for r in results if not r.ok]
        if failures:
            print(f"  concurrency {concurrency}: {len(failures)} failed, e.g. {failures[0]}")
    print_table(levels)

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"serve-{label}.json"
    out.write_text(
        json.dumps(
            {
                "benchmark": "serve",
                "isa": isa.describe(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "config": {k: v for k, v in vars(args).items() if k != "api_key"},
                "server": info,
                "levels": [asdict(lv) for lv in levels],
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {out}")
    png = out.with_suffix(".png")
    if plot(levels, png, f"kvpilot serve: {label}, {args.input_len} in / {args.output_len} out"):
        print(f"wrote {png}")
    else:
        print("matplotlib is not installed: skipping the PNG (pip install matplotlib to get it)")
    return 0 if all(lv.num_failed == 0 for lv in levels) else 1


if __name__ == "__main__":
    raise SystemExit(main())
