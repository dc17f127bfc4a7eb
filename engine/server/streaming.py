"""Server-Sent Events for completions and chat completions: the event encoding, the response that
watches for the client's disconnect, and the chunk stream both endpoints share (per-choice deltas,
usage, ``[DONE]``, the engine-death event, the abort of what still runs). An endpoint supplies only the
shape of its choices."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvpilot.engine.errors import EngineDeadError
from kvpilot.engine.request_stream import RequestStream
from kvpilot.engine.server.errors import from_exception
from kvpilot.engine.server.protocol import ChatCompletionRequest, CompletionRequest, request_logprobs
from kvpilot.engine.server.serving import ServerState, choice, usage

SSE_DONE = "data: [DONE]\n\n"


# Characters that many line readers (Python's ``str.splitlines``, hence httpx's ``iter_lines``) take
# as line breaks although SSE does not. JSON escapes the other ones (control characters) itself; these
# three it leaves raw with ``ensure_ascii=False``. They can only stand inside JSON strings, where the
# ``\uXXXX`` escape means the same text.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: dict[str, Any]) -> str:
    """One ``data:`` event: ``payload`` as compact JSON, on one line for every line reader: generated
    text holding U+0085, U+2028 or U+2029 is sent escaped."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    if not data.isascii():
        data = data.translate(_UNICODE_LINE_BREAKS)
    return f"data: {data}\n\n"


async def load_stream_backend() -> None:
    """Load what ``SSEResponse`` first loads lazily: anyio imports its asyncio backend on the first task
    group, some milliseconds of imports holding the interpreter. Left to the first streamed request, they
    run while the engine thread computes that request's first step, which waits for the interpreter: on
    a 2-core box the first streamed request after every start took 12 ms to its first token, the next
    ones 3. Called once at start-up, before the server listens."""
    async with anyio.create_task_group():
        pass


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


@dataclass(frozen=True)
class ChunkShape:
    """What tells one endpoint's chunks apart: their ``object`` and the key of a choice's content."""

    object_type: str  # "text_completion" | "chat.completion.chunk"
    content_key: str  # "text" | "delta"


@dataclass
class ChoiceDelta:
    """What one choice added since its previous chunk."""

    index: int  # the choice's index in the response: prompt index * n + completion index
    text: str  # may be empty (a chunk that carries only logprobs or the finish)
    finish_reason: str | None
    stop_reason: int | str | None  # only with a finish_reason
    token_ids: list[int]  # the new tokens, with their logprob entries below; both empty without logprobs
    logprobs: list[dict[int, float]]


# A choice's (content, logprobs) for one delta, in the endpoint's format. A content of None says the
# delta adds nothing to send yet (text a tool-call parser holds back): unless it carries logprobs or
# the finish, no chunk is sent for it.
ContentFn = Callable[[ChoiceDelta], tuple[Any, Any]]
# The finish_reason a choice reports for its final delta (chat's "tool_calls").
FinishFn = Callable[[ChoiceDelta], str | None]


@dataclass
class ChunkStream:
    """The SSE events of one streaming response to ``req`` over ``rs``.

    Every chunk is ``{"id", "object", "created", "model", "choices": [one choice]}`` plus ``"usage"``
    when the client asked for it (null on each chunk, or the running totals with
    ``continuous_usage_stats``); a final chunk with no choices carries the totals. A choice is
    ``{"index", <content_key>, "logprobs", "finish_reason", "stop_reason"}``. ``request_ids`` are the
    engine requests in prompt order, ``req.n`` completions each.
    """

    state: ServerState
    rs: RequestStream
    req: CompletionRequest | ChatCompletionRequest
    shape: ChunkShape
    request_id: str
    model: str
    request_ids: Sequence[str]
    num_prompt_tokens: int

    async def events(
        self, content: ContentFn, first: Iterable[tuple[int, Any]] = (), finish: FinishFn | None = None
    ) -> AsyncIterator[str]:
        """A chunk per ``(index, content)`` in ``first`` (sent before any output), then one per
        :class:`ChoiceDelta` with what ``content`` makes of it (the finish reason from ``finish`` when
        given); then the usage chunk (when asked for) and ``[DONE]``. If the engine loop dies, an error
        event and ``[DONE]``. However the stream ends (the client may leave), the sequences still
        running are aborted so that their KV blocks are freed at once."""
        created = int(time.time())
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        num_tokens = [0] * (len(self.request_ids) * self.req.n)

        def chunk(choices: list[dict[str, Any]], final: bool = False) -> str:
            payload: dict[str, Any] = {
                "id": self.request_id,
                "object": self.shape.object_type,
                "created": created,
                "model": self.model,
                "choices": choices,
            }
            if include_usage:
                current = final or continuous
                payload["usage"] = usage(self.num_prompt_tokens, sum(num_tokens)) if current else None
            return sse_event(payload)

        key = self.shape.content_key
        try:
            for index, body in first:
                yield chunk([choice(index, key, body)])
            async for d in self._deltas(num_tokens):
                body, logprobs = content(d)
                if body is None:
                    if logprobs is None and d.finish_reason is None:
                        continue
                    body = {}
                reason = d.finish_reason if finish is None or d.finish_reason is None else finish(d)
                yield chunk([choice(d.index, key, body, logprobs, reason, d.stop_reason)])
            if include_usage:
                yield chunk([], final=True)
            yield SSE_DONE
        except EngineDeadError as exc:
            yield sse_event(from_exception(exc, while_running=True).body())
            yield SSE_DONE
        finally:
            if not self.rs.finished:
                self.state.engine.abort(self.rs.unfinished_ids)

    async def _deltas(self, num_tokens: list[int]) -> AsyncIterator[ChoiceDelta]:
        """The choices' news, counting generated tokens into ``num_tokens`` (by choice index)."""
        n = self.req.n
        with_logprobs = request_logprobs(self.req) is not None
        prompt_index = {rid: p for p, rid in enumerate(self.request_ids)}
        done: set[int] = set()
        async for outs in self.rs:
            for out in outs:
                p = prompt_index[out.request_id]
                for comp in out.outputs:
                    i = comp.index
                    index = p * n + i
                    if index in done:
                        continue
                    new_ids = out.delta_token_ids[i]
                    num_tokens[index] += len(new_ids)
                    text = out.delta_text[i]
                    finish = comp.finish_reason
                    if not text and finish is None and (not with_logprobs or not new_ids):
                        continue  # held back (partial character, possible stop string): nothing to say yet
                    # Streamed outputs carry only the delta: these lists are the new tokens' own.
                    has_entries = with_logprobs and comp.logprobs is not None and new_ids
                    ids, entries = (new_ids, comp.logprobs) if has_entries else ([], [])
                    if finish is not None:
                        done.add(index)
                    yield ChoiceDelta(index, text, finish, comp.stop_reason if finish else None, ids, entries)
