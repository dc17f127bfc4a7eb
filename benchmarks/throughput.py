"""Offline throughput: kvpilot continuous batching vs kvpilot static batching vs transformers static batching.

One fixed, seeded synthetic workload (token-id prompts of 32-512 tokens, exact output lengths of 16-256
tokens with ``ignore_eos``) on one checkpoint, run three ways:

* ``continuous``: every request submitted to one ``LLM.generate`` call (iteration-level batching).
* ``static``: kvpilot admits a batch of ``--batch-size`` requests together and runs it until its longest
  member ends before the next batch starts (what request-level batching does).
* ``hf``: transformers ``generate`` on left-padded static batches of ``--batch-size``.

Also reports the engine's per-step overhead (scheduling + input preparation + sampling + bookkeeping,
i.e. everything outside the model forward) as a share of step time, overall and over the steps that
ran at least 64 sequences.

    python benchmarks/throughput.py --size 100m --threads 1
    python benchmarks/throughput.py --model /path/to/hf-dir --modes continuous,hf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(os.environ.get("KVPILOT_BENCH_CACHE", Path.home() / ".cache" / "kvpilot-bench"))


@dataclass
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(
    num_requests: int, vocab_size: int, seed: int = 0, prompt_range=(32, 512), output_range=(16, 256)
) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_range)
        items.append(
            WorkItem([rng.randrange(5, vocab_size) for _ in range(plen)], rng.randint(*output_range))
        )
    return items


def ensure_model(args) -> str:
    if args.model:
        return args.model
    from kvpilot.engine.models.synthetic import build_checkpoint

    path = CACHE / f"llama-{args.size}-bf16"
    if not (path / "config.json").exists():
        print(f"building a random {args.size} checkpoint in {path} ...", flush=True)
        build_checkpoint(path, size=args.size, dtype="bfloat16")
    return str(path)


def engine_kwargs(args) -> dict:
    return dict(
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        dtype=args.dtype,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        max_model_len=1024,
        seed=0,
        attention_backend=args.attention_backend,
    )


class StepRecorder:
    """Stat logger: accumulates step and overhead time."""

    def __init__(self) -> None:
        self.steps = []

    def __call__(self, sched_stats, it) -> None:
        self.steps.append(
            (
                it.num_running_seqs,
                it.step_s,
                it.overhead_s,
                it.schedule_s,
                it.prepare_s,
                it.sample_s,
                it.update_s,
            )
        )

    def summary(self, min_running: int = 0) -> dict:
        rows = [s for s in self.steps if s[0] >= min_running]
        if not rows:
            return {"steps": 0}
        step = sum(r[1] for r in rows)
        return {
            "steps": len(rows),
            "step_s": step,
            "overhead_share": sum(r[2] for r in rows) / step,
            "schedule_share": sum(r[3] for r in rows) / step,
            "prepare_share": sum(r[4] for r in rows) / step,
            "sample_share": sum(r[5] for r in rows) / step,
            "update_share": sum(r[6] for r in rows) / step,
        }


def run_kvpilot(model: str, work: list[WorkItem], args, static: bool) -> dict:
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.stats import StepCallback

    t0 = time.perf_counter()
    llm = LLM(model, **engine_kwargs(args))
    init_s = time.perf_counter() - t0

    def params(w):
        return SamplingParams(
            temperature=0.0, max_tokens=w.output_len, min_tokens=w.output_len, ignore_eos=True
        )

    warm = make_workload(2, llm.llm_engine.model_config.vocab_size, seed=99)
    llm.generate(
        [{"prompt_token_ids": w.prompt_token_ids} for w in warm], [params(w) for w in warm], use_tqdm=False
    )
    recorder = StepRecorder()
    llm.llm_engine.stat_loggers.append(StepCallback(recorder))
    outs = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    batches = (
        [work[i : i + args.batch_size] for i in range(0, len(work), args.batch_size)] if static else [work]
    )
    for batch in batches:
        outs += llm.generate(
            [{"prompt_token_ids": w.prompt_token_ids} for w in batch],
            [params(w) for w in batch],
            use_tqdm=False,
        )
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == [w.output_len for w in work], "output lengths differ from the workload"
    return {
        "init_s": init_s,
        "elapsed_s": elapsed,
        # Process CPU time (all threads): with --threads 1 it is the work's own time on a busy machine.
        "cpu_s": cpu_s,
        "steps": llm.llm_engine.num_steps,
        "overhead": recorder.summary(),
        "overhead_at_64_running": recorder.summary(min_running=64),
    }


def run_hf(model: str, work: list[WorkItem], args) -> dict:
    import torch
    import transformers

    dtype = getattr(torch, args.dtype)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    t0 = time.perf_counter()
    for i in range(0, len(work), args.batch_size):
        batch = work[i : i + args.batch_size]
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, w in enumerate(batch):
            ids[j, width - len(w.prompt_token_ids) :] = torch.tensor(w.prompt_token_ids)
            mask[j, width - len(w.prompt_token_ids) :] = 1
        longest = max(w.output_len for w in batch)
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        assert out.shape[1] == width + longest
    return {"elapsed_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face model directory (default: a random checkpoint of --size)")
    ap.add_argument("--size", default="100m", choices=["10m", "100m", "1b"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="static batch size (static and hf modes)")
    ap.add_argument("--modes", default="continuous,static,hf")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument(
        "--attention-backend", default="auto", help="auto | torch | triton | cpu (the C++ CPU kernel)"
    )
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = ap.parse_args(argv)
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = ensure_model(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    work = make_workload(args.num_requests, vocab, seed=args.seed)
    prompt_tokens = sum(len(w.prompt_token_ids) for w in work)
    output_tokens = sum(w.output_len for w in work)
    results = {}
    for mode in args.modes.split(","):
        print(f"running {mode} ...", flush=True)
        if mode == "hf":
            r = run_hf(model, work, args)
        else:
            r = run_kvpilot(model, work, args, static=(mode == "static"))
        r["output_tok_per_s"] = output_tokens / r["elapsed_s"]
        r["total_tok_per_s"] = (prompt_tokens + output_tokens) / r["elapsed_s"]
        if "cpu_s" in r:
            r["output_tok_per_cpu_s"] = output_tokens / r["cpu_s"]
        results[mode] = r

    print(
        f"\nworkload: {len(work)} requests, {prompt_tokens:,} prompt + {output_tokens:,} output tokens; "
        f"model {model}; dtype {args.dtype}; torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'mode':12s} {'elapsed s':>10s} {'out tok/s':>10s} {'total tok/s':>12s} "
        f"{'overhead':>9s} {'@>=64 seqs':>11s} {'out tok/CPU-s':>14s}"
    )
    for mode, r in results.items():
        ov = r.get("overhead", {}).get("overhead_share")
        ov64 = r.get("overhead_at_64_running", {}).get("overhead_share")
        fmt = lambda x: f"{100 * x:8.1f}%" if x is not None else f"{'-':>9s}"
        print(
            f"{mode:12s} {r['elapsed_s']:10.2f} {r['output_tok_per_s']:10.1f} {r['total_tok_per_s']:12.1f} "
            f"{fmt(ov)} {fmt(ov64):>11s} {r.get('output_tok_per_cpu_s', float('nan')):14.1f}"
        )
    if "continuous" in results:
        for other in ("static", "hf"):
            if other in results:
                ratio = results["continuous"]["output_tok_per_s"] / results[other]["output_tok_per_s"]
                print(f"continuous / {other}: {ratio:.2f}x")
    suffix = "" if args.attention_backend == "auto" else f"-{args.attention_backend}"
    out = args.out or RESULTS / f"throughput-{Path(model).name}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "isa": isa.describe(),
        "model": model,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "threads": torch.get_num_threads(),
        "num_requests": len(work),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "batch_size": args.batch_size,
        "results": results,
    }
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
