"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpilot.engine.async_engine import PromptInput, RequestStream
from kvpilot.engine.server import protocol
from kvpilot.engine.server.errors import bad_request, not_supported
from kvpilot.engine.server.serving import (
    ServerState,
    SSEResponse,
    chat_logprobs,
    check_context,
    check_sampling,
    collect_final,
    delta_logprobs,
    guarded_stream,
    new_id,
    sse_event,
    submit,
    usage,
)

# Arguments of apply_chat_template that chat_template_kwargs must not override.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tokenize",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tools",
    "documents",
}


async def create_chat_completion(state: ServerState, body: dict[str, Any], request: Request) -> Response:
    req: protocol.ChatCompletionRequest = protocol.validate(protocol.ChatCompletionRequest, body)
    model = state.resolve_model(req.model)
    protocol.check_unsupported(req)
    prompt_ids = await state.encode(render_chat(state, req), add_special_tokens=False)
    max_tokens = protocol.default_max_tokens(req, state.sampling_defaults)
    check_context(state, len(prompt_ids), max_tokens, "messages", protocol.max_tokens_param(req))
    top_logprobs = protocol.request_logprobs(req)
    params = protocol.to_sampling_params(req, max_tokens, top_logprobs, state.sampling_defaults)
    check_sampling(state, params)

    request_id = new_id("chatcmpl")
    rs = await submit(
        state, [PromptInput(request_id, prompt_ids, params, time.monotonic())], stream=req.stream
    )
    if req.stream:
        return SSEResponse(_stream(state, req, model, request_id, len(prompt_ids), rs))
    out = (await collect_final(state, rs, request))[request_id]
    choices = []
    for comp in out.outputs:
        logprobs = None
        if top_logprobs is not None and comp.logprobs is not None:
            logprobs = {"content": chat_logprobs(state, comp.token_ids, comp.logprobs, top_logprobs)}
        choices.append(
            {
                "index": comp.index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": logprobs,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
        )
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(len(prompt_ids), sum(len(comp.token_ids) for comp in out.outputs)),
            "system_fingerprint": None,
        }
    )


def render_chat(state: ServerState, req: protocol.ChatCompletionRequest) -> str:
    """The prompt text: the messages through the chat template (the server's ``--chat-template`` or the
    tokenizer's)."""
    conversation = []
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, list):
            texts = []
            for j, part in enumerate(msg.content):
                if part.type != "text":
                    raise not_supported(
                        f"content part type {part.type!r} (this server is text-only)",
                        f"messages[{i}].content[{j}].type",
                    )
                if part.text is None:
                    raise bad_request(
                        "a text content part needs a 'text' string", param=f"messages[{i}].content[{j}].text"
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = msg.content or ""
        message = {"role": msg.role, "content": content}
        if msg.name is not None:
            message["name"] = msg.name
        conversation.append(message)
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
        )
    template = state.chat_template
    if template is None and not getattr(state.tokenizer, "chat_template", None):
        raise bad_request(
            "this model has no chat template: use /v1/completions, or start the server with --chat-template",
            param="messages",
            code="no_chat_template",
        )
    try:
        return state.tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            chat_template=template,
            **kwargs,
        )
    except Exception as exc:  # jinja's TemplateError, raise_exception() in templates, bad roles, ...
        raise bad_request(
            f"the chat template cannot render these messages: {exc}", param="messages"
        ) from None


async def _stream(
    state: ServerState,
    req: protocol.ChatCompletionRequest,
    model: str,
    request_id: str,
    num_prompt: int,
    rs: RequestStream,
) -> AsyncIterator[str]:
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    top_logprobs = protocol.request_logprobs(req)
    num_tokens = [0] * req.n
    done: set[int] = set()

    def chunk(
        index: int,
        delta: dict[str, Any],
        logprobs: Any = None,
        finish: str | None = None,
        stop_reason: Any = None,
    ) -> str:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
        payload: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            payload["usage"] = usage(num_prompt, sum(num_tokens)) if continuous else None
        return sse_event(payload)

    async def body() -> AsyncIterator[str]:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for outs in rs:
            out = outs[-1]
            for comp in out.outputs:
                i = comp.index
                if i in done:
                    continue
                new_ids = out.delta_token_ids[i]
                num_tokens[i] += len(new_ids)
                text = out.delta_text[i]
                finish = comp.finish_reason
                if not text and finish is None and (top_logprobs is None or not new_ids):
                    continue
                logprobs = None
                if top_logprobs is not None:
                    ids, entries = delta_logprobs(out, i, len(new_ids))
                    logprobs = {"content": chat_logprobs(state, ids, entries, top_logprobs)}
                if finish is not None:
                    done.add(i)
                yield chunk(
                    i,
                    {"content": text} if text else {},
                    logprobs,
                    finish,
                    comp.stop_reason if finish else None,
                )

    def usage_chunk() -> str | None:
        if not include_usage:
            return None
        return sse_event(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage(num_prompt, sum(num_tokens)),
            }
        )

    async for event in guarded_stream(state, rs, body(), usage_chunk):
        yield event
