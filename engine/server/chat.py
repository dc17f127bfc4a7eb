"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template, and tool calls
as vLLM serves them (``tools`` through the template, ``tool_choice`` none / auto / required / a named
function, the output read back into ``tool_calls``)."""

from __future__ import annotations

import json
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
from kvpilot.engine.server.tool_choice import ToolPlan, resolve_tools

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
    plan = resolve_tools(req, state.enable_auto_tool_choice, state.tool_call_parser)
    prompt_ids = await state.encode(render_chat(state, req, plan.tools), add_special_tokens=False)
    max_tokens = protocol.default_max_tokens(req, state.sampling_defaults)
    top_logprobs = protocol.request_logprobs(req)
    params = plan.constrain(
        protocol.to_sampling_params(req, max_tokens, top_logprobs, state.sampling_defaults)
    )
    # The engine refuses a max_tokens past the context (OpenAI's answer), naming this endpoint's fields.
    context = ContextRule(
        clip_max_tokens=False, prompt_param="messages", max_tokens_param=protocol.max_tokens_param(req)
    )

    request_id = new_id("chatcmpl")
    rs = await submit(
        state,
        [PromptInput(request_id, prompt_ids, params, time.monotonic(), context)],
        stream=req.stream,
        request=request,
    )
    if req.stream:
        return SSEResponse(_stream(state, req, plan, model, request_id, len(prompt_ids), rs))
    out = (await collect_final(state, rs, request))[request_id]
    choices = []
    for comp in out.outputs:
        logprobs = None
        if top_logprobs is not None and comp.logprobs is not None:
            logprobs = {"content": chat_logprobs(state, comp.token_ids, comp.logprobs, top_logprobs)}
        message, finish_reason = plan.message(comp.text, comp.finish_reason)
        choices.append(choice(comp.index, "message", message, logprobs, finish_reason, comp.stop_reason))
    num_completion = sum(len(comp.token_ids) for comp in out.outputs)
    return whole_response(request_id, "chat.completion", model, choices, len(prompt_ids), num_completion)


def render_chat(
    state: ServerState, req: protocol.ChatCompletionRequest, tools: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text: the messages (with their tool calls and tool results) and ``tools`` through the
    chat template (the server's ``--chat-template`` or the tokenizer's)."""
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
        message: dict[str, Any] = {"role": msg.role, "content": content}
        if msg.name is not None:
            message["name"] = msg.name
        if msg.role == "tool":
            if msg.tool_call_id is None:
                raise bad_request(
                    "a 'tool' message needs the 'tool_call_id' of the call it answers",
                    param=f"messages[{i}].tool_call_id",
                )
            message["tool_call_id"] = msg.tool_call_id
        if msg.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in msg.tool_calls]
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
            tools=tools,
            **kwargs,
        )
    except Exception as exc:  # jinja's TemplateError, raise_exception() in templates, bad roles, ...
        raise bad_request(
            f"the chat template cannot render these messages: {exc}", param="messages"
        ) from None


def _template_tool_call(call: protocol.MessageToolCall) -> dict[str, Any]:
    """An earlier call as chat templates take it: ``arguments`` as a dict when they are a JSON object
    (transformers' convention, which vLLM follows), the text otherwise."""
    arguments: Any = call.function.arguments
    try:
        decoded = json.loads(arguments)
    except ValueError:
        decoded = None
    if isinstance(decoded, dict):
        arguments = decoded
    return {
        "id": call.id,
        "type": call.type,
        "function": {"name": call.function.name, "arguments": arguments},
    }


# ---------------------------------------------------------------------------------------------- streaming
def _stream(
    state: ServerState,
    req: protocol.ChatCompletionRequest,
    plan: ToolPlan,
    model: str,
    request_id: str,
    num_prompt: int,
    rs: RequestStream,
) -> AsyncIterator[str]:
    """``chat.completion.chunk`` events: the assistant role for every choice first, then ``delta``
    content (or ``tool_calls`` pieces, when the request reads calls) with chat-shaped logprobs."""
    top_logprobs = protocol.request_logprobs(req)
    readers = [plan.stream() for _ in range(req.n)]

    def content(d: ChoiceDelta) -> tuple[dict[str, Any] | None, Any]:
        logprobs = None
        if top_logprobs is not None:
            logprobs = {"content": chat_logprobs(state, d.token_ids, d.logprobs, top_logprobs)}
        reader = readers[d.index]
        if reader is None:
            return ({"content": d.text} if d.text else {}), logprobs
        out = reader.feed(d.text)
        if d.finish_reason is not None:
            out.extend(reader.finish())
        body: dict[str, Any] = {}
        if out.content:
            body["content"] = out.content
        if out.tool_calls:
            body["tool_calls"] = [piece.as_dict() for piece in out.tool_calls]
        return (body or None), logprobs

    def finish(d: ChoiceDelta) -> str | None:
        reader = readers[d.index]
        return (
            plan.finish_reason(d.finish_reason)
            if reader is not None and reader.num_calls
            else d.finish_reason
        )

    roles = [(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
    chunks = ChunkStream(state, rs, req, _CHUNK, request_id, model, [request_id], num_prompt)
    return chunks.events(content, roles, finish)
