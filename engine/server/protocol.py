"""Request bodies: parse, type-check and turn into ``SamplingParams``.

Bodies are parsed here rather than by FastAPI so that every failure is a 4xx in OpenAI's shape with a
precise message: a body over the size limit (413), bytes that are not UTF-8, malformed JSON, ``NaN``
or ``Infinity`` literals, strings with lone surrogates, and fields of the wrong type (400). Types are
checked strictly (``"16"`` is not an integer); value ranges are checked once, by ``SamplingParams``.
Unknown fields are ignored, as vLLM does, with a warning at a bounded rate (``limits.UnknownFieldsLog``):
a body with thousands of made-up keys costs one log line at most and leaves no state behind.

Per-request bounds beyond the types (``limits.RequestLimits``, server flags) are checked by
:func:`check_limits` on the parsed body, before validation and tokenization: the number of ``stop``
strings and their length, the number of ``stop_token_ids``, and prompts x ``n``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect, Request

from kvpilot.engine.errors import SamplingParamsError
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server import constraints
from kvpilot.engine.server.errors import APIError, ClientDisconnected, bad_request, not_supported
from kvpilot.engine.server.limits import RequestLimits, UnknownFieldsLog

MAX_BODY_BYTES = 16 << 20  # far beyond any prompt a max_model_len admits; stops memory abuse
MAX_N = 128
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


unknown_fields_log = UnknownFieldsLog()


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's constraint object: one of json / regex / choice / grammar / json_object.
    structured_outputs: dict[str, Any] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the API returns it


class MessageToolCall(_Strict):
    """A call an earlier assistant turn made (``messages[i].tool_calls[j]``)."""

    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------------------- parsing
async def read_json_body(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's JSON object; raises ``APIError`` (413 / 400) for anything else."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected from None
    return parse_json_object(b"".join(chunks))


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the request body has {size} bytes or more; the limit is {limit}", code="request_too_large"
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode UTF-8 and JSON strictly; the top level must be an object."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"the request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
            code="invalid_encoding",
        ) from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})",
            code="invalid_json",
        ) from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(
            f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json"
        )
    _check_strings(obj, "")
    return obj


def _check_strings(value: Any, path: str) -> None:
    """Reject strings that cannot be encoded as UTF-8 (JSON escapes of lone surrogates)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                f"{path or 'a string'} contains an unpaired surrogate (not valid Unicode)",
                param=path or None,
                code="invalid_encoding",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, path)
            _check_strings(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{path}[{i}]")


def validate(model: type[BaseModel], obj: dict[str, Any]) -> Any:
    """``model`` validated from ``obj``; a 400 naming the first bad field otherwise."""
    try:
        req = model.model_validate(obj)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param = _loc(errors[0]["loc"])
        details: dict[str, str] = {}
        for err in errors:
            where = _loc(err["loc"]) or "body"
            top = where.split("[", 1)[0].split(".", 1)[0]
            if top in _UNION_HINTS:
                details.setdefault(top, f"must be {_UNION_HINTS[top]}")
            else:
                details.setdefault(where, err["msg"])
        text = "; ".join(f"{where}: {msg}" for where, msg in list(details.items())[:5])
        raise bad_request(f"invalid request: {text}", param=param.split("[", 1)[0] or None) from None
    unknown_fields_log.observe(req.model_extra or {})
    return req


def _loc(loc: tuple) -> str:
    """``('messages', 0, 'content', 'list[ContentPart]', 1, 'type')`` -> ``messages[0].content[1].type``:
    pydantic's union-branch markers are dropped so that the param reads like the API's."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out


# Fields whose type is a union: one plain description beats pydantic's error per branch.
_UNION_HINTS = {
    "prompt": "a string, an array of strings, an array of token ids or an array of token-id arrays",
    "stop": "a string or an array of strings",
}
_UNION_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "dict",
    "none",
    "StreamOptions",
    "ContentPart",
    "ChatMessage",
}


# ---------------------------------------------------------------------------------------------- limits
def check_limits(body: dict[str, Any], limits: RequestLimits, *, is_chat: bool) -> None:
    """400 when a body's ``stop`` strings, ``stop_token_ids`` or prompts x ``n`` exceed ``limits`` (each
    message names the flag). Runs on the parsed JSON before type validation and tokenization, so that
    a hostile request costs no more than its parse; values of the wrong type are left to
    :func:`validate`."""
    stop = body.get("stop")
    stop_strings = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stop_strings) > limits.max_stop_sequences:
        raise bad_request(
            f"stop has {len(stop_strings)} strings; this server allows at most "
            f"{limits.max_stop_sequences} per request (--max-stop-sequences)",
            param="stop",
        )
    longest = max((len(s) for s in stop_strings if isinstance(s, str)), default=0)
    if longest > limits.max_stop_sequence_length:
        raise bad_request(
            f"a stop string has {longest} characters; this server allows at most "
            f"{limits.max_stop_sequence_length} (--max-stop-sequence-length)",
            param="stop",
        )
    stop_ids = body.get("stop_token_ids")
    if isinstance(stop_ids, list) and len(stop_ids) > limits.max_stop_token_ids:
        raise bad_request(
            f"stop_token_ids has {len(stop_ids)} entries; this server allows at most "
            f"{limits.max_stop_token_ids} per request (--max-stop-token-ids)",
            param="stop_token_ids",
        )
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    num_prompts = 1 if is_chat else _num_prompts(body.get("prompt"))
    if num_prompts * n > limits.max_sequences_per_request:
        raise bad_request(
            f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; this "
            f"server allows at most {limits.max_sequences_per_request} per request "
            "(--max-sequences-per-request)",
            param="n" if num_prompts == 1 else "prompt",
        )


def _num_prompts(prompt: Any) -> int:
    """Prompts in a completions ``prompt``: a list of strings or of token-id lists holds several."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


