"""Request updates in, ``RequestOutput`` objects out: detokenization, stop strings, the ``n > 1`` merge,
streaming deltas and beam search (torch-free).

A streaming request's outputs carry only what is new since its previous output (text, token ids,
logprobs; the cumulative logprob is a running sum), so each step costs O(new tokens) whatever the
length so far; a non-streaming request gets one output with everything.

The output processor owns the per-user-request state, keyed by the user's request id: the sequences of
an ``n``-way request with their detokenizers, or a beam search group. It never changes a sequence:
what the scheduler must do (finish a sequence whose text hit a stop string, pause, fork or finish
beams) it returns, and the engine applies before asking for the outputs. One step is::

    processed = output_processor.process(updates)   # text, stop strings, beam selection
    ... the engine applies processed.stop_strings and processed.beam_intents to the scheduler ...
    outputs = output_processor.make_outputs(processed)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.beam_search import BeamIntent, BeamSearchGroup, Pause
from kvpilot.engine.detokenizer import IncrementalDetokenizer, StopStrings
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler_output import RequestUpdate


@dataclass
class RequestState:
    """One user request of ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    # Streaming: token ids not yet handed out, per sequence.
    pending_ids: list[list[int]]
    # Per sequence: the sum of its sampled tokens' logprobs so far, and how many logprob entries have
    # been handed out (streaming).
    cumulative_logprobs: list[float]
    num_logprobs_sent: list[int]
    num_finished: int = 0

    @property
    def req_ids(self) -> list[str]:
        """The scheduler ids of its sequences."""
        return [s.req_id for s in self.seqs]


@dataclass
class ProcessedUpdates:
    """What ``process`` made of one step's updates, for the engine to apply and then ``make_outputs``."""

    # Sequences whose text reached a stop string: req_id -> the stop string (finish them as stopped).
    stop_strings: dict[str, str] = field(default_factory=dict)
    # Scheduler actions for the beam searches, in the order they must be applied.
    beam_intents: list[BeamIntent] = field(default_factory=list)
    # Requests with news this step, and beam searches that ended.
    touched: list[RequestState] = field(default_factory=list)
    finished_beams: list[BeamSearchGroup] = field(default_factory=list)


class OutputProcessor:
    """Keeps the state of every unfinished user request and builds its outputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState | BeamSearchGroup] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        """The number of unfinished user requests."""
        return len(self._states)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seqs: list[Request],
        stream: bool,
    ) -> None:
        """Track a request whose ``seqs`` the scheduler has queued (``params`` are the user's)."""
        stops = StopStrings(params.stop_strings)  # one index for all n sequences
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                stops,
                params.include_stop_str_in_output,
            )
            for _ in seqs
        ]
        n = len(seqs)
        self._states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, stream, seqs, detoks, [[] for _ in seqs], [0.0] * n, [0] * n
        )

    def add_beam_search(self, group: BeamSearchGroup) -> None:
        """Track a beam search whose first beam the scheduler has queued."""
        self._states[group.request_id] = group

    def abort(self, request_id: str) -> list[str]:
        """Forget ``request_id``; return the scheduler ids of its unfinished sequences ([] if unknown)."""
        state = self._states.pop(request_id, None)
        return [] if state is None else state.req_ids

    # ------------------------------------------------------------------ one step
    def process(self, updates: list[RequestUpdate]) -> ProcessedUpdates:
        """Detokenize the new tokens, look for stop strings and advance the beam searches that every
        beam has reported to."""
        result = ProcessedUpdates()
        touched: dict[str, RequestState] = {}
        ready: dict[str, BeamSearchGroup] = {}
        for upd in updates:
            req = upd.request
            state = self._states.get(req.client_request_id)
            if state is None:
                continue  # aborted while the step ran
            if isinstance(state, BeamSearchGroup):
                result.beam_intents.append(Pause(req.req_id))
                if state.on_sampled(req):
                    ready[state.request_id] = state
                continue
            i = state.seqs.index(req)
            detok = state.detoks[i]
            detok.add_token(upd.new_token_id)
            if state.stream:
                state.pending_ids[i].append(upd.new_token_id)
            if req.logprobs:
                state.cumulative_logprobs[i] += next(iter(req.logprobs[-1].values()))
            if detok.stop_string is not None and not upd.finished:
                result.stop_strings[req.req_id] = detok.stop_string
            if upd.finished or req.req_id in result.stop_strings:
                state.num_finished += 1
            touched[state.request_id] = state
        result.touched = list(touched.values())
        for group in ready.values():
            result.beam_intents += group.advance()
            if group.state.done:
                result.finished_beams.append(group)
        return result

    def make_outputs(self, processed: ProcessedUpdates) -> list[RequestOutput]:
        """The outputs of the step ``processed`` describes (after the engine applied it): finished
        requests, and streaming requests with news. Finished requests are forgotten."""
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
                    cumulative_logprob=state.cumulative_logprobs[i] if logprobs is not None else None,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = state.seqs[0]
        seqs = state.seqs
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            scheduled_time=first.scheduled_time,
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
            last_token_time=max((s.last_token_time for s in seqs if s.last_token_time), default=None),
            finished_time=max((s.finished_time for s in seqs if s.finished_time), default=None),
            num_preemptions=sum(s.num_preemptions for s in seqs),
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
