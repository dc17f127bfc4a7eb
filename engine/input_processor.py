"""Prompts in, requests out: tokenization, validation and the ``n > 1`` fan-out (torch-free).

The one place a request is checked: everything it can be refused for (a duplicate id, ids outside the
vocabulary (prompt, stop_token_ids, logit_bias), a structured-output constraint that does not compile,
an empty prompt, a context past ``max_model_len``, more sequences than ``max_num_seqs``
allows now, more KV than the whole cache holds) raises ``InvalidRequestError`` here, naming the field
at fault, before anything is queued. The scheduler and the server check nothing a request carries.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.beam_search import BeamSearchGroup, BeamSearchParams, BeamSearchState
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.request import Request, output_cap
from kvpilot.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpilot.engine.scheduler import Scheduler
    from kvpilot.engine.structured_output import GrammarCompiler

# How many offending values an error message quotes.
_MAX_QUOTED = 5


@dataclass(frozen=True)
class ContextRule:
    """What a request whose prompt plus ``max_tokens`` passes ``max_model_len`` gets, and the names its
    errors give the two fields: the offline engine clips ``max_tokens`` to the room left (as vLLM's
    ``LLM`` does); the OpenAI server refuses it with ``context_length_exceeded``, naming the endpoint's
    own fields (``messages``, ``max_completion_tokens``)."""

    clip_max_tokens: bool = True
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"


CLIP_TO_CONTEXT = ContextRule()


@dataclass
class NewRequest:
    """A checked request, nothing of it queued yet: its prompt and the ``n`` independent sequences to
    queue (they share the prompt's blocks through the prefix cache)."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]


class InputProcessor:
    """Turns one user request into the scheduler's ``Request`` objects.

    ``active_request_ids`` holds the user request ids still running (a duplicate is refused), and
    ``live_sequence_ids`` the ids of their unfinished sequences (both the output processor's: the
    front end checks against its own state, never the core's);
    ``eos_token_id`` is stamped on every request made, and may be changed between requests. The bounds
    are the scheduler's, read at each request: ``max_num_seqs`` may change at run time.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: int | None,
        scheduler: Scheduler,
        active_request_ids: Container[str],
        live_sequence_ids: Container[str],
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Compiles structured-output constraints at admission; None: constrained requests are refused.
        self.grammar_compiler = grammar_compiler
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.scheduler = scheduler
        self.active_request_ids = active_request_ids
        self.live_sequence_ids = live_sequence_ids

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        context: ContextRule = CLIP_TO_CONTEXT,
    ) -> NewRequest:
        """The checked request; siblings (``n > 1``) get ids ``{request_id}#{i}``, ``n=1`` and
        ``seed + i``. Raises ``InvalidRequestError`` for anything the module docstring lists."""
        self._check_new(request_id)
        bad_stops = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stops:
            raise InvalidRequestError(
                f"stop_token_ids must be below the vocabulary size {self.vocab_size}; "
                f"got {bad_stops[:_MAX_QUOTED]}",
                param="stop_token_ids",
            )
        if params.logit_bias:
            bad_bias = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad_bias:
                raise InvalidRequestError(
                    f"logit_bias token ids must be below the vocabulary size {self.vocab_size}; "
                    f"got {bad_bias[:_MAX_QUOTED]}",
                    param="logit_bias",
                )
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise InvalidRequestError(
                    "structured outputs are not available with pipeline parallelism (the sampling rank "
                    "runs in a worker process)",
                    param="structured_outputs",
                )
            self.grammar_compiler.compile(params.structured_outputs)
        token_ids = self.prompt_token_ids(prompt, context.prompt_param)
        self._check_num_seqs(params.n, f"n={params.n} sequences exceed", "lower n", "n")
        self._check_context(len(token_ids), params.max_tokens, context)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        text = prompt if isinstance(prompt, str) else None
        if params.n == 1:
            seqs = [self._request(request_id, request_id, token_ids, params, arrival)]
        else:
            seqs = []
            for i in range(params.n):
                # Siblings draw different samples: each gets its own seed offset.
                seed = None if params.seed is None else params.seed + i
                sibling_params = dataclasses.replace(params, n=1, seed=seed)
                sibling = self._request(f"{request_id}#{i}", request_id, token_ids, sibling_params, arrival)
                seqs.append(sibling)
        self.check_sequence_ids_free(seqs)
        return NewRequest(request_id, text, token_ids, params, seqs)

    def process_beam_search(
        self, request_id: str, prompt: str | list[int], params: BeamSearchParams
    ) -> BeamSearchGroup:
        """The checked search (``max_tokens`` clipped to what ``max_model_len`` leaves after the prompt),
        to run above the core in rounds of one-token requests (``beam_requests``).

        Raises ``InvalidRequestError`` like ``process``, and for a ``beam_width`` above ``max_num_seqs``.
        """
        self._check_new(request_id)
        token_ids = self.prompt_token_ids(prompt)
        self._check_num_seqs(
            params.beam_width, f"beam_width {params.beam_width} exceeds", "every beam runs as a sequence", "n"
        )
        self._check_context(len(token_ids), params.max_tokens, CLIP_TO_CONTEXT)
        cap = output_cap(len(token_ids), params.max_tokens, self.scheduler.config.max_model_len)
        limited = dataclasses.replace(params, max_tokens=cap)
        state = BeamSearchState(limited, self.eos_token_id)
        # Each round's requests sample one token greedily and report their top candidates; the group
        # decides which beams go on.
        beam_params = SamplingParams(
            temperature=0.0, max_tokens=1, logprobs=state.num_candidates, ignore_eos=True
        )
        text = prompt if isinstance(prompt, str) else None
        return BeamSearchGroup(request_id, text, token_ids, state, time.monotonic(), beam_params)

    def beam_requests(self, group: BeamSearchGroup, round_: list[tuple[str, list[int]]]) -> list[Request]:
        """The scheduler's requests for one round of ``group`` (ids and prompts from ``next_round``,
        within the checked bounds: a beam is never longer than the search's clipped ``max_tokens``)."""
        return [
            self._request(req_id, group.request_id, token_ids, group.sampling_params, group.arrival_time)
            for req_id, token_ids in round_
        ]

    def prompt_token_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
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
                f"prompt token ids must be integers in [0, {vocab}); got {bad[:_MAX_QUOTED]}", param=param
            )
        return token_ids

    def _check_new(self, request_id: str) -> None:
        if request_id in self.active_request_ids:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param=None)

    def check_sequence_ids_free(self, seqs: list[Request], taken: Container[str] = ()) -> None:
        """Refuse sequences whose ids an unfinished sequence (or ``taken``) holds: a user id may spell
        another request's sibling or beam id (``x#1``, ``x#b0``)."""
        live = self.live_sequence_ids
        clash = [s.req_id for s in seqs if s.req_id in live or s.req_id in taken]
        if clash:
            raise InvalidRequestError(
                f"request id {seqs[0].client_request_id!r}: sequence id {clash[0]!r} is in use", param=None
            )

    def _check_num_seqs(self, num_seqs: int, what: str, hint: str, param: str) -> None:
        limit = self.scheduler.config.max_num_seqs
        if num_seqs > limit:
            raise InvalidRequestError(f"{what} max_num_seqs ({limit}): {hint}", param=param)

    def _check_context(self, num_prompt: int, max_tokens: int | None, context: ContextRule) -> None:
        """An empty prompt, one that leaves no room for output, a ``max_tokens`` past the context when
        the rule refuses it, or a sequence whose KV outgrows the whole cache."""
        limit = self.scheduler.config.max_model_len
        prompt_param = context.prompt_param
        if num_prompt == 0:
            raise InvalidRequestError(
                f"the {prompt_param} is empty: at least one token is required", param=prompt_param
            )
        if num_prompt >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{num_prompt} input tokens, leaving no room for output. Please reduce the length of the "
                f"{prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if not context.clip_max_tokens and max_tokens is not None and num_prompt + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_param}, {max_tokens} in "
                f"the completion). Please reduce the length of the {prompt_param} or "
                f"{context.max_tokens_param}.",
                param=context.max_tokens_param,
                code="context_length_exceeded",
            )
        bm = self.scheduler.block_manager
        max_output = output_cap(num_prompt, max_tokens, limit)
        # The last sampled token is never fed back, so a request holds at most prompt + max_output - 1 slots.
        peak = num_prompt + max_output - 1
        if bm.num_blocks_needed(peak) > bm.num_blocks:
            raise InvalidRequestError(
                f"the request needs up to {peak} tokens of KV cache ({num_prompt} {prompt_param} + "
                f"{max_output} output) but the whole cache holds {bm.num_blocks * bm.block_size} "
                f"tokens; shorten the {prompt_param} or lower {context.max_tokens_param}",
                param=context.max_tokens_param,
            )

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
