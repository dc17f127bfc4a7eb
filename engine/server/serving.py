"""What completions and chat completions share: server state, prompt checks, submission to the engine,
waiting with disconnect detection, usage and logprobs formatting (the streaming side is in
``streaming``)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvpilot.engine.async_engine import AsyncEngine, PromptInput, RequestStream
from kvpilot.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.server.errors import APIError, ClientDisconnected, from_exception
from kvpilot.engine.server.intake import Intakes
from kvpilot.engine.server.limits import RequestLimits
from kvpilot.engine.server.startup_inputs import normalize_api_key

logger = logging.getLogger("kvpilot.server")

# Prompts longer than this many characters are tokenized on a worker thread, not on the event loop.
_INLINE_TOKENIZE_CHARS = 8192
# A logprob of -inf is not JSON; report this floor instead (as vLLM does).
_MIN_LOGPROB = -9999.0


@dataclass
class ServerState:
    """Everything the request handlers need; one per server process.

    ``api_key``: None serves unauthenticated; otherwise the key with surrounding whitespace removed (a
    key file ending in a newline works), and a key that is empty after that is a ``ConfigError``.
    """

    engine: AsyncEngine
    tokenizer: Any  # the server's own tokenizer instance (the engine thread uses the engine's)
    served_model_names: list[str]
    model_dir: str
    max_model_len: int
    api_key: str | None = None
    metrics: Any = None  # PrometheusStatLogger
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    tool_call_parser: str | None = None  # --tool-call-parser: a key of tool_parsers.PARSERS
    limits: RequestLimits = field(default_factory=RequestLimits)
    created: int = field(default_factory=lambda: int(time.time()))
    intakes: Intakes = field(default_factory=Intakes, repr=False)
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            self.api_key = normalize_api_key(self.api_key, "api_key")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, requested: str | None) -> str:
        """The name to report; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.model_name
        if requested not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{requested}` does not exist. This server serves: "
                f"{', '.join(self.served_model_names)}.",
                param="model",
                code="model_not_found",
            )
        return requested

    def check_api_key(self, authorization: str | None) -> APIError | None:
        """None when the request may pass; the 401 otherwise."""
        if self.api_key is None:
            return None
        headers = {"WWW-Authenticate": "Bearer"}
        if not authorization:
            return APIError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers=headers,
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), self.api_key.encode("utf-8", "surrogateescape")
        ):
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key", headers=headers)
        return None

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize like the offline engine does (``tokenizer.encode``)."""
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def submit(
    state: ServerState, inputs: list[PromptInput], stream: bool, request: Request | None = None
) -> RequestStream:
    """Queue the requests; the engine's refusals (its typed errors) become HTTP errors. Any other
    exception propagates: the application answers it with a logged 500. With ``request``, its intake
    ends here, at the hand-off (``kvpilot_engine_request_intake_seconds``)."""
    intake = getattr(request.state, "intake", None) if request is not None else None
    if intake is not None:
        seconds = state.intakes.end(intake)
        if seconds is not None and state.metrics is not None:
            state.metrics.record_intake(seconds)
    if logger.isEnabledFor(logging.DEBUG):
        first = inputs[0]
        logger.debug(
            "request %s: %d prompt(s), prompt tokens %s, stream %s, %s",
            first.request_id,
            len(inputs),
            [len(i.prompt_token_ids) for i in inputs],
            stream,
            first.params,
        )
    try:
        return await state.engine.add(inputs, stream)
    except (InvalidRequestError, QueueFullError, EngineDeadError) as exc:
        raise from_exception(exc) from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_final(state: ServerState, rs: RequestStream, request: Request) -> dict[str, RequestOutput]:
    """Wait for every final output; abort the requests at once if the client disconnects first."""
    collect = asyncio.ensure_future(rs.collect())
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if collect in done:
            return collect.result()
        raise ClientDisconnected
    except EngineDeadError as exc:
        raise from_exception(exc, while_running=True) from None
    finally:
        watch.cancel()
        if not collect.done():
            collect.cancel()
        if not rs.finished:
            state.engine.abort(rs.unfinished_ids)


# ---------------------------------------------------------------------------------------------- outputs
def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def choice(
    index: int,
    content_key: str,
    content: Any,
    logprobs: Any = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    """One choice: ``{"index", <content_key>, "logprobs", "finish_reason", "stop_reason"}`` (the content
    key is "text", "message" or "delta")."""
    return {
        "index": index,
        content_key: content,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def whole_response(
    request_id: str,
    object_type: str,
    model: str,
    choices: list[dict[str, Any]],
    num_prompt_tokens: int,
    num_completion_tokens: int,
) -> JSONResponse:
    """A response that is not streamed: ``choices`` in OpenAI's envelope, with the usage."""
    return JSONResponse(
        {
            "id": request_id,
            "object": object_type,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(num_prompt_tokens, num_completion_tokens),
            "system_fingerprint": None,
        }
    )


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def completion_logprobs(
    state: ServerState, token_ids: list[int], entries: list[dict[int, float]], text_offset: int
) -> dict[str, Any]:
    """Legacy completions logprobs: ``tokens``, ``token_logprobs``, ``top_logprobs`` (the sampled token
    and the top-k alternatives), ``text_offset``."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries, strict=False):
        text = state.token_text(tid)
        tokens.append(text)
        token_logprobs.append(_lp(entry.get(tid, next(iter(entry.values())))))
        top.append({state.token_text(t): _lp(v) for t, v in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(
    state: ServerState, token_ids: list[int], entries: list[dict[int, float]], top_k: int
) -> list[dict[str, Any]]:
    """Chat logprobs ``content`` items: token, logprob, bytes and the ``top_k`` most likely tokens."""

    def item(tid: int, value: float) -> dict[str, Any]:
        text = state.token_text(tid)
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
        content.append(
            {
                **item(tid, entry.get(tid, next(iter(entry.values())))),
                "top_logprobs": [item(t, v) for t, v in top],
            }
        )
    return content
