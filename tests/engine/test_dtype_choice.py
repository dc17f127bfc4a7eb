"""``dtype: auto`` picks the compute type from the CPU's ISA; the KV pool may store a narrower type.

The engine runs float32 over a bfloat16 pool against transformers in float32 (logits within the
rounding of K/V to bfloat16, greedy tokens mostly equal), and the choice itself is checked on every
combination of checkpoint type, ISA and explicit setting.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.engine_config import resolve_dtype
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.models.config import ModelConfig
from kvpilot.kernels import isa
from tests.conftest import build_checkpoint
from tests.engine.prompt_logits import prompt_logits, random_prompts

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


class _Checkpoint:
    """Just what ``resolve_dtype`` reads of a ``ModelConfig``."""

    def __init__(self, torch_dtype: str | None) -> None:
        self.torch_dtype = torch_dtype


@pytest.mark.parametrize(
    ("checkpoint", "native", "compute", "kv"),
    [
        ("bfloat16", True, torch.bfloat16, torch.bfloat16),
        ("bfloat16", False, torch.float32, torch.bfloat16),
        ("float16", True, torch.bfloat16, torch.bfloat16),
        ("float16", False, torch.float32, torch.bfloat16),
        ("float32", False, torch.float32, torch.float32),
        ("float32", True, torch.float32, torch.float32),
        (None, False, torch.float32, torch.float32),
    ],
)
def test_auto_on_cpu_follows_the_isa(checkpoint, native, compute, kv):
    choice = resolve_dtype("auto", _Checkpoint(checkpoint), CPU, native_bf16=native)
    assert (choice.dtype, choice.kv_cache_dtype) == (compute, kv)
    if checkpoint == "bfloat16" and not native:
        assert "no native bfloat16" in choice.reason and "float32" in choice.reason
        assert "KV cache kept in bfloat16" in choice.reason


def test_auto_on_cuda_keeps_the_checkpoints_type():
    for checkpoint, expected in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        choice = resolve_dtype("auto", _Checkpoint(checkpoint), CUDA, native_bf16=False)
        assert (choice.dtype, choice.kv_cache_dtype) == (expected, expected)


def test_an_explicit_dtype_always_wins():
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16)):
        choice = resolve_dtype(name, _Checkpoint("bfloat16"), CPU, native_bf16=False)
        assert (choice.dtype, choice.kv_cache_dtype) == (dtype, dtype)
        assert "as set" in choice.reason


def test_explicit_kv_cache_dtype():
    bf16 = _Checkpoint("bfloat16")
    choice = resolve_dtype("float32", bf16, CPU, "bfloat16", native_bf16=True)
    assert (choice.dtype, choice.kv_cache_dtype) == (torch.float32, torch.bfloat16)
    choice = resolve_dtype("auto", bf16, CPU, "float32", native_bf16=False)
    assert (choice.dtype, choice.kv_cache_dtype) == (torch.float32, torch.float32)
    with pytest.raises(ConfigError, match="needs float32 compute"):
        resolve_dtype("bfloat16", bf16, CPU, "float32", native_bf16=True)
    with pytest.raises(ConfigError, match="CPU only"):
        resolve_dtype("float32", bf16, CUDA, "bfloat16")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineArgs(model="m", kv_cache_dtype="fp8")


@pytest.mark.parametrize(
    ("flags", "cap", "native"),
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "", True),
        ({"avx2", "amx_tile", "amx_bf16"}, "", True),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX2", False),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_CORE", False),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512_CORE_BF16", True),
        ({"avx2", "fma", "f16c"}, "", False),
        (set(), "", False),
    ],
)
def test_native_bf16_reads_flags_and_the_onednn_cap(flags, cap, native):
    assert isa.native_bf16(frozenset(flags), cap) is native


def test_cpu_flags_parse_x86_and_arm(tmp_path: Path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t\t: none\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert isa.cpu_flags(x86) == {"fpu", "avx2", "fma"}
    assert isa.cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert isa.cpu_flags(tmp_path / "missing") == frozenset()
    line = isa.summary_line(frozenset({"avx2", "fma", "sse2"}))
    assert "avx2 fma" in line and "sse2" not in line and "no native bfloat16" in line


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, tokenizer_dir) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("bf16-ckpt"), tokenizer_dir, seed=3, dtype="bfloat16")


def test_the_engine_computes_in_float32_over_a_bfloat16_pool_without_native_bf16(
    bf16_checkpoint, monkeypatch, caplog
):
    """A bfloat16 checkpoint, ``dtype auto``, oneDNN capped at AVX2 (what an AVX2-only CPU has): the
    engine computes in float32, keeps the pool in bfloat16 with the block count a bfloat16 pool of the
    same memory has, and says why."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert ModelConfig.from_pretrained(bf16_checkpoint).torch_dtype == "bfloat16"
    with caplog.at_level(logging.INFO, logger="kvpilot.engine"):
        llm = LLM(str(bf16_checkpoint), block_size=8, kv_cache_memory_bytes=1 << 20)
    engine = llm.llm_engine
    assert engine.dtype == torch.float32 and engine.kv_cache_dtype == torch.bfloat16
    assert engine.runner.kv_cache.data.dtype == torch.bfloat16
    assert next(engine.model.parameters()).dtype == torch.float32
    reference = LLM(str(bf16_checkpoint), block_size=8, kv_cache_memory_bytes=1 << 20, dtype="bfloat16")
    assert engine.kv_plan.num_blocks == reference.llm_engine.kv_plan.num_blocks
    assert any(
        "no native bfloat16" in r.getMessage() and "KV blocks per GiB" in r.getMessage()
        for r in caplog.records
    )
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def _hf_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_float32_over_a_bfloat16_pool_matches_transformers(tiny_llama, backend):
    """Logits at every position of a prompt prefilled in chunks (the later chunks read K/V back from
    the bfloat16 pool) against transformers in float32: within bfloat16's rounding of K and V, and far
    closer than the same engine computing in bfloat16."""
    kw = dict(block_size=8, num_gpu_blocks_override=64, attention_backend=backend)
    mixed = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype="bfloat16", **kw)
    assert mixed.llm_engine.backend.name == backend
    assert mixed.llm_engine.runner.kv_cache.data.dtype == torch.bfloat16
    bf16 = LLM(str(tiny_llama), dtype="bfloat16", **kw)
    prompt = random_prompts(mixed.get_tokenizer(), 16, seed=4)[14]
    reference = _hf_logits(tiny_llama, prompt)
    got = prompt_logits(mixed, prompt, 24)
    err = (got - reference).abs().max().item()
    err_bf16 = (prompt_logits(bf16, prompt, 24) - reference).abs().max().item()
    assert err < 0.05, err
    assert err < err_bf16 / 2, (err, err_bf16)
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.95
