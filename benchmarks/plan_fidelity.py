"""Does ``kvpilot plan`` predict what the engine really does? Predicted vs measured, side by side.

For each workload a real ``kvpilot serve`` (CPU, a tiny random-weight checkpoint, one intra-op
thread) runs under the settings in force and two other settings, each for a fixed time under a client
load, its ``/metrics`` scraped every second into a recording (the lines ``kvpilot operator --record``
writes). Only the recordings of the settings in force are given to the plan; it rebuilds the
workload and the step-time model from them and simulates every setting. Per setting the table gives predicted
and measured preemptions/s, output tok/s (over the span from the first request sent to the last
answered), TTFT p99 and the storm call (the preemption rate over some ``window`` above
``preemptionRate``, as ``spec.remediation`` says), with the error of each. Goals: throughput within
15 %, TTFT p99 within 25 %, every storm call right.

TTFT p99 is given three ways. The goal is checked on the engine's own TTFT of every request (arrival
at the engine to its first token, from ``kvpilot serve --request-trace``, which the plan is not
given): the quantity ``vllm:time_to_first_token_seconds`` and so ``spec.remediation.slo`` measure.
Beside it, the same read from the histogram as Prometheus reads it (``histogram_quantile``, with the
simulated TTFTs binned into the same buckets; interpolation within a bucket moves both sides by up to
its width, so a p99 near a bucket bound swings), and the client-measured p99, which adds the HTTP
round trip and, on a small box, the client's own event loop, which no engine model can see (the
storm's 8 streams: 131 ms against the engine's 115; the steady mix: 7 against 4; the shared-prefix
workload's 2-4 KB request bodies: 45 against 15, a gap not traced yet). The recorded vLLM storm has
no trace: its goal is checked on the histogram.

Each workload's settings in force run twice. The second run is given to nothing: its row sets the
same prediction against another measurement, and the two measured TTFT p99s show how far apart two
runs of one setting land on this box. With ``--repeat N`` every setting runs N times instead, round
by round (a slow stretch of the box falls on one run of several settings, not on every run of one);
the goals are checked on the median of each setting's runs, TTFT p99 on that of every request of
its runs together (some 1,100 for an open-loop workload, where the median of three runs' own p99s,
also printed, rests on three samples of the fourth slowest of 370), and each run's figures are
printed beside the prediction with the goals checked against one run at a time. The plan is given the
recordings of every run of the settings in force, laid end to end as one longer recording
(``kvpilot plan --recording A --recording B ...``): three stretches of the node's speed rather than
one, and three times the requests behind each predicted quantile (``--plan-from first``: the first
run's alone, as before). The ``TRACE`` column is the TTFT p99 error of the plan given those runs'
request traces as well (``kvpilot plan --trace``): each round's clients draw their own arrivals and
lengths (seed + round), the same in every setting of the round, so the traces of all rounds hold the
very requests each setting served, where the recording alone gives their distributions. (Reports
without ``client_seed_per_round`` ran every round on the same requests: one sample of the traffic
measured three times.)

Workloads:

* ``storm``: the demo's (8 closed-loop streaming clients, 16-token prompts, 96 tokens each, a pool
  of ~14 blocks of 16 tokens where the load needs 56);
* ``long``: open-loop arrivals (3/s) of 300-1500-token prompts with 8-24 output tokens
  (max_model_len 2048);
* ``steady``: open-loop mixed lengths (3/s) on a pool large enough for them (no storm in force);
* ``prefix``: open-loop (3/s) prompts of 300-800 tokens whose first 256 are the same in every request
  (a system prompt), prefix caching on: the plan sees only the recorded hit rate;
* ``vllm``: the recorded vLLM 0.32 storm (``tests/operator/fixtures/vllm-0.32-cpu-storm.jsonl.gz``):
  predicted vs recorded for the settings in force only (no other vLLM setting can be run here).

The open-loop workloads run 4.8 times as long as the storm (120 s by default), so that their TTFT
p99 rests on some 360 requests, the fourth slowest, rather than on the second slowest of 180 (where
two queueing events decide it and the same requests measured 27-39 ms in four runs).

Closed-loop clients send their next request when the previous one ends, so a faster setting gets
more requests; the plan replays the recorded arrival times (capped at the recorded concurrency), or,
where the recorded queue never emptied, every request as soon as the cap allows and the clients have
turned round (closed-loop). Open-
loop workloads are planned with ``open_loop``.

    python benchmarks/plan_fidelity.py            # ~30 minutes on 2 cores; JSON to results/plan_fidelity.json
    python benchmarks/plan_fidelity.py --repeat 3 # every setting three times, the goals on the medians
    python benchmarks/plan_fidelity.py --quick    # shorter runs
    python benchmarks/plan_fidelity.py --keep runs --out first.json            # keep the recordings
    python benchmarks/plan_fidelity.py --keep runs --replan first.json --out again.json
                                                  # no engine run: plan the kept runs again
    python benchmarks/plan_fidelity.py --keep runs --replan first.json --traffic-samples 12 --out t.json
                                                  # and where each p99 falls among 12 fresh samples
                                                  # of the open-loop clients' own process
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import itertools
import json
import math
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

try:
    from tests.operator.test_plan_cli import FIXTURE
    from tests.operator.test_plan_cli import isvc as vllm_isvc
except ImportError:  # run as a script: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.operator.test_plan_cli import FIXTURE
    from tests.operator.test_plan_cli import isvc as vllm_isvc

from benchmarks import fidelity_cpu  # the repository root is on the path
from benchmarks.fidelity_traffic import quantile_interval, rank_of, traffic_p99s
from kvpilot.engine import metrics_names as m
from kvpilot.engine.config import to_cli_args
from kvpilot.engine.server.cli import positive_int
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.spec import engine_snake_args
from kvpilot.operator.demo.prepare import start_process, stop_process, wait_for_line
from kvpilot.operator.plan.calibrate import calibrate
from kvpilot.operator.plan.candidates import MIN_LATENCY_SAMPLES, Candidate, context_of, evaluate
from kvpilot.operator.plan.recording import read_recording, read_recordings
from kvpilot.operator.plan.trace import with_trace
from kvpilot.operator.plan.workload import workload_from_scrapes

RESULTS = Path(__file__).resolve().parent / "results"
LISTEN_LINE = re.compile(r"listening on (http://\S+)")
THRESHOLD = 1.0  # preemptions/s per replica that count as a storm (spec.remediation.preemptionRate)
WINDOW_S = 10.0  # spec.remediation.window
SERVED = "llm"
GOALS = {"output_tokens_per_s": 0.15, "ttft_p99_s": 0.25}
AGAIN = "in force, run again"


@dataclasses.dataclass(frozen=True)
class Load:
    """The clients: ``closed`` (``concurrency`` streams back to back) or open-loop Poisson arrivals at
    ``rate`` per second; lengths uniform in the given inclusive ranges, the first ``shared_prefix``
    prompt tokens the same in every request."""

    kind: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    concurrency: int = 0
    rate: float = 0.0
    # Every prompt starts with the same this many tokens (a system prompt), within its drawn length.
    shared_prefix: int = 0


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting to run: a label, the pool in blocks it is calibrated to (None: the in-force
    fraction), and engine keys that differ from the shape."""

    label: str
    blocks: int | None = None
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: dict[str, Any]  # spec.engine keys besides the memory ones
    blocks_in_force: int
    load: Load
    others: tuple[Setting, ...]
    # Runs this many times the base duration: an open-loop workload needs more than 100 requests for
    # its p99 to be other than its slowest request.
    duration_factor: float = 1.0


