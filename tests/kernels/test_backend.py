"""Backend choice: names, the engine argument as the one source, and the torch path with triton absent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from kvpilot.kernels import torch_ops
from kvpilot.kernels.backend import get_backend, resolve_backend_name

# ``auto`` on CPU: the C++ kernel wherever a C++ compiler is there to build it (torch's cpp_extension
# uses $CXX, else c++), else the torch path. Decided from the machine, not from the code under test:
# a kernel that stops building where it can must fail here.
AUTO_ON_CPU = "cpu" if shutil.which(os.environ.get("CXX", "c++")) else "torch"


def test_explicit_names_and_auto_on_cpu():
    assert resolve_backend_name("torch", "cuda") == "torch"
    assert resolve_backend_name("triton", "cpu") == "triton"
    assert resolve_backend_name("cpu", "cpu") == "cpu"
    assert resolve_backend_name("auto", "cpu") == AUTO_ON_CPU
    backend = get_backend("torch", "cpu")
    assert backend.name == "torch" and backend.paged_attention is torch_ops.paged_attention


def test_the_name_given_is_the_one_source(monkeypatch):
    """The ``attention_backend`` engine argument decides; the environment variable that once overrode
    ``auto`` does nothing."""
    monkeypatch.setenv("KVPILOT_ATTENTION_BACKEND", "triton")
    assert resolve_backend_name("auto", "cpu") == AUTO_ON_CPU
    assert resolve_backend_name("triton", "cpu") == "triton"


def test_unknown_name_is_rejected():
    with pytest.raises(ValueError, match="auto, torch, triton, cpu"):
        resolve_backend_name("flash", "cpu")
    with pytest.raises(ValueError, match="CPU devices only"):
        resolve_backend_name("cpu", "cuda")


def test_failed_build_falls_back_to_torch(tmp_path):
    """With no compiler the build fails: one warning line, and ``auto`` and ``cpu`` both give the
    torch path; nothing raises."""
    script = textwrap.dedent(
        """
        import logging, os
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
        from kvpilot.kernels import torch_ops
        from kvpilot.kernels.backend import get_backend, resolve_backend_name

        assert resolve_backend_name("auto", "cpu") == "torch"
        backend = get_backend("cpu", "cpu")
        assert backend.name == "torch" and backend.paged_attention is torch_ops.paged_attention
        print("ok")
        """
    )
    env = {
        "PATH": str(tmp_path),  # no compiler, no ninja
        "HOME": str(tmp_path),
        "KVPILOT_KERNEL_CACHE": str(tmp_path / "cache"),
        "CXX": str(tmp_path / "missing-c++"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING kvpilot.kernels")]
    assert len(warnings) == 1 and "using the torch path" in warnings[0], proc.stderr[-3000:]


def test_torch_path_works_without_triton(tmp_path):
    """With triton unimportable, ``auto`` falls back to torch even on CUDA, writes K/V into their slots
    and computes the same attention as a dense causal reference; choosing torch never imports triton."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import torch
        from kvpilot.kernels.backend import get_backend, resolve_backend_name
        from kvpilot.kernels.metadata import AttentionMetadata

        assert resolve_backend_name("auto", "cuda") == "torch"
        backend = get_backend("auto", "cpu")
        torch.manual_seed(0)
        q, key, value = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
        k_cache, v_cache = torch.randn(4, 8, 2, 64), torch.randn(4, 8, 2, 64)
        # Request 0 decodes its 5th token (block 2, slot 2*8+4); request 1 prefills 2 tokens in block 1.
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([20, 8, 9]), query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
            seq_lens=torch.tensor([5, 2], dtype=torch.int32),
            block_tables=torch.tensor([[2], [1]], dtype=torch.int32), max_query_len=2, max_seq_len=5,
            num_decodes=1, query_start_loc_host=[0, 1, 3], seq_lens_host=[5, 2],
        )
        backend.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        assert torch.equal(k_cache.view(-1, 2, 64)[[20, 8, 9]], key)
        assert torch.equal(v_cache.view(-1, 2, 64)[[20, 8, 9]], value)
        out = backend.paged_attention(q, k_cache, v_cache, meta, 0.125)
        # Dense causal attention, each pair of query heads on one KV head.
        expected = torch.empty_like(q)
        for block, start, end, seq_len in ((2, 0, 1, 5), (1, 1, 3, 2)):
            k = k_cache[block, :seq_len].repeat_interleave(2, dim=1)
            v = v_cache[block, :seq_len].repeat_interleave(2, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * 0.125
            positions = torch.arange(seq_len - (end - start), seq_len)
            scores.masked_fill_(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
            expected[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5), (out - expected).abs().max()
        assert sys.modules["triton"] is None
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_the_pool_follows_what_the_backend_declares(monkeypatch, tiny_llama):
    # The runner lays out and fills the KV pool from the backend's declarations, not from its name: the
    # torch backend declared head-major and unzeroed gets a head-major pool and still decodes (its ops
    # read the pool through the standard view, by strides).
    import dataclasses

    import kvpilot.engine.llm_engine as llm_engine
    import kvpilot.engine.parallel.rank as rank
    from kvpilot.engine import LLM, SamplingParams

    def declared(name, device_type):
        return dataclasses.replace(get_backend(name, device_type), head_major_kv=True, needs_zeroed_kv=False)

    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine_args = dict(attention_backend="torch", dtype="float32", block_size=8, num_gpu_blocks_override=64)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 8, 21, 7]}]
    plain = LLM(str(tiny_llama), **engine_args)
    try:
        assert not plain.llm_engine.runner.kv_cache.head_major
        expected = plain.generate(prompts, params)[0].outputs[0].token_ids
    finally:
        plain.shutdown()
    monkeypatch.setattr(llm_engine, "get_backend", declared)
    monkeypatch.setattr(rank, "get_backend", declared)  # a rank builds its backend from the name
    llm = LLM(str(tiny_llama), **engine_args)
    try:
        assert llm.llm_engine.backend.name == "torch"
        assert llm.llm_engine.runner.kv_cache.head_major
        assert llm.generate(prompts, params)[0].outputs[0].token_ids == expected
    finally:
        llm.shutdown()
    assert get_backend("torch", "cpu").needs_zeroed_kv and not get_backend("torch", "cpu").head_major_kv
