"""Beam search: which continuations survive each step (torch-free; the engine applies its intents).

Each step every running beam reports the log-probabilities of its top ``2 * beam_width`` next tokens.
The candidates (beam, token) are ranked by accumulated log-probability; the best ``2 * beam_width``
are kept. Of those, candidates that end (EOS, or ``max_tokens`` reached) and rank within the first
``beam_width`` become finished hypotheses scored ``logprob_sum / generated_len ** length_penalty``; the
best ``beam_width`` candidates that do not end become the next running beams. The search stops when
every kept candidate ends or no running beam can still beat the worst finished hypothesis. This is
the same procedure as transformers' ``generate(num_beams=..., do_sample=False)`` with its default
``early_stopping=False`` heuristic, so both return the same sequences.

Sharing: a surviving candidate whose parent beam already holds that token continues in the parent;
any other continuation forks the parent's KV blocks (reference counted, copy-on-write).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.errors import SamplingParamsError
from kvpilot.engine.request import Request, RequestStatus


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


@dataclass
class Fork:
    """Start ``child`` from the KV of the running beam ``parent_req_id`` (shared, copy-on-write)."""

    parent_req_id: str
    child: Request


@dataclass
class Finish:
    """End the beam ``req_id`` with ``status`` and free its blocks."""

    req_id: str
    status: RequestStatus


@dataclass
class Pause:
    """Hold the beam ``req_id`` (keeping its blocks) until its group has been advanced."""

    req_id: str


@dataclass
class Resume:
    """Schedule the beam ``req_id`` again."""

    req_id: str


BeamIntent = Fork | Finish | Pause | Resume


class BeamSearchGroup:
    """One beam search on the engine: its beams are ordinary sequences of the scheduler.

    Each beam samples greedily with ``logprobs = num_candidates`` and then pauses (keeping its KV)
    until every running beam of the group has reported for the same length; ``advance`` then runs
    the selection: winners continue in place or fork, losers finish. The group never touches the
    scheduler and holds none of its objects (only the beams' ids; its own ``state`` has their
    tokens): it returns what to do as intents, which the engine applies in order. ``first`` is the
    first beam's ``Request``, read once here for the values every beam shares.
    """

    def __init__(self, request_id: str, prompt: str | None, state: BeamSearchState, first: Request) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = first.prompt_token_ids
        self.state = state
        self._sampling_params = first.sampling_params
        self._eos_token_id = first.eos_token_id
        self._arrival_time = first.arrival_time
        self.beam_ids: list[str] = [first.req_id]
        self.reports: dict[str, dict[int, float]] = {}
        self._next_beam = 1

    def on_sampled(self, req_id: str, top_logprobs: dict[int, float]) -> bool:
        """Record the candidates the beam ``req_id`` reported (its sampled token first; it must then
        be paused); True when every beam has reported."""
        self.reports[req_id] = top_logprobs
        return all(b in self.reports for b in self.beam_ids)

    def advance(self) -> list[BeamIntent]:
        """Select the next beams; return the forks, then the finished beams, then the resumed ones.
        ``state.done`` tells whether the search is over (every beam then finishes)."""
        generated = [tokens for tokens, _ in self.state.beams]  # each beam's tokens before this step
        sampled = [next(iter(self.reports[b])) for b in self.beam_ids]  # the token each beam appended
        continuations = self.state.step([self.reports[b] for b in self.beam_ids])
        self.reports.clear()
        if self.state.done:
            return self.finish()
        # A winner whose parent already holds its token continues in the parent; the rest fork.
        chosen: list[str | None] = [None] * len(continuations)
        kept: set[str] = set()
        for i, c in enumerate(continuations):
            parent = self.beam_ids[c.parent]
            if sampled[c.parent] == c.token and parent not in kept:
                chosen[i] = parent
                kept.add(parent)
        intents: list[BeamIntent] = []
        for i, c in enumerate(continuations):
            if chosen[i] is None:
                child = self._child(generated[c.parent] + [c.token])
                chosen[i] = child.req_id
                intents.append(Fork(self.beam_ids[c.parent], child))
        intents += [Finish(b, RequestStatus.FINISHED_ABORTED) for b in self.beam_ids if b not in kept]
        intents += [Resume(b) for b in chosen if b in kept]
        self.beam_ids = chosen
        return intents

    def _child(self, output_token_ids: list[int]) -> Request:
        """A new beam (for the scheduler to fork) with these generated tokens."""
        child = Request(
            req_id=f"{self.request_id}#b{self._next_beam}",
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self._sampling_params,
            eos_token_id=self._eos_token_id,
            arrival_time=self._arrival_time,
            client_request_id=self.request_id,
        )
        self._next_beam += 1
        # The child shares the prompt list; only the generated tokens are its own.
        child.output_token_ids = output_token_ids
        return child

    def finish(self) -> list[BeamIntent]:
        """Finish every remaining beam (the search is over)."""
        return [Finish(b, RequestStatus.FINISHED_STOPPED) for b in self.beam_ids]
