"""What JSON-schema constraints cost: 64 sequences, half of them constrained, against none.

Both runs decode the same 64 seeded prompts for ``--max-tokens`` tokens each at temperature 1 on a
random-weight checkpoint. In the constrained run, 32 of them follow a JSON schema (an array of at least
20 objects with string, integer and enum fields) whose shortest document is longer than
``--max-tokens``, so every sequence runs to its cap in both runs and the batches match step for step.
Prints output tok/s both ways and their ratio, the grammar's compile time, the mask fill per step on
the worker thread and how much of it the forward hid, and writes
``benchmarks/results/structured_outputs.json``; the CPU's ISA line comes first.

    python benchmarks/structured_outputs.py --size 10m --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from throughput import RESULTS, ensure_model

NUM_SEQS = 64
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": ITEM, "minItems": 20}},
    "required": ["people"],
    "additionalProperties": False,
}


def run(llm, prompts: list[list[int]], num_constrained: int, max_tokens: int) -> dict:
    from kvpilot.engine import SamplingParams
    from kvpilot.engine.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured_outputs=so if i % 2 == 0 and i // 2 < num_constrained else None,
        )
        for i in range(len(prompts))
    ]
    runner_so = llm.llm_engine.runner.structured_output
    before = (runner_so.timings.num_steps, runner_so.timings.fill_s, runner_so.timings.wait_s)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = runner_so.timings.num_steps - before[0]
    fill = runner_so.timings.fill_s - before[1]
    wait = runner_so.timings.wait_s - before[2]
    constrained = [o.outputs[0] for o, p in zip(outs, params, strict=True) if p.structured_outputs]
    return {
        "num_constrained": num_constrained,
        "wall_s": wall,
        "output_tokens": num_tokens,
        "output_tok_per_s": num_tokens / wall,
        "constrained_steps": steps,
        "mask_fill_ms_per_step": 1e3 * fill / steps if steps else 0.0,
        "mask_wait_ms_per_step": 1e3 * wait / steps if steps else 0.0,
        "mask_overlap_fraction": (fill - wait) / fill if fill else 0.0,
        "all_ran_to_the_cap": all(o.finish_reason == "length" for o in constrained),
        "sample_output": constrained[0].text[:120] if constrained else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint directory (default: build a random --size one)")
    ap.add_argument("--size", default="10m", help="random checkpoint size: test | 10m | 100m | 1b")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode; the best is reported")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model = ensure_model(args)
    from kvpilot.engine import LLM
    from kvpilot.engine.sampling_params import StructuredOutputsParams

    llm = LLM(
        model,
        dtype=args.dtype,
        block_size=16,
        max_num_seqs=NUM_SEQS,
        max_model_len=1024,
        num_gpu_blocks_override=NUM_SEQS * (-(-(args.prompt_len + args.max_tokens) // 16)) + 16,
        enable_prefix_caching=False,
        seed=0,
    )
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab - 8) for _ in range(args.prompt_len)] for _ in range(NUM_SEQS)]

    compiler = engine.input_processor.grammar_compiler
    t0 = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=SCHEMA))
    compile_s = time.perf_counter() - t0

    run(llm, prompts[:8], 4, 8)  # warm-up: kernels, allocator, the worker thread
    # The modes alternate, so that a machine busier in one part of the run favours neither.
    modes = {"unconstrained": 0, "half_constrained": NUM_SEQS // 2}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, num_constrained in modes.items():
            runs[name].append(run(llm, prompts, num_constrained, args.max_tokens))
    results = {name: max(rs, key=lambda r: r["output_tok_per_s"]) for name, rs in runs.items()}
    ratio = results["half_constrained"]["output_tok_per_s"] / results["unconstrained"]["output_tok_per_s"]

    print(
        f"model {model} (vocab {vocab}), {NUM_SEQS} sequences x {args.max_tokens} tokens, "
        f"best of {args.repeats}"
    )
    print(f"grammar compile (first, uncached): {compile_s * 1e3:.1f} ms")
    print(f"{'mode':<18} {'tok/s':>9} {'wall s':>8} {'fill ms/step':>13} {'wait ms/step':>13} {'overlap':>8}")
    for name, r in results.items():
        print(
            f"{name:<18} {r['output_tok_per_s']:>9.1f} {r['wall_s']:>8.2f} "
            f"{r['mask_fill_ms_per_step']:>13.3f} {r['mask_wait_ms_per_step']:>13.3f} "
            f"{r['mask_overlap_fraction']:>7.0%}"
        )
    print(f"ratio half-constrained / unconstrained: {ratio:.3f}")
    assert results["half_constrained"]["all_ran_to_the_cap"], "a constrained sequence ended early"

    out = args.out or RESULTS / "structured_outputs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "isa": isa.describe(),
                "model": model,
                "vocab_size": vocab,
                "num_seqs": NUM_SEQS,
                "max_tokens": args.max_tokens,
                "threads": torch.get_num_threads(),
                "compile_ms": compile_s * 1e3,
                "results": results,
                "tok_per_s_ratio": ratio,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
