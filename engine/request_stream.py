"""The event-loop side of one API call's engine requests: ``RequestStream`` (lives on the event loop,
fed by ``AsyncEngine``) and how two streamed outputs of one request merge when the consumer lags."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvpilot.engine.outputs import RequestOutput


class RequestStream:
    """The outputs of the engine requests behind one API call (several prompts share one stream).

    Lives on the event loop. For streaming requests, outputs that arrive faster than the consumer reads
    them are merged (their deltas concatenated), so a slow client holds one pending output per request,
    never a backlog.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self._unfinished = set(self.request_ids)
        self._pending: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        """True once every request has delivered its final output (and it was read)."""
        return not self._unfinished and not self._pending

    @property
    def unfinished_ids(self) -> list[str]:
        return [rid for rid in self.request_ids if rid in self._unfinished]

    def _put(self, out: RequestOutput) -> None:
        old = self._pending.get(out.request_id)
        if old is not None:
            out = merge_deltas(old, out)
        self._pending[out.request_id] = out
        if out.finished:
            self._unfinished.discard(out.request_id)
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    async def get(self) -> list[RequestOutput]:
        """Wait for news; return the outputs that changed since the last call, in request order.

        Raises ``EngineDeadError`` if the engine loop died, ``StopAsyncIteration`` once finished.
        """
        while not self._pending:
            if self._error is not None:
                raise self._error
            if not self._unfinished:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
        outs = [self._pending.pop(rid) for rid in self.request_ids if rid in self._pending]
        return outs

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        return await self.get()

    async def collect(self) -> dict[str, RequestOutput]:
        """Wait until every request finished; return the final outputs by request id."""
        final: dict[str, RequestOutput] = {}
        async for outs in self:
            for out in outs:
                if out.finished:
                    final[out.request_id] = out
        return final


def merge_deltas(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two consecutive streamed outputs of one request as one: ``old``'s deltas extended in place by
    ``new``'s (O(size of ``new``)), with ``new``'s state (finish reasons, cumulative logprobs, metrics)."""
    for a, b in zip(old.outputs, new.outputs, strict=True):
        a.text += b.text
        a.token_ids.extend(b.token_ids)
        if a.logprobs is not None and b.logprobs is not None:
            a.logprobs.extend(b.logprobs)
        a.cumulative_logprob = b.cumulative_logprob
        a.finish_reason = b.finish_reason
        a.stop_reason = b.stop_reason
    old.delta_text = [a.text for a in old.outputs]
    old.delta_token_ids = [a.token_ids for a in old.outputs]
    old.finished = new.finished
    old.metrics = new.metrics
    old.num_cached_tokens = new.num_cached_tokens
    return old
