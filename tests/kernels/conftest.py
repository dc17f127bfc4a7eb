"""Builders for the kernel tests: paged batches, a dense reference, covering arrays, the Triton module.

Device: ``KVPILOT_TEST_DEVICE`` (cpu | cuda), default cuda when available. On CPU the Triton kernels
run under the interpreter; on CUDA they are compiled (``benchmarks/gpu_check.py`` runs them so).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
from dataclasses import dataclass
from types import ModuleType
from typing import NoReturn

import pytest
import torch

from kvpilot.kernels import cpu_build
from kvpilot.kernels.metadata import AttentionMetadata

DEVICE = os.environ.get("KVPILOT_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# (num_heads, num_kv_heads) layouts the attention kernels are tested on.
HEADS = {"mha": (4, 4), "gqa3": (12, 4), "gqa4": (8, 2), "gqa8": (16, 2), "mqa": (6, 1)}

# Attention outputs are O(1). 16-bit formats: two units of their epsilon (9.8e-4, 7.8e-3), since both
# sides round the output and may round P once more (observed: under a third of that). fp32: summation
# order only (observed ~1e-6).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

# Unused cache slots hold finite garbage that would show in the output if a masked key leaked in.
GARBAGE_K, GARBAGE_V = 3.0, -40.0


def long_len(block_size: int) -> int:
    """A "long" context: several blocks and several 32-key tiles, not a multiple of either."""
    return max(4 * block_size, 64) + 7


def batch_spans(kind: str, block_size: int) -> list[tuple[int, int]]:
    """``(context_len, query_len)`` per request, decodes first, for a batch kind.

    decode:  decodes at sequence lengths 1, bs-1, bs, bs+1, long
    prefill: fresh prompts of bs-1, bs+1, long and 1 tokens
    mixed:   decodes at 1, bs, long; chunked prefills continuing a context; a fresh prompt
    """
    bs, long = block_size, long_len(block_size)
    if kind == "decode":
        return [(n - 1, 1) for n in (1, bs - 1, bs, bs + 1, long)]
    if kind == "prefill":
        return [(0, bs - 1), (0, bs + 1), (0, long), (0, 1)]
    if kind == "mixed":
        return [(0, 1), (bs - 1, 1), (long - 1, 1), (bs - 1, bs + 1), (long, 5), (0, bs)]
    raise ValueError(kind)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size], a view into a fused QKV tensor
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size], the new tokens' keys (also in the cache)
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float
    spans: list[tuple[int, int]]
    block_tables: list[list[int]]

    def fresh_metadata(self) -> AttentionMetadata:
        """The same step with an empty ``derived`` dict (as a new step would have)."""
        m = self.metadata
        return AttentionMetadata(
            m.slot_mapping,
            m.query_start_loc,
            m.seq_lens,
            m.block_tables,
            m.max_query_len,
            m.max_seq_len,
            m.num_decodes,
            m.query_start_loc_host,
            m.seq_lens_host,
        )


def make_paged_batch(
    spans: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    seed: int = 0,
    first_block_id: int = 1,
    num_blocks: int | None = None,
) -> PagedBatch:
    """A flattened batch whose K/V (context and new tokens) are already in a paged cache.

    Each request's blocks are scattered over ids ``first_block_id ..``; block 0 (the block-table
    padding) and the unused slots of used blocks hold garbage. With a large ``num_blocks`` the cache is
    allocated lazily (``torch.empty``) and only the blocks in use are touched, so offsets past 2**31
    elements cost no memory on CPU.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in spans]
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    needed = sum(blocks_per_req)
    ids = list(range(first_block_id, first_block_id + needed + 3))
    rng.shuffle(ids)
    num_blocks = num_blocks or first_block_id + needed + 3
    width = max(blocks_per_req)
    tables, used = [], 0
    for n in blocks_per_req:
        tables.append(ids[used : used + n] + [0] * (width - n))
        used += n

    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    touched = torch.tensor([0] + ids, device=device)
    k_cache[touched] = GARBAGE_K
    v_cache[touched] = GARBAGE_V

    num_tokens = sum(q for _, q in spans)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(device)
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_size)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_size)

    slots, qsl = [], [0]
    for r, (context, q_len) in enumerate(spans):
        slots_of = [tables[r][p // block_size] * block_size + p % block_size for p in range(context + q_len)]
        ctx_slots, new_slots = slots_of[:context], slots_of[context:]
        if ctx_slots:
            flat_k = k_cache.view(-1, num_kv_heads, head_size)
            flat_v = v_cache.view(-1, num_kv_heads, head_size)
            idx = torch.tensor(ctx_slots, device=device)
            flat_k[idx] = torch.randn(context, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
            flat_v[idx] = torch.randn(context, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
        slots += new_slots
        qsl.append(qsl[-1] + q_len)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    k_cache.view(-1, num_kv_heads, head_size)[slot_mapping] = key
    v_cache.view(-1, num_kv_heads, head_size)[slot_mapping] = value

    num_decodes = next((i for i, (_, q) in enumerate(spans) if q != 1), len(spans))
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(q for _, q in spans),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
    )
    return PagedBatch(query, key, value, k_cache, v_cache, metadata, head_size**-0.5, spans, tables)


def naive_attention(batch: PagedBatch) -> torch.Tensor:
    """Dense causal attention in float64, one request at a time, with an explicit mask and softmax."""
    query, k_cache, v_cache = batch.query.cpu().double(), batch.k_cache, batch.v_cache
    num_heads, block_size, num_kv_heads = query.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    token = 0
    for r, (context, q_len) in enumerate(batch.spans):
        seq_len = context + q_len
        positions = torch.arange(seq_len)
        blocks = torch.tensor([batch.block_tables[r][p // block_size] for p in range(seq_len)])
        offsets = positions % block_size
        # [seq_len, num_heads, head_size]: query head h reads KV head h // group.
        keys = k_cache[blocks.to(k_cache.device), offsets.to(k_cache.device)].cpu().double()
        values = v_cache[blocks.to(v_cache.device), offsets.to(v_cache.device)].cpu().double()
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        q = query[token : token + q_len]  # [q_len, num_heads, head_size]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * batch.scale
        visible = positions[None, :] <= (context + torch.arange(q_len))[:, None]  # [q_len, seq_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out[token : token + q_len] = torch.einsum("hqk,khd->qhd", weights, values)
        token += q_len
    return out


def pairwise(factors: dict[str, list]) -> list[dict]:
    """A small covering array: every pair of levels of any two factors appears in some row.

    Greedy (pick the combination covering most uncovered pairs, first in product order on ties), so
    the rows are deterministic.
    """
    names = list(factors)
    uncovered = {
        ((a, x), (b, y))
        for a, b in itertools.combinations(range(len(names)), 2)
        for x in range(len(factors[names[a]]))
        for y in range(len(factors[names[b]]))
    }
    candidates = list(itertools.product(*(range(len(factors[n])) for n in names)))
    rows = []
    while uncovered:

        def gain(combo):
            return sum(
                ((a, combo[a]), (b, combo[b])) in uncovered
                for a, b in itertools.combinations(range(len(names)), 2)
            )

        best = max(candidates, key=gain)
        for a, b in itertools.combinations(range(len(names)), 2):
            uncovered.discard(((a, best[a]), (b, best[b])))
        rows.append({n: factors[n][i] for n, i in zip(names, best, strict=True)})
    return rows


def missing_dependency(reason: str) -> NoReturn:
    """Skip for ``reason``; under ``KVPILOT_REQUIRE_TOOLS=1`` (``make test``) fail instead, so a
    missing kernel dependency never turns the suite green by skipping it."""
    if os.environ.get("KVPILOT_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{reason} (KVPILOT_REQUIRE_TOOLS=1: required)")
    pytest.skip(reason)


def require_modules(*names: str) -> None:
    """Skip (fail under ``KVPILOT_REQUIRE_TOOLS=1``) unless the modules are installed, without
    importing them into this process (importing triton here would fix its interpreter setting for
    the rest of the session)."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        missing_dependency(f"needs {', '.join(missing)}")


def require_cpu_kernel() -> None:
    """Skip unless the ``cpu`` backend's C++ kernel is built; under ``KVPILOT_REQUIRE_TOOLS=1``
    (``make test``) a failed build fails the test instead."""
    from kvpilot.kernels import cpu_ops

    if not cpu_ops.is_available():
        missing_dependency("the CPU attention kernel could not be built (see the kvpilot.kernels log line)")


def _kernel_levels() -> list[str]:
    """The ISA levels whose kernel builds the CPU kernel tests run on: each level this CPU can run
    below its best, then the default build (``-march=native``, or ``$KVPILOT_CPU_MARCH``), which has
    the best level's paths."""
    runnable, _ = cpu_build.isa_levels()
    return [level.name for level in runnable[:-1]] + ["default"]


@pytest.fixture(params=_kernel_levels())
def kernel_isa(request, monkeypatch) -> str:
    """Runs a test once per ISA level of the kernels (see ``_kernel_levels``): ``cpu_ops`` then calls
    that level's build. A level that does not build fails under ``KVPILOT_REQUIRE_TOOLS=1``."""
    from kvpilot.kernels import cpu_ops

    if request.param == "default":
        require_cpu_kernel()
        return request.param
    level = next(level for level in cpu_build.ISA_LEVELS if level.name == request.param)
    try:
        ext = cpu_build.load_level(level)
    except Exception as exc:  # a compiler error is what this reports
        missing_dependency(f"the kernels for ISA level {level.name} did not build: {exc}")
    monkeypatch.setattr(cpu_ops, "load_extension", lambda: ext)
    return request.param


def pytest_terminal_summary(terminalreporter) -> None:
    """Name the kernel code paths this CPU cannot run: they were compiled (test_isa_matrix.py), not
    tested."""
    reports = (r for group in terminalreporter.stats.values() for r in group if hasattr(r, "nodeid"))
    if not any("test_cpu_" in r.nodeid or "test_fused_cpu" in r.nodeid for r in reports):
        return
    runnable, missing = cpu_build.isa_levels()
    if not runnable and not missing:
        terminalreporter.write_line("CPU kernel ISA levels: not an x86-64 CPU, only the default build ran")
        return
    terminalreporter.write_line(
        "CPU kernel ISA levels tested here: " + ", ".join(level.name for level in runnable)
    )
    for level in missing:
        terminalreporter.write_line(f"NOT TESTED on this CPU (compiled only): {level.name}: {level.paths}")


def load_triton_ops() -> ModuleType:
    """``kvpilot.kernels.triton_ops`` ready to run on ``DEVICE`` (compiled on CUDA, interpreted on CPU)."""
    require_modules("triton")
    if DEVICE == "cpu":
        require_modules("numpy")  # the interpreter needs it
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.fail(
                "on CPU the Triton kernels run only with TRITON_INTERPRET=1 set before triton is "
                "imported: run tests/kernels/test_triton_ops.py, which starts this suite so"
            )
    from kvpilot.kernels import triton_ops

    return triton_ops


@pytest.fixture(scope="session")
def triton_ops() -> ModuleType:
    return load_triton_ops()


def pytest_collection_modifyitems(config, items):
    """``KVPILOT_TEST_SHARD=i/n`` keeps every n-th test from the i-th (the Triton suite runs sharded)."""
    shard = os.environ.get("KVPILOT_TEST_SHARD")
    if not shard:
        return
    index, count = (int(x) for x in shard.split("/"))
    keep = [item for j, item in enumerate(items) if j % count == index]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    tol = TOLERANCES[dtype]
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    err = (actual - expected).abs()
    bound = tol["atol"] + tol["rtol"] * expected.abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {err.numel()} elements off; max abs error {err.max():.3g} at "
        f"{tuple(int(i) for i in (err == err.max()).nonzero()[0])} (atol {tol['atol']}, rtol {tol['rtol']})"
    )
