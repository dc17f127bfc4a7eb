"""The engine under abuse and long runs, without a model: bounded request parameters, one shared copy
of what the n > 1 siblings have in common, stop strings searched only where new text can complete
them, sequences counted as the queue holds them, O(1) aborts and no starvation in swap mode."""

from __future__ import annotations

import dataclasses
import gc
import random
import time

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpilot.engine.detokenizer import IncrementalDetokenizer, StopStrings
from kvpilot.engine.errors import SamplingParamsError
from kvpilot.engine.input_processor import InputProcessor
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.request import Request, RequestStatus, check_stop
from kvpilot.engine.sampling_params import (
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from tests.engine.conftest import FakeModel, check_blocks, make_request, make_scheduler, run_to_completion


class CharTokenizer:
    """Token id ``i`` decodes to ``chr(i)``: enough for the detokenizer."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


# ---------------------------------------------------------------------------------- bounded parameters
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} stop strings"),
        (dict(stop="y" * (MAX_STOP_STRING_LEN + 1)), f"at most {MAX_STOP_STRING_LEN} characters"),
        (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"),
        (dict(n=MAX_N + 1), f"n must be at most {MAX_N}"),
        (dict(stop=42), "stop must be a string or a list"),
    ],
)
def test_sampling_params_refuse_unbounded_lists(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_limits_themselves_are_accepted():
    params = SamplingParams(
        stop=["s"] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), n=MAX_N
    )
    assert len(params.stop_strings) == MAX_STOP_STRINGS
    assert params.stop_token_id_set == frozenset(range(MAX_STOP_TOKEN_IDS))


def test_siblings_share_one_copy_of_stops_and_prompt():
    params = SamplingParams(n=8, seed=3, stop=["a", "bc"], stop_token_ids=[4, 5], max_tokens=4)
    # replace() (the n > 1 fan-out) shares the lists instead of copying them.
    sibling = dataclasses.replace(params, n=1, seed=4)
    assert sibling.stop_strings is params.stop_strings and sibling.stop_token_ids is params.stop_token_ids
    assert params.stop_strings == ("a", "bc") and params.stop_token_id_set == {4, 5}
    sched = make_scheduler(
        num_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=4096,
        enable_prefix_caching=True,
    )
    proc = InputProcessor(
        CharTokenizer(), 1000, None, sched, active_request_ids=set(), live_sequence_ids=set()
    )
    prompt = list(range(100, 400))
    new = proc.process("r", prompt, params)
    token_ids, seqs = new.prompt_token_ids, new.seqs
    assert [s.sampling_params.seed for s in seqs] == list(range(3, 11))
    assert all(s.prompt_token_ids is token_ids for s in seqs)
    assert all(s.sampling_params.stop_strings is params.stop_strings for s in seqs)
    # Running does not make each sequence copy the prompt either.
    for seq in seqs:
        sched.add_request(seq)
    model = FakeModel(4)
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, model.execute(sched, out))
    assert all(s.status == RequestStatus.RUNNING and s.num_output_tokens >= 1 for s in seqs)
    for s in seqs:
        copies = [v for v in vars(s).values() if isinstance(v, list) and len(v) >= len(prompt)]
        assert all(v is token_ids for v in copies), s.req_id
    # One stop-string index for all eight detokenizers.
    op = OutputProcessor(CharTokenizer())
    op.add_request("r", None, token_ids, params, [s.req_id for s in seqs], 0.0, stream=True)
    assert len({id(d.stops) for d in op._states["r"].detoks}) == 1


def test_stop_token_check_is_a_set_lookup():
    params = SamplingParams(stop_token_ids=list(range(10, 10 + MAX_STOP_TOKEN_IDS)), max_tokens=8)
    req = Request("r", [1, 2], params, eos_token_id=None)
    req.max_output_tokens = 8
    assert isinstance(params.stop_token_id_set, frozenset)
    req.append_output_token(9)
    assert check_stop(req, 9) == (None, None)
    req.append_output_token(500)
    assert check_stop(req, 500) == (RequestStatus.FINISHED_STOPPED, 500)


# ---------------------------------------------------------------------------------- stop strings
class RecordingStops(StopStrings):
    """Records the length of every text it is asked to search."""

    def __init__(self, stop_strings) -> None:
        super().__init__(stop_strings)
        self.searched: list[int] = []

    def find(self, text: str, new_from: int):
        self.searched.append(len(text))
        return super().find(text, new_from)


def test_stop_strings_are_searched_in_the_new_tail_only():
    rng = random.Random(0)
    stops = RecordingStops(
        ["".join(rng.choice("xyz") for _ in range(rng.randint(1, 30))) for _ in range(500)]
    )
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("a")], stop_strings=stops)
    for _ in range(3000):
        detok.add_token(ord(rng.choice("abcdefgh")))  # never completes a stop string
    assert detok.stop_string is None and len(detok.text) == 3000
    # Each search sees at most the new character and the longest stop's length before it.
    assert len(stops.searched) == 3000 and max(stops.searched) <= stops.max_len
    detok.add_token(ord("x"))
    assert max(stops.searched) <= stops.max_len


def _reference_match(text: str, old_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The old full search: the first-starting stop string found from ``old_len - max + 1`` on."""
    max_len = max(len(s) for s in stops)
    best = None
    for s in stops:
        i = text.find(s, max(0, old_len - max_len + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", min_size=1, max_size=40),
    cut=st.integers(min_value=0, max_value=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=6),
)
def test_stop_index_finds_what_a_full_search_finds(text, cut, stops):
    old_len = min(cut, len(text) - 1)
    # Only texts whose old part held no stop string (else the detokenizer would have stopped already).
    assume(not any(s in text[:old_len] for s in stops))
    assert StopStrings(stops).find(text, old_len) == _reference_match(text, old_len, stops)


def test_detokenizer_cuts_at_the_stop_across_tokens():
    for include, expected in ((False, "hello "), (True, "hello STOP")):
        detok = IncrementalDetokenizer(
            CharTokenizer(), [1], stop_strings=["STOP", "never"], include_stop_str_in_output=include
        )
        streamed = ""
        for c in "hello STOP and more":
            detok.add_token(ord(c))
            streamed += detok.pop_delta()
        assert detok.stop_string == "STOP" and detok.text == expected
        assert streamed + detok.pop_delta(final=True) == expected


# ---------------------------------------------------------------------------------- the queue
def test_waiting_counts_every_sequence_siblings_included():
    sched = make_scheduler(num_blocks=64, max_num_seqs=8)
    for i in range(4):  # an n=4 request: four independent sequences
        sched.add_request(make_request(12, req_id=f"p#{i}", max_tokens=4))
    sched.add_request(make_request(5, req_id="single"))
    assert sched.stats().num_waiting == 5
    sched.abort_requests(["p#2"])
    assert sched.stats().num_waiting == 4
    sched.abort_requests(["p#0"])  # the first goes: the others go on by themselves
    assert sched.stats().num_waiting == 3 and len(sched.waiting) == 3
    run_to_completion(sched)
    assert sched.stats().num_waiting == 0


def _abort_all(groups: int) -> tuple[float, list]:
    """(CPU seconds, aborted) for aborting every sequence of ``groups`` queued groups of 4, in any order."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=4)
    prompt = list(range(1, 9))
    ids = []
    for p in range(groups):
        group = [Request(f"q{p}#{i}", prompt, params, eos_token_id=0) for i in range(4)]
        for seq in group:
            sched.add_request(seq)
        ids += [r.req_id for r in group]
    out = sched.schedule()  # some run, the rest stay queued
    assert out.scheduled and sched.stats().num_waiting > groups * 4 - 8
    random.Random(1).shuffle(ids)  # a client's aborts come in any order
    # This thread's CPU time, not the wall clock: time the process spends descheduled on a busy machine
    # is not the abort's work. The collector is off while it runs: a full collection walks every live
    # object, and the larger queue holds more of them, which is not the abort's cost either.
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        aborted = sched.abort_requests(ids)
        elapsed = time.thread_time() - t0
    finally:
        gc.enable()
    assert not sched.requests and not sched.waiting and not sched.running
    assert sched.stats().num_waiting == 0
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.block_tables == {}
    return elapsed, aborted


def test_aborting_100k_queued_sequences_is_linear():
    """Ten times the queue costs about ten times the CPU time, not a hundred (a scan of the queue per
    abort, ``deque.remove``, is quadratic): two sizes compared in one run, no absolute time."""
    small_s, _ = _abort_all(2_500)
    large_s, aborted = _abort_all(25_000)
    assert large_s / small_s < 30, f"10x the sequences took {large_s / small_s:.0f}x as long"
    assert len(aborted) == 100_000 and all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)


# ---------------------------------------------------------------------------------- no starvation
def _run_long_behind_a_stream_of_short_ones(mode: str, num_steps: int = 2000) -> tuple[int | None, int]:
    """32 blocks; a long request gets preempted, then one short request arrives every step. Returns the
    step at which the long one finished (None: never) and how many newer requests finished before."""
    # 32 blocks of 4, 16 sequences, 64 tokens a step, max_model_len 128.
    sched = make_scheduler(32, 4, 16, 64, 128, preemption_mode=mode, num_cpu_blocks=64)
    model = FakeModel(4)
    # Made first, so older: the long request, newest of the two, is the one preempted.
    hog = make_request(40, req_id="hog", max_tokens=48, ignore_eos=True)
    long = make_request(44, req_id="long", max_tokens=24, ignore_eos=True)
    sched.add_request(long)
    sched.add_request(hog)
    num_newer_done = 0
    for step in range(num_steps):
        if long.num_preemptions:
            sched.add_request(make_request(16, req_id=f"short{step}", max_tokens=24, ignore_eos=True))
        out = sched.schedule()
        for upd in sched.update_from_output(out, model.execute(sched, out)):
            num_newer_done += upd.finish_reason is not None and upd.req_id.startswith("short")
        check_blocks(sched)
        if long.is_finished:
            return step, num_newer_done
    return None, num_newer_done


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_is_not_starved_by_newer_ones(mode):
    finished_at, num_newer_done = _run_long_behind_a_stream_of_short_ones(mode)
    assert finished_at is not None and finished_at < 100, (mode, finished_at, num_newer_done)
    # Newer requests do not overtake it while it waits for its blocks.
    assert num_newer_done <= 2, num_newer_done


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["recompute", "swap"]),
    arrivals=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 30), st.integers(1, 30)),  # step, prompt, max_tokens
        min_size=2,
        max_size=20,
    ),
)
def test_no_newer_request_starts_while_an_older_one_is_preempted(mode, arrivals):
    """While a preempted request waits to resume, no newer request is admitted for the first time; so
    every request finishes, whatever keeps arriving behind it."""
    # 16 blocks of 4, 4 sequences, 16 tokens a step, max_model_len 64: preemption is frequent.
    sched = make_scheduler(16, 4, 4, 16, 64, preemption_mode=mode, num_cpu_blocks=8)
    model = FakeModel(4)
    by_step: dict[int, list] = {}
    for i, (step, plen, max_tokens) in enumerate(arrivals):
        by_step.setdefault(step, []).append(make_request(plen, req_id=f"a{i}", max_tokens=max_tokens))
    preempted_states = (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
    for now in range(2000):
        for req in by_step.get(now, []):
            sched.add_request(req)
        if now > 30 and not sched.requests:
            break
        never_ran = [r for r in sched.requests.values() if r.scheduled_time is None]
        out = sched.schedule()
        still_preempted = [r.arrival_seq for r in sched.requests.values() if r.status in preempted_states]
        if still_preempted and not out.preempted_req_ids:
            started = [r.req_id for r in never_ran if r.scheduled_time is not None]
            newer = [rid for rid in started if sched.requests[rid].arrival_seq > min(still_preempted)]
            assert not newer, (now, newer)
        sched.update_from_output(out, model.execute(sched, out))
        check_blocks(sched)
    else:
        raise AssertionError(f"still unfinished: {sorted(sched.requests)}")
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
