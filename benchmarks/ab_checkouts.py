"""Whole-run A/B of two kvpilot checkouts on the peer-bench workload, fresh processes interleaved.

Each run is ``../shared/peer-bench/peer_throughput.py --backend kvpilot`` in a fresh process, with
``PYTHONPATH`` pointing at a directory whose ``kvpilot`` package is the checkout to measure (``--a``
and ``--b``; an empty string means the installed package). Order per round: a, b; medians of
``--rounds``.

    python benchmarks/ab_checkouts.py --a /tmp/kvhead/pkg --b "" --model ~/.cache/kvpilot-peer/models/small

Prints the medians and writes ``benchmarks/results/ab_checkouts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PEER = Path(__file__).resolve().parents[2] / "shared" / "peer-bench"


def run_once(pythonpath: str, model: str, preset: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    cmd = [
        sys.executable,
        str(PEER / "peer_throughput.py"),
        "--backend",
        "kvpilot",
        "--model",
        model,
        "--preset",
        preset,
        "--repeat",
        "1",
        "--threads",
        str(threads),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp", check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"no RESULT line: {proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="PYTHONPATH of checkout a ('' = installed)")
    ap.add_argument("--b", required=True, help="PYTHONPATH of checkout b ('' = installed)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    tok_s: dict[str, list[float]] = {"a": [], "b": []}
    for _ in range(args.rounds):
        for name, path in (("a", args.a), ("b", args.b)):
            result = run_once(path, args.model, args.preset, args.threads)
            tok_s[name].append(result["output_tok_per_s"])
            print(
                f"{name}: {result['output_tok_per_s']:.1f} out tok/s ({result['elapsed_s']:.1f} s)",
                flush=True,
            )
    ma, mb = statistics.median(tok_s["a"]), statistics.median(tok_s["b"])
    print(f"median a {ma:.1f}, b {mb:.1f} out tok/s: b/a = {mb / ma:.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"ab_checkouts{('_' + args.label) if args.label else ''}.json"
    out.write_text(
        json.dumps(
            {"isa": isa.describe(), "args": vars(args), "out_tok_per_s": tok_s, "ratio_b_over_a": mb / ma},
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
