"""``POST /v1/completions``: one or more prompts, ``n`` completions each, whole or as Server-Sent Events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpilot.engine.async_engine import PromptInput, RequestStream
from kvpilot.engine.server import protocol
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.serving import (
    ServerState,
    SSEResponse,
    check_context,
    check_sampling,
    collect_final,
    completion_logprobs,
    delta_logprobs,
    guarded_stream,
    new_id,
    sse_event,
    submit,
    usage,
)

MAX_PROMPTS = 2048  # OpenAI's limit on prompts per request


async def create_completion(state: ServerState, body: dict[str, Any], request: Request) -> Response:
    req: protocol.CompletionRequest = protocol.validate(protocol.CompletionRequest, body)
    model = state.resolve_model(req.model)
    protocol.check_unsupported(req)
    prompts = await _prompts(state, req.prompt)
    max_tokens = protocol.default_max_tokens(req, state.sampling_defaults)
    for _, ids in prompts:
        check_context(state, len(ids), max_tokens, "prompt", "max_tokens")
    params = protocol.to_sampling_params(req, max_tokens, req.logprobs, state.sampling_defaults)
    check_sampling(state, params)

    request_id = new_id("cmpl")
    arrival = time.monotonic()
    request_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
    inputs = [
        PromptInput(rid, ids, params, arrival) for rid, (_, ids) in zip(request_ids, prompts, strict=True)
    ]
    rs = await submit(state, inputs, stream=req.stream)
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
            choices.append(
                {
                    "index": p * req.n + comp.index,
                    "text": prefix + comp.text,
                    "logprobs": logprobs,
                    "finish_reason": comp.finish_reason,
                    "stop_reason": comp.stop_reason,
                }
            )
    num_prompt = sum(len(ids) for _, ids in prompts)
    num_completion = sum(len(comp.token_ids) for out in finals.values() for comp in out.outputs)
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(num_prompt, num_completion),
            "system_fingerprint": None,
        }
    )


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


async def _stream(
    state: ServerState,
    req: protocol.CompletionRequest,
    model: str,
    request_id: str,
    request_ids: list[str],
    prompts: list[tuple[str | None, list[int]]],
    rs: RequestStream,
) -> AsyncIterator[str]:
    created = int(time.time())
    n = req.n
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    num_prompt = sum(len(ids) for _, ids in prompts)
    num_tokens = [0] * (len(prompts) * n)
    offsets = [0] * (len(prompts) * n)
    done: set[int] = set()
    prompt_index = {rid: p for p, rid in enumerate(request_ids)}

    def chunk(choice: dict[str, Any]) -> str:
        payload: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            payload["usage"] = usage(num_prompt, sum(num_tokens)) if continuous else None
        return sse_event(payload)

    async def body() -> AsyncIterator[str]:
        if req.echo:
            for p, (text, ids) in enumerate(prompts):
                for i in range(n):
                    yield chunk(
                        {
                            "index": p * n + i,
                            "text": _prompt_text(state, text, ids),
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    )
        async for outs in rs:
            for out in outs:
                p = prompt_index[out.request_id]
                for comp in out.outputs:
                    i = comp.index
                    idx = p * n + i
                    if idx in done:
                        continue
                    new_ids = out.delta_token_ids[i]
                    num_tokens[idx] += len(new_ids)
                    text = out.delta_text[i]
                    finish = comp.finish_reason
                    if not text and finish is None and (req.logprobs is None or not new_ids):
                        continue  # held back (partial character, possible stop string): nothing to say yet
                    logprobs = None
                    if req.logprobs is not None:
                        ids, entries = delta_logprobs(out, i, len(new_ids))
                        logprobs = completion_logprobs(state, ids, entries, offsets[idx])
                        offsets[idx] += sum(len(t) for t in logprobs["tokens"])
                    if finish is not None:
                        done.add(idx)
                    yield chunk(
                        {
                            "index": idx,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                            "stop_reason": comp.stop_reason if finish else None,
                        }
                    )

    def usage_chunk() -> str | None:
        if not include_usage:
            return None
        return sse_event(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage(num_prompt, sum(num_tokens)),
            }
        )

    async for event in guarded_stream(state, rs, body(), usage_chunk):
        yield event
