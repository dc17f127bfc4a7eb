"""Prompts in, requests out: tokenization, validation and the ``n > 1`` fan-out (torch-free).

Everything a request can be refused for before it reaches the scheduler is checked here and raised as
``InvalidRequestError``; what depends on the KV pool (prompt length, cache size, ``max_num_seqs``) the
scheduler checks when it queues the requests.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Container

from kvpilot.engine.beam_search import BeamSearchParams, BeamSearchState
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import SamplingParams

# How many offending values an error message quotes.
_MAX_QUOTED = 5


class InputProcessor:
    """Turns one user request into the scheduler's ``Request`` objects.

    ``active_request_ids`` holds the user request ids still running (a duplicate is refused);
    ``eos_token_id`` is stamped on every request made, and may be changed between requests.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: int | None,
        max_model_len: int,
        max_num_seqs: int,
        active_request_ids: Container[str],
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.active_request_ids = active_request_ids

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> tuple[list[int], list[Request]]:
        """The prompt's token ids and the ``params.n`` sequences to queue (the first is the one the
        others fork from). Siblings get ids ``{request_id}#{i}``, ``n=1`` and ``seed + i``.

        Raises ``InvalidRequestError`` for a duplicate id, stop token ids or prompt token ids outside
        the vocabulary.
        """
        self._check_new(request_id)
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise InvalidRequestError(
                f"stop_token_ids must be below the vocabulary size {self.vocab_size}; "
                f"got {bad_stops[:_MAX_QUOTED]}"
            )
        token_ids = self.prompt_token_ids(prompt)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if params.n == 1:
            return token_ids, [self._request(request_id, request_id, token_ids, params, arrival)]
        seqs = []
        for i in range(params.n):
            # Siblings draw different samples: each gets its own seed offset.
            seed = None if params.seed is None else params.seed + i
            sibling_params = dataclasses.replace(params, n=1, seed=seed)
            seqs.append(self._request(f"{request_id}#{i}", request_id, token_ids, sibling_params, arrival))
        return token_ids, seqs

    def process_beam_search(
        self, request_id: str, prompt: str | list[int], params: BeamSearchParams
    ) -> tuple[BeamSearchState, Request]:
        """The search state and its first beam (``{request_id}#b0``). ``max_tokens`` is clipped to what
        ``max_model_len`` leaves after the prompt.

        Raises ``InvalidRequestError`` like ``process``, and for a ``beam_width`` above ``max_num_seqs``.
        """
        self._check_new(request_id)
        token_ids = self.prompt_token_ids(prompt)
        if params.beam_width > self.max_num_seqs:
            raise InvalidRequestError(
                f"beam_width {params.beam_width} exceeds max_num_seqs ({self.max_num_seqs}): "
                "every beam runs as a sequence"
            )
        room = self.max_model_len - len(token_ids)
        limited = dataclasses.replace(params, max_tokens=min(params.max_tokens, max(room, 1)))
        state = BeamSearchState(limited, self.eos_token_id)
        # Beams sample greedily and report their top candidates; the group decides when they stop.
        beam_params = SamplingParams(
            temperature=0.0,
            max_tokens=state.params.max_tokens,
            logprobs=state.num_candidates,
            ignore_eos=True,
        )
        first = self._request(f"{request_id}#b0", request_id, token_ids, beam_params, time.monotonic())
        return state, first

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """A text prompt tokenized, or a copy of the given ids checked against the vocabulary.

        Raises ``InvalidRequestError`` for ids that are not integers in ``[0, vocab_size)``.
        """
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab}); got {bad[:_MAX_QUOTED]}"
            )
        return token_ids

    def _check_new(self, request_id: str) -> None:
        if request_id in self.active_request_ids:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")

    def _request(
        self, req_id: str, request_id: str, token_ids: list[int], params: SamplingParams, arrival: float
    ) -> Request:
        return Request(
            req_id=req_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival,
            client_request_id=request_id,
        )
