"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvpilot.engine.async_engine import PromptInput, RequestStream
from kvpilot.engine.input_processor import ContextRule
from kvpilot.engine.server import protocol
from kvpilot.engine.server.errors import bad_request, not_supported
from kvpilot.engine.server.serving import (
    ServerState,
    chat_logprobs,
    choice,
    collect_final,
    new_id,
    submit,
    whole_response,
)
from kvpilot.engine.server.streaming import ChoiceDelta, ChunkShape, ChunkStream, SSEResponse

_CHUNK = ChunkShape(object_type="chat.completion.chunk", content_key="delta")

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
    top_logprobs = protocol.request_logprobs(req)
    params = protocol.to_sampling_params(req, max_tokens, top_logprobs, state.sampling_defaults)
    # The engine refuses a max_tokens past the context (OpenAI's answer), naming this endpoint's fields.
    context = ContextRule(
        clip_max_tokens=False, prompt_param="messages", max_tokens_param=protocol.max_tokens_param(req)
    )

    request_id = new_id("chatcmpl")
    rs = await submit(
        state, [PromptInput(request_id, prompt_ids, params, time.monotonic(), context)], stream=req.stream
    )
    if req.stream:
        return SSEResponse(_stream(state, req, model, request_id, len(prompt_ids), rs))
    out = (await collect_final(state, rs, request))[request_id]
    choices = []
    for comp in out.outputs:
        logprobs = None
        if top_logprobs is not None and comp.logprobs is not None:
            logprobs = {"content": chat_logprobs(state, comp.token_ids, comp.logprobs, top_logprobs)}
        message = {"role": "assistant", "content": comp.text}
        choices.append(choice(comp.index, "message", message, logprobs, comp.finish_reason, comp.stop_reason))
    num_completion = sum(len(comp.token_ids) for comp in out.outputs)
    return whole_response(request_id, "chat.completion", model, choices, len(prompt_ids), num_completion)


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


def _stream(
    state: ServerState,
    req: protocol.ChatCompletionRequest,
    model: str,
    request_id: str,
    num_prompt: int,
    rs: RequestStream,
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events: the assistant role for every choice first, then ``delta``
    content with chat-shaped logprobs."""
    top_logprobs = protocol.request_logprobs(req)

    def content(d: ChoiceDelta) -> tuple[dict[str, str], Any]:
        logprobs = None
        if top_logprobs is not None:
            logprobs = {"content": chat_logprobs(state, d.token_ids, d.logprobs, top_logprobs)}
        return ({"content": d.text} if d.text else {}), logprobs

    roles = [(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
    chunks = ChunkStream(state, rs, req, _CHUNK, request_id, model, [request_id], num_prompt)
    return chunks.events(content, roles)
