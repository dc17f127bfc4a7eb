"""AsyncEngine: one engine loop on a background thread, per-request output streams for asyncio.

The ``LLMEngine`` is not thread-safe, so exactly one thread touches it: the engine thread. The event
loop talks to it through a command queue (add, abort) and gets outputs back through
``loop.call_soon_threadsafe``::

    event loop (HTTP handlers)                     engine thread
    ─────────────────────────                      ─────────────
    add([...]) ──► commands ──────────────────────► apply commands (add_request / abort_request)
      awaits the add's Future ◄─── result/error ──┘   while there is work: step()
    RequestStream.get() ◄── _deliver(outputs) ◄────── publish this step's outputs (one callback)
    abort(ids) ──► commands ──────────────────────► abort_request: KV blocks freed before the next step

Commands are applied between steps, so an abort frees its blocks within one step time. A request that
can never run (``InvalidRequestError`` from the engine) or that finds the waiting queue full
(``QueueFullError``) fails its ``add`` without touching the engine's state. If ``step()`` raises, the
loop is dead: every open stream and every later ``add`` fails with ``EngineDeadError`` and
``is_healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

from kvpilot.engine.errors import ConfigError, EngineDeadError, QueueFullError
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvpilot.engine.async")

# A step that has not returned after this long counts as a hung engine (health turns 503).
DEFAULT_STALL_TIMEOUT_S = 300.0


@dataclass
class PromptInput:
    """One engine request: already tokenized, with validated sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


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
        if old is not None and old.delta_text and out.delta_text:
            out.delta_text = [a + b for a, b in zip(old.delta_text, out.delta_text, strict=True)]
            out.delta_token_ids = [
                a + b for a, b in zip(old.delta_token_ids, out.delta_token_ids, strict=True)
            ]
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


