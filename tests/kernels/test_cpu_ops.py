"""The ``cpu`` backend's C++ paged attention against the torch reference, as the Triton kernel is tested.

The matrix (7 head sizes x 3 dtypes x 3 block sizes x 5 head layouts x 3 batch kinds) is covered
pairwise; every batch kind mixes the lengths 1, bs-1, bs, bs+1 and long, and unused cache slots and
block 0 hold garbage. Without the compiled kernel these tests skip, except under
``KVPILOT_REQUIRE_TOOLS=1`` (``make test``), where a failed build fails them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpilot.kernels import cpu_build, cpu_ops, torch_ops
from kvpilot.kernels.backend import get_backend

from .conftest import (
    DTYPES,
    HEADS,
    assert_close,
    batch_spans,
    make_paged_batch,
    naive_attention,
    pairwise,
    require_cpu_kernel,
)

CASES = pairwise(
    {
        # 32: the benchmarks' small checkpoint; 48: a size with no specialised instantiation.
        "head_size": [32, 48, 64, 80, 96, 128, 256],
        "dtype": list(DTYPES),
        "heads": list(HEADS),
        "block_size": [8, 16, 32],
        "kind": ["decode", "prefill", "mixed"],
    }
)


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    require_cpu_kernel()


def _case_id(case: dict) -> str:
    return "-".join(f"{v}" for v in case.values())


def _run_both(batch, threads: int | None = None):
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        out = cpu_ops.paged_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
        )
    finally:
        torch.set_num_threads(saved)
    ref = torch_ops.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
    )
    return out, ref


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_attention_matches_torch(case):
    dtype = DTYPES[case["dtype"]]
    num_heads, num_kv_heads = HEADS[case["heads"]]
    batch = make_paged_batch(
        batch_spans(case["kind"], case["block_size"]),
        num_heads,
        num_kv_heads,
        case["head_size"],
        case["block_size"],
        dtype,
        device="cpu",
        seed=CASES.index(case),
    )
    out, ref = _run_both(batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert_close(out, ref, dtype, _case_id(case))


@pytest.mark.usefixtures("kernel_isa")
def test_long_prefill_chunk_over_cached_context_matches_dense():
    """A chunk of 70 queries (several query tiles) over 300 cached tokens, against float64 attention."""
    batch = make_paged_batch([(300, 70), (0, 33), (12, 1)], 8, 2, 64, 16, torch.float32, device="cpu")
    out, ref = _run_both(batch)
    assert_close(out, ref, torch.float32, "long chunk vs torch")
    assert_close(out, naive_attention(batch), torch.float32, "long chunk vs dense")


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("kind", ["prefill", "mixed"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("heads", ["gqa3", "gqa8", "mqa"])
def test_bfloat16_prefill_tiles_match_torch(heads, head_size, block_size, kind):
    """bfloat16 items with more than a few rows (prefill tiles; on AMX where the CPU has it: see
    ``uses_amx``), every head size that is a multiple of 32, against the torch reference."""
    num_heads, num_kv_heads = HEADS[heads]
    batch = make_paged_batch(
        batch_spans(kind, block_size),
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        torch.bfloat16,
        device="cpu",
        seed=head_size + block_size,
    )
    out, ref = _run_both(batch)
    assert_close(out, ref, torch.bfloat16, f"{heads} d={head_size} bs={block_size} {kind}")


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_give_the_same_result(threads):
    """Work items are independent: any thread count gives bit-identical output."""
    batch = make_paged_batch(batch_spans("mixed", 16), 12, 4, 64, 16, torch.bfloat16, device="cpu", seed=3)
    one, _ = _run_both(batch, threads=1)
    many, _ = _run_both(batch, threads=threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parallel_loops_run_on_torchs_threads(threads):
    """The extension's ``at::parallel_for`` loops run on as many threads as torch is set to. Built
    without OpenMP, ATen's parallel_for runs the whole range on the calling thread, and an engine on
    two threads would get one thread of attention."""
    ext = cpu_build.load_extension()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        width = ext.parallel_width(64)
    finally:
        torch.set_num_threads(before)
    assert width == threads


@pytest.mark.usefixtures("kernel_isa")
def test_unused_heads_of_a_fused_qkv_view_are_not_read():
    """The query may be a strided view; the result equals the contiguous query's."""
    batch = make_paged_batch([(20, 1), (5, 9)], 6, 2, 80, 8, torch.float16, device="cpu", seed=7)
    assert not batch.query.is_contiguous()
    strided, _ = _run_both(batch)
    contiguous = cpu_ops.paged_attention(
        batch.query.contiguous(), batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
    )
    assert torch.equal(strided, contiguous)


@pytest.mark.usefixtures("kernel_isa")
def test_offsets_past_int32():
    """Blocks whose element offsets exceed 2**31 (the cache is 4.3 GB, allocated lazily)."""
    block_size, num_kv_heads, head_size = 16, 1, 64
    first = (1 << 31) // (block_size * num_kv_heads * head_size) + 5
    batch = make_paged_batch(
        [(40, 1), (0, 19), (17, 6)],
        4,
        num_kv_heads,
        head_size,
        block_size,
        torch.float16,
        device="cpu",
        first_block_id=first,
        num_blocks=first + 16,
    )
    assert batch.k_cache.numel() > 2**31
    out, ref = _run_both(batch)
    assert_close(out, ref, torch.float16, "int64 offsets")


