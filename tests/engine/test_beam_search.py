"""Beam search against transformers' ``generate(num_beams=..., do_sample=False)``."""

from __future__ import annotations

import gc
import random

import pytest
import torch
import transformers

from kvpilot.engine import LLM, BeamSearchParams, SamplingParams
from kvpilot.engine.beam_search import BeamSearchGroup, BeamSearchState
from kvpilot.engine.request import Request
from kvpilot.engine.stats import StepCallback


def _hf_beams(hf, prompt, width, max_tokens, length_penalty, eos):
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        length_penalty=length_penalty,
        eos_token_id=eos,
        pad_token_id=0,
        early_stopping=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    seqs = [row[len(prompt) :].tolist() for row in out.sequences]
    # Finished-at-EOS sequences are padded after the EOS: cut there.
    if eos is not None:
        seqs = [s[: s.index(eos) + 1] if eos in s else s for s in seqs]
    return seqs, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def hf_llama(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.mark.parametrize("width, max_tokens", [(2, 8), (4, 12)])
def test_beam_search_matches_transformers(tiny_llama, hf_llama, width, max_tokens):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=256)
    rng = random.Random(width)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (5, 17, 30)]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        expected, scores = _hf_beams(hf_llama, prompt, width, max_tokens, 1.0, eos=None)
        got = [s.tokens[len(prompt) :] for s in out.sequences]
        assert got == expected
        normalised = [s.cum_logprob / len(s.tokens[len(prompt) :]) for s in out.sequences]
        assert normalised == pytest.approx(scores, abs=1e-4)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.llm_engine.has_unfinished_requests()


def test_beam_search_with_eos_and_length_penalty(tiny_llama, hf_llama):
    """EOS made frequent (a token the model produces right after the prompt) so hypotheses finish early."""
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=256)
    prompt = [random.Random(9).randrange(5, 1000) for _ in range(12)]
    greedy = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(1, 6, ignore_eos=True))
    eos = greedy[0].sequences[0].tokens[len(prompt) + 2]
    llm.llm_engine.eos_token_id = eos
    for lp in (1.0, 0.5):
        out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(3, 10, length_penalty=lp))[0]
        expected, _ = _hf_beams(hf_llama, prompt, 3, 10, lp, eos=eos)
        assert [s.tokens[len(prompt) :] for s in out.sequences] == expected, lp
        assert any(s.finish_reason == "stop" for s in out.sequences)


def test_beams_share_blocks_and_survive_a_tiny_pool(tiny_llama, hf_llama):
    """Each round's requests reuse the previous round's blocks through the prefix cache and compute
    one token each; under a pool too small for all beams at once a round's
    requests wait for each other (a one-token request never grows, so nothing is preempted) and still
    give transformers' answer, with the prefix cache on or off (off: every round recomputes)."""
    prompt = [random.Random(3).randrange(5, 1000) for _ in range(30)]
    expected, _ = _hf_beams(hf_llama, prompt, 4, 10, 1.0, eos=None)
    roomy = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=256)
    bm = roomy.llm_engine.block_manager
    peak, computed = [], []
    roomy.llm_engine.stat_loggers.append(
        StepCallback(
            lambda s, it: (
                peak.append(bm.num_blocks - bm.num_free_blocks),
                computed.append(it.num_batched_tokens),
            )
        )
    )
    out = roomy.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(4, 10, ignore_eos=True))[0]
    assert [s.tokens[30:] for s in out.sequences] == expected
    # 4 beams of up to 40 tokens would need 4 x 5 blocks unshared; the 3 full prompt blocks are shared.
    assert max(peak) <= 3 + 4 * 2
    # Round 1 computes the prompt once; each later round one token per beam: each round's request finds
    # its parent's blocks, the partly filled last one too (copied first when two beams continue it).
    assert computed[0] == 30 and computed[1:] == [4] * (len(computed) - 1), computed
    for caching in (True, False):
        tight = LLM(
            str(tiny_llama),
            block_size=8,
            num_gpu_blocks_override=8,
            max_model_len=64,
            enable_prefix_caching=caching,
        )
        waiting = []
        tight.llm_engine.stat_loggers.append(
            StepCallback(lambda s, it, seen=waiting: seen.append(s.num_waiting))
        )
        out = tight.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(4, 10, ignore_eos=True))[0]
        assert [s.tokens[30:] for s in out.sequences] == expected, caching
        assert max(waiting) > 0, "the pool holds fewer than all of a round's requests"
        assert tight.llm_engine.block_manager.num_free_blocks == 8


