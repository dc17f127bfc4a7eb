"""The engine against Hugging Face transformers on the same tiny random-weight checkpoints."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from kvpilot.engine import LLM, SamplingParams

from ..conftest import build_checkpoint
from .prompt_logits import prompt_logits, random_prompts

LOGITS_ATOL = 1e-4  # float32 end to end; observed differences are ~1e-6


def _hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


def _assert_greedy_matches(llm: LLM, hf_model, prompts: list[list[int]], max_tokens: int) -> None:
    """The engine's greedy tokens for ``prompts`` (one batch) equal transformers' for each alone."""
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(hf_model, p, max_tokens), f"prompt of {len(p)} tokens"


def _chunked_llm(model_dir, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> LLM:
    """An engine that prefills in chunks of 32 tokens over ``num_blocks`` KV blocks."""
    return LLM(
        str(model_dir),
        block_size=block_size,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )


@pytest.fixture(scope="module")
def hf_llama(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_matches_transformers_in_one_chunked_batch(tiny_llama, hf_llama, block_size):
    llm = _chunked_llm(tiny_llama, block_size, num_blocks=512, enable_prefix_caching=False)
    prompts = random_prompts(llm.get_tokenizer(), 16)
    max_tokens = 24
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == _hf_greedy(hf_llama, prompt, max_tokens), (
            f"prompt of {len(prompt)} tokens"
        )
    # Chunked prefill really happened: the longest prompt needed several 32-token steps.
    assert max(len(p) for p in prompts) > 32
    assert llm.llm_engine.block_manager.num_free_blocks == 512


def test_greedy_with_prefix_cache_hits_matches_transformers(tiny_llama, hf_llama):
    """Prompts that reuse cached KV blocks of a long shared prefix still generate transformers' tokens."""
    block_size = 8
    llm = _chunked_llm(tiny_llama, block_size, num_blocks=256, enable_prefix_caching=True)
    rng = random.Random(21)
    vocab = len(llm.get_tokenizer())
    prefix = [rng.randrange(5, vocab) for _ in range(6 * block_size)]
    suffixes = [[rng.randrange(5, vocab) for _ in range(n)] for n in (3, 11, 1)]
    max_tokens = 16
    # The first request computes (and caches) the prefix; the batch then reads it from the cache:
    # prompts extending it, the prefix alone (block-aligned: its last block is recomputed) and a repeat.
    _assert_greedy_matches(llm, hf_llama, [prefix + suffixes[0]], max_tokens)
    hits_before = llm.llm_engine.stats().prefix_cache_hits
    prompts = [prefix + suffixes[1], prefix + suffixes[2], prefix, prefix + suffixes[0]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens)
    )
    for p, o in zip(prompts, outs, strict=True):
        assert o.num_cached_tokens >= len(prefix) - block_size, f"prompt of {len(p)} tokens missed the cache"
        assert o.outputs[0].token_ids == _hf_greedy(hf_llama, p, max_tokens), f"prompt of {len(p)} tokens"
    assert llm.llm_engine.stats().prefix_cache_hits - hits_before == sum(o.num_cached_tokens for o in outs)
    assert llm.llm_engine.block_manager.num_free_blocks == 256


@pytest.mark.parametrize("chunk", [7, 1000])
def test_prompt_logits_close_to_transformers(tiny_llama, hf_llama, chunk):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=64)
    prompt = random_prompts(llm.get_tokenizer(), 16)[-1]
    ours = prompt_logits(llm, prompt, chunk)
    with torch.no_grad():
        ref = hf_llama(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def test_each_prompt_alone_matches_the_batch(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, max_num_batched_tokens=48, num_gpu_blocks_override=512)
    prompts = random_prompts(llm.get_tokenizer(), 12, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batch = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    assert batch == alone


def test_seeded_sampling_is_independent_of_batch_composition(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, max_num_batched_tokens=40, num_gpu_blocks_override=512)
    prompts = random_prompts(llm.get_tokenizer(), 10, seed=2)
    target = {"prompt_token_ids": prompts[3]}
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    alone = llm.generate(target, seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in prompts]
    mixed = llm.generate(
        others[:3] + [target] + others[4:],
        [SamplingParams(temperature=1.0, max_tokens=20)] * 3
        + [seeded]
        + [SamplingParams(temperature=0.7, seed=7, max_tokens=9)] * 6,
    )
    assert mixed[3].outputs[0].token_ids == alone
    # A different seed gives a different sample (the seed is really used).
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=16)
    assert llm.generate(target, other_seed)[0].outputs[0].token_ids != alone


def test_sampling_filters(tiny_llama):
    """top_k=1 and a tiny top_p are greedy; min_p=1 keeps only the argmax."""
    llm = LLM(str(tiny_llama), block_size=16, num_gpu_blocks_override=64)
    prompt = {"prompt_token_ids": random_prompts(llm.get_tokenizer(), 16)[9]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0].token_ids
    for params in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10),
        SamplingParams(temperature=1.5, min_p=1.0, max_tokens=10),
    ):
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == greedy, params


