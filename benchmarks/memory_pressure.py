"""KV-cache waste of paged allocation, and recompute vs swap preemption under an undersized pool.

1. Waste: the throughput workload (seeded; prompts 32-512, outputs 16-256 tokens) runs with a roomy
   pool. After every step it samples the slots allocated to running requests (blocks x block size) and
   the slots they actually fill, and reports allocated-but-unused / allocated, averaged over steps --
   beside what reserving ``max_model_len`` contiguous slots per running request (the pre-paging
   practice) would waste on the same steps.
2. Preemption: the same workload with a pool sized to a fraction of its peak need, once with
   ``preemption_mode=recompute`` and once with ``swap`` (a CPU pool large enough to hold every victim),
   reporting wall time, preemptions and the prefill tokens computed (recomputation shows up there).

    python benchmarks/memory_pressure.py --size 10m --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from throughput import RESULTS, ensure_model, make_workload


class WasteProbe:
    """Stat logger sampling allocated vs filled KV slots after every step."""

    def __init__(self, engine, max_model_len: int) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self.paged = []
        self.contiguous = []

    def __call__(self, sched_stats, it) -> None:
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        running = [r for r in sched.running if r.req_id in bm.block_tables]
        if not running:
            return
        filled = sum(r.num_computed_tokens for r in running)
        allocated = sum(len(bm.block_tables[r.req_id]) for r in running) * bm.block_size
        self.paged.append(1 - filled / allocated)
        self.contiguous.append(1 - filled / (len(running) * self.max_model_len))


def run(model: str, work, args, **engine_kwargs):
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.stats import StepCallback

    llm = LLM(
        model,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        dtype=args.dtype,
        max_model_len=1024,
        seed=0,
        **engine_kwargs,
    )
    engine = llm.llm_engine
    prefill = []
    engine.stat_loggers.append(StepCallback(lambda s, it: prefill.append(it.num_prefill_tokens)))
    probe = WasteProbe(engine, engine.max_model_len)
    engine.stat_loggers.append(StepCallback(probe))
    params = [
        SamplingParams(temperature=0.0, max_tokens=w.output_len, min_tokens=w.output_len, ignore_eos=True)
        for w in work
    ]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w.prompt_token_ids} for w in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == [w.output_len for w in work]
    stats = engine.stats()
    return {
        "elapsed_s": elapsed,
        "num_gpu_blocks": engine.kv_plan.num_blocks,
        "num_cpu_blocks": engine.num_cpu_blocks,
        "preemptions": stats.num_preemptions_total,
        "swap_fallbacks": stats.num_swap_fallbacks,
        "prefill_tokens_computed": sum(prefill),
        "paged_waste": sum(probe.paged) / len(probe.paged),
        "contiguous_waste": sum(probe.contiguous) / len(probe.contiguous),
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--size", default="10m", choices=["10m", "100m", "1b"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=0.25,
        help="undersized pool, as a fraction of the workload's total KV need",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = ensure_model(args)
    from transformers import AutoConfig

    work = make_workload(args.num_requests, AutoConfig.from_pretrained(model).vocab_size, seed=0)
    need_blocks = sum(-(-(len(w.prompt_token_ids) + w.output_len) // 16) for w in work)
    tight = max(64, int(need_blocks * args.pool_fraction))

    results = {"roomy": run(model, work, args, num_gpu_blocks_override=need_blocks + 64)}
    results["recompute"] = run(model, work, args, num_gpu_blocks_override=tight, preemption_mode="recompute")
    results["swap"] = run(
        model, work, args, num_gpu_blocks_override=tight, preemption_mode="swap", swap_space=4.0
    )
    reference = results["roomy"]["outputs"]
    for r in results.values():
        r["same_outputs_as_roomy"] = r.pop("outputs") == reference

    print(
        f"\nworkload: {len(work)} requests; needs {need_blocks} blocks of 16 at once; "
        f"tight pool {tight} blocks"
    )
    print(
        f"KV waste (allocated but unused slots / allocated), averaged over {args.num_requests}-request run:"
    )
    r = results["roomy"]
    print(
        f"  paged (block 16): {100 * r['paged_waste']:.1f}%   contiguous max_model_len 1024 reservation: "
        f"{100 * r['contiguous_waste']:.1f}%"
    )
    print(
        f"\n{'run':10s} {'blocks':>7s} {'elapsed s':>10s} {'preempt':>8s} {'fallback':>9s} "
        f"{'prefill tok':>12s} same"
    )
    for name, r in results.items():
        print(
            f"{name:10s} {r['num_gpu_blocks']:7d} {r['elapsed_s']:10.2f} {r['preemptions']:8d} "
            f"{r['swap_fallbacks']:9d} {r['prefill_tokens_computed']:12d} {r['same_outputs_as_roomy']}"
        )
    out = args.out or RESULTS / f"memory-pressure-{Path(model).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "isa": isa.describe(),
                "model": model,
                "need_blocks": need_blocks,
                "tight_blocks": tight,
                "results": results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