class AsyncEngine:
    """Runs an ``LLMEngine`` on its own thread and serves it to asyncio code.

    ``max_waiting_requests``: when set, an ``add`` that finds at least this many sequences waiting in
    the scheduler fails with ``QueueFullError`` (what ``vllm:num_requests_waiting`` shows).
    Call ``start()`` from the event loop that will consume the streams; ``shutdown()`` stops the thread.
    """

    def __init__(
        self,
        engine,
        *,
        max_waiting_requests: int | None = None,
        retry_after_s: int = 1,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ConfigError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.retry_after_s = retry_after_s
        self.stall_timeout_s = stall_timeout_s
        self.dead_error: BaseException | None = None
        self._cv = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side; the engine thread keeps no request state of its own (the engine does).
        self._streams: dict[str, RequestStream] = {}
        self._step_started_at: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after its current step; open streams fail with ``EngineDeadError``."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread runs, has not died, and no step has hung."""
        if self.dead_error is not None or self._thread is None or not self._thread.is_alive():
            return False
        if self._engine_error() is not None:
            return False
        started = self._step_started_at
        return started is None or time.monotonic() - started < self.stall_timeout_s

    @property
    def health_detail(self) -> str:
        if self.dead_error is not None:
            return f"the engine loop died: {type(self.dead_error).__name__}: {self.dead_error}"
        error = self._engine_error()
        if error is not None:
            return f"the engine is unusable: {type(error).__name__}: {error}"
        if self._thread is None:
            return "the engine loop has not started"
        if not self._thread.is_alive():
            return "the engine loop has stopped"
        started = self._step_started_at
        if started is not None and time.monotonic() - started >= self.stall_timeout_s:
            return f"an engine step has not returned for {time.monotonic() - started:.0f} s"
        return "ok"

    def _engine_error(self) -> BaseException | None:
        """What makes the engine unusable even while its loop idles (e.g. a dead parallel worker)."""
        check = getattr(self.engine, "check_health", None)
        if check is None:
            return None
        try:
            check()
        except Exception as exc:
            return exc
        return None

    # ------------------------------------------------------------------ requests (event loop)
    async def add(self, inputs: Sequence[PromptInput], stream: bool) -> RequestStream:
        """Queue the requests (all or none) and return their stream.

        Raises ``InvalidRequestError`` for a request the engine can never run, ``QueueFullError`` when the
        waiting queue is full, ``EngineDeadError`` when the loop is dead.
        """
        ids = [inp.request_id for inp in inputs]
        rs = RequestStream(ids)
        for rid in ids:
            self._streams[rid] = rs
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(("add", list(inputs), stream, fut))
            await asyncio.wrap_future(fut)
        except BaseException as exc:
            for rid in ids:
                self._streams.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError) and not fut.cancelled():
                self.abort(ids)  # cancelled while the engine thread was already adding them
            raise
        return rs

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed before the next
        step. Call from the event loop."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._streams.pop(rid, None)
        if ids and self.dead_error is None:
            try:
                self._submit(("abort", ids))
            except EngineDeadError:
                pass

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """Run one request; yield its outputs (every step for ``stream``, else only the final one).
        Leaving the iteration early aborts the request."""
        rs = await self.add([PromptInput(request_id, prompt_token_ids, params, time.monotonic())], stream)
        try:
            async for outs in rs:
                for out in outs:
                    yield out
        finally:
            if not rs.finished:
                self.abort(request_id)

    def _submit(self, command: tuple) -> None:
        with self._cv:
            if self.dead_error is not None:
                raise EngineDeadError(self.health_detail)
            if self._stopping or self._thread is None:
                raise EngineDeadError("the engine loop is not running")
            self._commands.append(command)
            self._cv.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            rs = self._streams.get(out.request_id)
            if rs is None:
                continue  # aborted by its consumer
            rs._put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        streams = set(self._streams.values())
        self._streams.clear()
        for rs in streams:
            rs._fail(exc)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                if commands:
                    self._apply(commands)
                if not engine.has_unfinished_requests():
                    continue
                num_steps = engine.num_steps
                self._step_started_at = time.monotonic()
                outputs = engine.step()
                self._step_started_at = None
                if outputs:
                    self._publish(self._deliver, outputs)
                if engine.num_steps == num_steps:
                    # Nothing was schedulable this time: wait for a command instead of spinning.
                    with self._cv:
                        if not self._commands and not self._stopping:
                            self._cv.wait(0.005)
        except BaseException as exc:  # any failure of the loop is fatal: report it, never hang
            self._die(exc)
            return
        self._die(EngineDeadError("the engine loop was shut down"), log=False)

    def _apply(self, commands: list[tuple]) -> None:
        num_aborted = 0
        for command in commands:
            if command[0] == "add":
                _, inputs, stream, fut = command
                if fut.set_running_or_notify_cancel():
                    self._apply_add(inputs, stream, fut)
            else:
                # Ids that finished (or never got in) meanwhile are ignored by the engine.
                num_aborted += self.engine.abort_request(command[1])
        # Gauges must reflect adds and aborts even when no step follows (an idle engine after an abort).
        stats = self.engine.stats()
        for stat_logger in self.engine.stat_loggers:
            observe = getattr(stat_logger, "observe_scheduler_stats", None)
            if observe is not None:
                observe(stats)
            if num_aborted:
                observe_aborted = getattr(stat_logger, "observe_aborted", None)
                if observe_aborted is not None:
                    observe_aborted(num_aborted)

    def _apply_add(self, inputs: list[PromptInput], stream: bool, fut: concurrent.futures.Future) -> None:
        engine = self.engine
        added: list[str] = []
        try:
            if self.max_waiting_requests is not None:
                num_waiting = engine.stats().num_waiting
                if num_waiting >= self.max_waiting_requests:
                    raise QueueFullError(num_waiting, self.max_waiting_requests, self.retry_after_s)
            for inp in inputs:
                engine.add_request(
                    inp.request_id,
                    inp.prompt_token_ids,
                    inp.params,
                    stream=stream,
                    arrival_time=inp.arrival_time,
                )
                added.append(inp.request_id)
        except Exception as exc:
            if added:
                engine.abort_request(added)
            fut.set_exception(exc)
        else:
            fut.set_result(None)

    def _publish(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed between the check and the call (process shutting down)

    def _die(self, exc: BaseException, log: bool = True) -> None:
        if log:
            logger.error("the engine loop died; the server reports unhealthy from now on", exc_info=exc)
        with self._cv:
            self.dead_error = exc if log else None
            self._stopping = True
            pending, self._commands = self._commands, []
        error = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}" if log else str(exc))
        for command in pending:
            if command[0] == "add" and command[3].set_running_or_notify_cancel():
                command[3].set_exception(error)
        self._publish(self._fail_all, error)
