"""The linears of a checkpoint on CPU as a step runs them: every layer's own weights, so that a pass
streams them from memory as a decode step does (a benchmark that reuses one weight measures a warm cache
instead). For each token count: the engine's float32 ``F.linear``, oneDNN-prepacked float32 weights,
bfloat16-stored weight panels widened in registers (``cpu_ops.linear_bf16w``), and two floors: reading
the float32 weights (or bfloat16 ones, half the bytes) at the read bandwidth this core measures, and the
FLOPs at the best rate a large warm matmul reaches here.

At small token counts (decode batches) a pass is bound by reading the weights, not by the FMAs; the
floors say how far each path is from that.

    python benchmarks/linear_cpu.py --model ~/.cache/kvpilot-peer/models/small --threads 1

Prints a table and writes ``benchmarks/results/linear_cpu.json``; the CPU's ISA line comes first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"


def layer_shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of one decoder layer's linears, as the engine fuses them."""
    h, i = config["hidden_size"], config["intermediate_size"]
    nh, nk = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nh
    return [("qkv", h, (nh + 2 * nk) * d), ("o", nh * d, h), ("gate_up", h, 2 * i), ("down", i, h)]


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second one pass of ``sum`` reads over a tensor far larger than the caches."""
    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times)


def warm_peak(k: int, n: int, m: int = 512) -> float:
    """FLOP/s of a float32 matmul whose operands stay in cache (the best this core does here)."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    F.linear(x, w)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / min(times)


def time_pass(fns, m: int, k_of, repeats: int) -> float:
    """Median seconds of one pass over every layer's linears at ``m`` tokens."""
    inputs = {k: torch.randn(m, k) for k in set(k_of)}
    for fn, k in zip(fns, k_of, strict=True):
        fn(inputs[k])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for fn, k in zip(fns, k_of, strict=True):
            fn(inputs[k])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache/kvpilot-peer/models/small"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "linear_cpu.json")
    args = ap.parse_args()
    from kvpilot.kernels import isa

    print(isa.summary_line(), flush=True)
    torch.set_num_threads(args.threads)
    config = json.loads((Path(args.model) / "config.json").read_text())
    shapes = layer_shapes(config) * config["num_hidden_layers"]
    weights = [torch.randn(n, k) * 0.02 for _, k, n in shapes]
    k_of = [k for _, k, _ in shapes]
    params = sum(w.numel() for w in weights)
    bandwidth = read_bandwidth()
    peak = max(warm_peak(k, n) for _, k, n in shapes[:4])
    plain = [lambda x, w=w: F.linear(x, w) for w in weights]
    from kvpilot.kernels import cpu_ops

    panels = [(cpu_ops.pack_bf16_panels(w), w.shape[0]) for w in weights]
    bf16w = [lambda x, p=p, n=n: cpu_ops.linear_bf16w(x, p, n) for p, n in panels]
    layers = config["num_hidden_layers"]
    print(
        f"{layers} layers, {params / 1e6:.1f}M linear weights ({params * 4 / 1e6:.0f} MB float32), "
        f"{args.threads} thread(s); read bandwidth {bandwidth / 1e9:.1f} GB/s, "
        f"warm matmul {peak / 1e9:.1f} GFLOP/s",
        flush=True,
    )
    header = (
        "tokens | F.linear ms | oneDNN-packed ms | bf16 panels ms | floor fp32 weights | floor bf16 weights "
        "| floor FLOPs"
    )
    print(header)
    rows = []
    for m in [int(t) for t in args.tokens.split(",")]:
        packed_weights = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
        packed = [
            lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            for p in packed_weights
        ]
        t_plain = time_pass(plain, m, k_of, args.repeats)
        t_packed = time_pass(packed, m, k_of, args.repeats)
        t_bf16w = time_pass(bf16w, m, k_of, args.repeats)
        del packed_weights, packed
        row = {
            "tokens": m,
            "f_linear_ms": 1000 * t_plain,
            "onednn_packed_ms": 1000 * t_packed,
            "bf16_panels_ms": 1000 * t_bf16w,
            "floor_fp32_weights_ms": 1000 * params * 4 / bandwidth,
            "floor_bf16_weights_ms": 1000 * params * 2 / bandwidth,
            "floor_flops_ms": 1000 * 2 * m * params / peak,
            "f_linear_gflops": 2 * m * params / t_plain / 1e9,
            "bf16_panels_gflops": 2 * m * params / t_bf16w / 1e9,
        }
        rows.append(row)
        print(
            f"{m:6d} | {row['f_linear_ms']:11.1f} | {row['onednn_packed_ms']:16.1f} | "
            f"{row['bf16_panels_ms']:14.1f} | "
            f"{row['floor_fp32_weights_ms']:18.1f} | {row['floor_bf16_weights_ms']:18.1f} | "
            f"{row['floor_flops_ms']:11.1f}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "isa": isa.describe(),
                "model": args.model,
                "threads": args.threads,
                "linear_params": params,
                "read_bandwidth_gb_s": bandwidth / 1e9,
                "warm_matmul_gflops": peak / 1e9,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
