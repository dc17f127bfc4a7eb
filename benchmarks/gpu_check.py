"""One-shot GPU check for a fresh CUDA machine: kernel tests natively, decode-attention bandwidth, and
(placeholders for now) engine throughput and a vLLM side-by-side.

    python3 benchmarks/gpu_check.py               # all; results in $OUT or benchmarks/results/gpu_check
    python3 benchmarks/gpu_check.py --skip-tests  # bandwidth only
    python3 benchmarks/gpu_check.py --cpu-smoke   # exercise this script's code paths on CPU, tiny sizes

Runs from a plain checkout with the machine's own python3 (torch with CUDA, triton, pytest): kvpilot is
made importable through a link farm in a temporary folder, nothing is downloaded or installed, and the
whole run stays well under ten minutes on an H100/H200 (tests ~2-4 min, mostly Triton compiles;
bandwidth ~1 min). Writes ``gpu_check.json``, ``kernel_tests.xml`` and ``kernel_tests.log`` into the
output folder and prints a table.

Decode bandwidth: bytes of K and V that the attention kernel must read (every cached token of every
sequence, once) divided by the kernel's median time (``triton.testing.do_bench``, which clears L2
between runs), against the device's HBM peak (from its memory clock and bus width, else a table) and
against a measured device-to-device copy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Datasheet HBM bandwidth (GB/s) by device-name fragment, when the driver does not report clock and bus.
HBM_PEAK_GBPS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "A10": 600,
}

# Llama-3-8B-like attention: 32 query heads over 8 KV heads of 128, bf16, block size 16.
DECODE_POINTS = [
    (1, 4096),
    (8, 2048),
    (32, 1024),
    (32, 4096),
    (64, 2048),
    (128, 1024),
    (128, 4096),
    (256, 2048),
]


def make_importable() -> Path:
    """A folder holding ``kvpilot`` -> the repo's package folders (as pyproject's package-dir maps them).

    Only that folder goes on the path: the repository root must not, since its ``operator/`` would
    shadow the standard library's ``operator``.
    """
    site = Path(tempfile.mkdtemp(prefix="kvpilot-site-"))
    pkg = site / "kvpilot"
    pkg.mkdir()
    for entry in (REPO / "kvpilot").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in (("engine", "engine"), ("kernels", "kernels"), ("operator", "operator")):
        if not (pkg / name).exists():
            (pkg / name).symlink_to(REPO / folder)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return site


def device_info(torch) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if not torch.cuda.is_available():
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(
        name=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1)
    )
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        info["hbm_peak_gbps"] = round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9)  # double data rate
        info["hbm_peak_source"] = "memory clock x bus width"
    else:
        for fragment, gbps in HBM_PEAK_GBPS.items():
            if fragment in props.name:
                info["hbm_peak_gbps"], info["hbm_peak_source"] = gbps, f"datasheet ({fragment})"
                break
    return info


def run_kernel_tests(out_dir: Path, device: str, timeout_s: int) -> dict:
    """``pytest tests/kernels`` in a child process on ``device`` (compiled Triton kernels on CUDA)."""
    report, log = out_dir / "kernel_tests.xml", out_dir / "kernel_tests.log"
    env = dict(os.environ, KVPILOT_TEST_DEVICE=device, PYTHONUNBUFFERED="1")
    tests = REPO / "tests" / "kernels"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        targets = [tests]
    else:
        env.pop("TRITON_INTERPRET", None)
        # The Triton suite runs in this pytest, so that the report lists each case, instead of through
        # test_triton_ops.py's child process (which exists for the interpreter's sake). Files are named
        # one by one: pytest drops a file named beside its own directory.
        targets = [p for p in sorted(tests.glob("test_*.py")) if p.name != "test_triton_ops.py"]
        targets.append(tests / "triton_cases.py")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *map(str, targets),
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = f"{e.stdout or ''}{e.stderr or ''}\nTIMED OUT after {timeout_s} s", -1
    log.write_text(output if isinstance(output, str) else output.decode(errors="replace"))
    result = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": str(log)}
    if report.exists():
        import xml.etree.ElementTree as ET

        suites = ET.parse(report).getroot()
        suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
        for key in ("tests", "failures", "errors", "skipped"):
            result[key] = int(suite.get(key, 0))
        result["failed"] = [
            c.get("classname", "") + "::" + c.get("name", "")
            for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
    result["tail"] = output[-1500:] if rc else ""
    return result


def copy_bandwidth_gbps(torch, device: str) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written: a practical HBM ceiling."""
    n = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = bench(torch, lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (ms / 1e3) / 1e9


def bench(torch, fn, device: str) -> float:
    """Median milliseconds of ``fn``."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def decode_batch(
    torch,
    num_seqs: int,
    seq_len: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    device: str,
    seed: int = 0,
):
    """K/V caches holding ``num_seqs`` sequences of ``seq_len`` tokens in shuffled blocks, and the
    metadata of one decode step over them."""
    from kvpilot.kernels.metadata import AttentionMetadata

    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    tables = perm[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq).to(torch.int32)
    qsl = list(range(num_seqs + 1))
    lens = [seq_len] * num_seqs
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=seq_len,
        num_decodes=num_seqs,
        query_start_loc_host=qsl,
        seq_lens_host=lens,
    )
    return k_cache, v_cache, meta


def _time_point(
    torch, backends: dict, num_seqs: int, seq_len: int, device: str, peak_gbps, copy_gbps
) -> dict:
    num_heads, num_kv_heads, head_size, block_size = 32, 8, 128, 16
    k_cache, v_cache, meta = decode_batch(
        torch, num_seqs, seq_len, num_kv_heads, head_size, block_size, device
    )
    query = torch.randn(num_seqs, num_heads, head_size, device=device, dtype=torch.bfloat16)
    kv_bytes = 2 * num_seqs * seq_len * num_kv_heads * head_size * k_cache.element_size()
    row = {"num_seqs": num_seqs, "seq_len": seq_len, "kv_mib": round(kv_bytes / 2**20, 1)}
    reference = None
    for label, (backend, kwargs) in backends.items():

        def step(backend=backend, kwargs=kwargs):
            return backend.paged_attention(query, k_cache, v_cache, meta, head_size**-0.5, **kwargs)

        out = step().float()
        if reference is None:
            reference = out
        else:
            row[f"{label}_max_diff"] = float((out - reference).abs().max())
        ms = bench(torch, step, device)
        gbps = kv_bytes / (ms / 1e3) / 1e9
        row[f"{label}_us"] = round(ms * 1e3, 1)
        row[f"{label}_gbps"] = round(gbps, 1)
        if peak_gbps:
            row[f"{label}_pct_peak"] = round(100 * gbps / peak_gbps, 1)
        row[f"{label}_pct_copy"] = round(100 * gbps / copy_gbps, 1)
    return row


def decode_bandwidth(torch, device: str, points, peak_gbps: float | None, copy_gbps: float) -> list[dict]:
    """Per (sequences, length) point: each backend's time, K/V bytes per second, share of the peaks.
    ``triton`` uses the split heuristic, ``triton_nosplit`` one segment; ``torch`` is the gather+SDPA path."""
    from kvpilot.kernels.backend import get_backend

    backends = {}
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # the latter: --cpu-smoke only
        triton_backend = get_backend("triton", device)
        backends = {"triton": (triton_backend, {}), "triton_nosplit": (triton_backend, {"num_kv_splits": 1})}
    backends["torch"] = (get_backend("torch", device), {})
    rows = []
    for num_seqs, seq_len in points:
        rows.append(_time_point(torch, backends, num_seqs, seq_len, device, peak_gbps, copy_gbps))
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def engine_throughput_placeholder() -> dict:
    """To be filled by the engine room: the throughput workload (benchmarks/throughput.py) on a ~1B
    random-weight Llama on CUDA with the Triton backend, output tokens/s."""
    return {"status": "not implemented yet"}


def vllm_placeholder() -> dict:
    """To be filled: the same workload on vLLM when it is importable, for a side-by-side ratio."""
    import importlib.util

    return {"status": "not implemented yet", "vllm_importable": importlib.util.find_spec("vllm") is not None}


def print_table(result: dict) -> None:
    info = result["device"]
    print(
        f"\ndevice: {info.get('name', 'cpu')}  torch {info['torch']}  triton {info.get('triton')}  "
        f"HBM peak {info.get('hbm_peak_gbps')} GB/s ({info.get('hbm_peak_source', '-')}); "
        f"measured copy {result['copy_gbps']:.0f} GB/s"
    )
    tests = result.get("kernel_tests")
    if tests:
        print(
            f"kernel tests: rc {tests['rc']}, {tests.get('tests', '?')} tests, "
            f"{tests.get('failures', '?')} failures, {tests.get('errors', '?')} errors, "
            f"{tests.get('skipped', '?')} skipped, {tests['seconds']} s"
        )
        for name in tests.get("failed", [])[:20]:
            print(f"  FAILED {name}")
    labels = [k[: -len("_us")] for k in result["decode"][0] if k.endswith("_us")] if result["decode"] else []
    header = f"{'seqs':>5} {'len':>6} {'KV MiB':>8}" + "".join(
        f" {label + ' us':>18} {'GB/s':>7} {'%peak':>6}" for label in labels
    )
    print("\ndecode attention (bf16, 32q/8kv heads, d=128, block 16)")
    print(header)
    for row in result["decode"]:
        line = f"{row['num_seqs']:>5} {row['seq_len']:>6} {row['kv_mib']:>8}"
        for label in labels:
            pct = row.get(label + "_pct_peak", "-")
            line += f" {row[label + '_us']:>18} {row[label + '_gbps']:>7} {pct:>6}"
        print(line)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"])
        if os.environ.get("OUT")
        else REPO / "benchmarks" / "results" / "gpu_check",
    )
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--test-timeout", type=int, default=330, help="seconds for the kernel test run")
    parser.add_argument("--cpu-smoke", action="store_true", help="run every section on CPU at tiny sizes")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    make_importable()
    import torch

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible; use --cpu-smoke to exercise the script on CPU")
    t0 = time.perf_counter()
    result = {"benchmark": "gpu_check", "device": device_info(torch)}
    if not args.skip_tests:
        print("kernel tests ...", flush=True)
        result["kernel_tests"] = run_kernel_tests(args.out, device, args.test_timeout)
    print("bandwidth ...", flush=True)
    result["copy_gbps"] = round(copy_bandwidth_gbps(torch, device), 1)
    points = DECODE_POINTS if device == "cuda" else [(2, 64), (4, 128)]
    result["decode"] = decode_bandwidth(
        torch, device, points, result["device"].get("hbm_peak_gbps"), result["copy_gbps"]
    )
    result["engine_throughput"] = engine_throughput_placeholder()
    result["vllm"] = vllm_placeholder()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\n{result['seconds']} s; wrote {args.out / 'gpu_check.json'}")
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(1 if outcome.get("kernel_tests", {}).get("rc", 0) else 0)
