"""Beam search above the engine core (torch-free): which continuations survive each step.

Each step every running beam reports the log-probabilities of its top ``2 * beam_width`` next tokens.
The candidates (beam, token) are ranked by accumulated log-probability; the best ``2 * beam_width``
are kept. Of those, candidates that end (EOS, or ``max_tokens`` reached) and rank within the first
``beam_width`` become finished hypotheses scored ``logprob_sum / generated_len ** length_penalty``; the
best ``beam_width`` candidates that do not end become the next running beams. The search stops when
every kept candidate ends or no running beam can still beat the worst finished hypothesis. This is
the same procedure as transformers' ``generate(num_beams=..., do_sample=False)`` with its default
``early_stopping=False`` heuristic, so both return the same sequences.

The search runs on the core's ordinary API, as vLLM's does: each round is one request per running
beam, its prompt the beam's tokens, greedy with ``max_tokens=1`` and ``logprobs=num_candidates``. The
core knows nothing of beams (no fork, pause or resume). The rounds share KV through the prefix cache:
each round's request finds its parent's blocks, the partly filled last one too (which a freed request
leaves keyed by the tokens it holds), and computes one token; when two beams continue one parent, the
second copies that last block before writing (copy on write). With prefix caching off, every round
recomputes its beams whole.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.errors import SamplingParamsError
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.stats import FinishedRequestStats

if TYPE_CHECKING:
    from kvpilot.engine.output_processor import StepRecord


@dataclass
class BeamSearchParams:
    """Beam search settings, mirroring vLLM's ``BeamSearchParams``. Raises ``SamplingParamsError`` for a
    width or ``max_tokens`` below 1."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise SamplingParamsError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclass
class Hypothesis:
    """A finished beam: generated tokens, their summed log-probability and the length-penalised score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class Continuation:
    """A running beam for the next step: ``parent`` (index into the current beams) extended by ``token``."""

    parent: int
    token: int
    cum_logprob: float


@dataclass
class BeamSearchState:
    """The search of one prompt. ``beams`` are the running beams' generated tokens and scores."""

    params: BeamSearchParams
    eos_token_id: int | None
    beams: list[tuple[list[int], float]] = field(default_factory=lambda: [([], 0.0)])
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False

    @property
    def num_candidates(self) -> int:
        """How many top tokens each beam must report."""
        n_eos = 0 if self.params.ignore_eos or self.eos_token_id is None else 1
        return max(2, 1 + n_eos) * self.params.beam_width

    def step(self, top_logprobs: list[dict[int, float]]) -> list[Continuation]:
        """Advance by one token. ``top_logprobs[i]`` holds beam ``i``'s top ``num_candidates`` tokens.

        Returns the continuations that form the next running beams (empty when the search is done).
        """
        assert len(top_logprobs) == len(self.beams) and not self.done
        params = self.params
        width = params.beam_width
        gen_len = len(self.beams[0][0]) + 1  # generated length including the new token
        candidates = []
        for b, ((_, score), logprobs) in enumerate(zip(self.beams, top_logprobs, strict=True)):
            for token, lp in logprobs.items():
                candidates.append((score + lp, b, token))
        # Highest score first; ties go to the lower (beam, token) like a top-k over the flattened vocab.
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: self.num_candidates]

        def ends(token: int) -> bool:
            is_eos = token == self.eos_token_id and not params.ignore_eos
            return is_eos or gen_len >= params.max_tokens

        if self._can_improve():
            for score, b, token in candidates[:width]:
                if ends(token):
                    reason = "stop" if token == self.eos_token_id and not params.ignore_eos else "length"
                    self.finished.append(
                        Hypothesis(
                            self.beams[b][0] + [token], score, score / gen_len**params.length_penalty, reason
                        )
                    )
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[width:]

        running = [Continuation(b, token, score) for score, b, token in candidates if not ends(token)][:width]
        if not running:
            self.done = True
            return []
        self.beams = [(self.beams[c.parent][0] + [c.token], c.cum_logprob) for c in running]
        if not self._can_improve():
            self.done = True
            return []
        return running

    def _can_improve(self) -> bool:
        """transformers' early-stopping heuristic: go on while fewer than ``beam_width`` hypotheses are
        finished, or the best running beam, scored at its current length, beats the worst of them."""
        if len(self.finished) < self.params.beam_width:
            return True
        best_running = self.beams[0][1] / max(1, len(self.beams[0][0])) ** self.params.length_penalty
        return best_running > self.finished[-1].score

    def results(self) -> list[Hypothesis]:
        """Best first; if the search ended with fewer finished hypotheses than beams (it cannot run
        past ``max_tokens``), the running beams are scored too."""
        hyps = list(self.finished)
        if len(hyps) < self.params.beam_width and not self.done:
            for tokens, score in self.beams:
                hyps.append(
                    Hypothesis(
                        tokens, score, score / max(1, len(tokens)) ** self.params.length_penalty, "length"
                    )
                )
        return sorted(hyps, key=lambda h: -h.score)[: self.params.beam_width]


