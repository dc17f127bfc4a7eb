"""``POST /v1/completions``: one or more prompts, ``n`` completions each, whole or as Server-Sent Events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvpilot.engine.async_engine import PromptInput, RequestStream
from kvpilot.engine.input_processor import ContextRule
from kvpilot.engine.server import protocol
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.serving import (
    ServerState,
    choice,
    collect_final,
    completion_logprobs,
    new_id,
    submit,
    whole_response,
)
from kvpilot.engine.server.streaming import ChoiceDelta, ChunkShape, ChunkStream, SSEResponse

MAX_PROMPTS = 2048  # OpenAI's limit on prompts per request
_CHUNK = ChunkShape(object_type="text_completion", content_key="text")
# The engine refuses a max_tokens past the context (OpenAI's answer) rather than clip it.
_CONTEXT = ContextRule(clip_max_tokens=False, prompt_param="prompt", max_tokens_param="max_tokens")


async def create_completion(state: ServerState, body: dict[str, Any], request: Request) -> Response:
    req: protocol.CompletionRequest = protocol.validate(protocol.CompletionRequest, body)
    model = state.resolve_model(req.model)
    protocol.check_unsupported(req)
    prompts = await _prompts(state, req.prompt)
    max_tokens = protocol.default_max_tokens(req, state.sampling_defaults)
    params = protocol.to_sampling_params(req, max_tokens, req.logprobs, state.sampling_defaults)

    request_id = new_id("cmpl")
    arrival = time.monotonic()
    request_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
    inputs = [
        PromptInput(rid, ids, params, arrival, _CONTEXT)
        for rid, (_, ids) in zip(request_ids, prompts, strict=True)
    ]
    rs = await submit(state, inputs, stream=req.stream, request=request)
    if req.stream:
        return SSEResponse(_stream(state, req, model, request_id, request_ids, prompts, rs))
    finals = await collect_final(state, rs, request)
    choices = []
    for p, (rid, (text, ids)) in enumerate(zip(request_ids, prompts, strict=True)):
        out = finals[rid]
        for comp in out.outputs:
            prefix = _prompt_text(state, text, ids) if req.echo else ""
            logprobs = None
            if req.logprobs is not None and comp.logprobs is not None:
                logprobs = completion_logprobs(state, comp.token_ids, comp.logprobs, 0)
            index = p * req.n + comp.index
            choices.append(
                choice(index, "text", prefix + comp.text, logprobs, comp.finish_reason, comp.stop_reason)
            )
    num_prompt = sum(len(ids) for _, ids in prompts)
    num_completion = sum(len(comp.token_ids) for out in finals.values() for comp in out.outputs)
    return whole_response(request_id, "text_completion", model, choices, num_prompt, num_completion)


async def _prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad_request("prompt is empty", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
    out = []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt is empty: at least one character is required", param="prompt")
            out.append((item, await state.encode(item)))
        else:
            if not item:
                raise bad_request("prompt is empty: at least one token id is required", param="prompt")
            out.append((None, list(item)))
    return out


def _prompt_text(state: ServerState, text: str | None, ids: list[int]) -> str:
    return text if text is not None else state.tokenizer.decode(ids)


def _stream(
    state: ServerState,
    req: protocol.CompletionRequest,
    model: str,
    request_id: str,
    request_ids: list[str],
    prompts: list[tuple[str | None, list[int]]],
    rs: RequestStream,
) -> AsyncIterator[str]:
    """``text_completion`` events: the prompts first (with ``echo``), then ``text`` deltas with legacy
    logprobs whose ``text_offset`` runs on across a choice's chunks."""
    n = req.n
    offsets = [0] * (len(prompts) * n)

    def content(d: ChoiceDelta) -> tuple[str, Any]:
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(state, d.token_ids, d.logprobs, offsets[d.index])
            offsets[d.index] += sum(len(t) for t in logprobs["tokens"])
        return d.text, logprobs

    # Lazy, so that decoding the prompts happens inside the stream (whose end aborts the requests).
    echoes = (
        (p * n + i, _prompt_text(state, text, ids))
        for p, (text, ids) in enumerate(prompts if req.echo else [])
        for i in range(n)
    )
    num_prompt = sum(len(ids) for _, ids in prompts)
    chunks = ChunkStream(state, rs, req, _CHUNK, request_id, model, request_ids, num_prompt)
    return chunks.events(content, echoes)