def test_state_rejects_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    state = BeamSearchState(BeamSearchParams(2, 1, ignore_eos=True), eos_token_id=1)
    assert state.num_candidates == 4
    assert state.step([{7: -0.1, 8: -0.5, 9: -1.0, 10: -2.0}]) == []
    assert [h.token_ids for h in state.results()] == [[7], [8]]


def test_group_runs_rounds_of_plain_requests_above_the_core():
    state = BeamSearchState(BeamSearchParams(2, 4, ignore_eos=True), eos_token_id=None)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=state.num_candidates, ignore_eos=True)
    group = BeamSearchGroup("g", None, [1, 2, 3], state, 0.0, params)
    # Round 1: one request for the one beam there is, its prompt the search's prompt.
    assert group.next_round() == [("g#b0", [1, 2, 3])]
    # It reports its candidates (a core output's new logprobs: the sampled token first).
    assert group.on_sampled("g#b0", {7: -0.1, 8: -0.2, 9: -3.0, 10: -4.0})
    assert group.advance()
    # Round 2: a request per surviving beam, prompt + the beam's tokens; ids taken by live sequences
    # are skipped.
    assert group.next_round(taken={"g#b1"}) == [("g#b2", [1, 2, 3, 7]), ("g#b3", [1, 2, 3, 8])]
    assert not group.on_sampled("g#b2", {11: -0.1, 12: -0.2, 13: -3.0, 14: -4.0})
    assert group.on_sampled("g#b3", {15: -5.0, 16: -6.0, 17: -7.0, 18: -8.0})
    assert group.advance()
    # Both winners come from beam 0 (7): 7 + 11 and 7 + 12.
    assert [tokens for _, tokens in group.next_round()] == [[1, 2, 3, 7, 11], [1, 2, 3, 7, 12]]
    assert not any(isinstance(v, Request) for v in vars(group).values()), "it holds ids, not requests"


def test_discarded_beams_are_freed_at_once(tiny_llama):
    """After every step the search holds at most ``beam_width`` live requests and ``beam_width``
    finished hypotheses: a round's requests (their Request objects, their blocks) are gone once the
    round ends."""
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    width, max_tokens = 4, 24
    prompt = [random.Random(5).randrange(5, 1000) for _ in range(40)]  # longer than any output
    engine.add_beam_search_request("beam", prompt, BeamSearchParams(width, max_tokens, ignore_eos=True))
    group = engine.output_processor._states["beam"]
    num_steps = 0
    # Freed by reference counting, not left to the cycle collector: with it off, nothing may linger.
    gc.collect()
    gc.disable()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            num_steps += 1
            num_alive = sum(type(o) is Request and o.client_request_id == "beam" for o in gc.get_objects())
            assert num_alive <= width, (num_steps, num_alive)
            assert len(group.state.finished) <= width
            live = set(group.beam_ids)
            assert {r for r in engine.scheduler.requests if r.startswith("beam#")} <= live
            held = {rid for rid in engine.block_manager.block_tables if rid.startswith("beam#")}
            assert held <= live
    finally:
        gc.enable()
    assert num_steps >= max_tokens
    assert not engine.scheduler.requests and len(engine.runner.requests) <= width
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_search_counts_as_one_request_in_the_metrics(tiny_llama):
    """Its rounds are internal requests: the stat loggers see one time to first token, one inter-token
    latency per later round and one finished request with the search's prompt."""
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=256)
    iters = []
    llm.llm_engine.stat_loggers.append(StepCallback(lambda s, it: iters.append(it)))
    prompt = [random.Random(11).randrange(5, 1000) for _ in range(20)]
    llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(3, 6, ignore_eos=True))
    finished = [f for it in iters for f in it.finished]
    assert len(finished) == 1 and finished[0].num_prompt_tokens == 20
    assert finished[0].num_generation_tokens == 6
    assert sum(len(it.time_to_first_tokens) for it in iters) == 1
    assert sum(len(it.inter_token_latencies) for it in iters) == 5
