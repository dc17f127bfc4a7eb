"""Tensor / pipeline parallelism: throughput and KV-pool size per layout on one checkpoint.

For each layout ``TPxPP[@threads]`` (threads = torch threads per rank, default ``--threads``) this runs the
continuous-batching workload of ``throughput.py`` (same seeded prompts and exact output lengths) and
reports elapsed time, output tokens/s, the per-rank weight bytes, and the KV blocks that the start-up
planner fits in a fixed per-rank memory budget (``--cpu-memory-budget-gib`` x ``--gpu-memory-utilization``,
CPU only). Greedy outputs are compared with the first layout's.

    python benchmarks/parallel.py --model /tmp/llama-100m --layouts 1x1@1,1x1@2,2x1@1,1x2@1
    python benchmarks/parallel.py --model /tmp/llama-100m --layouts 1x2@1 --pipeline-micro-batches 2

Pipeline micro-batching (``pipeline_micro_batches``) is off by default because it did not pay on CPU:
measured on the 100M checkpoint with two 1-thread stages on 2 cores, 2 micro-batches ran at 0.64x the
speed of 1 (smaller matmuls, and each blocking gloo send waits for the next stage's receive).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import RESULTS, engine_kwargs, make_workload  # noqa: E402


def parse_layout(text: str, default_threads: int) -> tuple[int, int, int]:
    """``2x1@1`` -> (tensor_parallel_size, pipeline_parallel_size, threads per rank)."""
    sizes, _, threads = text.partition("@")
    tp, _, pp = sizes.partition("x")
    return int(tp), int(pp or 1), int(threads or default_threads)


def run_layout(model: str, tp: int, pp: int, threads: int, work, args) -> dict:
    import torch

    from kvpilot.engine import LLM, SamplingParams

    # The executor splits the driver's threads over the ranks: give it threads x ranks.
    torch.set_num_threads(threads * tp * pp)
    common = engine_kwargs(args)
    common.update(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pipeline_micro_batches=args.pipeline_micro_batches,
    )
    # --kv-cache-gib is the pool of all ranks together; the budget run sizes its pool itself.
    kv_cache_bytes = int(common.pop("kv_cache_memory_bytes") / (tp * pp))
    budget = int(args.cpu_memory_budget_gib * 2**30)
    with LLM(
        model, cpu_memory_budget_bytes=budget, gpu_memory_utilization=args.gpu_memory_utilization, **common
    ) as sized:
        engine = sized.llm_engine
        executor = engine.executor
        reports = getattr(executor, "reports", None)
        weights = (
            [r.weight_bytes for r in reports]
            if reports
            else [sum(p.numel() * p.element_size() for p in engine.model.parameters())]
        )
        budget_blocks = engine.kv_plan.num_blocks
        kv_bytes_per_block = engine.kv_plan.bytes_per_block
    t0 = time.perf_counter()
    llm = LLM(model, kv_cache_memory_bytes=kv_cache_bytes, **common)
    init_s = time.perf_counter() - t0
    try:

        def params(w):
            return SamplingParams(
                temperature=0.0, max_tokens=w.output_len, min_tokens=w.output_len, ignore_eos=True
            )

        warm = make_workload(2, llm.llm_engine.model_config.vocab_size, seed=99)
        llm.generate(
            [{"prompt_token_ids": w.prompt_token_ids} for w in warm],
            [params(w) for w in warm],
            use_tqdm=False,
        )
        engine = llm.llm_engine
        executor = engine.executor
        timing = {"step_s": 0.0, "execute_s": 0.0, "prepare_s": 0.0}
        step, execute = engine.step, executor.execute

        def timed_step():
            t = time.perf_counter()
            try:
                return step()
            finally:
                timing["step_s"] += time.perf_counter() - t

        def timed_execute(sched_out):
            t = time.perf_counter()
            out = execute(sched_out)
            timing["execute_s"] += time.perf_counter() - t
            timing["prepare_s"] += out.prepare_s
            return out

        engine.step, executor.execute = timed_step, timed_execute
        steps_before = engine.num_steps
        bytes_before = getattr(executor, "step_bytes_sent", 0)
        messages_before = getattr(executor, "num_step_messages", 0)
        t0 = time.perf_counter()
        outs = llm.generate(
            [{"prompt_token_ids": w.prompt_token_ids} for w in work],
            [params(w) for w in work],
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - t0
        steps = llm.llm_engine.num_steps
        timed_steps = max(1, steps - steps_before)
        step_bytes = getattr(executor, "step_bytes_sent", 0) - bytes_before
        step_messages = getattr(executor, "num_step_messages", 0) - messages_before
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in tokens] == [w.output_len for w in work], "output lengths differ from the workload"
    return {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "threads_per_rank": threads,
        "cores_used": threads * tp * pp,
        "init_s": init_s,
        "elapsed_s": elapsed,
        "steps": steps,
        # Step messages to the worker ranks (0 on one rank): bytes per broadcast, all workers' copies.
        "step_messages": step_messages,
        "step_bytes_sent": step_bytes,
        "bytes_per_step_message": step_bytes / step_messages if step_messages else 0.0,
        # Python time per step on the driver: the core around execute (schedule, update, outputs), and
        # the sampling rank's input preparation (flattening the step into tensors).
        "core_ms_per_step": 1000 * (timing["step_s"] - timing["execute_s"]) / timed_steps,
        "prepare_ms_per_step": 1000 * timing["prepare_s"] / timed_steps,
        "weight_bytes_per_rank": weights,
        "kv_bytes_per_block_per_rank": kv_bytes_per_block,
        "kv_blocks_in_budget": budget_blocks,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--layouts", default="1x1@1,1x1@2,2x1@1,1x2@1", help="TPxPP[@threads per rank], ...")
    ap.add_argument("--threads", type=int, default=1, help="default torch threads per rank")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--kv-cache-gib", type=float, default=0.5, help="KV cache of the throughput runs (all ranks)"
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--attention-backend", default="auto", help="auto | torch | triton | cpu")
    ap.add_argument("--pipeline-micro-batches", type=int, default=1, help="with pipeline stages")
    ap.add_argument("--cpu-memory-budget-gib", type=float, default=1.0, help="per-rank budget for KV sizing")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = ap.parse_args(argv)
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    work = make_workload(args.num_requests, vocab, seed=args.seed)
    prompt_tokens = sum(len(w.prompt_token_ids) for w in work)
    output_tokens = sum(w.output_len for w in work)
    results = []
    load_before = os.getloadavg()
    for text in args.layouts.split(","):
        tp, pp, threads = parse_layout(text, args.threads)
        print(f"running {tp}x{pp} with {threads} thread(s) per rank ...", flush=True)
        r = run_layout(args.model, tp, pp, threads, work, args)
        r["output_tok_per_s"] = output_tokens / r["elapsed_s"]
        r["total_tok_per_s"] = (prompt_tokens + output_tokens) / r["elapsed_s"]
        results.append(r)

    base = results[0]
    print(
        f"\nworkload: {len(work)} requests, {prompt_tokens:,} prompt + {output_tokens:,} output tokens; "
        f"model {args.model}; dtype {args.dtype}; KV sizing budget {args.cpu_memory_budget_gib} GiB x "
        f"{args.gpu_memory_utilization} per rank; load average before {load_before}, after {os.getloadavg()}"
    )
    print(
        f"{'layout':>8s} {'thr/rank':>8s} {'cores':>5s} {'elapsed s':>10s} {'out tok/s':>10s} "
        f"{'vs first':>8s} {'weights/rank MiB':>17s} {'KV blocks':>10s} {'same seqs':>10s} "
        f"{'B/step':>8s} {'core ms':>8s} {'prep ms':>8s}"
    )
    for r in results:
        # Greedy sequences identical to the first layout's (bfloat16 sums in another order can flip
        # near-ties of a random-weight model; float32 matches exactly).
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"], strict=True))
        print(
            f"{r['tensor_parallel_size']}x{r['pipeline_parallel_size']:<6d} {r['threads_per_rank']:8d} "
            f"{r['cores_used']:5d} {r['elapsed_s']:10.2f} {r['output_tok_per_s']:10.1f} "
            f"{r['output_tok_per_s'] / base['output_tok_per_s']:7.2f}x "
            f"{max(r['weight_bytes_per_rank']) / 2**20:17.1f} {r['kv_blocks_in_budget']:10,d} "
            f"{f'{same}/{len(work)}':>10s} {r['bytes_per_step_message']:8.0f} "
            f"{r['core_ms_per_step']:8.2f} {r['prepare_ms_per_step']:8.2f}"
        )
        r["same_sequences_as_first"] = same
    out = args.out or RESULTS / f"parallel-{Path(args.model).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "isa": isa.describe(),
        "model": args.model,
        "dtype": args.dtype,
        "num_requests": len(work),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cpu_memory_budget_gib": args.cpu_memory_budget_gib,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "pipeline_micro_batches": args.pipeline_micro_batches,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
    }
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
