"""AsyncEngine: one engine loop on a background thread, per-request output streams for asyncio.

The ``LLMEngine`` is not thread-safe, so exactly one thread touches it: the engine thread. The event
loop talks to it through one queue of typed commands (``AddRequests``, ``AbortRequests``,
``Reconfigure``: values, each with a future for its reply where it has one) and gets outputs back through
``loop.call_soon_threadsafe``::

    event loop (HTTP handlers)                     engine thread
    ─────────────────────────                      ─────────────
    add([...]) ──► commands ──────────────────────► apply commands (check + queue all / abort)
      awaits the add's Future ◄─── result/error ──┘   while there is work: step()
    RequestStream.get() ◄── _deliver(outputs) ◄────── publish this step's outputs (one callback)
    abort(ids) ──► commands ──────────────────────► abort_request: KV blocks freed before the next step

Commands are applied between steps, so an abort frees its blocks within one step time. A request that
can never run (``InvalidRequestError`` from the engine) or that finds the waiting queue full
(``QueueFullError``: admission counts sequences, prompts x ``n``) fails its ``add`` without touching
the engine's state. If ``step()`` or applying a command raises, the loop is dead: every open stream,
every ``add`` still pending (queued or half applied) and every later one fails with ``EngineDeadError``
and ``is_healthy`` turns False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence

from kvpilot.engine.engine_commands import (
    AbortRequests,
    AddRequests,
    EngineCommand,
    PromptInput,
    Reconfigure,
    SteppedEngine,
)
from kvpilot.engine.errors import ConfigError, EngineDeadError, InvalidRequestError, QueueFullError
from kvpilot.engine.input_processor import NewRequest
from kvpilot.engine.live_config import LiveConfig, LiveLimits, apply_update
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.request_stream import RequestStream
from kvpilot.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "PromptInput", "RequestStream"]

logger = logging.getLogger("kvpilot.engine.async")

# A step that has not returned after this long counts as a hung engine (health turns 503).
DEFAULT_STALL_TIMEOUT_S = 300.0


class AsyncEngine:
    """Runs an ``LLMEngine`` on its own thread and serves it to asyncio code.

    ``max_waiting_requests``: when set, an ``add`` whose sequences (prompts x ``n``) would bring the
    sequences waiting in the scheduler (what ``vllm:num_requests_waiting`` shows) above this many
    fails whole with ``QueueFullError``.
    Call ``start()`` from the event loop that will consume the streams; ``shutdown()`` stops the thread.
    """

    def __init__(
        self,
        engine: SteppedEngine,
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
        self._commands: list[EngineCommand] = []
        # The commands the engine thread took and is applying: failed too if the loop dies midway.
        self._applying: list[EngineCommand] = []
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
        try:
            self.engine.check_health()
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
            self._submit(AddRequests(tuple(inputs), stream, fut))
            await asyncio.wrap_future(fut)
        except BaseException as exc:
            for rid in ids:
                self._streams.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError) and not fut.cancelled():
                self.abort(ids)  # cancelled while the engine thread was already adding them
            raise
        return rs

    def live_config(self) -> LiveConfig:
        """The run-time settings in force (``live_config``): the scheduler's bounds and preemption mode,
        and the admission bound."""
        config = self.engine.scheduler.config
        return LiveConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting_requests=self.max_waiting_requests,
            preemption_mode=config.preemption_mode,
        )

    def live_limits(self) -> LiveLimits:
        """What a run-time change must stay within: the values the engine started with."""
        engine = self.engine
        return LiveLimits(
            max_num_seqs=engine.engine_config.scheduler.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
            enable_chunked_prefill=engine.engine_config.scheduler.enable_chunked_prefill,
            num_cpu_blocks=engine.num_cpu_blocks,
        )

    async def reconfigure(self, update: object) -> LiveConfig:
        """Apply ``update`` (see ``live_config.apply_update``) between two steps, all of it or none of
        it; returns the settings in force afterwards. Raises ``ConfigError`` for an invalid update and
        ``EngineDeadError`` when the loop is dead."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(Reconfigure(update, fut))
        return await asyncio.wrap_future(fut)

    def reconfigure_before_start(self, update: object) -> LiveConfig:
        """``reconfigure`` from the calling thread, before ``start()`` (the settings a pod starts with);
        raises ``ConfigError`` for an invalid update, ``RuntimeError`` once the loop runs."""
        if self._thread is not None:
            raise RuntimeError("the engine loop has started: use reconfigure()")
        return self._reconfigure(update)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed before the next
        step. Call from the event loop."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._streams.pop(rid, None)
        if ids and self.dead_error is None:
            try:
                self._submit(AbortRequests(tuple(ids)))
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

    def _submit(self, command: EngineCommand) -> None:
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
                    self._applying = commands
                    self._apply(commands)
                    self._applying = []
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

    def _apply(self, commands: list[EngineCommand]) -> None:
        num_aborted = 0
        for command in commands:
            match command:
                case AddRequests(inputs, stream, reply):
                    if reply.set_running_or_notify_cancel():
                        self._apply_add(inputs, stream, reply)
                case Reconfigure(update, reply):
                    if reply.set_running_or_notify_cancel():
                        self._apply_config(update, reply)
                case AbortRequests(request_ids):
                    # Ids that finished (or never got in) meanwhile are ignored by the engine.
                    num_aborted += self.engine.abort_request(list(request_ids))
                case _:
                    raise TypeError(f"unknown engine command {command!r}")
        # Gauges must reflect adds and aborts even when no step follows (an idle engine after an abort).
        stats = self.engine.stats()
        for stat_logger in self.engine.stat_loggers:
            stat_logger.record(stats, None)
            if num_aborted:
                stat_logger.record_aborted(num_aborted)

    def _apply_config(self, update: object, fut: concurrent.futures.Future) -> None:
        try:
            new = self._reconfigure(update)
        except ConfigError as exc:
            fut.set_exception(exc)
            return
        fut.set_result(new)

    def _reconfigure(self, update: object) -> LiveConfig:
        """The one place run-time settings change: validated whole against the start-up limits
        (``ConfigError``, nothing changed), then applied to the scheduler and the admission bound, and
        shown to the stat loggers. On the engine thread, or before it starts."""
        new = apply_update(self.live_config(), update, self.live_limits())
        self.engine.scheduler.reconfigure(new.max_num_seqs, new.max_num_batched_tokens, new.preemption_mode)
        self.max_waiting_requests = new.max_waiting_requests
        for stat_logger in self.engine.stat_loggers:
            stat_logger.record_live_config(new)
        logger.info("run-time settings now %s", new.as_dict())
        return new

    def _apply_add(self, inputs: Sequence[PromptInput], stream: bool, fut: concurrent.futures.Future) -> None:
        """All or none: every input is checked before admission (a request that can never run is
        refused as such, whatever the queue), and none is queued unless all are admitted."""
        engine = self.engine
        added: list[str] = []
        try:
            checked: list[NewRequest] = []
            ids: set[str] = set()  # user and sequence ids of this call
            for inp in inputs:
                if inp.request_id in ids:
                    raise InvalidRequestError(f"duplicate request id {inp.request_id!r}", param=None)
                new = engine.check_request(
                    inp.request_id, inp.prompt_token_ids, inp.params, inp.arrival_time, inp.context
                )
                engine.input_processor.check_sequence_ids_free(new.seqs, ids)
                ids.add(inp.request_id)
                ids.update(seq.req_id for seq in new.seqs)
                checked.append(new)
            if self.max_waiting_requests is not None:
                # Admission counts sequences: one call of P prompts x n queues P * n of them.
                num_waiting = engine.stats().num_waiting
                num_new = sum(len(new.seqs) for new in checked)
                if num_waiting + num_new > self.max_waiting_requests:
                    raise QueueFullError(
                        num_waiting, self.max_waiting_requests, self.retry_after_s, num_new=num_new
                    )
            for new in checked:
                engine.queue_request(new, stream)
                added.append(new.request_id)
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

    def _count_errored(self) -> None:
        """The loop died with sequences in flight: they end with ``finished_reason="error"``."""
        try:
            num_seqs = len(self.engine.output_processor.live_sequence_ids)
            for stat_logger in self.engine.stat_loggers:
                stat_logger.record_errored(num_seqs)
        except Exception:  # the failure may have left the engine half updated: never fail the shutdown
            logger.warning("could not count the failed sequences in the metrics", exc_info=True)

    def _die(self, exc: BaseException, log: bool = True) -> None:
        if log:
            logger.error("the engine loop died; the server reports unhealthy from now on", exc_info=exc)
        with self._cv:
            self.dead_error = exc if log else None
            self._stopping = True
            pending, self._commands = self._commands, []
        pending = self._applying + pending
        self._applying = []
        error = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}" if log else str(exc))
        if log:
            self._count_errored()
        for command in pending:
            if isinstance(command, AddRequests | Reconfigure):
                # Whether it was still queued or half applied when the loop died, its caller gets the error.
                try:
                    command.reply.set_exception(error)
                except concurrent.futures.InvalidStateError:
                    pass  # resolved already, or cancelled by its caller
        self._publish(self._fail_all, error)
