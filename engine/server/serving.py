"""What completions and chat completions share: server state, prompt checks, submission to the engine,
waiting with disconnect detection, usage and logprobs formatting, Server-Sent Events."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvpilot.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    PromptInput,
    QueueFullError,
    RequestStream,
)
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.errors import SERVER_ERROR, APIError, ClientDisconnected, bad_request, error_body

logger = logging.getLogger("kvpilot.server")

# Prompts longer than this many characters are tokenized on a worker thread, not on the event loop.
_INLINE_TOKENIZE_CHARS = 8192
# A logprob of -inf is not JSON; report this floor instead (as vLLM does).
_MIN_LOGPROB = -9999.0


@dataclass
class ServerState:
    """Everything the request handlers need; one per server process."""

    engine: AsyncEngine
    tokenizer: Any  # the server's own tokenizer instance (the engine thread uses the engine's)
    served_model_names: list[str]
    model_dir: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    metrics: Any = None  # PrometheusStatLogger
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict, repr=False)

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
            token.strip().encode(), self.api_key.encode()
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


# ---------------------------------------------------------------------------------------------- prompts
def check_context(
    state: ServerState, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str, max_param: str
) -> None:
    """400 for an empty prompt, or one that with ``max_tokens`` does not fit ``max_model_len``."""
    limit = state.max_model_len
    if num_prompt_tokens == 0:
        raise bad_request(f"the {prompt_param} is empty: at least one token is required", param=prompt_param)
    if num_prompt_tokens >= limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens, leaving no room for output. Please reduce the length of the "
            f"{prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, "
            f"{max_tokens} in the completion). Please reduce the length of the {prompt_param} or "
            f"{max_param}.",
            param=max_param,
            code="context_length_exceeded",
        )


def check_sampling(state: ServerState, params: SamplingParams) -> None:
    """400 for token ids outside the model's vocabulary (they would index past the logits)."""
    bad = [t for t in params.stop_token_ids if t >= state.vocab_size]
    if bad:
        raise bad_request(
            f"stop_token_ids must be below the vocabulary size {state.vocab_size}; got {bad[:5]}",
            param="stop_token_ids",
        )


async def submit(state: ServerState, inputs: list[PromptInput], stream: bool) -> RequestStream:
    """Queue the requests; map the engine's refusals to HTTP errors."""
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
    except QueueFullError as exc:
        raise APIError(
            503, str(exc), code="server_overloaded", headers={"Retry-After": str(exc.retry_after_s)}
        ) from None
    except EngineDeadError as exc:
        raise APIError(503, f"the engine is not running: {exc}", code="engine_dead") from None
    except ValueError as exc:  # the engine's own checks (vocabulary, KV pool size, ...)
        raise bad_request(str(exc), param="prompt") from None


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
        raise APIError(
            503, f"the engine loop died while the request ran: {exc}", code="engine_dead"
        ) from None
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


def delta_logprobs(out: RequestOutput, i: int, num_new: int) -> tuple[list[int], list[dict[int, float]]]:
    """The token ids and logprob entries of completion ``i``'s newest ``num_new`` tokens."""
    comp = out.outputs[i]
    if comp.logprobs is None or num_new == 0:
        return [], []
    return comp.token_ids[-num_new:], comp.logprobs[-num_new:]


# ---------------------------------------------------------------------------------------------- SSE
def sse_event(payload: dict[str, Any] | str) -> str:
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(Response):
    """A ``text/event-stream`` response that watches for the client's disconnect while it streams, so
    that a client that leaves — even while its request is still queued and nothing is being sent —
    cancels the event iterator at once (whose ``finally`` aborts the engine requests)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        self.init_headers({**base, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream(cancel: Callable[[], None]) -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            cancel()

        async def watch(cancel: Callable[[], None]) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, tg.cancel_scope.cancel)
                tg.start_soon(watch, tg.cancel_scope.cancel)
        except OSError:
            pass  # the connection broke mid-send: same as a disconnect
        finally:
            aclose: Callable[[], Awaitable[None]] | None = getattr(self.events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def guarded_stream(
    state: ServerState,
    rs: RequestStream,
    body: AsyncIterator[str],
    usage_chunk: Callable[[], str | None],
) -> AsyncIterator[str]:
    """Frame an SSE stream: ``body``'s events, then the usage chunk (when asked for) and ``[DONE]``; an
    error event if the engine loop dies; and, however the stream ends (the client may leave), an abort
    of the sequences still running so that their KV blocks are freed at once."""
    try:
        async for event in body:
            yield event
        final = usage_chunk()
        if final is not None:
            yield final
        yield SSE_DONE
    except EngineDeadError as exc:
        yield sse_event(
            error_body(f"the engine loop died while the request ran: {exc}", SERVER_ERROR, code="engine_dead")
        )
        yield SSE_DONE
    finally:
        if not rs.finished:
            state.engine.abort(rs.unfinished_ids)
