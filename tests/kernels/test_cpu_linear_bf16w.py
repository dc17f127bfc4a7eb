"""The few-token linear with bfloat16-stored weights (``cpu_ops.linear_bf16w``) against float64: the
product of float32 activations and the bfloat16 weights, within float32 summation's error bound, for
every tile and panel remainder, on each ISA level's build."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import cpu_ops


@pytest.fixture
def ext(kernel_isa):
    return kernel_isa


def reference(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product with the bfloat16-rounded weight, and the bound on float32 summation's error
    over K terms (Higham: K u sum |x_k w_k|, u = 2^-24, with a factor 2 for the FMA and split order)."""
    w = weight.to(torch.bfloat16).double()
    exact = x.double() @ w.T
    bound = 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ w.abs().T) + 1e-30
    return exact, bound


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 12, 13, 24, 25, 32, 97, 200])
@pytest.mark.parametrize("n, k", [(1, 1), (15, 7), (16, 64), (17, 300), (100, 33), (64, 768)])
def test_matches_float64_within_the_float32_bound(ext, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    y = cpu_ops.linear_bf16w(x, cpu_ops.pack_bf16_panels(weight), n)
    exact, bound = reference(x, weight)
    assert y.shape == (m, n) and y.dtype == torch.float32
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def test_strided_rows_and_a_bfloat16_checkpoint_are_exact_inputs(ext):
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 96, generator=gen).to(torch.bfloat16)  # as a bfloat16 checkpoint holds it
    wide = torch.randn(9, 200, generator=gen)
    x = wide[:, 50:146]  # rows strided, each contiguous
    packed = cpu_ops.pack_bf16_panels(weight)
    assert packed.shape == (3, 96, 16) and bool((packed[2, :, 8:] == 0).all())
    y = cpu_ops.linear_bf16w(x, packed, 40)
    exact, bound = reference(x, weight.float())
    assert bool(((y.double() - exact).abs() <= bound).all())
    # The same values through F.linear in float32: equal within the same bound.
    assert bool(((torch.nn.functional.linear(x, weight.float()).double() - exact).abs() <= bound).all())


def test_bad_shapes_are_refused(ext):
    packed = cpu_ops.pack_bf16_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="features"):
        cpu_ops.linear_bf16w(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="do not fill"):
        cpu_ops.linear_bf16w(torch.randn(2, 8), packed, 33)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.linear_bf16w(torch.randn(2, 8, dtype=torch.float64), packed, 20)
    assert cpu_ops.linear_bf16w(torch.randn(0, 8), packed, 20).shape == (0, 20)


EXPECTED_PATH = {"portable": "portable", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512"}


def test_each_level_runs_its_own_loop_and_no_thread_count_changes_a_bit(ext):
    """The build of each ISA level names the loop it compiled (the default build: this CPU's best), and
    the product is bit-identical on 1 and on every thread (each output is summed by one thread)."""
    path = cpu_ops.linear_bf16w_path()
    assert path == EXPECTED_PATH.get(ext, path) and path in set(EXPECTED_PATH.values())
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(200, 256, generator=gen)
    packed = cpu_ops.pack_bf16_panels(weight)
    before = torch.get_num_threads()
    try:
        outs = {}
        for threads in sorted({1, 2, before}):
            torch.set_num_threads(threads)
            outs[threads] = [
                cpu_ops.linear_bf16w(torch.randn(m, 256, generator=gen.manual_seed(m)), packed, 200)
                for m in (1, 7, 130)
            ]
    finally:
        torch.set_num_threads(before)
    first = outs[1]
    for got in outs.values():
        assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True))
