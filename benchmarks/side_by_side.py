"""kvpilot against vLLM's CPU build (and transformers' static batching) on one workload, side by side.

Runs ``../shared/peer-bench/peer_throughput.py`` (the shared workload definition: preset ``default`` is
64 requests, 17,709 prompt + 8,885 output tokens, greedy, exact output lengths) as fresh processes,
interleaved kvpilot, vLLM, kvpilot, ... for each checkpoint and setting:

- ``1 thread``: both on one compute thread (kvpilot ``--threads 1``; vLLM's worker bound to core 0);
- ``whole box``: each at its best on every core (kvpilot on all of them; vLLM with its default
  binding, its worker and its front end on cores of their own);

for each dtype setting (``--settings``: kvpilot's and vLLM's ``--dtype``), then transformers' static
batching (batch 8) on the first checkpoint at one thread. The CPU's ISA flags head the output and the
JSON (bfloat16 figures differ several times between CPUs with and without native bfloat16). Prints the
table
of medians and ratios that the README's benchmark section shows, and writes
``benchmarks/results/side_by_side.json`` with every run.

    cd /tmp && python /path/to/benchmarks/side_by_side.py --rounds 2 \\
        --vllm-python ~/.cache/kvpilot-peer/vllm-venv/bin/python

``--baseline DIR`` runs a second kvpilot checkout (``DIR`` on ``PYTHONPATH``) before the installed one in
every round, against the same vLLM runs: a change's before and after in one run, each as a ratio to
the peer and to each other.

Checkpoints: ``$PEER/models/{tiny,small}`` built by the peer bench's ``make_tiny_model.py`` (``$PEER``
defaults to ``~/.cache/kvpilot-peer``). kvpilot runs with this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PEER_BENCH = HERE.parent.parent / "shared" / "peer-bench"


def run(
    python: str,
    backend: str,
    model: Path,
    threads: int,
    preset: str,
    log: Path,
    pythonpath: str | None = None,
    **extra,
) -> dict:
    """One fresh process of ``peer_throughput.py``; its RESULT line as a dict (``{}`` when it failed).
    ``pythonpath``: import kvpilot from that checkout instead of the installed one."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if backend == "vllm":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else "auto"
    command = [python, str(PEER_BENCH / "peer_throughput.py"), "--backend", backend, "--model", str(model)]
    command += ["--preset", preset, "--repeat", "1", "--threads", str(threads)]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd="/tmp")
    log.write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    return json.loads(lines[-1].split("RESULT", 1)[1]) if lines else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer = Path(os.environ.get("PEER", Path.home() / ".cache" / "kvpilot-peer"))
    parser.add_argument("--vllm-python", default=str(peer / "vllm-venv" / "bin" / "python"))
    parser.add_argument(
        "--models",
        default="tiny,small",
        help="checkpoints under $PEER/models, each NAME or NAME=PRESET (a preset of its own)",
    )
    parser.add_argument("--preset", default="default", help="the workload preset of a model without one")
    parser.add_argument(
        "--settings",
        default="bf16=bfloat16:bfloat16",
        help="comma-separated LABEL=KVPILOT_DTYPE:VLLM_DTYPE; e.g. defaults=auto:auto (each engine as a "
        "user starts it) and best=auto:float32 (vLLM's fastest dtype on a CPU without native bfloat16)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the whole box")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' static batching")
    parser.add_argument(
        "--baseline",
        default="",
        help="a kvpilot checkout (a directory to put on PYTHONPATH) run before the installed one in every "
        "round: before and after against the same peer runs",
    )
    args = parser.parse_args()
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    settings = [item.split("=", 1) for item in args.settings.split(",")]
    logs = peer / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    table: list[tuple[str, list[float], list[float]]] = []
    models = [(item.split("=", 1) + [args.preset])[:2] for item in args.models.split(",")]
    for name, preset in models:
        model = peer / "models" / name
        for label, dtypes in settings:
            ours_dtype, their_dtype = dtypes.split(":")
            for setting, threads in (("1 compute thread each", 1), ("whole box", args.threads)):
                got: dict[str, list[float]] = {"baseline": [], "kvpilot": [], "vllm": []}
                engines = [("kvpilot", "kvpilot", sys.executable, ours_dtype, None)]
                if args.baseline:
                    engines.insert(0, ("baseline", "kvpilot", sys.executable, ours_dtype, args.baseline))
                engines.append(("vllm", "vllm", args.vllm_python, their_dtype, None))
                for index in range(args.rounds):
                    for who, backend, python, dtype, pythonpath in engines:
                        log = logs / f"sbs_{who}_{name}_{label}_t{threads}_{index}.log"
                        result = run(python, backend, model, threads, preset, log, pythonpath, dtype=dtype)
                        runs.append(
                            {
                                "model": name,
                                "preset": preset,
                                "dtypes": label,
                                "setting": setting,
                                "backend": backend if who != "baseline" else "kvpilot-baseline",
                                "dtype": dtype,
                                **result,
                            }
                        )
                        value = result.get("output_tok_per_s")
                        print(
                            f"{name} ({preset}), {label} ({dtype}), {setting}, round {index + 1}, {who}: "
                            f"{value} out tok/s",
                            flush=True,
                        )
                        if value:
                            got[who].append(value)
                row = f"{name} ({preset}), {label} ({dtypes}), {setting}"
                if args.baseline:
                    table.append((f"{row}: baseline vs peer", got["baseline"], got["vllm"]))
                table.append((row, got["kvpilot"], got["vllm"]))
                if args.baseline:
                    table.append((f"{row}: kvpilot vs baseline", got["kvpilot"], got["baseline"]))
    if not args.no_hf:
        name, preset = models[0]
        hf = []
        for index in range(args.rounds):
            log = logs / f"sbs_hf_{name}_{index}.log"
            result = run(sys.executable, "hf", peer / "models" / name, 1, preset, log, batch_size=8)
            runs.append({"model": name, "setting": "1 thread, static batch 8", "backend": "hf", **result})
            print(f"{name}, transformers static batch 8, round {index + 1}: {result.get('output_tok_per_s')}")
            if result.get("output_tok_per_s"):
                hf.append(result["output_tok_per_s"])
        ours = next(k for label, k, _ in table if label.startswith(name) and label.endswith("thread each"))
        table.append((f"{name}, 1 thread: kvpilot vs transformers static batch 8", ours, hf))

    def show(values: list[float]) -> str:
        return "; ".join(f"{v:,.0f}" for v in values) or "-"

    print()
    print("| checkpoint, setting | kvpilot out tok/s | peer out tok/s | kvpilot / peer (median) |")
    print("| --- | --- | --- | --- |")
    medians = {}
    for label, ours, theirs in table:
        ratio = statistics.median(ours) / statistics.median(theirs) if ours and theirs else None
        medians[label] = ratio
        shown = f"{ratio:.2f}" if ratio is not None else "-"
        print(f"| {label} | {show(ours)} | {show(theirs)} | {shown} |")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "side_by_side.json"
    path.write_text(
        json.dumps({"isa": isa.describe(), "runs": runs, "ratios": medians, "models": models}, indent=1)
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
