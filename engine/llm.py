"""The offline API, mirroring vLLM: ``LLM(model=DIR, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.beam_search import BeamSearchParams
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.llm_engine import LLMEngine, ShutdownOnExit
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` = prompt + generated tokens; ``text`` is the generated text."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class LLM(ShutdownOnExit):
    """An engine for offline batches. Keyword arguments are ``EngineArgs`` fields; ``with LLM(...)``
    shuts it down on exit."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor/pipeline parallel); idempotent, also done at exit."""
        self.llm_engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs come back in prompt order.

        A prompt is a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``. ``sampling_params``
        is one for all prompts or one per prompt. Raises ``InvalidRequestError`` for a request the engine
        refuses (none of the batch runs then), ``TypeError`` for a prompt of another shape.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                rid = str(next(self._ids))
                engine.add_request(rid, _prompt_input(prompt), params)
                request_ids.append(rid)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation or a list of them, formatted by the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            ids = tokenizer.apply_chat_template(
                conv, tokenize=True, add_generation_prompt=add_generation_prompt, chat_template=chat_template
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (all searches run batched together); each output holds
        ``beam_width`` sequences, best first. The beams share their common prefix's KV blocks."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt in prompts:
                rid = str(next(self._ids))
                engine.add_beam_search_request(rid, _prompt_input(prompt), params)
                request_ids.append(rid)
            outputs = self._run(request_ids, use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=out.prompt_token_ids + c.token_ids,
                        text=c.text,
                        cum_logprob=c.cumulative_logprob,
                        finish_reason=c.finish_reason,
                    )
                    for c in out.outputs
                ]
            )
            for out in outputs
        ]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in request_ids]


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
    raise TypeError(
        f"a prompt is a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; got {prompt!r}"
    )
