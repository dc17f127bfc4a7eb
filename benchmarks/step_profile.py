"""Where one engine step goes at N running decode sequences: attention, linears, elementwise, sampler,
Python input preparation, output processing.

Builds an ``LLMEngine`` on a checkpoint (``--dtype``, bf16 by default), adds ``--num-seqs`` requests
with ``--prompt-len`` token prompts, steps until every one of them decodes, then profiles ``--steps``
decode steps with
``torch.profiler`` (op self times grouped by category) and times the phases of ``LLMEngine.step`` by
process CPU time (meaningful on a shared machine at one thread) and wall time.

    python benchmarks/step_profile.py --model ~/.cache/kvpilot-peer/models/small --threads 1

Prints a table and writes ``benchmarks/results/step_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# Op name (substring, first match wins) -> category.
CATEGORIES = [
    ("paged_attention", "attention"),
    ("scaled_dot_product", "attention"),
    ("linear", "linears"),  # aten::linear and kvpilot::linear_bf16w
    ("addmm", "linears"),
    ("aten::mm", "linears"),
    ("matmul", "linears"),
    ("mkldnn", "linears"),
    ("index_put", "kv write"),
    ("index_copy", "kv write"),
    ("argmax", "sampler"),
    ("aten::max", "sampler"),
    ("log_softmax", "sampler"),
]


def category(name: str) -> str:
    for key, cat in CATEGORIES:
        if key in name:
            return cat
    return "elementwise / other ops"


def make_engine(args):
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=1024,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=2 << 30,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
        )
    )


def fill(engine, args, vocab: int) -> None:
    from kvpilot.engine import SamplingParams

    g = torch.Generator().manual_seed(0)
    for i in range(args.num_seqs):
        prompt = torch.randint(10, vocab - 1, (args.prompt_len,), generator=g).tolist()
        params = SamplingParams(max_tokens=1000 - args.prompt_len, ignore_eos=True, temperature=0)
        engine.add_request(f"r{i}", prompt, params)
    # Prefill everything, then a few decode steps to warm caches and allocators.
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(5):
        engine.step()


def timed_phases(engine, steps: int) -> tuple[dict[str, float], float]:
    """Median per-step CPU ms of each phase of ``LLMEngine.step`` (same calls, timed one by one), and
    the median bytes of the step message a worker rank would be sent (the pickled ``SchedulerOutput``)."""
    import pickle

    from kvpilot.engine.request import RequestStatus

    phases = defaultdict(list)
    message_bytes = []
    for _ in range(steps):
        c0 = time.process_time()
        w0 = time.perf_counter()
        sched_out = engine.scheduler.schedule()
        c1 = time.process_time()
        p0 = time.perf_counter()  # the measurement is not part of any phase
        message_bytes.append(len(pickle.dumps(("execute", sched_out), protocol=pickle.HIGHEST_PROTOCOL)))
        pickle_wall = time.perf_counter() - p0
        c1b = time.process_time()
        runner_out = engine.executor.execute(sched_out)
        c2 = time.process_time()
        core_outputs = engine.scheduler.update_from_output(sched_out, runner_out)
        c3 = time.process_time()
        processed = engine.output_processor.process(core_outputs, time.monotonic())
        engine.scheduler.finish_requests(processed.stop_ids, RequestStatus.FINISHED_STOPPED)
        engine.output_processor.make_outputs(processed)
        c4 = time.process_time()
        w4 = time.perf_counter()
        phases["schedule"].append(c1 - c0)
        phases["prepare inputs"].append(runner_out.prepare_s)
        phases["forward"].append(runner_out.forward_s)
        phases["sample"].append(runner_out.sample_s)
        phases["execute (all)"].append(c2 - c1b)
        phases["update_from_output"].append(c3 - c2)
        phases["output processing"].append(c4 - c3)
        phases["step (cpu)"].append((c1 - c0) + (c4 - c1b))
        phases["step (wall)"].append(w4 - w0 - pickle_wall)
    return {k: 1000 * statistics.median(v) for k, v in phases.items()}, statistics.median(message_bytes)


def label_attention(engine) -> None:
    """Make the attention ops and the weight-panel linears visible to the profiler: a C++
    extension's pybind call is not a dispatcher op, so its time would otherwise count as Python."""
    import copy
    import dataclasses

    from torch.profiler import record_function

    from kvpilot.engine.models.layers import PanelWeight

    def labelled(name, fn):
        def call(*a, **k):
            with record_function(name):
                return fn(*a, **k)

        return call

    b = engine.model.backend
    fused = None
    if b.fused is not None:
        fused = copy.copy(b.fused)
        for name in ("rms_norm", "add_rms_norm_", "rotary_", "silu_and_mul"):
            setattr(fused, name, labelled(f"kvpilot::{name}", getattr(b.fused, name)))
    labelled_backend = dataclasses.replace(
        b,
        paged_attention=labelled("kvpilot::paged_attention", b.paged_attention),
        write_kv_cache=labelled("kvpilot::write_kv_cache", b.write_kv_cache),
        fused=fused,
    )
    for module in engine.model.modules():
        if getattr(module, "backend", None) is b:
            module.backend = labelled_backend
        # float32 linears over bfloat16 weight panels call the extension too.
        packed = getattr(module, "packed_weight", None)
        if type(packed) is PanelWeight:
            packed.op = labelled("kvpilot::linear_bf16w", packed.op)


def op_profile(engine, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    cats: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        # record_function ranges report their children's time as their own too: count only the
        # attention kernel's (the write's children are index ops, counted by name).
        if ev.key == "kvpilot::write_kv_cache":
            continue
        cats[category(ev.key)] += ev.self_cpu_time_total / 1000.0 / steps  # us -> ms per step
    total_ops = sum(cats.values())
    cats["python / outside ops"] = max(0.0, 1000 * wall / steps - total_ops)
    cats["step (wall, profiled)"] = 1000 * wall / steps
    return dict(cats)


def top_ops(engine, steps: int, n: int) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    evs = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [(e.key, e.self_cpu_time_total / 1000.0 / steps, e.count // steps) for e in evs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/kvpilot-peer/models/small"))
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--dtype", default="bfloat16", help="the engine's dtype (auto: its choice for this CPU)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    torch.set_num_threads(args.threads)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    engine = make_engine(args)
    fill(engine, args, vocab)
    running = len(engine.scheduler.running)
    phases, message_bytes = timed_phases(engine, args.steps)
    label_attention(engine)
    cats = op_profile(engine, args.steps)
    tops = top_ops(engine, max(2, args.steps // 2), args.top)
    print(f"{running} running decode sequences, {args.threads} thread(s), {args.model}")
    print("phases of a step (median ms, CPU time; prepare/forward/sample: wall inside execute)")
    for k, v in phases.items():
        print(f"  {k:28s} {v:8.2f}")
    print(f"  {'step message to a rank (B)':28s} {message_bytes:8.0f}")
    print("op self time by category (ms per step, torch.profiler)")
    for k, v in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v:8.2f}")
    print("top ops (ms per step, calls per step)")
    for name, ms, count in tops:
        print(f"  {name[:48]:48s} {ms:8.2f} {count:6d}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"step_profile{('_' + args.label) if args.label else ''}.json"
    out.write_text(
        json.dumps(
            {
                "isa": isa.describe(),
                "model": args.model,
                "threads": args.threads,
                "running": running,
                "phases_ms": phases,
                "step_message_bytes": message_bytes,
                "categories_ms": cats,
                "top_ops": tops,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
