"""A bfloat16 checkpoint computed in float32 keeps its linears as bfloat16 weight panels
(``layers.PanelWeight`` over ``cpu_ops.linear_bf16w``): what an AVX2-only CPU runs under ``dtype auto``.

The engine against transformers in float32 on the same checkpoint (logits at every prompt position
and greedy tokens), the weight memory against the float32 layout, and the layer-level pieces
(``linear``, a tied table's lookup, a tensor-parallel shard's lookup) against ``F.linear`` and
``F.embedding`` within float32 summation's bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.models import layers
from kvpilot.engine.models.layers import (
    ColumnParallelLinear,
    PanelWeight,
    VocabParallelEmbedding,
    is_bf16_exact,
    linear,
    prepack_cpu_linears,
)
from tests.conftest import build_checkpoint
from tests.engine.prompt_logits import prompt_logits, random_prompts
from tests.kernels.conftest import require_cpu_kernel

LOGITS_ATOL = 1e-4  # float32 end to end, summed in another order than transformers' matmuls


@pytest.fixture(autouse=True)
def _kernel():
    require_cpu_kernel()


def _panel_op():
    from kvpilot.kernels import cpu_ops

    path = cpu_ops.linear_bf16w_path()
    if path not in ("avx2", "avx512"):
        pytest.skip(f"the kernel's linear runs its {path} loop here, which the engine does not use")
    return cpu_ops.load_extension().linear_bf16w


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def bf16_checkpoint(request, tmp_path_factory, tokenizer_dir) -> Path:
    out = tmp_path_factory.mktemp("bf16-panels")
    return build_checkpoint(out, tokenizer_dir, seed=11, dtype="bfloat16", tie_word_embeddings=request.param)


def _engine(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="float32",
        block_size=8,
        num_gpu_blocks_override=128,
        max_num_batched_tokens=32,
    )


def _hf(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 summation's error bound on ``x @ w.T`` (two float32 sums may each be off by it)."""
    return 2 * 2 * x.shape[-1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30


def test_the_engine_holds_every_linear_as_panels_and_half_the_weight_bytes(bf16_checkpoint, monkeypatch):
    _panel_op()
    llm = _engine(bf16_checkpoint)
    model = llm.llm_engine.model
    matmuls = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, layers.RowParallelLinear))]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    for module in [*matmuls, head]:
        assert type(module.packed_weight) is PanelWeight, module
        assert module.weight.numel() == 0  # the float32 copy is gone
    shapes = [(m.packed_weight.out_features, m.packed_weight.panels.shape[1]) for m in [*matmuls, head]]
    assert {n % 16 for n, _ in shapes} == {0}  # no padding column in this model's panels
    weights = llm.llm_engine.runner.weight_bytes
    # The same engine without panels: every float32 weight kept.
    monkeypatch.setattr(layers, "_panel_op", lambda: None)
    plain = _engine(bf16_checkpoint).llm_engine.runner
    assert plain.packed_weight_bytes == 0
    packed_params = sum(n * k for n, k in shapes)
    # Each packed weight takes 2 bytes instead of 4.
    assert weights == plain.weight_bytes - 2 * packed_params
    assert llm.llm_engine.kv_plan.weights_bytes == weights  # what KV sizing and the start-up line count


def test_logits_and_greedy_tokens_match_transformers(bf16_checkpoint):
    _panel_op()
    llm = _engine(bf16_checkpoint)
    hf = _hf(bf16_checkpoint)
    prompts = random_prompts(llm.get_tokenizer(), 16, seed=2)
    for prompt in (prompts[9], prompts[13], prompts[15]):  # 31, 100 and 150 tokens: several chunks of 32
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prompt_logits(llm, prompt, 32), reference, atol=LOGITS_ATOL, rtol=0)
    batch = prompts[4:12]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0.0, max_tokens=12)
    )
    for prompt, out in zip(batch, outs, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 96), (1, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_panel_linear_is_f_linear_within_the_float32_bound(shape, with_bias):
    op = _panel_op()
    gen = torch.Generator().manual_seed(shape[0] * 7 + with_bias)
    w = torch.randn(40, 96, generator=gen).to(torch.bfloat16).float()
    b = torch.randn(40, generator=gen) if with_bias else None
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)[..., ::2]  # strided features
    assert x.stride(-1) != 1
    panel = PanelWeight(w, op)
    y = linear(x, w, b, panel)
    assert y.shape == (*shape[:-1], 40) and y.dtype == torch.float32
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert bool(((y.double() - exact).abs() <= _bound(x, w)).all())
    ids = torch.tensor([0, 15, 16, 39, 17])
    assert torch.equal(panel.rows(ids), F.embedding(ids, w))  # exact: the rows are the bfloat16 values


def test_only_float32_weights_that_are_bfloat16_values_become_panels():
    _panel_op()
    exact = ColumnParallelLinear(32, {None: (24, 0)}, bias=False)
    inexact = ColumnParallelLinear(32, {None: (24, 0)}, bias=False)
    with torch.no_grad():
        exact.weight.copy_(torch.randn(24, 32).to(torch.bfloat16).float())
        inexact.weight.copy_(torch.randn(24, 32))
        inexact.weight[3, 5] = exact.weight[3, 5]
    assert is_bf16_exact(exact.weight) and not is_bf16_exact(inexact.weight)
    model = torch.nn.Sequential(exact, inexact)
    assert prepack_cpu_linears(model) == 2 * 32 * 32  # one layer's panels: 2 panels of 16 columns
    assert type(exact.packed_weight) is PanelWeight and exact.weight.numel() == 0
    assert inexact.packed_weight is None and inexact.weight.shape == (24, 32)  # F.linear, as transformers


class _TwoRanks:
    """A tensor-parallel comm of two ranks, seen from one: the all-reduce adds the other rank's part."""

    tp_size = 2
    tp_rank = 1

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.other


def test_a_sharded_table_looks_up_its_own_rows_in_the_panels():
    """Rank 1 of 2 holds vocabulary rows 20..39 of 37 (three padding rows): its lookups of ids outside
    them are zero before the all-reduce, as with the float32 table."""
    op = _panel_op()
    table = torch.randn(40, 24).to(torch.bfloat16).float()
    table[37:] = 0
    ids = torch.tensor([0, 19, 20, 21, 36, 5, 30])
    other = torch.randn(len(ids), 24)
    emb = VocabParallelEmbedding(20, 24, vocab_start=20, vocab_size=37, comm=_TwoRanks(other))
    with torch.no_grad():
        emb.weight.copy_(table[20:])
    expected = emb(ids)
    emb.packed_weight = PanelWeight(emb.weight.detach().clone(), op)
    emb.weight.data = emb.weight.new_empty(0)
    got = emb(ids)
    assert torch.equal(got, expected)
    mine = (ids >= 20) & (ids < 40)
    assert torch.equal(got[~mine], other[~mine])
