"""Do the tests catch a broken engine, kernel, scheduler, policy or reconciler? Single-line mutations,
each applied to the working tree in turn, with the tests that cover that code run against it.

A mutation is caught when its tests fail (pytest exits 1). Every mutation must be caught; the script
prints a table, writes ``benchmarks/results/mutation_check.json`` and exits 1 when one survived. Each
file is restored after its run, and once more at the end whatever happened (and the script refuses to
start on a file with uncommitted changes, so a restore can never lose work).

    python benchmarks/mutation_check.py              # every mutation
    python benchmarks/mutation_check.py --only policy-storm-flipped
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "blocks-floor-not-ceil",
        "engine/block_manager.py",
        "return -(-num_tokens // self.block_size)",
        "return num_tokens // self.block_size",
        ("tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py"),
    ),
    Mutation(
        "stop-one-token-late",
        "engine/request.py",
        "if req.num_output_tokens >= req.max_output_tokens:",
        "if req.num_output_tokens > req.max_output_tokens:",
        ("tests/engine/test_scheduler.py", "tests/engine/test_bounds.py"),
    ),
    Mutation(
        "min-tokens-off-by-one",
        "engine/request.py",
        "if req.num_output_tokens >= params.min_tokens:",
        "if req.num_output_tokens > params.min_tokens:",
        ("tests/engine",),
    ),
    Mutation(
        "top-p-strict",
        "engine/sampler.py",
        "below = probs.cumsum(dim=-1) <= rest[:, None]",
        "below = probs.cumsum(dim=-1) < rest[:, None] * 0.5",
        ("tests/engine/test_sampling_vs_hf.py",),
    ),
    Mutation(
        "top-k-one-more-dropped",
        "engine/sampler.py",
        "drop = ranks < (vocab - ks)[:, None]",
        "drop = ranks <= (vocab - ks)[:, None]",
        ("tests/engine/test_sampling_vs_hf.py",),
    ),
    Mutation(
        "softmax-scale-off",
        "kernels/torch_ops.py",
        "q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa",
        "q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale * 1.05, enable_gqa=gqa",
        ("tests/kernels/test_torch_ops.py",),
    ),
    Mutation(
        "preemption-not-counted",
        "engine/scheduler.py",
        "self.num_preemptions_total += 1",
        "self.num_preemptions_total += 0",
        ("tests/engine/test_scheduler.py", "tests/server/test_metrics_unit.py"),
    ),
    Mutation(
        "budget-one-seq-too-many",
        "engine/scheduler.py",
        "return budget > 0 and len(self.running) < self.config.max_num_seqs",
        "return budget > 0 and len(self.running) <= self.config.max_num_seqs",
        ("tests/engine/test_scheduler.py",),
    ),
    Mutation(
        "policy-storm-flipped",
        "operator/remediation/signals.py",
        "and window.preemption_rate > s.preemption_rate",
        "and window.preemption_rate < s.preemption_rate",
        ("tests/operator/test_policy.py",),
    ),
    Mutation(
        "policy-demand-flipped",
        "operator/remediation/signals.py",
        "and all(i.kv_usage >= s.kv_usage_high and i.waiting >= s.waiting_high for i in window.intervals)",
        "and all(i.kv_usage <= s.kv_usage_high and i.waiting >= s.waiting_high for i in window.intervals)",
        ("tests/operator/test_policy.py",),
    ),
    Mutation(
        "blame-misses-the-same-second",
        "operator/remediation/policy.py",
        "0 <= f.time - since <= BLAME_S",
        "0 < f.time - since <= BLAME_S",
        ("tests/operator/test_policy.py",),
    ),
    Mutation(
        "stale-scrape-accepted",
        "operator/remediation/window.py",
        "if last is None or now - last.time > stale_after_s:",
        "if last is None:",
        ("tests/operator/test_window.py", "tests/operator/test_policy.py"),
    ),
    Mutation(
        "evaluate-not-awaited",
        "operator/remediation/loop.py",
        "                await self._evaluate(service, now, logger)",
        "                self._evaluate(service, now, logger)",
        ("tests/operator/test_remediation_tick.py",),
    ),
    Mutation(
        "drift-ignores-list-length",
        "operator/reconcile/drift.py",
        "        if len(live) != len(desired):\n            return path",
        "        if len(live) < len(desired):\n            return path",
        ("tests/operator/test_reconcile.py",),
    ),
    Mutation(
        "rolled-out-with-old-pods",
        "operator/reconcile/status.py",
        "rolled_out = seen and updated >= desired and total == updated",
        "rolled_out = seen and updated >= desired",
        ("tests/operator/test_reconcile.py", "tests/operator/test_effective_status.py"),
    ),
    Mutation(
        "signals-never-refreshed",
        "operator/remediation/evaluate.py",
        "fresh = sampled is not None and now - parse_time(sampled) < SIGNALS_REFRESH_S",
        "fresh = sampled is not None",
        ("tests/operator/test_remediation_status.py",),
    ),
    Mutation(
        "wait-event-swallows-cancel",
        "operator/aio.py",
        "    if event.is_set():\n        return True\n    try:\n"
        "        async with asyncio.timeout(timeout):\n            await event.wait()\n",
        "    try:\n        await asyncio.wait_for(event.wait(), timeout)\n",
        ("tests/operator/test_shutdown.py::test_a_cancel_that_lands_as_the_event_is_set_is_not_swallowed",),
    ),
    Mutation(
        "scrapes-one-after-another",
        "operator/remediation/scrape.py",
        "return list(await asyncio.gather(*(self._one(t) for t in targets)))",
        "return [await self._one(t) for t in targets]",
        ("tests/operator/test_scrape.py",),
    ),
    Mutation(
        "copy-on-write-skipped",
        "engine/block_manager.py",
        "return int(last < len(table) and self.ref_counts[table[last]] > 1)",
        "return int(last < len(table) and self.ref_counts[table[last]] > 2)",
        ("tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py"),
    ),
    Mutation(
        "uncomputed-block-stays-keyed",
        "engine/block_manager.py",
        "                    keyed.append(block)",
        "                    pass",
        ("tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py"),
    ),
    Mutation(
        "in-place-write-keeps-full-key",
        "engine/block_manager.py",
        "        full = self.block_keys[block]\n        if full is not None:",
        "        full = self.block_keys[block]\n        if False:",
        ("tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py"),
    ),
    Mutation(
        "dropped-copy-target-keyed",
        "engine/block_manager.py",
        "if any(dst == block for _, dst in self.pending_copies):",
        "if False:",
        ("tests/engine/test_block_manager.py", "tests/engine/test_scheduler.py"),
    ),
    Mutation(
        "leader-steps-down-late",
        "operator/leader.py",
        "if not renewed and self.clock() - (self.last_renewal or 0.0) >= cfg.renew_deadline:",
        "if not renewed and self.clock() - (self.last_renewal or 0.0) > cfg.renew_deadline:",
        ("tests/operator/test_leader.py",),
    ),
]


def run_one(mutation: Mutation, python: str) -> dict:
    path = ROOT / mutation.path
    original = path.read_text()
    if original.count(mutation.old) != 1:
        return {"name": mutation.name, "status": "stale", "why": "the line is not in the file exactly once"}
    began = time.monotonic()
    try:
        path.write_text(original.replace(mutation.old, mutation.new))
        done = subprocess.run(
            [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    finally:
        path.write_text(original)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    status = {0: "survived", 1: "caught"}.get(done.returncode, f"error (pytest exit {done.returncode})")
    return {
        "name": mutation.name,
        "file": mutation.path,
        "status": status,
        "caught_by": lines[0].removeprefix("FAILED ").split(" - ")[0] if lines else None,
        "seconds": round(time.monotonic() - began, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="run only this mutation (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS / "mutation_check.json")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    touched = sorted({m.path for m in chosen})
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", *touched], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    if dirty:
        print(f"uncommitted changes in files this script mutates; commit or stash them first:\n{dirty}")
        return 2
    python = sys.executable
    rows = []
    try:
        for mutation in chosen:
            row = run_one(mutation, python)
            rows.append(row)
            detail = row.get("caught_by") or row.get("why") or ""
            print(f"{row['status']:>9}  {row['name']:<32} {detail}", flush=True)
    finally:
        subprocess.run(["git", "checkout", "--", *touched], cwd=ROOT, check=True)
    survived = [r for r in rows if r["status"] != "caught"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "survived": [r["name"] for r in survived]}, indent=1))
    print(f"{len(rows) - len(survived)}/{len(rows)} caught; wrote {args.out}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
