"""CPU attention: the torch path's original implementation, its current one, and the ``cpu`` backend's
C++ kernel (reads K/V in place; ``kvpilot.kernels.cpu_ops``).

Decode step of ``--num-seqs`` sequences of ~``--seq-len`` tokens (bf16, 12 query / 4 KV heads, head
size 64, block size 16, blocks scattered over the pool), timed per layer over a few layers with their
own caches, on 1 and 2 threads; also a mixed step (decodes + prefill chunks). Each step builds fresh
metadata, so per-step planning is counted. The two implementations are timed alternately; with one
thread the process CPU time is reported too, which stays meaningful on a shared, busy machine where
wall times are not.

    python benchmarks/attention_cpu.py            # table + benchmarks/results/attention_cpu.json
    python benchmarks/attention_cpu.py --sweep    # also sweep the decode chunk size

What it showed: for 64 decodes of 512 tokens (bf16, 4 KV heads of 64, one thread) a layer of the current
implementation is about half gather (reading the scattered blocks from DRAM) and half SDPA (its CPU
flash kernel, compute-bound at one query row). The original gathered into fresh tensors on every layer,
and the page faults made its time swing between about 1x and 4x of the current one's with the
allocator's state.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpilot.kernels import cpu_ops, isa, torch_ops
from kvpilot.kernels.metadata import AttentionMetadata

RESULTS = Path(__file__).resolve().parent / "results"


# --- baseline: kernels/torch_ops.paged_attention as it was before the CPU optimisations -------------
def _baseline_gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    flat = torch.index_select(cache.view(num_blocks, -1), 0, block_ids.reshape(-1))
    return flat.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_size)


def baseline_paged_attention(query, k_cache, v_cache, metadata, scale):
    num_tokens, num_heads, head_size = query.shape
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    nd = metadata.num_decodes
    gqa = num_heads != k_cache.shape[2]
    if nd:
        derived = metadata.derived
        if "decode_mask" not in derived:
            max_len = max(metadata.seq_lens_host[:nd])
            num_blocks = -(-max_len // block_size)
            positions = torch.arange(num_blocks * block_size, device=query.device)
            mask = positions[None, :] < metadata.seq_lens[:nd, None]
            derived["decode_blocks"] = metadata.block_tables[:nd, :num_blocks].contiguous()
            derived["decode_mask"] = mask[:, None, None, :]
        blocks = derived["decode_blocks"]
        k = _baseline_gather(k_cache, blocks).transpose(1, 2)
        v = _baseline_gather(v_cache, blocks).transpose(1, 2)
        q = query[:nd].unsqueeze(2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=derived["decode_mask"], scale=scale, enable_gqa=gqa
        )
        out[:nd] = o.squeeze(2)
    qsl, lens = metadata.query_start_loc_host, metadata.seq_lens_host
    for i in range(nd, metadata.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
        q_len = end - start
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_tables[i, :num_blocks]
        k = _baseline_gather(k_cache, blocks)[:seq_len].transpose(0, 1)
        v = _baseline_gather(v_cache, blocks)[:seq_len].transpose(0, 1)
        q = query[start:end].transpose(0, 1)
        context = seq_len - q_len
        if context == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            key_pos = torch.arange(seq_len, device=query.device)
            query_pos = torch.arange(context, seq_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    return out


# --- workload ----------------------------------------------------------------------------------------
def make_batch(spans, block_size, num_kv_heads, head_size, dtype, num_layers, seed=0):
    """Caches (one K/V pair per layer) holding requests of ``(context_len, query_len)`` spans, each
    request's blocks scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-(c + q) // block_size) for c, q in spans]
    num_blocks = sum(blocks_per_req) + 64
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_req)
    tables, used = [], 0
    for n in blocks_per_req:
        tables.append(perm[used : used + n] + [0] * (width - n))
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    caches = [tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2)) for _ in range(num_layers)]
    return caches, tables


def make_metadata(spans, tables) -> AttentionMetadata:
    qsl = [0]
    for _, q in spans:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in spans]
    return AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(q for _, q in spans),
        max_seq_len=max(seq_lens),
        num_decodes=next((i for i, (_, q) in enumerate(spans) if q != 1), len(spans)),
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
    )


