"""Bad input gets a clear error and loses nothing."""

from __future__ import annotations

import json

import pytest

from kvpilot.engine import LLM, BeamSearchParams, SamplingParams
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import (
    ConfigError,
    InvalidRequestError,
    KVCacheSizeError,
    SamplingParamsError,
    UnsupportedModelError,
)

from ..conftest import build_checkpoint


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named(tmp_path, tokenizer_dir):
    model_dir = build_checkpoint(tmp_path / "m", tokenizer_dir)
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(model_dir), num_gpu_blocks_override=16)


def test_unsupported_rope_scaling_is_named(tmp_path, tokenizer_dir):
    model_dir = build_checkpoint(tmp_path / "m", tokenizer_dir)
    _edit_config(model_dir, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        LLM(str(model_dir), num_gpu_blocks_override=16)


def test_missing_model_dir():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/nonexistent/model/dir")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=12), "power of two"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
        (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
        (dict(preemption_mode="drop"), "preemption_mode must be one of recompute, swap"),
        (dict(dtype="int8"), "dtype must be one of"),
    ],
)
def test_invalid_engine_args(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model="x", **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(n=0), "n must be"),
        (dict(stop=[""]), "stop strings"),
        (dict(logprobs=50), "logprobs"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(top_p=None), "top_p must be a number"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens")],
)
def test_invalid_beam_search_params(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        BeamSearchParams(**kwargs)


def test_max_model_len_that_cannot_fit_fails_at_start_with_the_fix(tiny_llama):
    with pytest.raises(KVCacheSizeError, match=r"lower max_model_len to at most 64") as err:
        LLM(str(tiny_llama), block_size=16, num_gpu_blocks_override=4, max_model_len=256)
    assert "needs 16 blocks" in str(err.value)
    with pytest.raises(ConfigError, match="exceeds what the model supports"):
        LLM(str(tiny_llama), num_gpu_blocks_override=64, max_model_len=100_000)


def test_memory_fraction_too_small_names_the_knob(tiny_llama):
    with pytest.raises(KVCacheSizeError, match="raise gpu_memory_utilization"):
        LLM(str(tiny_llama), device="cpu", cpu_memory_budget_bytes=8 << 20, gpu_memory_utilization=0.5)


def test_bad_requests_are_rejected_and_the_rest_of_the_batch_completes(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=16, max_model_len=120)
    engine = llm.llm_engine
    good = [[5, 6, 7, 8], [9, 10, 11]]
    engine.add_request("a", good[0], SamplingParams(temperature=0.0, max_tokens=5))
    vocab = engine.model_config.vocab_size
    # Every refusal is an InvalidRequestError (the server's 400), and none leaves a trace.
    with pytest.raises(InvalidRequestError, match="maximum context length is 120 tokens"):
        engine.add_request("too-long", list(range(5, 205)), SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids must be integers"):
        engine.add_request("oov", [5, 10**6], SamplingParams())
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("a", good[0], SamplingParams())
    with pytest.raises(InvalidRequestError, match="stop_token_ids must be below the vocabulary size"):
        engine.add_request("stops", good[1], SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(InvalidRequestError, match=r"n=300 sequences exceed max_num_seqs \(256\)"):
        engine.add_request("wide", good[1], SamplingParams(n=300))
    with pytest.raises(InvalidRequestError, match=r"beam_width 300 exceeds max_num_seqs \(256\)"):
        engine.add_beam_search_request("beams", good[1], BeamSearchParams(beam_width=300, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_beam_search_request("a", good[1], BeamSearchParams(beam_width=2, max_tokens=4))
    assert engine.get_num_unfinished_requests() == 1 and list(engine.scheduler.requests) == ["a"]
    engine.add_request("b", good[1], SamplingParams(temperature=0.0, max_tokens=5))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == ["a", "b"]
    assert all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    assert engine.block_manager.num_free_blocks == 16


def test_abort_frees_blocks_immediately(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=32, max_model_len=128)
    engine = llm.llm_engine
    engine.add_request("x", list(range(5, 45)), SamplingParams(max_tokens=50), stream=True)
    engine.add_request("y", list(range(5, 25)), SamplingParams(max_tokens=50, n=2))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < 32
    engine.abort_request(["x", "y", "unknown"])
    assert engine.block_manager.num_free_blocks == 32
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
