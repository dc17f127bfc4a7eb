"""``MultiProcExecutor``: rank 0 in the driver (the engine's process, which keeps the scheduler and the
block manager) and one spawned worker process per other rank::

    driver (rank 0)                                   worker (rank r)
    ───────────────                                   ───────────────
    spawn ──────────────────────────────────────────► import torch ──► ("ready", pid)
    join the process groups  ◄──── TCPStore on 127.0.0.1 ────►  join the process groups
    load / plan / allocate ──► pipe ──► the same on every rank ──► ("ok", report | plan | None)
    each step: pickled SchedulerOutput ──► pipe ──► prepare inputs, forward over the shard
       all ranks: all-reduce in the TP group, send/recv between stages, gather logits to the sampler
       the sampler (rank 0, or tp rank 0 of the last stage) samples ──► ("ok", ModelRunnerOutput)

Every rank holds the same number of KV blocks (the fewest any rank can fit), so the driver's block
manager and slot mappings are valid everywhere.

Failure is fatal and fast: a worker that raises reports its exception and exits; a worker that dies
is seen at once (the collectives' sockets close; a watchdog thread waits on the worker processes'
sentinels). The step in flight, and every later call, raises ``WorkerDiedError`` naming the rank, its
pid and how it ended; the remaining workers are stopped. Nothing waits without a bound: collectives time
out (engine argument ``distributed_timeout_s``) and replies are awaited together with the worker's
process sentinel.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
import weakref
from multiprocessing import connection

import torch
import torch.multiprocessing as mp

from kvpilot.engine.errors import WorkerDiedError
from kvpilot.engine.memory import format_bytes
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.parallel.comm import CommSpec, serve_store
from kvpilot.engine.parallel.executor import Executor, ExecutorSpec
from kvpilot.engine.parallel.rank import Rank, RankReport, RankSpec
from kvpilot.engine.parallel.supervision import (
    DIAGNOSE_GRACE_S,
    SHUTDOWN_WAIT_S,
    RemoteTraceback,
    WorkerHandle,
    WorkerRaised,
    how_ended,
    reap,
    watchdog,
)
from kvpilot.engine.parallel.worker import encode, worker_main
from kvpilot.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("kvpilot.engine.parallel")


class MultiProcExecutor(Executor):
    """Rank 0 in this process, one spawned worker per other rank (see the module doc)."""

    def __init__(self, spec: ExecutorSpec) -> None:
        layout = spec.layout
        self.layout = layout
        self.backend_name = "nccl" if spec.device.type == "cuda" else "gloo"
        self._workers: list[WorkerHandle] = []
        self._dead: WorkerDiedError | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._conn_lock = threading.Lock()
        self._num_steps = 0
        # Bytes of the step messages sent to the workers (every worker's copy counted): what a step
        # costs on the pipes, read by benchmarks/parallel.py.
        self.step_bytes_sent = 0
        self.num_step_messages = 0
        self._saved_threads: int | None = None
        self.num_threads = torch.get_num_threads()
        if spec.device.type == "cpu":
            # One process per rank shares the cores: split the threads instead of oversubscribing.
            self.num_threads = max(1, torch.get_num_threads() // layout.world_size)
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self.num_threads)
            if layout.world_size > (os.cpu_count() or 1):
                logger.warning(
                    "%d ranks on %d CPU cores: the ranks share cores and will run slowly",
                    layout.world_size,
                    os.cpu_count(),
                )
        timeout_s = spec.config.distributed_timeout_s
        store = serve_store(layout.world_size, timeout_s)
        rank_spec = spec.rank_spec(CommSpec(store.port, layout.world_size, self.backend_name, timeout_s))
        ctx = mp.get_context("spawn")
        self._stop_r, self._stop_w = os.pipe()
        self._watching = False
        processes: list[mp.Process] = []
        conns: list[connection.Connection] = []
        # Kills and reaps the workers if this executor is dropped without shutdown() (and at exit).
        self._finalizer = weakref.finalize(self, reap, processes, conns)
        try:
            for rank in range(1, layout.world_size):
                parent_conn, child_conn = ctx.Pipe()
                process = ctx.Process(
                    target=worker_main,
                    args=(rank_spec, rank, self.num_threads, os.getpid(), child_conn),
                    name=f"kvpilot-rank{rank}",
                    daemon=True,
                )
                conns.append(parent_conn)
                process.start()
                processes.append(process)
                child_conn.close()
                self._workers.append(WorkerHandle(rank, process, parent_conn))
            for w in self._workers:
                self._recv(w)  # ("ready", pid): imports done; a crash on start-up is seen here
            self.rank = self._join(rank_spec, store)
            self._send_all(encode(("load",)))
            self.reports: list[RankReport] = [self.rank.load()] + [self._recv(w) for w in self._workers]
            self._send_all(encode(("plan",)))
            plans = [(self.rank.plan_kv(), self.rank.num_cpu_blocks())]
            plans += [self._recv(w) for w in self._workers]
            num_blocks = min(plan.num_blocks for plan, _ in plans)
            self.num_cpu_blocks = min(num_cpu for _, num_cpu in plans)
            self._send_all(encode(("allocate", num_blocks, self.num_cpu_blocks)))
            self.rank.allocate(num_blocks, self.num_cpu_blocks)
            for w in self._workers:
                self._recv(w)
        except WorkerRaised as exc:
            self.shutdown()
            raise exc.error from exc.error.__cause__  # the worker's own exception, its traceback the cause
        except BaseException:
            self.shutdown()
            raise
        self.rank_plans = [plan for plan, _ in plans]
        self.kv_plan = dataclasses.replace(self.rank_plans[0], num_blocks=num_blocks)
        self.runner = self.rank.runner
        self._sampler = next((w for w in self._workers if w.rank == layout.sampler_rank), None)
        threading.Thread(
            target=watchdog,
            args=(
                weakref.WeakMethod(self._on_worker_exit),
                [w.process.sentinel for w in self._workers],
                self._stop_r,
            ),
            name="kvpilot-worker-watchdog",
            daemon=True,
        ).start()
        self._watching = True
        self._log_layout()

    def _join(self, rank_spec: RankSpec, store) -> Rank:
        """Rank 0, once every rank has joined the process groups. Joining blocks until all ranks are in
        (or the store times out), so it runs on a helper thread while this one watches the workers."""
        result: dict[str, object] = {}

        def join() -> None:
            try:
                result["rank"] = Rank(rank_spec, 0, store)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=join, name="kvpilot-rank0-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            for w in self._workers:
                if not w.process.is_alive():
                    error = self._gone_error(w)
                    # A start-up failure raises the worker's own exception (e.g. a checkpoint error).
                    raise error.__cause__ if error.__cause__ is not None else error
        if "error" in result:
            raise result["error"]
        return result["rank"]

    # ------------------------------------------------------------------ steps
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        try:
            self._broadcast_step("execute", sched_out)
            out = self.rank.execute(sched_out)
            if self._sampler is not None:
                out = self._recv(self._sampler)
        except BaseException as exc:
            error = self._fail(exc)
            if not isinstance(exc, Exception):
                raise  # an interrupt stays an interrupt (the executor is dead all the same)
            raise error from (error.__cause__ or exc)  # the worker's own exception, if it raised one
        self._num_steps += 1
        return out

    def apply_block_ops(self, sched_out: SchedulerOutput) -> None:
        self.check_health()
        try:
            self._broadcast_step("block_ops", sched_out)
            self.rank.apply_block_ops(sched_out)
        except BaseException as exc:
            error = self._fail(exc)
            if not isinstance(exc, Exception):
                raise
            raise error from (error.__cause__ or exc)

    def check_health(self) -> None:
        if self._dead is not None:
            self.shutdown()
            # A fresh exception each time: re-raising one object would grow its traceback on every
            # health probe.
            error = WorkerDiedError(str(self._dead))
            error.__cause__ = self._dead.__cause__
            raise error
        if self._closed:
            raise RuntimeError("the engine was shut down")

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            os.write(self._stop_w, b"x")  # ends the watchdog
        except OSError:
            pass
        if self._dead is None:
            for w in self._workers:
                try:
                    w.conn.send_bytes(encode(("shutdown",)))
                except OSError:
                    pass
            deadline = time.monotonic() + SHUTDOWN_WAIT_S
            for w in self._workers:
                w.process.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # kills what did not exit, reaps, closes the pipes
        # The watchdog closes the read end; close it here only if the watchdog never started.
        for fd in (self._stop_w,) if self._watching else (self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, rank 1 first."""
        return [w.process.pid for w in self._workers]

    # ------------------------------------------------------------------ plumbing
    def _send_all(self, payload: bytes) -> None:
        for w in self._workers:
            w.conn.send_bytes(payload)

    def _broadcast_step(self, command: str, sched_out: SchedulerOutput) -> None:
        full = slim = None
        for w in self._workers:
            if w is self._sampler:
                full = full or encode((command, sched_out))
                payload = full
            else:
                slim = slim or encode((command, _without_sampling_inputs(sched_out)))
                payload = slim
            w.conn.send_bytes(payload)
            self.step_bytes_sent += len(payload)
        if self._workers:
            self.num_step_messages += 1

    def _read(self, w: WorkerHandle) -> tuple | None:
        """One message of ``w`` (None at end of file). The pipe is read under a lock: the watchdog may
        read the last words of a dead worker while a step waits on the same pipe."""
        with self._conn_lock:
            try:
                return pickle.loads(w.conn.recv_bytes())
            except (EOFError, OSError):
                return None

    def _recv(self, w: WorkerHandle):
        """The next reply of ``w``, waiting on its pipe and on its process at once."""
        ready = connection.wait([w.conn, w.process.sentinel])
        if w.conn in ready:
            message = self._read(w)
            if message is not None and message[0] == "error":
                raise self._worker_raised(w, message)
            if message is not None:
                return message[1]
        raise self._gone_error(w)

    def _worker_raised(self, w: WorkerHandle, message: tuple) -> WorkerRaised:
        _, error, tb = message
        error.__cause__ = RemoteTraceback(tb)
        error.add_note(f"raised in parallel worker rank {w.rank} (pid {w.process.pid})")
        raised = WorkerRaised(w, error)
        raised.__cause__ = error
        return raised

    def _gone_error(self, w: WorkerHandle) -> WorkerDiedError:
        """Why ``w`` is gone: the exception it reported before exiting, else how its process ended."""
        while True:
            with self._conn_lock:
                try:
                    pending = w.conn.poll()
                except OSError:
                    pending = False
            if not pending:
                break
            message = self._read(w)
            if message is None:
                break
            if message[0] == "error":
                return self._raised_error(self._worker_raised(w, message))
        shard = self.layout.shard(w.rank)
        return WorkerDiedError(
            f"parallel worker rank {w.rank} (tensor-parallel rank {shard.tp_rank}, pipeline stage "
            f"{shard.pp_rank}, pid {w.process.pid}) {how_ended(w.process)}"
            + (f" after {self._num_steps} steps" if self._num_steps else " during start-up")
            + "; the engine cannot continue without it and must be restarted"
        )

    def _raised_error(self, raised: WorkerRaised) -> WorkerDiedError:
        error = WorkerDiedError(
            f"{raised} (after {self._num_steps} steps); the engine cannot continue and must be restarted"
        )
        error.__cause__ = raised.error
        return error

    def _diagnose(self) -> WorkerDiedError | None:
        """After a failed step: the worker behind it (its error report, or its exit), waiting a little
        for it to be seen gone."""
        deadline = time.monotonic() + DIAGNOSE_GRACE_S
        while True:
            for w in self._workers:
                if not w.process.is_alive():
                    return self._gone_error(w)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _fail(self, exc: BaseException) -> WorkerDiedError:
        """Turn a failed step into the executor's fatal error, stopping every worker."""
        error = self._dead
        if error is None and isinstance(exc, WorkerDiedError):
            error = exc
        if error is None and isinstance(exc, WorkerRaised):
            error = self._raised_error(exc)
        if error is None and not isinstance(exc, Exception):
            error = WorkerDiedError(
                f"a parallel step was interrupted ({type(exc).__name__}) after {self._num_steps} steps; "
                "the ranks are out of step, so the engine cannot continue"
            )
        if error is None:
            error = self._diagnose()
        if error is None:
            error = WorkerDiedError(
                f"a parallel step failed on the driver after {self._num_steps} steps: "
                f"{type(exc).__name__}: {exc}; the ranks are out of step, so the engine cannot continue"
            )
        with self._lock:
            if self._dead is None:
                self._dead = error
        self.shutdown()
        return self._dead

    def _on_worker_exit(self, sentinel: int) -> None:
        """Watchdog: a worker process ended while the executor was running."""
        w = next(w for w in self._workers if w.process.sentinel == sentinel)
        error = self._gone_error(w)
        with self._lock:
            if self._closed or self._dead is not None:
                return
            self._dead = error
        logger.error("%s", error)
        # Unblock collectives waiting on the dead rank (NCCL waits on the device otherwise).
        if self.backend_name == "nccl":
            self.rank.abort()
        for other in self._workers:
            if other.process.is_alive():
                other.process.kill()

    def _log_layout(self) -> None:
        layout = self.layout
        logger.info(
            "parallel layout: tensor_parallel_size %d x pipeline_parallel_size %d = %d ranks (%s; torch "
            "threads per rank: %d)",
            layout.tensor_parallel_size,
            layout.pipeline_parallel_size,
            layout.world_size,
            self.backend_name,
            self.num_threads,
        )
        for report, plan in zip(self.reports, self.rank_plans, strict=True):
            who = "driver" if report.rank == 0 else "worker"
            logger.info(
                "  %s; %s pid %d: weights %s, KV %s blocks x %s = %s (fits %s blocks)",
                report.description,
                who,
                report.pid,
                _size(report.weight_bytes),
                f"{self.kv_plan.num_blocks:,}",
                _size(report.kv_bytes_per_block),
                _size(self.kv_plan.num_blocks * report.kv_bytes_per_block),
                f"{plan.num_blocks:,}",
            )


def _size(num_bytes: int) -> str:
    return format_bytes(num_bytes) if num_bytes >= 1 << 20 else f"{num_bytes / 1024:.1f} KiB"


def _without_sampling_inputs(out: SchedulerOutput) -> SchedulerOutput:
    """``out`` for a rank that does not sample: the new requests without their sampling parameters
    (the rest is what the rank's runner state and ``prepare_inputs`` need)."""
    if not any(item.new is not None and item.new.sampling_params is not None for item in out.scheduled):
        return out
    return dataclasses.replace(
        out,
        scheduled=[
            item
            if item.new is None
            else dataclasses.replace(item, new=dataclasses.replace(item.new, sampling_params=None))
            for item in out.scheduled
        ],
    )