class BeamSearchGroup:
    """One beam search on the engine, driven from above the core.

    ``next_round`` names the round's requests (id and tokens, one per running beam); each reports its
    candidates through ``on_sampled``; when all have, ``advance`` runs the selection. The group holds
    no scheduler object: only the current round's ids and its own ``state``.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        state: BeamSearchState,
        arrival_time: float,
        sampling_params: SamplingParams,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params  # every round request's: greedy, one token, candidates
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.state = state
        self.arrival_time = arrival_time
        self.beam_ids: list[str] = []  # the current round's request ids, one per running beam
        self.reports: dict[str, dict[int, float]] = {}
        self._next_id = 0
        # The search's metrics, as one request's: first scheduled, rounds' ends, preemptions.
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_rounds = 0
        self.num_preemptions = 0

    def next_round(self, taken: Container[str] = ()) -> list[tuple[str, list[int]]]:
        """The requests of the next round: for each running beam, a fresh id (none in ``taken``, the
        live sequence ids) and prompt + its tokens."""
        round_ = []
        for tokens, _ in self.state.beams:
            req_id = f"{self.request_id}#b{self._next_id}"
            while req_id in taken:
                self._next_id += 1
                req_id = f"{self.request_id}#b{self._next_id}"
            self._next_id += 1
            round_.append((req_id, self.prompt_token_ids + tokens))
        self.beam_ids = [req_id for req_id, _ in round_]
        self.reports.clear()
        return round_

    def on_sampled(self, req_id: str, top_logprobs: dict[int, float]) -> bool:
        """Record the candidates the round's request ``req_id`` reported; True when all have."""
        self.reports[req_id] = top_logprobs
        return all(b in self.reports for b in self.beam_ids)

    def note_core_events(self, scheduled_time: float | None, num_preemptions: int) -> None:
        """What the core reported of one round request: when it first ran, how often it was preempted."""
        if self.scheduled_time is None:
            self.scheduled_time = scheduled_time
        self.num_preemptions += num_preemptions

    def record_round(self, now: float, step: StepRecord) -> None:
        """The round ended at ``now``: its latency goes into the step's record (``StepRecord``), the
        first as the search's time to first token, the later ones as inter-token latencies."""
        if self.first_token_time is None:
            self.first_token_time = now
            step.ttfts.append(now - self.arrival_time)
            step.num_prompt_tokens += len(self.prompt_token_ids)
        else:
            step.itls.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_rounds += 1

    def finished_stats(self, now: float) -> FinishedRequestStats:
        """The search as one finished request, for the metrics."""
        results = self.state.results()
        return FinishedRequestStats(
            finish_reason=results[0].finish_reason if results else "length",
            num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=self.num_rounds,
            arrival_time=self.arrival_time,
            scheduled_time=self.scheduled_time,
            first_token_time=self.first_token_time,
            finished_time=now,
            num_preemptions=self.num_preemptions,
        )

    def advance(self) -> bool:
        """Select the next beams from the round's reports; True while the search goes on (then
        ``next_round`` gives the requests to queue), False when it is over (``state.results()``)."""
        self.state.step([self.reports[b] for b in self.beam_ids])
        self.reports.clear()
        self.beam_ids = []
        return not self.state.done
