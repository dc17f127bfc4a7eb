"""float32 compute over a bfloat16 or float16 KV pool in the C++ kernels.

``paged_attention`` takes a float32 query over bfloat16 or float16 caches (the caches widened to fp32 as
they are read; the output float32) besides the all-one-dtype calls, and ``write_kv_cache`` stores float32
keys and values into such caches, rounded as torch's ``.to()`` rounds. The attention is checked against
the torch reference on the caches upcast to float32 and against a dense float64 softmax, over head sizes
with and without a specialised instantiation, block sizes, GQA groups, decode rows, prefill chunks with
and without cached context, and token-major and head-major pools, on the build of every ISA level this
CPU runs (``kernel_isa``). On a CPU with AVX2 and FMA but no AVX-512 the default build runs the 8-wide
score, softmax and PV loops (and reads a decode item's K/V straight from the cache), the portable level
the omp-simd loops. The fused decoder-layer ops also take float32 (no rounding between the ops): they
are checked against the torch float32 ops and a float64 reference. Every kernel result is bit-identical
across thread counts.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine.models.llama import RotaryEmbedding
from kvpilot.kernels import torch_ops

from .conftest import make_paged_batch, pairwise

HEAD_SIZES = [32, 48, 64, 80, 96, 128, 256]  # 48: no specialised instantiation
BLOCK_SIZES = [8, 16, 32]
GROUPS = [1, 4]
NUM_KV_HEADS = 2
HALF_CACHES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# fp32 against fp32: summation order and the exp approximation (observed ~1e-6). Against float64: the
# same plus the query and probabilities held in fp32.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
DENSE_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture
def ext(kernel_isa):
    """The kernel build of each ISA level this CPU runs (``kernel_isa``)."""
    from kvpilot.kernels import cpu_ops

    return cpu_ops.load_extension()


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values in a head-major allocation, viewed as ``[blocks, block_size, heads, d]``."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def spans_for(block_size: int) -> list[tuple[int, int]]:
    """``(context_len, query_len)``: decodes at 1, bs-1, bs, bs+1 and a long context; prefill chunks
    over cached context (short, and one past the 64-key step); fresh prompts (one block, and long)."""
    bs, long = block_size, max(4 * block_size, 64) + 7
    return [
        (0, 1),
        (bs - 2, 1),
        (bs - 1, 1),
        (bs, 1),
        (long - 1, 1),
        (bs - 1, bs + 1),
        (long, 5),
        (0, bs),
        (0, 70),
    ]


def attend(ext, query, k_cache, v_cache, metadata, scale, threads: int | None = None) -> torch.Tensor:
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return ext.paged_attention(
            query, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, scale
        )
    finally:
        torch.set_num_threads(saved)


def dense_attention(query, k_cache, v_cache, spans, block_tables, scale) -> torch.Tensor:
    """softmax(Q K^T * scale + causal mask) V in float64 over each request's keys gathered from the pool."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    token = 0
    for (context, q_len), table in zip(spans, block_tables, strict=True):
        positions = torch.arange(context + q_len)
        blocks = torch.tensor(table)[positions // block_size]
        keys = k_cache[blocks, positions % block_size].double().repeat_interleave(group, dim=1)
        values = v_cache[blocks, positions % block_size].double().repeat_interleave(group, dim=1)
        q = query[token : token + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        hidden = positions[None, :] > (context + torch.arange(q_len))[:, None]
        weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[token : token + q_len] = torch.einsum("hqk,khd->qhd", weights, values)
        token += q_len
    return out


def assert_within(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    err = (actual.double() - expected.double()).abs()
    bad = err > atol + rtol * expected.double().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} of {err.numel()} off, max abs error {err.max():.3g}"


def fp32_query(num_tokens: int, num_heads: int, head_size: int, seed: int) -> torch.Tensor:
    """A float32 query with full fp32 mantissas, as a strided view (the Q columns of a fused QKV)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2) * head_size, generator=g)
    return qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)


def mixed_case(head_size, block_size, group, cache_dtype, seed):
    spans = spans_for(block_size)
    batch = make_paged_batch(
        spans, group * NUM_KV_HEADS, NUM_KV_HEADS, head_size, block_size, cache_dtype, device="cpu", seed=seed
    )
    query = fp32_query(batch.query.shape[0], group * NUM_KV_HEADS, head_size, seed)
    return batch, query


LAYOUTS = ["token_major", "head_major"]
# bfloat16 (the pool the engine keeps under float32 compute): every combination; float16: pairwise.
MIXED_CASES = [
    dict(cache="bf16", head_size=h, block_size=b, group=g, layout=lay)
    for h in HEAD_SIZES
    for b in BLOCK_SIZES
    for g in GROUPS
    for lay in LAYOUTS
] + [
    dict(cache="fp16", **case)
    for case in pairwise(dict(head_size=HEAD_SIZES, block_size=BLOCK_SIZES, group=GROUPS, layout=LAYOUTS))
]


@pytest.mark.parametrize(
    "cache,head_size,block_size,group,layout",
    [tuple(case.values()) for case in MIXED_CASES],
    ids=["-".join(str(v) for v in case.values()) for case in MIXED_CASES],
)
def test_fp32_query_over_half_caches(ext, cache, head_size, block_size, group, layout):
    batch, query = mixed_case(head_size, block_size, group, HALF_CACHES[cache], seed=head_size + block_size)
    k_cache, v_cache = batch.k_cache, batch.v_cache
    if layout == "head_major":
        k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    out = attend(ext, query, k_cache, v_cache, batch.metadata, batch.scale)
    assert out.dtype == torch.float32 and out.shape == query.shape and out.is_contiguous()
    what = f"fp32 over {cache} d={head_size} bs={block_size} group={group} {layout}"
    ref = torch_ops.paged_attention(
        query, batch.k_cache.float(), batch.v_cache.float(), batch.fresh_metadata(), batch.scale
    )
    assert_within(out, ref, **FP32_TOL, what=f"{what} vs torch")
    dense = dense_attention(query, k_cache, v_cache, batch.spans, batch.block_tables, batch.scale)
    assert_within(out, dense, **DENSE_TOL, what=f"{what} vs float64")


@pytest.mark.parametrize("head_size", [48, 64, 128])
def test_fp32_over_fp32_matches_dense(ext, head_size):
    """The all-float32 call through the same loops, against float64 (the fp32 bound of the torch tests)."""
    batch = make_paged_batch(spans_for(16), 8, 2, head_size, 16, torch.float32, device="cpu", seed=head_size)
    query = fp32_query(batch.query.shape[0], 8, head_size, head_size)
    out = attend(
        ext, query, head_major(batch.k_cache), head_major(batch.v_cache), batch.metadata, batch.scale
    )
    dense = dense_attention(query, batch.k_cache, batch.v_cache, batch.spans, batch.block_tables, batch.scale)
    assert_within(out, dense, **DENSE_TOL, what=f"fp32 d={head_size}")


@pytest.mark.parametrize(
    "query_dtype,cache_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("head_size", [48, 64])
def test_attention_is_bit_identical_across_thread_counts(ext, query_dtype, cache_dtype, head_size):
    batch = make_paged_batch(spans_for(16), 8, 2, head_size, 16, cache_dtype, device="cpu", seed=9)
    query = fp32_query(batch.query.shape[0], 8, head_size, 9).to(query_dtype)
    one = attend(ext, query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale, threads=1)
    two = attend(ext, query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale, threads=2)
    assert one.dtype == query_dtype
    assert torch.equal(one, two)


def test_unsupported_dtype_combinations_are_rejected(ext):
    batch = make_paged_batch([(5, 1), (0, 3)], 4, 2, 32, 16, torch.bfloat16, device="cpu")
    meta, k, v = batch.metadata, batch.k_cache, batch.v_cache
    with pytest.raises(RuntimeError, match="unsupported dtypes"):  # a bfloat16 query over fp32 caches
        attend(ext, batch.query, k.float(), v.float(), meta, 1.0)
    with pytest.raises(RuntimeError, match="unsupported dtypes"):  # float16 over bfloat16
        attend(ext, batch.query.half(), k, v, meta, 1.0)
    with pytest.raises(RuntimeError, match="unsupported dtypes"):  # float32 over float64
        attend(ext, batch.query.float(), k.double(), v.double(), meta, 1.0)
    with pytest.raises(RuntimeError, match="must share a dtype"):  # K and V differ
        attend(ext, batch.query.float(), k, v.half(), meta, 1.0)


def rounding_probes(dtype: torch.dtype, n: int, g: torch.Generator) -> torch.Tensor:
    """n float32 values that exercise the narrowing to ``dtype``: random normals over several scales,
    exact ties between two representable values and their neighbours one fp32 ulp away, subnormals of
    either format, values that round to infinity, signed zeros, infinities and NaN."""
    wide = torch.randn(n, generator=g) * torch.tensor([1e-3, 1.0, 300.0, 3e4])[torch.arange(n) % 4]
    narrow = wide.to(dtype).float()
    # The low bits below the narrow format's last mantissa bit: 16 for bfloat16, 13 for float16.
    drop = 16 if dtype == torch.bfloat16 else 13
    half_ulp = 1 << (drop - 1)
    bits = narrow.view(torch.int32)
    tie = bits + half_ulp
    probes = [wide, tie.view(torch.float32), (tie - 1).view(torch.float32), (tie + 1).view(torch.float32)]
    tiny = 2.0**-133 if dtype == torch.bfloat16 else 2.0**-24  # the narrow format's least subnormal
    probes.append(tiny * (torch.arange(n, dtype=torch.float32) % 64 + 0.5) * torch.sign(wide))
    top = torch.finfo(dtype).max
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, top, -top, 1e-45, -1e-45]
    specials += [65519.0, 65520.0, 65536.0, 3.4e38, -3.4e38] if dtype == torch.float16 else [3.4e38, 3.39e38]
    probes.append(torch.tensor(specials, dtype=torch.float32))
    return torch.cat(probes)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit for bit, except that any NaN equals any NaN (the two sides' NaN payloads may differ)."""
    nan = actual.isnan()
    assert torch.equal(nan, expected.isnan())
    assert torch.equal(actual[~nan].view(torch.int16), expected[~nan].view(torch.int16))


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("cache", list(HALF_CACHES))
def test_write_kv_cache_narrows_fp32_as_torch(ext, cache, layout):
    dtype = HALF_CACHES[cache]
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, d, num_tokens = 40, 8, 3, 44, 120  # d % 8 != 0: the tails too
    probes = rounding_probes(dtype, 2048, g)
    need = 2 * num_tokens * heads * d  # every probe at least once, in random places
    flat = probes.repeat(-(-need // probes.numel()))[:need]
    flat = flat[torch.randperm(need, generator=g)]
    qkv = torch.cat(
        [torch.randn(num_tokens, 4 * d, generator=g), flat.view(num_tokens, 2 * heads * d)], dim=1
    )
    key = qkv[:, 4 * d : (4 + heads) * d].view(num_tokens, heads, d)
    value = qkv[:, (4 + heads) * d :].view(num_tokens, heads, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::7] = -1
    fresh = [torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype) for _ in range(2)]
    expected = [t.clone() for t in fresh]
    keep = slots >= 0
    for cache_t, rows in zip(expected, (key, value), strict=True):
        cache_t.view(-1, heads, d).index_copy_(0, slots[keep], rows[keep].to(dtype))
    for threads in (1, 2):
        actual = [t.clone() for t in fresh]
        if layout == "head_major":
            actual = [head_major(t) for t in actual]
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ext.write_kv_cache(key, value, *actual, slots)
        finally:
            torch.set_num_threads(saved)
        assert_same_bits(actual[0].contiguous(), expected[0])
        assert_same_bits(actual[1].contiguous(), expected[1])


def test_write_kv_cache_rejects_other_combinations(ext):
    key = torch.randn(4, 2, 32)
    caches = [torch.zeros(4, 8, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.arange(4)
    with pytest.raises(RuntimeError, match="must share a dtype"):  # bfloat16 rows into float32 caches
        ext.write_kv_cache(key.bfloat16(), key.bfloat16(), caches[0].float(), caches[1].float(), slots)
    with pytest.raises(RuntimeError, match="must share a dtype"):  # key and value differ
        ext.write_kv_cache(key, key.bfloat16(), *caches, slots)
    with pytest.raises(RuntimeError, match="must share a dtype"):  # k_cache and v_cache differ
        ext.write_kv_cache(key, key, caches[0], caches[1].half(), slots)
    with pytest.raises(RuntimeError, match="must share a dtype"):  # float64 rows
        ext.write_kv_cache(key.double(), key.double(), *caches, slots)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# float32 fused ops: the torch ops' roundings up to the sum of squares' order and the exp approximation.
FUSED_RTOL = 1e-6


@pytest.mark.parametrize("tokens,hidden", [(1, 768), (7, 100), (33, 4096), (5, 13)])
def test_fp32_rms_norm_and_residual_add(ext, tokens, hidden):
    """Hidden sizes not a multiple of 8 exercise the masked tails."""
    g = torch.Generator().manual_seed(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=g) * 3
    residual = torch.randn(tokens, hidden, generator=g)
    weight = torch.randn(hidden, generator=g) * 0.5 + 1.0
    eps = 1e-5
    plain = ext.rms_norm(x, weight, eps)
    assert plain.dtype == torch.float32
    assert_within(plain, rms_norm_reference(x, weight, eps), 0.0, FUSED_RTOL, "rms_norm vs torch")
    assert_within(plain, rms_norm_reference(x.double(), weight.double(), eps), 0.0, FUSED_RTOL, "vs float64")
    updated = residual.clone()
    out = ext.add_rms_norm_(x, updated, weight, eps)
    assert torch.equal(updated, x + residual)  # one fp32 addition, as torch's
    assert_within(out, rms_norm_reference(x + residual, weight, eps), 0.0, FUSED_RTOL, "add_rms_norm_")
    dense = rms_norm_reference(x.double() + residual.double(), weight.double(), eps)
    assert_within(out, dense, 0.0, FUSED_RTOL, "add_rms_norm_ vs float64")


@pytest.mark.parametrize("head_size", [32, 64, 80, 128, 12])
@pytest.mark.parametrize("heads", [(12, 4), (6, 1)])
def test_fp32_rotary_in_place(ext, head_size, heads):
    num_heads, num_kv_heads = heads
    tokens = 19
    g = torch.Generator().manual_seed(head_size * num_heads)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    angles = torch.rand(tokens, head_size // 2, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, num_heads, head_size), k.view(tokens, num_kv_heads, head_size)
    v_before = v.clone()
    refs = [RotaryEmbedding.apply((cos[:, None], sin[:, None]), q, k)]
    refs.append(RotaryEmbedding.apply((cos[:, None].double(), sin[:, None].double()), q.double(), k.double()))
    ext.rotary_(q, k, cos, sin)
    # A rotated value is a sum of two products that may cancel: the bound is relative to the inputs.
    atol = FUSED_RTOL * qkv.abs().max().item()
    for ref_q, ref_k in refs:
        assert_within(q, ref_q, atol, FUSED_RTOL, f"rotary q d={head_size}")
        assert_within(k, ref_k, atol, FUSED_RTOL, f"rotary k d={head_size}")
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("tokens,inter", [(1, 2048), (5, 37), (64, 512)])
def test_fp32_silu_and_mul(ext, tokens, inter):
    g = torch.Generator().manual_seed(tokens + inter)
    gate_up = torch.randn(tokens, 2 * inter, generator=g) * 4
    gate, up = gate_up.split(inter, dim=-1)
    out = ext.silu_and_mul(gate_up)
    assert out.dtype == torch.float32 and out.shape == (tokens, inter)
    assert_within(out, F.silu(gate) * up, 0.0, FUSED_RTOL, "silu_and_mul vs torch")
    assert_within(out, F.silu(gate.double()) * up.double(), 0.0, FUSED_RTOL, "vs float64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_ops_are_bit_identical_across_thread_counts(ext, dtype):
    g = torch.Generator().manual_seed(4)
    tokens, hidden, heads, d = 70, 300, 4, 64
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = (torch.randn(hidden, generator=g) * 0.5 + 1).to(dtype)
    qk = torch.randn(tokens, 2 * heads, d, generator=g).to(dtype)
    emb = torch.rand(tokens, d // 2, generator=g).repeat(1, 2) * 50
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    gate_up = (torch.randn(tokens, 2 * hidden, generator=g) * 4).to(dtype)

    def run(threads):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            res = residual.clone()
            q, k = qk[:, :heads].clone(), qk[:, heads:].clone()
            ext.rotary_(q, k, cos, sin)
            outs = [ext.rms_norm(x, weight, 1e-5), ext.add_rms_norm_(x, res, weight, 1e-5), res, q, k]
            return [*outs, ext.silu_and_mul(gate_up)]
        finally:
            torch.set_num_threads(saved)

    for one, two in zip(run(1), run(2), strict=True):
        assert one.dtype == dtype and torch.equal(one, two)


def test_fused_ops_reject_float64(ext):
    x = torch.randn(4, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ext.rms_norm(x, torch.ones(32, dtype=torch.float64), 1e-5)