def test_stop_conditions(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=128)
    prompt = {"prompt_token_ids": random_prompts(llm.get_tokenizer(), 16)[12]}
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0]
    assert len(full.token_ids) == 20 and full.finish_reason == "length"

    # stop_token_ids: ends at the first occurrence of that token, which is kept in the token ids.
    stop_tok = full.token_ids[6]
    first = full.token_ids.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok]))[
        0
    ].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)

    # EOS (made to be that token): stops there unless ignore_eos; min_tokens defers it.
    engine = llm.llm_engine
    saved = engine.eos_token_id
    engine.eos_token_id = stop_tok
    try:
        eos = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0]
        assert eos.token_ids == full.token_ids[: first + 1] and eos.finish_reason == "stop"
        assert eos.stop_reason is None
        ignored = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[
            0
        ].outputs[0]
        assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"
        deferred = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=first + 2))[
            0
        ]
        assert len(deferred.outputs[0].token_ids) >= first + 2
        assert stop_tok not in deferred.outputs[0].token_ids[: first + 2]
    finally:
        engine.eos_token_id = saved

    # Stop strings: the text ends before the stop string (or includes it), generation stops there.
    text = full.text
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    assert needle and needle in text
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[needle]))[0].outputs[0]
    assert out.text == text[: text.index(needle)]
    assert (out.finish_reason, out.stop_reason) == ("stop", needle)
    assert len(out.token_ids) < 20
    incl = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=needle, include_stop_str_in_output=True)
    )[0].outputs[0]
    assert incl.text == text[: text.index(needle) + len(needle)]
    assert engine.block_manager.num_free_blocks == 128


def test_logprobs_and_penalties(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=128)
    prompt_ids = random_prompts(llm.get_tokenizer(), 16)[10]
    prompt = {"prompt_token_ids": prompt_ids}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert next(iter(entry)) == tok  # sampled token first
        assert len(entry) == 3  # greedy: the sampled token is the top-1
        assert entry[tok] == pytest.approx(max(entry.values()))
        assert all(v <= 0 for v in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )
    # A strong repetition penalty forbids repeating any token seen in prompt or output.
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0].token_ids
    assert len(set(plain)) < len(plain), "the tiny model repeats itself greedily"
    penal = (
        llm.generate(
            prompt,
            SamplingParams(
                temperature=0.0,
                max_tokens=30,
                repetition_penalty=50.0,
                frequency_penalty=2.0,
                presence_penalty=2.0,
            ),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(penal)) == len(penal)


def test_text_prompts_and_chat(tiny_llama, hf_llama):
    llm = LLM(str(tiny_llama), block_size=16, num_gpu_blocks_override=64)
    tok = llm.get_tokenizer()
    out = llm.generate("def main():\n    print(", SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.prompt == "def main():\n    print("
    assert out.prompt_token_ids == tok.encode("def main():\n    print(")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "hello there"}]
    chat = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8))[0]
    expected_prompt = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected_prompt, list):
        expected_prompt = expected_prompt["input_ids"]
    assert chat.prompt_token_ids == list(expected_prompt)
    assert chat.outputs[0].token_ids == _hf_greedy(hf_llama, chat.prompt_token_ids, 8)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3"])
def test_other_architectures_match_transformers(tmp_path, tokenizer_dir, arch):
    extra = {"attention_bias": True} if arch == "qwen3" else {}
    model_dir = build_checkpoint(tmp_path / arch, tokenizer_dir, arch=arch, seed=3, **extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if arch == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
    llm = LLM(str(model_dir), block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=256)
    _assert_greedy_matches(llm, hf, random_prompts(llm.get_tokenizer(), 6, seed=4), max_tokens=10)


def test_sharded_checkpoint_and_tied_embeddings(tmp_path, tokenizer_dir):
    model_dir = build_checkpoint(
        tmp_path / "sharded", tokenizer_dir, seed=5, max_shard_size="100KB", tie_word_embeddings=True
    )
    assert (model_dir / "model.safetensors.index.json").exists()
    assert len(list(model_dir.glob("*.safetensors"))) > 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), block_size=8, num_gpu_blocks_override=128)
    assert llm.llm_engine.model.lm_head is None
    _assert_greedy_matches(llm, hf, random_prompts(llm.get_tokenizer(), 4, seed=6), max_tokens=10)


def test_llama3_rope_scaling_matches_transformers(tmp_path, tokenizer_dir):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    }
    model_dir = build_checkpoint(tmp_path / "llama3", tokenizer_dir, seed=7, rope_parameters=scaling)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), block_size=16, num_gpu_blocks_override=64)
    assert llm.llm_engine.model_config.rope_type == "llama3"
    prompt = random_prompts(llm.get_tokenizer(), 16, seed=8)[-1]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 12)


def test_bfloat16_runs_close_to_float32(tiny_llama):
    llm32 = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=64, dtype="float32")
    llm16 = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=64, dtype="bfloat16")
    assert llm16.llm_engine.runner.kv_cache.data.dtype == torch.bfloat16
    prompt = random_prompts(llm32.get_tokenizer(), 16)[13]
    a = prompt_logits(llm32, prompt, 1000)
    b = prompt_logits(llm16, prompt, 1000)
    # bf16 keeps ~3 significant digits; logits of this model are O(1).
    assert (a - b).abs().max().item() < 0.15
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9
