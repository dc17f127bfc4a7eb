"""The output processor works from the core's values alone: ``CoreOutput``s in, ``RequestOutput``s and
the ids to finish out, with neither side holding the other's objects."""

from __future__ import annotations

import gc
import pickle

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.beam_search import BeamSearchParams
from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.output_processor import OutputProcessor, RequestState, SeqState
from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import CoreOutput


class CharTokenizer:
    """Token id ``i`` decodes to ``chr(i)``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _reachable(roots: list[object], depth: int = 8) -> list[object]:
    """Every object reachable from ``roots`` through at most ``depth`` references (modules,
    classes and functions are not followed: they reach everything)."""
    seen: dict[int, object] = {}
    frontier = list(roots)
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            if id(obj) in seen or isinstance(obj, type | type(gc) | type(_reachable)):
                continue
            seen[id(obj)] = obj
            nxt += gc.get_referents(obj)
        frontier = nxt
    return list(seen.values())


def test_neither_side_holds_the_others_objects(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=128, max_num_seqs=8)
    engine = llm.llm_engine
    engine.add_request("plain", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, logprobs=2, ignore_eos=True))
    engine.add_request("twice", [11, 12, 13], SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3))
    engine.add_beam_search_request("beams", [21, 22, 23, 24], BeamSearchParams(2, 6, ignore_eos=True))
    seen_core_outputs = []
    original = engine.scheduler.update_from_output

    def spy(out, runner_out):
        core_outputs = original(out, runner_out)
        seen_core_outputs.extend(core_outputs)
        return core_outputs

    engine.scheduler.update_from_output = spy
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests and len(engine.output_processor) == 3
    # What crosses is values: it survives a trip through pickle unchanged, as it would to another process.
    assert seen_core_outputs and pickle.loads(pickle.dumps(seen_core_outputs)) == seen_core_outputs
    output_side = _reachable([engine.output_processor._states, engine.output_processor._seqs])
    core_side = _reachable([engine.scheduler.requests, engine.scheduler.running, engine.scheduler.waiting])
    assert not [o for o in output_side if isinstance(o, Request)]
    assert not [o for o in core_side if isinstance(o, SeqState | RequestState | IncrementalDetokenizer)]
    # The output side's token record is its own list, equal to the core's.
    for req_id, (_, seq, _) in engine.output_processor._seqs.items():
        req = engine.scheduler.requests[req_id]
        assert (
            seq.output_token_ids == req.output_token_ids and seq.output_token_ids is not req.output_token_ids
        )
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _out(req_id: str, tokens: list[int], logprobs=None, **kw) -> CoreOutput:
    """A core output as the scheduler makes it (it always says when it first ran the sequence)."""
    return CoreOutput(req_id, tokens, logprobs, scheduled_time=10.5, **kw)


def _processor(stream: bool, **params) -> OutputProcessor:
    op = OutputProcessor(CharTokenizer())
    op.add_request("r", None, [ord("p")], SamplingParams(**params), ["r#0", "r#1"], 10.0, stream)
    return op


def test_a_stop_string_finishes_the_sequence_here_and_names_it_for_the_core():
    op = _processor(stream=False, n=2, stop=["cd"], max_tokens=8)
    step1 = op.process([_out("r#0", [ord("a")]), _out("r#1", [ord("c")])], 11.0)
    assert step1.stop_ids == [] and op.make_outputs(step1) == []  # not streaming: nothing until the end
    assert step1.record.ttfts == [1.0, 1.0] and step1.record.num_prompt_tokens == 2
    step2 = op.process([_out("r#0", [ord("b")]), _out("r#1", [ord("d")])], 11.5)
    # r#1's text reached "cd": the core must finish it, and the processor already has.
    assert step2.stop_ids == ["r#1"] and step2.record.itls == [0.5, 0.5]
    [fin] = step2.record.finished
    assert (fin.finish_reason, fin.num_generation_tokens, fin.first_token_time, fin.finished_time) == (
        "stop",
        2,
        11.0,
        11.5,
    )
    assert op.make_outputs(step2) == []
    # A late output for the finished sequence (the step that ran while the core heard of it) is dropped.
    step3 = op.process([_out("r#0", [ord("e")], finish_reason="length"), _out("r#1", [1])], 12)
    [out] = op.make_outputs(step3)
    assert [(c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [
        ("abe", "length", None),
        ("", "stop", "cd"),  # the text ends before the stop string
    ]
    assert out.finished and out.metrics.scheduled_time == 10.5 and len(op) == 0


def test_streaming_deltas_and_logprobs_come_from_the_outputs():
    op = _processor(stream=True, n=2, max_tokens=4, logprobs=1)
    outs = op.make_outputs(op.process([_out("r#0", [ord("x")], [{ord("x"): -0.5, ord("y"): -1.0}])], 1.0))
    [first] = outs
    assert first.delta_token_ids == [[ord("x")], []] and not first.finished
    assert first.outputs[0].logprobs == [{ord("x"): -0.5, ord("y"): -1.0}]
    outs = op.make_outputs(op.process([_out("r#0", [ord("z")], [{ord("z"): -0.25}])], 2.0))
    [second] = outs
    assert second.outputs[0].text == "z" and second.outputs[0].logprobs == [{ord("z"): -0.25}]
    assert second.outputs[0].cumulative_logprob == -0.75
    # An abort names only the sequences still unfinished.
    op.process([_out("r#1", [ord("q")], [{ord("q"): 0.0}], finish_reason="length")], 3.0)
    assert op.abort("r") == ["r#0"] and op.abort("r") == [] and len(op) == 0