def naive_attention(query, k_cache, v_cache, spans, tables, scale):
    """Dense causal float64 attention per request: the exactness check."""
    num_heads, block_size, num_kv_heads = query.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    token = 0
    for i, (context, q_len) in enumerate(spans):
        n = context + q_len
        ids = torch.tensor(tables[i][: -(-n // block_size)])
        k = k_cache[ids].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)  # [n, h, d]
        v = v_cache[ids].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,nhd->hqn", query[token : token + q_len].double(), k) * scale
        visible = torch.arange(n)[None, :] <= (context + torch.arange(q_len))[:, None]
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[token : token + q_len] = torch.einsum("hqn,nhd->qhd", weights, v)
        token += q_len
    return out


def time_step(fn, query, caches, spans, tables, scale, repeats, clock=time.perf_counter) -> float:
    """Median per-layer time (ms) of ``repeats`` steps over all layers, fresh metadata per step.

    ``clock=time.process_time`` counts the process's CPU time instead of wall time: with one thread
    that is the time the work itself took, whatever else the machine is running."""
    per_layer = []
    for r in range(repeats + 1):
        meta = make_metadata(spans, tables)
        t0 = clock()
        for k_cache, v_cache in caches:
            fn(query, k_cache, v_cache, meta, scale)
        if r:  # the first step warms up
            per_layer.append((clock() - t0) / len(caches) * 1e3)
    return statistics.median(per_layer)


def run_case(name, spans, args, threads) -> dict:
    torch.set_num_threads(threads)
    dtype = torch.bfloat16
    caches, tables = make_batch(
        spans, args.block_size, args.num_kv_heads, args.head_size, dtype, args.num_layers
    )
    kernel_caches = caches
    if args.head_major:
        # The kernel reads the pool of ``KVCache(head_major=True)``: each (block, KV head) contiguous,
        # viewed as the usual [num_blocks, block_size, num_kv_heads, head_size] (the torch paths keep the
        # usual layout, which they need).
        kernel_caches = [
            tuple(c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in kv) for kv in caches
        ]
    gen = torch.Generator().manual_seed(1)
    num_tokens = sum(q for _, q in spans)
    query = torch.randn(num_tokens, args.num_heads, args.head_size, generator=gen).to(dtype)
    scale = args.head_size**-0.5
    k0, v0 = caches[0]
    ref = naive_attention(query, k0, v0, spans, tables, scale)
    new_out = torch_ops.paged_attention(query, k0, v0, make_metadata(spans, tables), scale)
    base_out = baseline_paged_attention(query, k0, v0, make_metadata(spans, tables), scale)
    impls = [
        (baseline_paged_attention, base_ms := [], base_cpu := []),
        (torch_ops.paged_attention, new_ms := [], new_cpu := []),
    ]
    kernel_ms, kernel_cpu, kernel_out = [], [], None
    if cpu_ops.is_available():
        k1, v1 = kernel_caches[0]
        kernel_out = cpu_ops.paged_attention(query, k1, v1, make_metadata(spans, tables), scale)
        impls.append((cpu_ops.paged_attention, kernel_ms, kernel_cpu))
    # Interleave the implementations so that drift in the machine's load hits all alike.
    for _ in range(args.rounds):
        for fn, wall, cpu in impls:
            cs = kernel_caches if fn is cpu_ops.paged_attention else caches
            wall.append(time_step(fn, query, cs, spans, tables, scale, args.repeats))
            if threads == 1:
                cpu.append(
                    time_step(fn, query, cs, spans, tables, scale, args.repeats, clock=time.process_time)
                )
    kv_bytes = 2 * sum(c + q for c, q in spans) * args.num_kv_heads * args.head_size * 2
    before, after = statistics.median(base_ms), statistics.median(new_ms)
    return {
        "case": name,
        "threads": threads,
        "num_reqs": len(spans),
        "num_tokens": num_tokens,
        "kv_tokens": sum(c + q for c, q in spans),
        "before_ms": round(before, 3),
        "after_ms": round(after, 3),
        "before_ms_all_rounds": [round(t, 3) for t in base_ms],
        "after_ms_all_rounds": [round(t, 3) for t in new_ms],
        "before_cpu_ms": round(statistics.median(base_cpu), 3) if base_cpu else None,
        "after_cpu_ms": round(statistics.median(new_cpu), 3) if new_cpu else None,
        "speedup": round(before / after, 2),
        "after_kv_gb_per_s": round(kv_bytes / (after / 1e3) / 1e9, 2),
        "max_abs_err_before": float((base_out.double() - ref).abs().max()),
        "max_abs_err_after": float((new_out.double() - ref).abs().max()),
        "kernel_ms": round(statistics.median(kernel_ms), 3) if kernel_ms else None,
        "kernel_ms_all_rounds": [round(t, 3) for t in kernel_ms],
        "kernel_cpu_ms": round(statistics.median(kernel_cpu), 3) if kernel_cpu else None,
        "kernel_speedup_vs_after": round(after / statistics.median(kernel_ms), 2) if kernel_ms else None,
        "kernel_cpu_speedup_vs_after": (
            round(statistics.median(new_cpu) / statistics.median(kernel_cpu), 2) if kernel_cpu else None
        ),
        "kernel_kv_gb_per_s": round(kv_bytes / (statistics.median(kernel_ms) / 1e3) / 1e9, 2)
        if kernel_ms
        else None,
        "max_abs_err_kernel": (
            float((kernel_out.double() - ref).abs().max()) if kernel_out is not None else None
        ),
    }


def sweep_chunk_bytes(spans, args, threads) -> list[dict]:
    torch.set_num_threads(threads)
    caches, tables = make_batch(
        spans, args.block_size, args.num_kv_heads, args.head_size, torch.bfloat16, args.num_layers
    )
    query = torch.randn(len(spans), args.num_heads, args.head_size).to(torch.bfloat16)
    default = torch_ops._DECODE_CHUNK_BYTES
    rows = []
    try:
        for mib in (0.5, 1, 2, 4, 8, 16, 64, 1024):
            torch_ops._DECODE_CHUNK_BYTES = int(mib * 2**20)
            ms = statistics.median(
                time_step(
                    torch_ops.paged_attention,
                    query,
                    caches,
                    spans,
                    tables,
                    args.head_size**-0.5,
                    args.repeats,
                )
                for _ in range(args.rounds)
            )
            rows.append({"threads": threads, "chunk_mib": mib, "ms": round(ms, 3)})
    finally:
        torch_ops._DECODE_CHUNK_BYTES = default
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--sweep", action="store_true", help="also sweep the decode chunk size")
    parser.add_argument(
        "--head-major",
        action="store_true",
        help="caches laid out as KVCache(head_major=True): each (block, KV head) contiguous",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "attention_cpu.json")
    args = parser.parse_args(argv)
    print(isa.summary_line(), flush=True)

    rng = random.Random(0)
    n, s = args.num_seqs, args.seq_len
    uniform = f"{n} decodes x {s}"
    cases = {
        uniform: [(s - 1, 1)] * n,
        f"{n} decodes x {s}±25%": [(rng.randint(s * 3 // 4, s * 5 // 4) - 1, 1) for _ in range(n)],
        # Continuous batching's usual step: decodes plus a prefill chunk continuing a context and a new
        # prompt (not the headline; shows the prefill path did not regress).
        f"{n // 2} decodes + 2 prefills": [(s - 1, 1)] * (n // 2) + [(s, 128), (0, 256)],
    }
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for name, spans in cases.items():
            rows.append(run_case(name, spans, args, threads))
    header = (
        f"{'case':<28}{'threads':>8}{'before ms':>11}{'after ms':>10}{'speedup':>9}{'GB/s':>7}"
        f"{'err after':>11}{'CPU-time before/after ms':>26}{'kernel ms':>11}{'kernel CPU ms':>15}"
        f"{'kernel/after':>14}{'err kernel':>12}"
    )
    print(
        "CPU attention per layer, torch path (bf16, "
        f"{args.num_heads}q/{args.num_kv_heads}kv heads, d={args.head_size}, block {args.block_size}"
        f"{', head-major pool' if args.head_major else ''})"
    )
    print(header)
    for r in rows:
        cpu = f"{r['before_cpu_ms']:.2f} / {r['after_cpu_ms']:.2f}" if r["before_cpu_ms"] else "-"
        print(
            f"{r['case']:<28}{r['threads']:>8}{r['before_ms']:>11.2f}{r['after_ms']:>10.2f}"
            f"{r['speedup']:>8.2f}x{r['after_kv_gb_per_s']:>7.1f}{r['max_abs_err_after']:>11.2e}{cpu:>26}"
            + (
                f"{r['kernel_ms']:>11.2f}{r['kernel_cpu_ms'] or float('nan'):>15.2f}"
                f"{r['kernel_speedup_vs_after']:>13.2f}x{r['max_abs_err_kernel']:>12.2e}"
                if r["kernel_ms"]
                else f"{'(kernel unavailable)':>40}"
            )
        )
    result = {
        "benchmark": "attention_cpu",
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "isa": isa.describe(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }
    if args.sweep:
        sweep = []
        for threads in [int(t) for t in args.threads.split(",")]:
            sweep += sweep_chunk_bytes(cases[uniform], args, threads)
        print("\ndecode chunk size sweep (uniform case)")
        for r in sweep:
            print(f"  threads {r['threads']}  chunk {r['chunk_mib']:>7} MiB  {r['ms']:.2f} ms")
        result["chunk_sweep"] = sweep
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
