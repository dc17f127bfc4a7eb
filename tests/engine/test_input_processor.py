"""The input processor is the one place a request is checked: what it refuses names the field at fault
and leaves nothing queued; what it passes, the scheduler runs."""

from __future__ import annotations

import pytest

from kvpilot.engine.beam_search import BeamSearchParams
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.input_processor import ContextRule, InputProcessor
from kvpilot.engine.sampling_params import SamplingParams

from .conftest import VOCAB, make_scheduler, run_to_completion

SERVER_RULE = ContextRule(
    clip_max_tokens=False, prompt_param="messages", max_tokens_param="max_completion_tokens"
)


class Tokens:
    """A tokenizer for prompts given as text: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % (VOCAB - 1) for c in text]


def processor(**scheduler_args):
    sched = make_scheduler(**scheduler_args)
    active: set[str] = set()
    live: set[str] = set()  # the unfinished sequences' ids (the output processor's, in the engine)
    proc = InputProcessor(Tokens(), VOCAB, None, sched, active_request_ids=active, live_sequence_ids=live)
    return proc, sched, active


def refused(proc, *args, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        proc.process(*args, **kwargs)
    return err.value


def test_an_empty_prompt_a_running_id_and_foreign_ids_are_refused():
    proc, sched, active = processor()
    err = refused(proc, "e", [], SamplingParams())
    assert ("empty" in str(err), err.param) == (True, "prompt")
    active.add("x")
    err = refused(proc, "x", [1, 2], SamplingParams())
    assert (str(err), err.param) == ("duplicate request id 'x'", None)
    err = refused(proc, "oov", [1, VOCAB], SamplingParams(), context=SERVER_RULE)
    assert f"[0, {VOCAB})" in str(err) and err.param == "messages"
    err = refused(proc, "stops", [1, 2], SamplingParams(stop_token_ids=[3, VOCAB + 1]))
    assert str(VOCAB + 1) in str(err) and err.param == "stop_token_ids"
    assert not sched.requests and not sched.waiting


@pytest.mark.parametrize("prompt_len", [16, 17, 40])
def test_a_prompt_that_reaches_max_model_len_is_refused(prompt_len):
    proc, _, _ = processor(max_model_len=16)
    err = refused(proc, "long", list(range(1, prompt_len + 1)), SamplingParams())
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")
    assert "maximum context length is 16 tokens" in str(err) and f"has {prompt_len} input tokens" in str(err)


def test_max_tokens_past_the_context_is_clipped_or_refused_by_the_rule():
    proc, sched, _ = processor(max_model_len=16)
    prompt = list(range(1, 11))
    # The offline rule clips: the scheduler caps the output at the room left.
    new = proc.process("clip", prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add_request(new.seqs[0])
    run_to_completion(sched)
    assert new.seqs[0].num_output_tokens == 6
    # The server's rule refuses it, naming its endpoint's fields and the numbers.
    err = refused(proc, "strict", prompt, SamplingParams(max_tokens=7), context=SERVER_RULE)
    assert (err.param, err.code) == ("max_completion_tokens", "context_length_exceeded")
    assert "you requested 17 tokens (10 in the messages, 7 in the completion)" in str(err)
    assert proc.process("exact", prompt, SamplingParams(max_tokens=6), context=SERVER_RULE).seqs


def test_what_can_never_fit_the_whole_cache_is_refused():
    proc, _, _ = processor(num_blocks=4, block_size=4, max_model_len=128)  # 16 slots
    prompt = list(range(1, 11))
    # 10 prompt + 7 output: the last token is never fed back, so 16 slots suffice.
    assert proc.process("fits", prompt, SamplingParams(max_tokens=7)).seqs
    err = refused(proc, "big", prompt, SamplingParams(max_tokens=8))
    assert "needs up to 17 tokens" in str(err) and "whole cache holds 16 tokens" in str(err)
    assert err.param == "max_tokens"


def test_the_sequence_bounds_are_the_schedulers_live_ones():
    proc, sched, _ = processor(max_num_seqs=8)
    assert len(proc.process("n4", [1, 2, 3], SamplingParams(n=4)).seqs) == 4
    sched.reconfigure(3, sched.config.max_num_batched_tokens, sched.config.preemption_mode)
    err = refused(proc, "n4", [1, 2, 3], SamplingParams(n=4))
    assert str(err).startswith("n=4 sequences exceed max_num_seqs (3)") and err.param == "n"
    with pytest.raises(InvalidRequestError, match=r"beam_width 4 exceeds max_num_seqs \(3\)"):
        proc.process_beam_search("b", [1, 2, 3], BeamSearchParams(beam_width=4, max_tokens=4))
    group = proc.process_beam_search("b", [1, 2, 3], BeamSearchParams(beam_width=3, max_tokens=500))
    # A search's max_tokens is clipped to the context left after the prompt; its rounds are plain
    # one-token requests.
    assert group.state.params.max_tokens == 128 - 3
    (first,) = proc.beam_requests(group, group.next_round())
    assert (first.req_id, first.prompt_token_ids, first.sampling_params.max_tokens) == ("b#b0", [1, 2, 3], 1)


def test_a_user_id_that_spells_a_queued_sequence_id_is_refused():
    proc, sched, active = processor()
    new = proc.process("x", [1, 2, 3], SamplingParams(n=2))
    for seq in new.seqs:
        sched.add_request(seq)
    active.add("x")
    proc.live_sequence_ids.update(seq.req_id for seq in new.seqs)
    for spelled in ("x#0", "x#1"):
        err = refused(proc, spelled, [1, 2], SamplingParams())
        assert f"sequence id {spelled!r} is in use" in str(err) and err.param is None
    group = proc.process_beam_search("y", [1, 2], BeamSearchParams(beam_width=2, max_tokens=4))
    (first,) = proc.beam_requests(group, group.next_round(proc.live_sequence_ids))
    sched.add_request(first)
    proc.live_sequence_ids.add(first.req_id)
    with pytest.raises(InvalidRequestError, match="'y#b0' is in use"):
        proc.process("y#b0", [1, 2], SamplingParams())
    assert sorted(sched.requests) == ["x#0", "x#1", "y#b0"]
