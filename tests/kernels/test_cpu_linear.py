"""The oneDNN-prepacked bfloat16 linears of the CPU path against ``F.linear``: bit for bit at every
token count, padded to a bucket or not, with and without bias; only bfloat16 CPU weights are packed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.models import layers
from kvpilot.engine.models.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SingleRankComm,
    can_prepack,
    linear,
    prepack_cpu_linears,
    token_bucket,
)

# oneDNN ISA caps that still allow its native bfloat16 kernels (ONEDNN_MAX_CPU_ISA; unset: no cap).
NATIVE_BF16_CAPS = {
    *("", "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX"),
    *("AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16"),
}


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX) and oneDNN may use it: read
    from the machine, not from the code under test."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    lines = info.splitlines()
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() not in NATIVE_BF16_CAPS
    return bool({"avx512_bf16", "amx_bf16"} & set(flags)) and not capped


NATIVE = native_bf16()
needs_native = pytest.mark.skipif(not NATIVE, reason="no native bfloat16 here: the linears run unpacked")


def test_packing_is_on_exactly_where_the_cpu_has_native_bf16():
    """A padding or bucketing regression in ``linear`` turns packing off (its probe fails): on a CPU
    with native bfloat16 that is a failure here, not a skip."""
    assert can_prepack(torch.zeros(2, 2, dtype=torch.bfloat16)) is NATIVE


def test_the_engine_says_when_the_linears_run_unpacked(monkeypatch, caplog):
    monkeypatch.setattr(layers, "_PREPACK_OK", False)
    model = nn.Sequential(ColumnParallelLinear(8, {None: (8, 0)}, bias=False)).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="kvpilot.engine"):
        assert prepack_cpu_linears(model) == 0
    assert "bfloat16 linears run unpacked (1 layers)" in caplog.text


@needs_native
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 17, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (1280, 768), (40, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_f_linear(num_tokens, out_features, in_features, with_bias):
    g = torch.Generator().manual_seed(num_tokens * out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(num_tokens, in_features, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    out = linear(x, w, b, packed)
    assert out.shape == (num_tokens, out_features) and out.is_contiguous()
    assert torch.equal(out, F.linear(x, w, b))


def test_token_buckets_cover_and_bound():
    seen = set()
    for n in range(1, 4097):
        b = token_bucket(n)
        assert b >= n and (b <= 2 * n or n <= 16) and b - n < 256
        seen.add(b)
    assert len(seen) <= 5 + 15 + 15  # a few dozen shapes in all, not one per token count


@needs_native
def test_prepack_packs_bf16_cpu_linears_only():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.col = ColumnParallelLinear(32, {None: (48, 0)}, bias=False)
            self.row = RowParallelLinear(48, 32, bias=True, input_start=0, comm=SingleRankComm())
            for p in self.parameters():
                nn.init.normal_(p, std=0.05)

    fp32 = Two()
    assert prepack_cpu_linears(fp32) == 0
    assert fp32.col.packed_weight is None and fp32.row.packed_weight is None
    model = Two().to(torch.bfloat16)
    nbytes = prepack_cpu_linears(model)
    assert nbytes == 2 * 48 * 32 * 2
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(model.col(x), F.linear(x, model.col.weight))
        h = model.col(x)
        assert torch.equal(model.row(h), F.linear(h, model.row.weight, model.row.bias))


@needs_native
def test_long_prefill_mlp_in_passes_matches_one_pass():
    """A CPU MLP over more than ``CPU_PASS_ROWS`` tokens runs in passes of rows; every row's output is
    the one-pass output (rows are independent; only oneDNN's kernel choice per row count may move the
    last bit)."""
    from types import SimpleNamespace

    from kvpilot.engine.models.llama import MLP
    from kvpilot.kernels.backend import get_backend

    cfg = SimpleNamespace(hidden_size=64, mlp_bias=False)
    shard = SimpleNamespace(intermediate_size=96, intermediate_start=0)
    mlp = MLP(cfg, shard, SingleRankComm(), get_backend("torch", "cpu"))
    g = torch.Generator().manual_seed(0)
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.1
    mlp = mlp.to(torch.bfloat16)
    prepack_cpu_linears(mlp)
    x = torch.randn(MLP.CPU_PASS_ROWS * 2 + 37, 64, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        out = mlp(x)
        whole = mlp._forward(x)
    assert out.shape == whole.shape
    torch.testing.assert_close(out, whole, atol=2e-2, rtol=2e-2)
    assert (out != whole).float().mean().item() < 0.01
