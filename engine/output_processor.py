"""Core outputs in, ``RequestOutput`` objects out: detokenization, stop strings, the ``n > 1`` merge,
streaming deltas, beam search and the per-sequence timings the metrics read (torch-free).

A streaming request's outputs carry only what is new since its previous output (text, token ids,
logprobs; the cumulative logprob is a running sum), so each step costs O(new tokens) whatever the
length so far; a non-streaming request gets one output with everything.

The output processor owns the per-user-request state, keyed by the user's request id: the sequences of
an ``n``-way request (``SeqState``: its tokens, logprobs, finish and timings, built from the core's
``CoreOutput`` values alone) with their detokenizers, or a beam search group. It never reads or writes
the scheduler's objects. What the core must do it returns: the ids of sequences whose text hit a
stop string (to finish), and the beam searches' next rounds (new one-token requests, as values). One
step is::

    processed = output_processor.process(core_outputs, now)   # text, stop strings, beam selection
    ... the engine finishes processed.stop_ids and queues processed.beam_rounds ...
    outputs = output_processor.make_outputs(processed)
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass, field

from kvpilot.engine.beam_search import BeamSearchGroup
from kvpilot.engine.detokenizer import IncrementalDetokenizer, StopStrings
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler_output import CoreOutput
from kvpilot.engine.stats import FinishedRequestStats


@dataclass
class SeqState:
    """One sequence as the output processor knows it: what the core reported about it, accumulated.
    ``metrics`` holds its timestamps and the core's counts (the same record a ``RequestOutput`` carries);
    ``logprobs`` is None unless they were asked for."""

    req_id: str
    num_prompt_tokens: int
    metrics: RequestMetrics
    # logprobs[i] = {token_id: logprob} for output token i (sampled token first), when requested.
    logprobs: list[dict[int, float]] | None
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    # The request's ``n`` and ``max_tokens`` (None: not set), for the finished-request metrics.
    params_n: int = 1
    params_max_tokens: int | None = None
    # Prompt tokens the prefix cache held at the admission that gave it its first token (the hits of a
    # recompute after a later preemption not counted).
    num_cached_prompt_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def record(self, out: CoreOutput, now: float, step: StepRecord) -> None:
        """Take in one core output: tokens, logprobs, the core's events, and the latency it marks."""
        m = self.metrics
        if m.first_token_time is None:
            step.ttfts.append(now - m.arrival_time)
            step.num_prompt_tokens += self.num_prompt_tokens
            step.num_cached_prompt_tokens += out.num_cached_tokens
            self.num_cached_prompt_tokens = out.num_cached_tokens
            m.first_token_time = now
        else:
            step.itls.append(now - m.last_token_time)
        m.last_token_time = now
        m.scheduled_time, m.num_cached_tokens, m.num_preemptions = (
            out.scheduled_time,
            out.num_cached_tokens,
            out.num_preemptions,
        )
        self.output_token_ids += out.new_token_ids
        if out.new_logprobs is not None and self.logprobs is not None:
            self.logprobs += out.new_logprobs
            self.cumulative_logprob += sum(next(iter(e.values())) for e in out.new_logprobs)

    def finish(self, reason: str, stop_reason: int | str | None, now: float, step: StepRecord) -> None:
        m = self.metrics
        self.finish_reason, self.stop_reason, m.finished_time = reason, stop_reason, now
        step.finished.append(
            FinishedRequestStats(
                finish_reason=reason,
                num_prompt_tokens=self.num_prompt_tokens,
                num_generation_tokens=len(self.output_token_ids),
                arrival_time=m.arrival_time,
                scheduled_time=m.scheduled_time,
                first_token_time=m.first_token_time,
                finished_time=now,
                num_preemptions=m.num_preemptions,
                n=self.params_n,
                max_tokens=self.params_max_tokens,
                num_cached_tokens=self.num_cached_prompt_tokens,
            )
        )