CASES = (
    Case(
        "storm",
        {"maxModelLen": 128, "maxNumBatchedTokens": 256, "maxNumSeqs": 16, "blockSize": 16},
        14,
        Load("closed", (16, 16), (96, 96), concurrency=8),
        (Setting("more memory (64 blocks)", blocks=64), Setting("maxNumSeqs 2", engine={"maxNumSeqs": 2})),
    ),
    Case(
        "long",
        {"maxModelLen": 2048, "maxNumBatchedTokens": 2048, "maxNumSeqs": 8, "blockSize": 16},
        320,
        Load("open", (300, 1500), (8, 24), rate=3.0),
        (
            Setting("maxNumBatchedTokens 512", engine={"maxNumBatchedTokens": 512}),
            Setting("maxNumSeqs 2", engine={"maxNumSeqs": 2}),
        ),
        duration_factor=4.8,
    ),
    Case(
        "steady",
        {"maxModelLen": 512, "maxNumBatchedTokens": 512, "maxNumSeqs": 16, "blockSize": 16},
        200,
        Load("open", (16, 200), (16, 128), rate=3.0),
        (Setting("less memory (36 blocks)", blocks=36), Setting("maxNumSeqs 2", engine={"maxNumSeqs": 2})),
        duration_factor=4.8,
    ),
    Case(
        "prefix",
        {
            "maxModelLen": 1024,
            "maxNumBatchedTokens": 1024,
            "maxNumSeqs": 16,
            "blockSize": 16,
            "enablePrefixCaching": True,
        },
        200,
        Load("open", (300, 800), (16, 64), rate=3.0, shared_prefix=256),
        (
            Setting("maxNumBatchedTokens 128", engine={"maxNumBatchedTokens": 128}),
            Setting("maxNumSeqs 2", engine={"maxNumSeqs": 2}),
        ),
        duration_factor=4.8,
    ),
)
# The shared prefix's tokens (Load.shared_prefix), the same in every run.
SHARED_TOKENS = [random.Random(7).randrange(5, 1000) for _ in range(4096)]


# --- metrics ------------------------------------------------------------------------------------


def samples_of(text: str) -> tuple[dict[str, float], dict[str, dict[float, float]], dict[str, dict]]:
    """Counters and gauges summed over series, histogram buckets summed, info labels by name."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    info: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                entry = buckets.setdefault(s.name[: -len("_bucket")], {})
                le = float(s.labels["le"])
                entry[le] = entry.get(le, 0.0) + s.value
            elif s.name.endswith("_info") or s.name in (m.CACHE_CONFIG_INFO, m.KV_POOL_INFO):
                info[s.name] = dict(s.labels)
            else:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return values, buckets, info


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The ``q``-quantile of a cumulative histogram's increase, linear within the bucket (Prometheus'
    ``histogram_quantile``); NaN without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    low, below = 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return low
            return low + (bound - low) * (rank - below) / max(cumulative - below, 1e-12)
        low, below = bound, cumulative
    return low


def measured_from_lines(lines: list[dict[str, Any]], duration_s: float | None = None) -> dict[str, Any]:
    """What the scrapes show: rates over ``duration_s`` (default: the active span, from the last scrape
    before output tokens first grew to the first one after they last did, as the plan's rates run from
    the first arrival to the last step), the worst ``WINDOW_S`` preemption rate, TTFT p99 from the
    histogram, the pool."""
    parsed = [(line["time"], *samples_of(line["metrics"])) for line in lines if line.get("metrics")]
    t0, v0, b0, _ = parsed[0]
    t1, v1, b1, info = parsed[-1]
    if duration_s is None:
        tokens = [v.get(m.GENERATION_TOKENS_TOTAL, 0.0) for _, v, _, _ in parsed]
        grew = [i for i in range(1, len(tokens)) if tokens[i] > tokens[i - 1]]
        first, last = (grew[0] - 1, grew[-1]) if grew else (0, len(parsed) - 1)
        duration_s = parsed[last][0] - parsed[first][0]
    duration = duration_s
    preempt = [(t, v.get(m.NUM_PREEMPTIONS_TOTAL, 0.0)) for t, v, _, _ in parsed]
    worst = 0.0
    for i, (t, p) in enumerate(preempt):
        base = next((pb for tb, pb in reversed(preempt[:i]) if tb <= t - WINDOW_S + 0.5), None)
        if base is not None:
            worst = max(worst, (p - base) / WINDOW_S)
    ttft = m.TIME_TO_FIRST_TOKEN_SECONDS
    return {
        "duration_s": duration,
        "num_preemptions": v1.get(m.NUM_PREEMPTIONS_TOTAL, 0.0) - v0.get(m.NUM_PREEMPTIONS_TOTAL, 0.0),
        "preemptions_per_s": (v1.get(m.NUM_PREEMPTIONS_TOTAL, 0.0) - v0.get(m.NUM_PREEMPTIONS_TOTAL, 0.0))
        / duration,
        "output_tokens_per_s": (
            v1.get(m.GENERATION_TOKENS_TOTAL, 0.0) - v0.get(m.GENERATION_TOKENS_TOTAL, 0.0)
        )
        / duration,
        "max_preemption_rate": worst,
        "storm": worst > THRESHOLD,
        "ttft_p99_hist_s": histogram_quantile(b0.get(ttft, {}), b1.get(ttft, {}), 0.99),
        "num_gpu_blocks": int(info.get(m.CACHE_CONFIG_INFO, {}).get("num_gpu_blocks", 0)),
    }


# --- engine and load ----------------------------------------------------------------------------


def serve(model: Path, engine: dict[str, Any], log_path: Path, trace: Path | None = None):
    """Start ``kvpilot serve`` with ``engine`` (spec.engine keys), writing a per-request trace to
    ``trace`` when given; (process, base URL)."""
    args = [str(model), "--host", "127.0.0.1", "--port", "0", "--served-model-name", SERVED]
    if trace is not None:
        args += ["--request-trace", str(trace)]
    args += ["--disable-log-stats", "--disable-access-log", "--seed", "0"]
    args += to_cli_args(engine_snake_args({"device": "cpu", "enablePrefixCaching": False, **engine}))
    proc = start_process([sys.executable, "-m", "kvpilot.cli", "serve", *args], log_path, new_session=True)
    return proc, wait_for_line(proc, log_path, LISTEN_LINE, 180)


def pool_sizing(model: Path, shape: dict[str, Any], workdir: Path) -> dict[str, int]:
    """One probe engine (fraction 1.0 of a known budget): ``kvpilot_kv_pool_info``'s figures."""
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    engine = {**shape, "cpuMemoryBudgetBytes": weights * 2 + (64 << 20), "gpuMemoryUtilization": 1.0}
    proc, url = serve(model, engine, workdir / "probe.log")
    try:
        text = asyncio.run(fetch(url + "/metrics"))
    finally:
        stop_process(proc, signal.SIGTERM, 15)
    labels = samples_of(text)[2][m.KV_POOL_INFO]
    return {k: int(labels[k]) for k in m.KV_POOL_LABELS}