# ---------------------------------------------------------------------------------------------- sampling
# Generation-config keys (Hugging Face) that may set request defaults, and their SamplingParams names.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def check_unsupported(req: _SamplingFields) -> None:
    """Reject OpenAI features this engine does not implement (a silent no-op would mislead)."""
    for name, key in constraints.REMOVED_GUIDED_FIELDS.items():
        if name in (req.model_extra or {}):
            raise bad_request(
                f"{name} was removed in vLLM 0.12 and is not accepted: send "
                f'"structured_outputs": {{"{key}": ...}} instead',
                param=name,
            )
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise not_supported("suffix", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise not_supported("best_of other than n", "best_of")
        if req.echo and req.logprobs is not None:
            raise not_supported("echo together with logprobs (prompt logprobs)", "echo")
    if isinstance(req, ChatCompletionRequest):
        # tools and tool_choice are checked by tool_choice.resolve_tools: what they allow depends on the
        # server's --enable-auto-tool-choice / --tool-call-parser.
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")


def to_sampling_params(
    req: _SamplingFields, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any]
) -> SamplingParams:
    """The engine's ``SamplingParams``; request values win over ``defaults`` (the model's generation
    config). Raises a 400 naming the parameter when a value is out of range."""

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    logit_bias = constraints.logit_bias(req.logit_bias)
    response_format = req.response_format if isinstance(req, ChatCompletionRequest) else None
    structured = constraints.structured_outputs(req.structured_outputs, response_format)
    try:
        return SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=logit_bias,
            structured_outputs=structured,
        )
    except SamplingParamsError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise bad_request(message, param=param if param in type(req).model_fields else None) from None


def default_max_tokens(req: _SamplingFields, defaults: dict[str, Any]) -> int | None:
    """The request's output cap before the context check (None: whatever room the prompt leaves)."""
    if isinstance(req, ChatCompletionRequest):
        value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return value if value is not None else defaults.get("max_tokens")
    if "max_tokens" in req.model_fields_set:
        return req.max_tokens
    return defaults.get("max_tokens", req.max_tokens)


def request_logprobs(req: _SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def max_tokens_param(req: _SamplingFields) -> str:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"