@dataclass
class StepRecord:
    """The latencies and finishes one step's outputs marked, for the stat loggers."""

    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompt lengths of the sequences that produced their first token
    num_cached_prompt_tokens: int = 0  # of those, the tokens the prefix cache held
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class RequestState:
    """One user request of ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool
    seqs: list[SeqState]
    detoks: list[IncrementalDetokenizer]
    # Streaming: token ids not yet handed out, and logprob entries handed out, per sequence.
    pending_ids: list[list[int]]
    num_logprobs_sent: list[int]
    num_finished: int = 0


@dataclass
class ProcessedUpdates:
    """What ``process`` made of one step's outputs, for the engine to apply and then ``make_outputs``."""

    # Sequences whose text reached a stop string (already finished here): the scheduler must finish them.
    stop_ids: list[str] = field(default_factory=list)
    # The beam searches' next rounds: per search, the requests to queue (id, prompt + beam tokens).
    beam_rounds: list[tuple[BeamSearchGroup, list[tuple[str, list[int]]]]] = field(default_factory=list)
    # Requests with news this step, and beam searches that ended.
    touched: list[RequestState] = field(default_factory=list)
    finished_beams: list[BeamSearchGroup] = field(default_factory=list)
    record: StepRecord = field(default_factory=StepRecord)


