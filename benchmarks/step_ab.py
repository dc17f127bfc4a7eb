"""A/B of the CPU forward's speed-ups within one process, at N running decode sequences.

One engine (bf16) with ``--num-seqs`` requests decoding; decode steps alternate between variants
that switch the oneDNN-prepacked linears and the fused decoder-layer ops on or off, so that every
variant sees the same machine load and the same context lengths. Per-step process CPU time (the
meaningful figure on a shared machine at one thread) and wall time, medians over ``--rounds``.

    python benchmarks/step_ab.py --model ~/.cache/kvpilot-peer/models/small --threads 1

Prints a table and writes ``benchmarks/results/step_ab.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from kvpilot.engine.models.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from kvpilot.kernels import isa

RESULTS = Path(__file__).resolve().parent / "results"


def set_variant(engine, packed: dict, prepack: bool, fused) -> None:
    model = engine.model
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            module.packed_weight = packed.get(module) if prepack else None
        if hasattr(module, "backend") and module.backend is not None:
            module.backend = dataclasses.replace(module.backend, fused=fused)


def main() -> None:
    from step_profile import fill, make_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/kvpilot-peer/models/small"))
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(isa.summary_line(), flush=True)
    torch.set_num_threads(args.threads)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    engine = make_engine(args)
    fill(engine, args, vocab)
    packed = {
        m: m.packed_weight
        for m in engine.model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
        and m.packed_weight is not None
    }
    fused = engine.model.backend.fused
    variants = {
        "baseline (F.linear, torch elementwise)": (False, None),
        "prepacked linears": (True, None),
        "fused elementwise": (False, fused),
        "prepacked + fused": (True, fused),
    }
    cpu = {k: [] for k in variants}
    wall = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, (prepack, f) in variants.items():
            set_variant(engine, packed, prepack, f)
            c, w = time.process_time(), time.perf_counter()
            engine.step()
            cpu[name].append(1000 * (time.process_time() - c))
            wall[name].append(1000 * (time.perf_counter() - w))
    set_variant(engine, packed, True, fused)
    base = statistics.median(cpu["baseline (F.linear, torch elementwise)"])
    print(f"{len(engine.scheduler.running)} running decodes, {args.threads} thread(s), {args.rounds} rounds")
    print(f"  {'variant':40s} {'cpu ms':>8s} {'wall ms':>8s} {'speed-up':>8s}")
    rows = {}
    for name in variants:
        mc, mw = statistics.median(cpu[name]), statistics.median(wall[name])
        rows[name] = {"cpu_ms": mc, "wall_ms": mw, "speedup_cpu": base / mc}
        print(f"  {name:40s} {mc:8.2f} {mw:8.2f} {base / mc:8.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "step_ab.json"
    out.write_text(
        json.dumps(
            {"isa": isa.describe(), "model": args.model, "threads": args.threads, "variants": rows}, indent=2
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