async def fetch(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


def memory_settings(sizing: dict[str, int], blocks: int, budget: int) -> float:
    """The fraction of ``budget`` that leaves ``blocks`` blocks (half a block of slack)."""
    fixed = sizing["weights_bytes"] + sizing["activation_bytes"]
    return math.ceil((fixed + (blocks + 0.5) * sizing["bytes_per_block"]) / budget * 1e6) / 1e6


async def drive(url: str, load: Load, duration_s: float, seed: int, record: list[dict], name: str):
    """Run ``load`` for ``duration_s`` (requests in flight then finish), scraping every second into
    ``record``; the requests' (send, first token, end, tokens) and the load's wall time."""
    rng = random.Random(seed)
    trips: list[tuple[float, float, float, int]] = []
    timeout = aiohttp.ClientTimeout(total=600)
    stop = asyncio.Event()

    async def one(session: aiohttp.ClientSession) -> None:
        length = rng.randint(*load.prompt)
        shared = SHARED_TOKENS[: min(load.shared_prefix, length - 1)]
        body = {
            "model": SERVED,
            "prompt": shared + [rng.randrange(5, 1000) for _ in range(length - len(shared))],
            "max_tokens": rng.randint(*load.output),
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, first, tokens = time.time(), None, 0
        async with session.post(url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and first is None:
                    first = time.time()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        trips.append((start, first or time.time(), time.time(), tokens))

    async def scrape(session: aiohttp.ClientSession) -> None:
        while True:
            now = time.time()
            async with session.get(url + "/metrics") as response:
                text = await response.text()
            record.append(
                {
                    "time": round(now, 3),
                    "tick": round(now, 3),
                    "namespace": "bench",
                    "inferenceService": name,
                    "pod": f"{name}-0",
                    "ready": True,
                    "metrics": text,
                }
            )
            if stop.is_set():
                return
            await asyncio.sleep(max(0.0, now + 1.0 - time.time()))

    async with aiohttp.ClientSession(timeout=timeout) as session:
        scraper = asyncio.create_task(scrape(session))
        await asyncio.sleep(0.2)  # a first scrape before any request
        began = time.time()
        deadline = began + duration_s
        if load.kind == "closed":

            async def client() -> None:
                while time.time() < deadline:
                    await one(session)

            await asyncio.gather(*(client() for _ in range(load.concurrency)))
        else:
            tasks = []
            at = began
            while True:
                at += rng.expovariate(load.rate)
                if at >= deadline:
                    break
                await asyncio.sleep(max(0.0, at - time.time()))
                tasks.append(asyncio.create_task(one(session)))
            await asyncio.gather(*tasks)
        ended = time.time()
        await asyncio.sleep(1.1)  # one scrape after the last request
        stop.set()
        await scraper
    return trips, ended - began


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def isvc_of(case: Case, engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": case.name, "namespace": "bench", "generation": 1},
        "spec": {
            "model": {"source": "pvc://models/llm"},
            "engine": {"device": "cpu", "enablePrefixCaching": False, **engine},
            "resources": {"gpusPerReplica": 0},
            "remediation": {
                "mode": "Recommend",
                "window": f"{WINDOW_S:g}s",
                "cooldown": "10m",
                "preemptionRate": THRESHOLD,
                "limits": {"maxGpuMemoryUtilization": 1.0, "minMaxNumSeqs": 1, "minMaxNumBatchedTokens": 16},
            },
        },
    }


# --- prediction and comparison -------------------------------------------------------------------


def binned_quantile(values: tuple[float, ...], bounds: list[float], q: float) -> float:
    """``q``-quantile of ``values`` as Prometheus gives it from a histogram with ``bounds`` (the
    engine's buckets): what an SLO on ``vllm:time_to_first_token_seconds`` would read."""
    if not values or not bounds:
        return math.nan
    cumulative = {b: float(sum(1 for v in values if v <= b)) for b in bounds}
    cumulative[math.inf] = float(len(values))
    return histogram_quantile({}, cumulative, q)


# --step-spread: the step-time model draws single steps from the recorded spread (Workload.step_time).
STEP_SPREAD = False
# How many draws of the recorded workload each prediction is also made with (--draws).
DRAWS = 1
# The requests the plan's latency quantiles rest on at least (kvpilot plan --latency-samples).
LATENCY_SAMPLES = MIN_LATENCY_SAMPLES
# The recordings of the settings in force given to the plan: "all" their runs', or the "first" one's.
PLAN_FROM = "all"
# Samples of an open-loop workload's clients' own process run through the plan (--traffic-samples).
TRAFFIC_SAMPLES: int | None = None
# The TTFT quantiles set side by side, the engine's against the plan's on the very requests (a trace).
TAIL_QUANTILES = (0.5, 0.9, 0.95, 0.98, 0.99, 0.999)


def predict(
    doc: dict,
    recordings: list[Path],
    candidates: list[Candidate],
    open_loop: bool,
    ttft_bounds: list[float],
    traces: list[Path] | None = None,
    load: Load | None = None,
) -> tuple[list, dict]:
    """The plan's simulation of each candidate on the workload of ``recordings`` (laid end to end, as
    ``kvpilot plan`` given each with ``--recording``; with their requests from ``traces`` when given,
    as ``kvpilot plan --trace``); TTFT p99 also binned into the engine's TTFT buckets
    (``ttft_bounds``). With traces and an open-loop ``load``, also the p99 of ``TRAFFIC_SAMPLES``
    fresh samples of the clients' own process over the traces' span (``fidelity_traffic``)."""
    scrapes = read_recordings(recordings, doc)
    workload = workload_from_scrapes(scrapes)
    if traces:
        workload = with_trace(workload, scrapes, [str(t) for t in traces])
    step_time = workload.step_time(spread=STEP_SPREAD)
    ctx, _ = calibrate(context_of(resolve(doc), workload, open_loop=open_loop), workload, step_time)
    ctx = dataclasses.replace(ctx, latency_samples=LATENCY_SAMPLES)
    traffic = (
        traffic_p99s(candidates, ctx, workload, step_time, load, TRAFFIC_SAMPLES)
        if traces and load is not None and TRAFFIC_SAMPLES
        else [[] for _ in candidates]
    )
    out = []
    for candidate, traffic_p99 in zip(candidates, traffic, strict=True):
        r = evaluate(candidate, ctx, workload, step_time)
        res = r.result
        out.append(
            {
                "num_gpu_blocks": r.num_gpu_blocks,
                "preemptions_per_s": res.preemptions_per_s if res else math.nan,
                "output_tokens_per_s": res.output_tokens_per_s if res else math.nan,
                "ttft_p99_s": res.ttft(0.99) if res else math.nan,
                "ttft_p99_hist_s": binned_quantile(res.ttft_s, ttft_bounds, 0.99) if res else math.nan,
                "max_preemption_rate": r.max_preemption_rate,
                "storm": r.sustained_preemption,
                "keeps_up": r.keeps_up,
                "error": r.error,
                # The same plan drawing other requests of the recorded kind (other arrival times
                # within each scrape interval, other lengths): how far the p99 of that many
                # requests moves with the sample alone. A trace replays the same requests: none.
                "ttft_p99_draws_s": other_draws(candidate, ctx, workload, step_time),
                # The clients' own process, sampled afresh, through the plan (with a trace only).
                "ttft_p99_traffic_s": traffic_p99,
                "ttft_quantiles_s": {str(q): res.ttft(q) if res else math.nan for q in TAIL_QUANTILES},
            }
        )
    about = {
        "step_time": step_time.describe(),
        "num_requests": workload.num_requests,
        "recordings": [str(r) for r in recordings],
        "peak_in_flight": workload.peak_in_flight,
        "closed_loop": ctx.closed_loop,
        "client_turnaround_s": ctx.client_turnaround_s,
        "handling": ctx.handling.describe() if ctx.handling is not None else None,
        "scrapes": ctx.scrapes.describe() if ctx.scrapes is not None else None,
        "notes": list(ctx.notes),
        "current": ctx.current.as_dict(),
    }
    return out, about


def other_draws(candidate: Candidate, ctx, workload, step_time) -> list[float]:
    """The predicted TTFT p99 with draws 1..DRAWS-1 of the workload, each as the plan makes it by
    default (on MIN_LATENCY_SAMPLES requests; none for a trace, which replays the same requests every
    time)."""
    if workload.trace is not None:
        return []
    ctx = dataclasses.replace(ctx, latency_samples=MIN_LATENCY_SAMPLES)
    out = []
    for seed in range(1, DRAWS):
        result = evaluate(candidate, ctx, workload, step_time, seed).result
        out.append(result.ttft(0.99) if result is not None else math.nan)
    return out


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas and math.isfinite(pred) and math.isfinite(meas) else math.nan


def compare(pred: dict, meas: dict) -> dict:
    return {
        "preemptions_per_s": pred["preemptions_per_s"] - meas["preemptions_per_s"],
        "output_tokens_per_s": rel(pred["output_tokens_per_s"], meas["output_tokens_per_s"]),
        "ttft_p99_s": rel(pred["ttft_p99_s"], meas["ttft_p99_s"]),
        "ttft_p99_hist_s": rel(pred["ttft_p99_hist_s"], meas["ttft_p99_hist_s"]),
        "ttft_p99_engine_s": rel(pred["ttft_p99_s"], meas["ttft_p99_engine_s"]),
        "ttft_p99_trace_s": rel(pred["ttft_p99_trace_s"], meas["ttft_p99_engine_s"]),
        "ttft_p99_engine_median_s": rel(pred["ttft_p99_s"], meas.get("ttft_p99_engine_median_s", math.nan)),
        "storm_right": pred["storm"] == meas["storm"],
    }


def median_of(runs: list[dict]) -> dict:
    """One setting's measurement over repeated runs: the median of each figure (the storm call by
    majority), the first run's pool, and every run's own figures under ``runs``. The engine's TTFT
    p99 is that of every request of the runs together (``ttft_p99_engine_median_s``: the median of
    the runs' own p99s): the p99 of some 1,100 requests where one run has some 370, as the plan,
    given the recordings of the three runs of the settings in force, predicts it over theirs."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, bool):
            out[key] = 2 * sum(bool(r[key]) for r in runs) > len(runs)
        elif isinstance(value, float):
            values = [r[key] for r in runs if math.isfinite(r[key])]
            out[key] = statistics.median(values) if values else math.nan
    out.pop("engine_ttfts_s", None)
    if all(r.get("engine_ttfts_s") for r in runs):
        out["ttft_p99_engine_median_s"] = out["ttft_p99_engine_s"]
        out["ttft_p99_engine_s"] = quantile([x for r in runs for x in r["engine_ttfts_s"]], 0.99)
    out["runs"] = runs
    return out


def case_settings(
    case: Case, model: Path, workdir: Path, repeat: int
) -> list[tuple[Setting, dict[str, Any]]]:
    """The settings a case runs, the settings in force first, each with its spec.engine keys: a pool
    of ``blocks_in_force`` at the in-force fraction of a budget sized for it (``pool_sizing``)."""
    sizing = pool_sizing(model, case.shape, workdir)
    fixed = sizing["weights_bytes"] + sizing["activation_bytes"]
    budget = round((fixed + (case.blocks_in_force + 0.5) * sizing["bytes_per_block"]) / 0.5)
    base = {**case.shape, "cpuMemoryBudgetBytes": budget, "gpuMemoryUtilization": 0.5}
    settings = [Setting("in force"), *case.others]
    if repeat == 1:
        # Run once each, the settings in force run twice: the second run, given to nothing, shows how
        # far one measured TTFT p99 lies from another of the same setting on this box.
        settings.append(Setting(AGAIN))
    out = []
    for setting in settings:
        engine = {**base, **setting.engine}
        if setting.blocks is not None:
            engine["gpuMemoryUtilization"] = memory_settings(sizing, setting.blocks, budget)
        out.append((setting, engine))
    return out


def measure_run(workdir: Path, stem: str) -> dict[str, Any]:
    """What one kept run measured: its recording (``STEM.jsonl``), the engine's request trace
    (``STEM.trace.jsonl``), the clients' trips (``STEM.trips.json``: send, first token, end) and the
    CPUs' shares while the load ran (``STEM.cpu.json``, ``fidelity_cpu``). Rates run over the span of
    the requests, first sent to last answered (the plan's run: first arrival to last step); without
    the trips, from the trace's first arrival to its last finish, and no client-measured TTFT."""
    record = [json.loads(line) for line in (workdir / f"{stem}.jsonl").read_text().splitlines()]
    trace = [json.loads(line) for line in (workdir / f"{stem}.trace.jsonl").read_text().splitlines()]
    trips_path = workdir / f"{stem}.trips.json"
    trips = json.loads(trips_path.read_text()) if trips_path.is_file() else None
    if trips:
        span = max(end for _, _, end, _ in trips) - min(start for start, _, _, _ in trips)
    else:
        span = max(e["arrival"] + e["e2e_s"] for e in trace if e.get("e2e_s") is not None) - min(
            e["arrival"] for e in trace
        )
    measured = measured_from_lines(record, span)
    measured["ttft_p99_s"] = (
        quantile([first - start for start, first, _, _ in trips], 0.99) if trips else math.nan
    )
    # The engine's own TTFT of every request (its trace, not given to the plan): exact, where the
    # histogram is read by interpolating within its buckets.
    engine_ttfts = [entry["ttft_s"] for entry in trace if entry.get("ttft_s") is not None]
    measured["ttft_p99_engine_s"] = quantile(engine_ttfts, 0.99)
    measured["engine_ttfts_s"] = [round(x, 7) for x in engine_ttfts]
    measured["num_requests"] = len(trips) if trips else len(trace)
    # The share of the CPUs' time the hypervisor took while the load ran (NaN: not kept).
    measured["cpu_steal"] = fidelity_cpu.read(workdir / f"{stem}.cpu.json")["steal"]
    return measured


def run_case(
    case: Case, model: Path, workdir: Path, duration_s: float, seed: int, repeat: int = 1, run: bool = True
) -> list[dict]:
    """Run every setting of ``case`` ``repeat`` times and plan them; ``run`` False: run no engine,
    measure the runs kept in ``workdir`` again (``measure_run``)."""
    settings = case_settings(case, model, workdir, repeat)
    measured_runs: list[list[dict]] = [[] for _ in settings]
    runs = []
    # Round by round through the settings, so that a slow stretch of the box falls on one run of
    # several settings rather than on every run of one.
    for rep, (index, (setting, engine)) in itertools.product(range(repeat), enumerate(settings)):
        stem = f"{case.name}-{index}" + (f".{rep}" if rep else "")
        if run:
            proc, url = serve(model, engine, workdir / f"{stem}.log", workdir / f"{stem}.trace.jsonl")
            record: list[dict] = []
            try:
                # Each round's clients draw their own requests (seed + round), the same in every
                # setting of the round: three rounds are three samples of the traffic, not one
                # sample measured three times.
                cpu_before = fidelity_cpu.cpu_times()
                trips, _ = asyncio.run(drive(url, case.load, duration_s, seed + rep, record, case.name))
                fidelity_cpu.write(workdir / f"{stem}.cpu.json", cpu_before, fidelity_cpu.cpu_times())
            finally:
                stop_process(proc, signal.SIGTERM, 15)
            (workdir / f"{stem}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in record))
            (workdir / f"{stem}.trips.json").write_text(json.dumps(trips))
        measured = measure_run(workdir, stem)
        measured_runs[index].append(measured)
        if rep == 0:
            runs.append({"setting": setting.label, "engine": engine, "recording": workdir / f"{stem}.jsonl"})
        print(
            f"  {'ran' if run else 'measured'} {case.name} / {setting.label}"
            + (f" (round {rep + 1} of {repeat})" if repeat > 1 else "")
            + f": {measured['num_requests']} requests, {measured['num_gpu_blocks']} blocks, TTFT p99 "
            f"{measured['ttft_p99_engine_s'] * 1e3:.1f} ms, {measured['output_tokens_per_s']:.0f} tok/s, "
            f"CPU steal {_pct1(measured['cpu_steal'])}",
            flush=True,
        )
    for r, measured in zip(runs, measured_runs, strict=True):
        r["measured"] = measured[0] if repeat == 1 else median_of(measured)
    return planned_rows(case, runs, workdir)


def planned_rows(case: Case, runs: list[dict], workdir: Path) -> list[dict]:
    """The plan's predictions for ``runs`` (each a setting's label, engine, first recording and
    measured figures; the settings in force first) from the settings in force's recordings
    (``in_force_runs``), with and without their request traces, set beside what the runs measured."""
    doc = isvc_of(case, runs[0]["engine"])
    candidates = [
        Candidate(
            float(r["engine"]["gpuMemoryUtilization"]),
            int(r["engine"]["maxNumSeqs"]),
            int(r["engine"]["maxNumBatchedTokens"]),
            1,
        )
        for r in runs
    ]
    open_loop = case.load.kind == "open"
    bounds = ttft_bounds_of(runs[0]["recording"])
    recordings, traces = in_force_runs(case, workdir)
    predicted, about = predict(doc, recordings, candidates, open_loop, bounds)
    # The same with those runs' request traces (kvpilot plan --trace): every setting's round r sent
    # the requests of the settings in force's round r, so the traces hold the very requests served.
    traced, _ = predict(
        doc, recordings, candidates, open_loop, bounds, traces, case.load if open_loop else None
    )
    rows = []
    for r, pred, pred_traced in zip(runs, predicted, traced, strict=True):
        pred["ttft_p99_trace_s"] = pred_traced["ttft_p99_s"]
        pred["ttft_p99_traffic_s"] = pred_traced["ttft_p99_traffic_s"]
        pred["ttft_quantiles_trace_s"] = pred_traced["ttft_quantiles_s"]
        rows.append(
            {
                "workload": case.name,
                "setting": r["setting"],
                "engine": r["engine"],
                "measured": r["measured"],
                "predicted": pred,
                "error": compare(pred, r["measured"]),
                # Against each run alone: how the goals fare on one measurement of the setting.
                "error_runs": [compare(pred, one) for one in r["measured"].get("runs", [])],
                "plan": about,
            }
        )
    return rows


def in_force_runs(case: Case, workdir: Path) -> tuple[list[Path], list[Path]]:
    """The recordings and request traces the plan is given: every kept run of the settings in force
    (``PLAN_FROM`` "all", its rounds in order), or the first one alone ("first")."""
    recordings, traces = [], []
    for rep in itertools.count():
        stem = f"{case.name}-0" + (f".{rep}" if rep else "")
        recording, trace = workdir / f"{stem}.jsonl", workdir / f"{stem}.trace.jsonl"
        if not recording.is_file() or not trace.is_file() or (rep and PLAN_FROM == "first"):
            break
        recordings.append(recording)
        traces.append(trace)
    if not recordings:
        raise SystemExit(f"{case.name}: no recording and trace of the settings in force in {workdir}")
    return recordings, traces


def ttft_bounds_of(recording: Path) -> list[float]:
    """The finite bucket bounds of the engine's TTFT histogram in a recording's last scrape."""
    opener = gzip.open if recording.suffix == ".gz" else open
    with opener(recording, "rt", encoding="utf-8") as handle:
        last = [json.loads(line) for line in handle if line.strip()]
    text = next(line["metrics"] for line in reversed(last) if line.get("metrics"))
    return sorted(b for b in samples_of(text)[1].get(m.TIME_TO_FIRST_TOKEN_SECONDS, {}) if math.isfinite(b))


def vllm_case() -> list[dict]:
    """The recorded vLLM storm: predicted vs recorded, the settings in force only."""
    doc = vllm_isvc()
    lines = [json.loads(line) for line in gzip.decompress(FIXTURE.read_bytes()).decode().splitlines()]
    measured = measured_from_lines([line for line in lines if line.get("metrics")])
    measured["ttft_p99_s"] = math.nan  # no client record, no trace: the engine's histogram alone
    measured["ttft_p99_engine_s"] = math.nan
    engine = doc["spec"]["engine"]
    workload = workload_from_scrapes(read_recording(FIXTURE, doc))
    ctx = context_of(resolve(doc), workload)
    predicted, about = predict(doc, [FIXTURE], [ctx.current], False, ttft_bounds_of(FIXTURE))
    pred = predicted[0]
    pred["ttft_p99_trace_s"] = math.nan  # no trace was recorded
    return [
        {
            "workload": "vllm",
            "setting": "in force (recorded)",
            "engine": engine,
            "measured": measured,
            "predicted": pred,
            "error": compare(pred, measured),
            "error_runs": [],
            "plan": about,
        }
    ]


# --- output -------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:+.0%}"


def _pct1(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1%}"


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:.0f}"


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'WORKLOAD':8} {'SETTING':24} {'BLK m/p':>9} {'PREEMPT/S m/p':>14} {'ERR':>6} "
        f"{'OUT TOK/S m/p':>15} {'ERR':>6} {'TTFT99 ENGINE':>15} {'ERR':>6} {'TRACE':>6} "
        f"{'TTFT99 HIST ms':>15} {'ERR':>6} "
        f"{'TTFT99 CLIENT':>15} {'ERR':>6} "
        f"{'STORM m/p':>9} OK"
    )
    print(header)
    for row in rows:
        mm, p, e = row["measured"], row["predicted"], row["error"]
        storm = f"{'yes' if mm['storm'] else 'no'}/{'yes' if p['storm'] else 'no'}"
        print(
            f"{row['workload']:8} {row['setting'][:24]:24} "
            f"{mm['num_gpu_blocks']:>4}/{p['num_gpu_blocks']:<4} "
            f"{mm['preemptions_per_s']:6.2f}/{p['preemptions_per_s']:<7.2f} {e['preemptions_per_s']:+6.2f} "
            f"{mm['output_tokens_per_s']:7.0f}/{p['output_tokens_per_s']:<7.0f} "
            f"{_pct(e['output_tokens_per_s']):>6} "
            f"{_ms(mm['ttft_p99_engine_s']):>7}/{_ms(p['ttft_p99_s']):<7} {_pct(e['ttft_p99_engine_s']):>6} "
            f"{_pct(e['ttft_p99_trace_s']):>6} "
            f"{_ms(mm['ttft_p99_hist_s']):>7}/{_ms(p['ttft_p99_hist_s']):<7} {_pct(e['ttft_p99_hist_s']):>6} "
            f"{_ms(mm['ttft_p99_s']):>7}/{_ms(p['ttft_p99_s']):<7} {_pct(e['ttft_p99_s']):>6} "
            f"{storm:>9} {'y' if e['storm_right'] else 'N'}"
        )


def print_runs(rows: list[dict]) -> None:
    """Every run of each repeated setting, and the goals checked on one run at a time: how far the
    measurement itself moves between runs of one setting, beside the prediction's error."""
    print()
    print("each run: TTFT p99 ms (the engine's own) and output tok/s / the prediction (the runs' spread)")
    single_tput = single_ttft = total = 0
    for row in rows:
        runs = row["measured"]["runs"]
        ttfts = [r["ttft_p99_engine_s"] for r in runs]
        tputs = [r["output_tokens_per_s"] for r in runs]
        measured = row["measured"]
        med_ttft = measured.get("ttft_p99_engine_median_s", measured["ttft_p99_engine_s"])
        med_tput = measured["output_tokens_per_s"]
        spread_ttft = max(abs(rel(x, med_ttft)) for x in ttfts)
        spread_tput = max(abs(rel(x, med_tput)) for x in tputs)
        print(
            f"  {row['workload']:8} {row['setting'][:24]:24} TTFT p99 "
            f"{' '.join(_ms1(x) for x in ttfts)} / {_ms1(row['predicted']['ttft_p99_s'])} "
            f"(runs within {spread_ttft:.0%} of their median {_ms1(med_ttft)}, error "
            f"{_pct(row['error'].get('ttft_p99_engine_median_s', math.nan))}; all their requests "
            f"{_ms1(measured['ttft_p99_engine_s'])}{_draws(row['predicted'])}); tok/s "
            f"{' '.join(f'{x:.0f}' for x in tputs)} / "
            f"{row['predicted']['output_tokens_per_s']:.0f} (within {spread_tput:.0%}); CPU steal "
            f"{' '.join(_pct1(r.get('cpu_steal', math.nan)) for r in runs)}"
        )
        for error in row["error_runs"]:
            total += 1
            single_tput += abs(error["output_tokens_per_s"]) <= GOALS["output_tokens_per_s"]
            single_ttft += abs(error["ttft_p99_engine_s"]) <= GOALS["ttft_p99_s"]
    print(
        f"against one run at a time: throughput +-15% {single_tput}/{total}, "
        f"TTFT p99 +-25% {single_ttft}/{total}"
    )
    spans = [
        (min(d), max(d), row["measured"]["ttft_p99_engine_s"])
        for row in rows
        if len(d := [row["predicted"]["ttft_p99_s"], *row["predicted"].get("ttft_p99_draws_s", [])]) > 1
    ]
    if spans:
        inside = sum(lo <= x <= hi for lo, hi, x in spans)
        print(f"measured TTFT p99 within the span of the draws' predictions: {inside}/{len(spans)}")


def print_traffic(rows: list[dict]) -> None:
    """Where the measured and the predicted TTFT p99 fall among the p99s of fresh samples of the
    clients' own process run through the plan (``--traffic-samples``): a measurement outside their
    span is one the traffic's sampling alone does not explain."""
    print()
    print("the clients' own process, sampled afresh through the plan: TTFT p99 ms (min median max)")
    inside = 0
    for row in rows:
        sample = row["predicted"]["ttft_p99_traffic_s"]
        finite = sorted(x for x in sample if math.isfinite(x))
        measured, predicted = row["measured"]["ttft_p99_engine_s"], row["predicted"]["ttft_p99_s"]
        below, n = rank_of(measured, finite)
        inside += bool(finite) and finite[0] <= measured <= finite[-1]
        lo, hi = (finite[0], finite[-1]) if finite else (math.nan, math.nan)
        median = statistics.median(finite) if finite else math.nan
        print(
            f"  {row['workload']:8} {row['setting'][:24]:24} {_ms1(lo)} {_ms1(median)} {_ms1(hi)} "
            f"(max {_pct(rel(hi, lo))} over min) "
            f"of {n}; measured {_ms1(measured)} above {below} of them; predicted {_ms1(predicted)} "
            f"({_pct(rel(predicted, median))} against their median)"
        )
    print(f"measured TTFT p99 within the span of the clients' process samples: {inside}/{len(rows)}")


def engine_ttfts(measured: dict) -> list[float]:
    """The engine's own TTFT of every request of a setting's runs (its request traces)."""
    runs = measured.get("runs") or [measured]
    return [x for run in runs for x in run.get("engine_ttfts_s", ())]


def print_tail(rows: list[dict]) -> None:
    """The engine's TTFT distribution against the plan's on the very same requests (planned with
    their traces), quantile by quantile: where the two part, the model misses that part of the
    distribution (a body that matches under a heavier measured tail: rare slow moments the model
    lacks)."""
    shown = [
        (row, measured)
        for row in rows
        if row["predicted"].get("ttft_quantiles_trace_s") and (measured := engine_ttfts(row["measured"]))
    ]
    if not shown:
        return
    print()
    print(
        "TTFT by quantile, the engine's / the plan's on the very requests (trace), ms: "
        + " ".join(f"p{q * 100:g}" for q in TAIL_QUANTILES)
    )
    for row, measured in shown:
        planned = row["predicted"]["ttft_quantiles_trace_s"]
        cells = [
            f"{_ms1(quantile(measured, q))}/{_ms1(planned.get(str(q), math.nan))}" for q in TAIL_QUANTILES
        ]
        print(f"  {row['workload']:8} {row['setting'][:24]:24} {'  '.join(cells)}")


def print_interval(rows: list[dict]) -> None:
    """The measured TTFT p99 is itself a sample: where a prediction falls against that p99's 95 %
    interval over the same requests (``quantile_interval``) says whether an error is more than the
    measurement's own uncertainty."""
    shown = [(row, measured) for row in rows if (measured := engine_ttfts(row["measured"]))]
    if not shown:
        return
    print()
    print("the measured TTFT p99's own 95 % interval (order statistics of its requests), ms")
    inside = near = 0
    for row, measured in shown:
        lo, hi = quantile_interval(measured, 0.99)
        predicted = row["predicted"]["ttft_p99_s"]
        inside += lo <= predicted <= hi
        near += lo * (1 - GOALS["ttft_p99_s"]) <= predicted <= hi * (1 + GOALS["ttft_p99_s"])
        print(
            f"  {row['workload']:8} {row['setting'][:24]:24} {_ms1(row['measured']['ttft_p99_engine_s'])} "
            f"in {_ms1(lo)}-{_ms1(hi)} ({_pct(rel(lo, row['measured']['ttft_p99_engine_s']))} "
            f"{_pct(rel(hi, row['measured']['ttft_p99_engine_s']))}) of {len(measured)} requests; "
            f"predicted {_ms1(predicted)}"
        )
    print(
        f"predicted TTFT p99 within the measured p99's 95 % interval: {inside}/{len(shown)}; within "
        f"25 % of it: {near}/{len(shown)}"
    )


def _draws(predicted: dict) -> str:
    """The predicted TTFT p99 over the plan's draws of the workload (seed 0 first), when made."""
    draws = [predicted["ttft_p99_s"], *predicted.get("ttft_p99_draws_s", [])]
    if len(draws) < 2:
        return ""
    return f"; predicted with draws 0-{len(draws) - 1}: {' '.join(_ms1(x) for x in draws)}"


def _ms1(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * 1e3:.1f}"


def goal_ttft_error(row: dict) -> float:
    """The TTFT p99 error the goal is checked on: against the engine's own per-request TTFTs where
    the run wrote them, else (a recording alone) against its histogram, both sides binned alike."""
    error = row["error"]["ttft_p99_engine_s"]
    return error if math.isfinite(error) else row["error"]["ttft_p99_hist_s"]


def replanned_rows(case: Case, report: dict, workdir: Path) -> list[dict]:
    """The rows of ``case`` in an earlier ``report``, planned again with the plan's code as it is now
    from the recordings and traces that run kept in ``workdir`` (``--keep``): what the engines measured
    is read back, not run again."""
    runs = [
        {
            "setting": row["setting"],
            "engine": row["engine"],
            "recording": workdir / f"{case.name}-{index}.jsonl",
            "measured": row["measured"],
        }
        for index, row in enumerate(r for r in report["rows"] if r["workload"] == case.name)
    ]
    if not runs:
        return []
    missing = [str(r["recording"]) for r in runs if not r["recording"].is_file()]
    if missing or not (workdir / f"{case.name}-0.trace.jsonl").is_file():
        raise SystemExit(f"--replan: {case.name}: the kept recordings or trace are missing in {workdir}")
    recordings, _ = in_force_runs(case, workdir)
    print(f"{case.name}: planned again from {', '.join(map(str, recordings))}", flush=True)
    return planned_rows(case, runs, workdir)


def write_report(
    args: argparse.Namespace, rows: list[dict], duration: float, earlier: dict | None, partial: bool = False
) -> None:
    """The JSON report (``--out``); ``partial``: written after a workload, before the rest have run."""
    from kvpilot.kernels import isa

    report = {
        # The runs' machine and load (those of the earlier report for --replan: its engines measured).
        "isa": earlier["isa"] if earlier is not None else isa.describe(),
        "duration_s": earlier["duration_s"] if earlier is not None else duration,
        "repeat": earlier["repeat"] if earlier is not None else args.repeat,
        **({"replanned_from": str(args.replan)} if earlier is not None else {}),
        **({"remeasured_from": str(args.keep)} if args.remeasure else {}),
        **({"partial": True} if partial else {}),
        "plan_from": args.plan_from,
        "latency_samples": args.latency_samples,
        "traffic_samples": args.traffic_samples,
        # Each round's clients drew their own requests (seed + round); earlier reports: every round
        # the same requests; null: kept runs measured again (--remeasure), which do not say.
        "client_seed_per_round": seeds_per_round(args, earlier),
        "threshold": {"preemption_rate": THRESHOLD, "window_s": WINDOW_S},
        "goals": GOALS,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")


def seeds_per_round(args: argparse.Namespace, earlier: dict | None) -> bool | None:
    """Whether the report's runs drew their requests per round (``client_seed_per_round``)."""
    if earlier is not None:
        return earlier.get("client_seed_per_round", False)
    return None if args.remeasure else True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 s runs instead of 25 s")
    parser.add_argument("--duration", type=float, help="seconds of load per run (overrides --quick)")
    parser.add_argument("--workloads", default="storm,long,steady,prefix,vllm", help="comma-separated subset")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_fidelity.json")
    parser.add_argument(
        "--keep", type=Path, help="keep every run's recording, request trace and log in this directory"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every setting this many times (round by round) and check the goals on the median of "
        "the runs (default 1: once each, the settings in force twice)",
    )
    parser.add_argument(
        "--replan",
        type=Path,
        metavar="REPORT",
        help="run no engine: plan again the runs of an earlier report (its --out) from the recordings "
        "and traces it kept in --keep, with the plan's code as it is now",
    )
    parser.add_argument(
        "--draws",
        type=int,
        default=6,
        help="also plan each setting with this many draws of the recorded workload (seeds 0..N-1) and "
        "print how far the predicted TTFT p99 moves between them (1: none)",
    )
    parser.add_argument(
        "--latency-samples",
        type=positive_int,
        default=MIN_LATENCY_SAMPLES,
        help="plan as `kvpilot plan --latency-samples N`: pool draws of the recorded workload until the "
        f"predicted latency quantiles rest on N requests (default {MIN_LATENCY_SAMPLES}, the plan's own)",
    )
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="run no engine: measure the runs kept in --keep again (as --repeat says they ran) and plan "
        "them, where no report of them was written; their rates then run over the engine's trace",
    )
    parser.add_argument(
        "--plan-from",
        choices=("all", "first"),
        default="all",
        help="the recordings of the settings in force the plan is given: every run's, laid end to end "
        "(default), or the first run's alone",
    )
    parser.add_argument(
        "--step-spread",
        action="store_true",
        help="plan as `kvpilot plan --step-spread`: every step drawn from the recorded spread of single "
        "steps instead of the recording's slow stretches replayed",
    )
    parser.add_argument(
        "--traffic-samples",
        type=positive_int,
        metavar="N",
        help="for each open-loop setting, also run N fresh samples of the clients' own process (over the "
        "span of the traced requests) through the plan, and print where the measured TTFT p99 falls "
        "among their p99s: how far the p99 moves with the sample of the traffic alone (default: none)",
    )
    args = parser.parse_args(argv)
    global STEP_SPREAD, PLAN_FROM, DRAWS, LATENCY_SAMPLES, TRAFFIC_SAMPLES
    STEP_SPREAD, PLAN_FROM, DRAWS = args.step_spread, args.plan_from, args.draws
    LATENCY_SAMPLES, TRAFFIC_SAMPLES = args.latency_samples, args.traffic_samples
    if args.replan is not None and args.keep is None:
        parser.error("--replan needs --keep: the directory the earlier run kept its recordings in")
    if args.remeasure and (args.keep is None or args.replan is not None):
        parser.error("--remeasure needs --keep (the directory of the runs), and no --replan")
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    duration = args.duration or (12.0 if args.quick else 25.0)
    wanted = args.workloads.split(",")
    rows: list[dict] = []
    started = time.time()
    earlier = None
    with tempfile.TemporaryDirectory(prefix="plan-fidelity-") as tmp:
        workdir = Path(tmp)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            workdir = args.keep
        model = workdir / "model"
        if args.replan is None and not args.remeasure and any(c.name in wanted for c in CASES):
            from kvpilot.engine.models.synthetic import build_checkpoint

            build_checkpoint(model, size="test", dtype="float32", max_position_embeddings=2048)
        if args.replan is not None:
            earlier = json.loads(args.replan.read_text())
        for case in CASES:
            if case.name in wanted and earlier is not None:
                rows += replanned_rows(case, earlier, workdir)
            elif case.name in wanted:
                seconds = duration * case.duration_factor
                count = (len(case.others) + 1) * args.repeat + (args.repeat == 1)
                print(f"{case.name}: {count} runs x {seconds:g}s", flush=True)
                rows += run_case(case, model, workdir, seconds, args.seed, args.repeat, not args.remeasure)
            # After every workload: an hour of runs is not lost to a later failure.
            write_report(args, rows, duration, earlier, partial=True)
    if "vllm" in wanted:
        rows += vllm_case()
    print()
    print_table(rows)
    tput = [abs(r["error"]["output_tokens_per_s"]) <= GOALS["output_tokens_per_s"] for r in rows]
    ttft = [abs(goal_ttft_error(r)) <= GOALS["ttft_p99_s"] for r in rows]
    medians = [r["error"].get("ttft_p99_engine_median_s", math.nan) for r in rows]
    ttft_median = [abs(x) <= GOALS["ttft_p99_s"] for x in medians if math.isfinite(x)]
    hist = [abs(r["error"]["ttft_p99_hist_s"]) <= GOALS["ttft_p99_s"] for r in rows]
    client = [r for r in rows if math.isfinite(r["error"]["ttft_p99_s"])]
    ttft_client = [abs(r["error"]["ttft_p99_s"]) <= GOALS["ttft_p99_s"] for r in client]
    storms = [r["error"]["storm_right"] for r in rows]
    traced = [r for r in rows if math.isfinite(r["error"]["ttft_p99_trace_s"])]
    ttft_traced = [abs(r["error"]["ttft_p99_trace_s"]) <= GOALS["ttft_p99_s"] for r in traced]
    print(
        f"within goals: throughput +-15% {sum(tput)}/{len(rows)}, TTFT p99 +-25% {sum(ttft)}/{len(rows)} "
        f"(the engine's own TTFTs; read from its histogram {sum(hist)}/{len(rows)}, client-measured "
        f"{sum(ttft_client)}/{len(client)}; planned with the trace {sum(ttft_traced)}/{len(traced)}; "
        f"against the median of the runs' own p99s {sum(ttft_median)}/{len(ttft_median)}), "
        f"storm call {sum(storms)}/{len(rows)}; {time.time() - started:.0f}s"
    )
    for name in dict.fromkeys(r["workload"] for r in rows):
        first, again = (
            next((r for r in rows if r["workload"] == name and r["setting"] == label), None)
            for label in ("in force", AGAIN)
        )
        if first is not None and again is not None:
            a, b = first["measured"]["ttft_p99_engine_s"], again["measured"]["ttft_p99_engine_s"]
            print(
                f"{name}: the settings in force measured twice: TTFT p99 {a * 1e3:.1f} and {b * 1e3:.1f} ms "
                f"({rel(b, a):+.0%}), output tok/s {first['measured']['output_tokens_per_s']:.0f} and "
                f"{again['measured']['output_tokens_per_s']:.0f}"
            )
    repeated = [r for r in rows if r["error_runs"]]
    if repeated:
        print_runs(repeated)
    sampled = [r for r in rows if r["predicted"].get("ttft_p99_traffic_s")]
    if sampled:
        print_traffic(sampled)
    print_tail(rows)
    print_interval(rows)
    for row in rows:
        if row["setting"].startswith("in force"):
            plan = row["plan"]
            scrapes = f"; {plan['scrapes']}" if plan.get("scrapes") else ""
            print(f"{row['workload']}: {plan['step_time']}{scrapes}; notes: {plan['notes']}")
    write_report(args, rows, duration, earlier)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
