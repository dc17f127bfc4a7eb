"""What one full garbage collection costs in a serving process, with and without the start-up heap
frozen (``engine.gc_heap.freeze_startup_heap``, which ``kvpilot serve`` calls before it listens).

A full (generation 2) collection stops every thread of the process while it walks every tracked
object, so the engine's step and every request's first token wait for it. This builds what
``kvpilot serve`` holds when it starts serving, in this process: the engine on a random-weight
checkpoint built here (or ``--model``), its Prometheus metrics, the async engine, the server's own
tokenizer and the app. With ``--requests`` requests in flight in the engine (so the heap holds what
serving allocates too) it times ``--rounds`` full collections; then, once those are done, it freezes
the heap the way the server does, puts as many new requests in flight, and times as many again.
Prints a table (the CPU's ISA line first) and writes ``benchmarks/results/gc_pause.json``.

    cd /tmp && python /path/to/benchmarks/gc_pause.py
    cd /tmp && python /path/to/benchmarks/gc_pause.py --model /path/to/checkpoint --rounds 9
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def full_collections(rounds: int) -> list[float]:
    """Seconds of each of ``rounds`` back-to-back full collections."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - start)
    return out


def serving_heap(model: Path) -> tuple[Any, Any]:
    """What ``kvpilot serve`` builds before it listens: (LLMEngine, the app)."""
    from transformers import AutoTokenizer

    from kvpilot.engine.async_engine import AsyncEngine
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.metrics import PrometheusStatLogger
    from kvpilot.engine.server.app import build_app
    from kvpilot.engine.server.serving import ServerState

    engine = LLMEngine(EngineArgs(model=str(model), device="cpu", max_model_len=512, max_num_seqs=16))
    metrics = PrometheusStatLogger.from_engine(engine, "llm")
    engine.stat_loggers.append(metrics)
    state = ServerState(
        engine=AsyncEngine(engine),
        tokenizer=AutoTokenizer.from_pretrained(str(model)),
        served_model_names=["llm"],
        model_dir=str(model),
        max_model_len=engine.max_model_len,
        metrics=metrics,
    )
    return engine, build_app(state)


def add_requests(engine: Any, requests: int, prefix: str = "") -> None:
    """Queue ``requests`` 64-token prompts, each to run to 32 output tokens."""
    from kvpilot.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    for i in range(requests):
        engine.add_request(f"{prefix}r{i}", [(i * 7 + j) % 900 + 5 for j in range(64)], params)


def run_steps(engine: Any, steps: int | None = None) -> int:
    """Step the engine ``steps`` times (None: until no request is left); output tokens finished."""
    tokens = 0
    while engine.has_unfinished_requests() and (steps is None or steps > 0):
        steps = None if steps is None else steps - 1
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a checkpoint directory (default: a random-weight one)")
    ap.add_argument("--rounds", type=int, default=7, help="full collections timed per side")
    ap.add_argument("--requests", type=int, default=64, help="requests in flight on the frozen side")
    ap.add_argument("--out", type=Path, default=RESULTS / "gc_pause.json")
    args = ap.parse_args(argv)

    from kvpilot.engine.gc_heap import freeze_startup_heap
    from kvpilot.kernels import isa

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kvpilot.engine.models.synthetic import build_checkpoint

            model = Path(tmp) / "model"
            build_checkpoint(model, size="test", dtype="float32", max_position_embeddings=512)
        engine, app = serving_heap(model)
        # Each side with the same requests in flight (the prompts in, some tokens out).
        add_requests(engine, args.requests)
        tokens = run_steps(engine, 8)
        tracked = len(gc.get_objects())
        before = full_collections(args.rounds)
        tokens += run_steps(engine)
        frozen = freeze_startup_heap()
        add_requests(engine, args.requests, "again-")
        tokens += run_steps(engine, 8)
        left = len(gc.get_objects())
        after = full_collections(args.rounds)
        tokens += run_steps(engine)
        gc.unfreeze()
        del app
        engine.shutdown()

    b, a = statistics.median(before), statistics.median(after)
    flight = f"{args.requests} requests in flight"
    print(isa.summary_line())
    print(f"python {platform.python_version()}; model {args.model or 'random-weight test size'}")
    print(f"{'':40}{'tracked objects':>16}{'full gc, median':>17}{'max':>10}")
    sides = (("as started, " + flight, tracked, before), ("frozen, " + flight, left, after))
    for label, count, times in sides:
        median = statistics.median(times)
        print(f"{label:40}{count:>16,}{median * 1e3:>14.2f} ms{max(times) * 1e3:>7.2f} ms")
    print(f"frozen {frozen:,} objects; a full collection takes {a / b:.5f}x the time ({tokens} tokens out)")
    report = {
        "python": platform.python_version(),
        "isa": isa.describe(),
        "model": str(args.model) if args.model else "random-weight test size",
        "tracked_objects_before": tracked,
        "tracked_objects_after": left,
        "frozen_objects": frozen,
        "full_gc_s_before": before,
        "full_gc_s_after": after,
        "median_ratio": a / b,
        "requests": args.requests,
        "output_tokens": tokens,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