class OutputProcessor:
    """Keeps the state of every unfinished user request and builds its outputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState | BeamSearchGroup] = {}
        # Every unfinished sequence's id -> its request (or beam search) and its state.
        self._seqs: dict[str, tuple[RequestState | BeamSearchGroup, SeqState, int]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        """The number of unfinished user requests."""
        return len(self._states)

    @property
    def live_sequence_ids(self) -> KeysView[str]:
        """The ids of every unfinished sequence (a live view)."""
        return self._seqs.keys()

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seq_ids: list[str],
        arrival_time: float,
        stream: bool,
    ) -> None:
        """Track a request whose sequences ``seq_ids`` the scheduler has queued (``params``: the user's)."""
        stops = StopStrings(params.stop_strings)  # one index for all n sequences
        n = len(seq_ids)
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                stops,
                params.include_stop_str_in_output,
            )
            for _ in seq_ids
        ]
        wants = params.logprobs is not None
        seqs = [
            SeqState(
                i,
                len(prompt_token_ids),
                RequestMetrics(arrival_time),
                [] if wants else None,
                params_n=n,
                params_max_tokens=params.max_tokens,
            )
            for i in seq_ids
        ]
        state = RequestState(
            request_id, prompt, prompt_token_ids, stream, seqs, detoks, [[] for _ in seqs], [0] * n
        )
        self._states[request_id] = state
        for i, seq in enumerate(seqs):
            self._seqs[seq.req_id] = (state, seq, i)

    def add_beam_search(self, group: BeamSearchGroup) -> list[tuple[str, list[int]]]:
        """Track a beam search; returns its first round, for the engine to queue."""
        self._states[group.request_id] = group
        return self._next_round(group)

    def _next_round(self, group: BeamSearchGroup) -> list[tuple[str, list[int]]]:
        """The group's next round of one-token requests, each tracked as a sequence of the group."""
        round_ = group.next_round(self._seqs)
        for req_id, token_ids in round_:
            seq = SeqState(req_id, len(token_ids), RequestMetrics(group.arrival_time), [])
            self._seqs[req_id] = (group, seq, 0)
        return round_

    def abort(self, request_id: str) -> list[str]:
        """Forget ``request_id``; return the ids of its unfinished sequences ([] if unknown)."""
        state = self._states.pop(request_id, None)
        if state is None:
            return []
        ids = [s.req_id for s in state.seqs] if isinstance(state, RequestState) else list(state.beam_ids)
        unfinished = [i for i in ids if i in self._seqs]
        for i in unfinished:
            del self._seqs[i]
        return unfinished

    # ------------------------------------------------------------------ one step
    def process(self, outputs: list[CoreOutput], now: float) -> ProcessedUpdates:
        """Detokenize the new tokens, look for stop strings and advance the beam searches that every
        beam has reported to. ``now``: the step's time (monotonic seconds) for the latencies."""
        result = ProcessedUpdates()
        step = result.record
        touched: dict[str, RequestState] = {}
        ready: dict[str, BeamSearchGroup] = {}
        for out in outputs:
            entry = self._seqs.get(out.req_id)
            if entry is None:
                continue  # aborted while the step ran
            state, seq, i = entry
            if isinstance(state, BeamSearchGroup):
                # A round's one-token requests are the search's own: the metrics see the search as
                # one request (its latencies per round, one finish), not every round as one.
                del self._seqs[out.req_id]
                state.note_core_events(out.scheduled_time, out.num_preemptions)
                if state.on_sampled(out.req_id, out.new_logprobs[-1]):
                    ready[state.request_id] = state
                    state.record_round(now, step)
                continue
            seq.record(out, now, step)
            if out.finish_reason is not None:
                seq.finish(out.finish_reason, out.stop_reason, now, step)
                del self._seqs[out.req_id]
            detok = state.detoks[i]
            for token in out.new_token_ids:
                detok.add_token(token)
            if state.stream:
                state.pending_ids[i] += out.new_token_ids
            if detok.stop_string is not None and not seq.is_finished:
                seq.finish("stop", detok.stop_string, now, step)
                del self._seqs[out.req_id]
                result.stop_ids.append(out.req_id)
            if seq.is_finished:
                state.num_finished += 1
            touched[state.request_id] = state
        result.touched = list(touched.values())
        for group in ready.values():
            if group.advance():
                result.beam_rounds.append((group, self._next_round(group)))
            else:
                step.finished.append(group.finished_stats(now))
                result.finished_beams.append(group)
        return result

    def make_outputs(self, processed: ProcessedUpdates) -> list[RequestOutput]:
        """The outputs of the step ``processed`` describes: finished requests, and streaming requests
        with news. Finished requests are forgotten."""
        outputs = []
        for state in processed.touched:
            finished = state.num_finished == len(state.seqs)
            if finished or state.stream:
                outputs.append(self._make_output(state, finished))
            if finished:
                del self._states[state.request_id]
        for group in processed.finished_beams:
            outputs.append(self._beam_output(group))
            del self._states[group.request_id]
        return outputs

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        completions = []
        deltas, delta_ids = [], []
        for i, (seq, detok) in enumerate(zip(state.seqs, state.detoks, strict=True)):
            delta = detok.pop_delta(final=seq.is_finished)
            logprobs = seq.logprobs
            if state.stream:
                # The delta is the unit: only what is new since this request's previous output.
                text, token_ids = delta, state.pending_ids[i]
                state.pending_ids[i] = []
                if logprobs is not None:
                    sent, state.num_logprobs_sent[i] = state.num_logprobs_sent[i], len(logprobs)
                    logprobs = logprobs[sent:]
            else:
                text, token_ids = detok.text, seq.output_token_ids
            deltas.append(delta)
            delta_ids.append(token_ids)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob if logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = state.seqs[0].metrics
        each = [s.metrics for s in state.seqs]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            scheduled_time=first.scheduled_time,
            first_token_time=min((m.first_token_time for m in each if m.first_token_time), default=None),
            last_token_time=max((m.last_token_time for m in each if m.last_token_time), default=None),
            finished_time=max((m.finished_time for m in each if m.finished_time), default=None),
            num_preemptions=sum(m.num_preemptions for m in each),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
            delta_text=deltas,
            delta_token_ids=delta_ids,
        )

    def _beam_output(self, group: BeamSearchGroup) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                token_ids=h.token_ids,
                cumulative_logprob=h.cum_logprob,
                finish_reason=h.finish_reason,
            )
            for i, h in enumerate(group.state.results())
        ]
        return RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids, completions, finished=True
        )