@pytest.mark.usefixtures("kernel_isa")
def test_empty_batch_and_bad_arguments():
    batch = make_paged_batch([(3, 1)], 4, 4, 64, 16, torch.float32, device="cpu")
    empty = cpu_ops.paged_attention(
        batch.query[:0], batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
    )
    assert empty.shape == (0, 4, 64)
    with pytest.raises(ValueError, match="share one of"):
        cpu_ops.paged_attention(
            batch.query.half(), batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
        )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        cpu_ops.paged_attention(
            batch.query[:, :3], batch.k_cache[..., :2, :], batch.v_cache[..., :2, :], batch.metadata, 1.0
        )


def test_backend_uses_the_kernels_and_the_torch_block_ops():
    backend = get_backend("cpu", "cpu")
    assert backend.name == "cpu" and backend.paged_attention is cpu_ops.paged_attention
    assert backend.write_kv_cache is cpu_ops.write_kv_cache
    assert backend.copy_blocks is torch_ops.copy_blocks and backend.swap_blocks is torch_ops.swap_blocks
    assert get_backend("auto", "cpu").name == "cpu"


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_write_kv_cache_matches_torch(dtype, num_tokens):
    """Keys and values as strided views of a fused QKV output, padding (-1) slots among real ones,
    and a key dtype that differs from the cache's (served by the torch op)."""
    g = torch.Generator().manual_seed(num_tokens)
    num_blocks, block_size, heads, d = 40, 8, 3, 32
    qkv = torch.randn(num_tokens, (4 + 2 * heads) * d, generator=g).to(dtype)
    key = qkv[:, 4 * d : (4 + heads) * d].view(num_tokens, heads, d)
    value = qkv[:, (4 + heads) * d :].view(num_tokens, heads, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::4] = -1
    for key_dtype in (dtype, torch.float32 if dtype != torch.float32 else torch.bfloat16):
        expected = [torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype) for _ in range(2)]
        actual = [t.clone() for t in expected]
        torch_ops.write_kv_cache(key.to(key_dtype), value.to(key_dtype), *expected, slots)
        cpu_ops.write_kv_cache(key.to(key_dtype), value.to(key_dtype), *actual, slots)
        assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])


def test_build_is_cached_across_processes(tmp_path):
    """A second process loads the cached build without compiling: with no compiler and no ninja on its
    PATH the kernel is still available, and the build directory is marked complete."""
    directory = cpu_build.cache_root() / f"kvpilot_cpu_attention_{cpu_build.build_key()}"
    assert (directory / "complete").exists()
    script = "from kvpilot.kernels import cpu_ops; print(cpu_ops.is_available())"
    env = dict(PATH=str(tmp_path), HOME=str(Path.home()), KVPILOT_KERNEL_CACHE=str(cpu_build.cache_root()))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "True", proc.stderr[-3000:]


@pytest.fixture
def fresh_loader(tmp_path, monkeypatch):
    """``load_extension`` with an empty kernel cache (``tmp_path``) and nothing loaded yet; the real
    cache is back afterwards."""
    monkeypatch.setenv("KVPILOT_KERNEL_CACHE", str(tmp_path))
    cpu_build.load_extension.cache_clear()
    yield tmp_path
    cpu_build.load_extension.cache_clear()


def test_a_failed_openmp_build_falls_back_once(fresh_loader, monkeypatch, caplog):
    """Where the OpenMP build fails, the kernels are built without it (one thread, one warning), and
    the failure is remembered: later loads do not compile the failing build again."""
    calls = []
    sentinel = object()

    def fake_build(name, directory, openmp, target=None):
        assert target is None  # the default build, for this CPU
        calls.append(openmp)
        if openmp:
            raise RuntimeError("cannot find -lgomp")
        directory.mkdir(parents=True, exist_ok=True)
        return sentinel

    monkeypatch.setattr(cpu_build, "_build", fake_build)
    with caplog.at_level("WARNING", logger="kvpilot.kernels"):
        assert cpu_build.load_extension() is sentinel
    assert calls == [True, False]
    assert "without OpenMP" in caplog.text and "cannot find -lgomp" in caplog.text
    assert (fresh_loader / f"kvpilot_cpu_attention_{cpu_build.build_key(True)}" / "failed").exists()
    cpu_build.load_extension.cache_clear()
    assert cpu_build.load_extension() is sentinel
    assert calls == [True, False, False]


def test_without_any_build_the_torch_path_is_used_and_retried_later(fresh_loader, monkeypatch, caplog):
    """No build works (no compiler): the kernel is unavailable (one warning), and the next process
    tries the plain build again (a compiler may have been installed), not the remembered OpenMP one."""
    calls = []

    def failing_build(name, directory, openmp, target=None):
        assert target is None  # the default build, for this CPU
        calls.append(openmp)
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(cpu_build, "_build", failing_build)
    with caplog.at_level("WARNING", logger="kvpilot.kernels"):
        assert cpu_build.load_extension() is None
    assert "using the torch path" in caplog.text and "g++: not found" in caplog.text
    cpu_build.load_extension.cache_clear()
    assert cpu_build.load_extension() is None
    assert calls == [True, False, False]
