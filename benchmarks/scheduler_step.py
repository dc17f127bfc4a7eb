"""The scheduler's own cost per engine step (torch-free): ``schedule()`` plus ``update_from_output()``
for N sequences that decode together, with no model behind them.

This is the Python a step spends deciding before and after the forward pass, in the engine and in
``kvpilot plan``'s simulator alike (which runs the same scheduler on a simulated clock). Each round
builds a fresh scheduler and block manager, adds N requests of 100-token prompts, runs the prefill
steps and ``--warmup`` decode steps, then times ``--steps`` decode steps; the table gives the best and
the median round. Run it in two checkouts (``PYTHONPATH``) for an A/B.

    python benchmarks/scheduler_step.py                       # N = 32 and 256, prefix caching on and off
    python benchmarks/scheduler_step.py --num-seqs 256 --rounds 9

Prints a table and writes ``benchmarks/results/scheduler_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import SchedulerConfig

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LEN = 100
BLOCK_SIZE = 16


def one_round(num_seqs: int, prefix_caching: bool, warmup: int, steps: int) -> float:
    """Seconds per decode step of ``num_seqs`` sequences, over ``steps`` steps after the warm-up."""
    blocks = num_seqs * -(-(PROMPT_LEN + warmup + steps + 1) // BLOCK_SIZE)
    bm = BlockManager(blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs * PROMPT_LEN), max_model_len=4096
    )
    scheduler = Scheduler(config, bm)
    params = SamplingParams(max_tokens=warmup + steps + 10, ignore_eos=True)
    for i in range(num_seqs):
        # Distinct prompts: nothing shared, so prefix caching keys every full block and hits none.
        scheduler.add_request(Request(f"r{i}", list(range(i, i + PROMPT_LEN)), params, eos_token_id=None))

    def step() -> None:
        out = scheduler.schedule()
        ids = [item.req_id for item in out.scheduled if item.do_sample]
        scheduler.update_from_output(out, ModelRunnerOutput(ids, [7] * len(ids), [None] * len(ids)))

    for _ in range(warmup + 1):  # the prefill step, then decodes
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    assert len(scheduler.running) == num_seqs, "every sequence must still be decoding"
    return elapsed / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=350)
    parser.add_argument("--out", type=Path, default=RESULTS / "scheduler_step.json")
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rows = []
    print(f"{'SEQS':>5} {'PREFIX CACHE':>12} {'BEST us/step':>13} {'MEDIAN us/step':>15}")
    for num_seqs in args.num_seqs:
        for prefix_caching in (True, False):
            times = [one_round(num_seqs, prefix_caching, args.warmup, args.steps) for _ in range(args.rounds)]
            row = {
                "num_seqs": num_seqs,
                "prefix_caching": prefix_caching,
                "best_us_per_step": min(times) * 1e6,
                "median_us_per_step": statistics.median(times) * 1e6,
            }
            rows.append(row)
            print(
                f"{num_seqs:5d} {'on' if prefix_caching else 'off':>12} {row['best_us_per_step']:13.0f} "
                f"{row['median_us_per_step']:15.0f}"
            )
    report = {"python": platform.python_version(), "machine": platform.machine(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
