"""How the driver of a parallel engine keeps its worker processes: their handles, how one ended, the
errors a worker reports, reaping, and the watchdog thread that notices a worker's exit at once.
"""

from __future__ import annotations

import os
import signal
import time
import weakref
from dataclasses import dataclass
from multiprocessing import connection

import torch.multiprocessing as mp

# After a collective fails, how long to wait for the worker behind it to be seen exiting.
DIAGNOSE_GRACE_S = 2.0
SHUTDOWN_WAIT_S = 5.0


@dataclass
class WorkerHandle:
    """The driver's side of one worker: its rank, process and pipe."""

    rank: int
    process: mp.Process
    conn: connection.Connection


class WorkerRaised(Exception):
    """A worker reported an exception (``error``, with its traceback as the cause)."""

    def __init__(self, w: WorkerHandle, error: BaseException) -> None:
        super().__init__(
            f"parallel worker rank {w.rank} (pid {w.process.pid}): {type(error).__name__}: {error}"
        )
        self.error = error


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (shown as the cause)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def how_ended(process: mp.Process, wait_s: float = DIAGNOSE_GRACE_S) -> str:
    """How ``process`` ended, e.g. ``was killed by SIGKILL``. Two threads (the step and the watchdog) may
    reap it at once, and the one that loses the race sees no exit code for a moment: poll for it."""
    deadline = time.monotonic() + wait_s
    code = process.exitcode
    while code is None and time.monotonic() < deadline:
        process.join(0.02)
        code = process.exitcode
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def reap(processes: list[mp.Process], conns: list[connection.Connection]) -> None:
    """Kill what is still running and close the pipes (also the finaliser of a forgotten executor)."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(SHUTDOWN_WAIT_S)
    for conn in conns:
        conn.close()


def watchdog(on_exit: weakref.WeakMethod, sentinels: list[int], stop_fd: int) -> None:
    """Thread body: wait until a worker process ends (call ``on_exit(sentinel)`` if its owner still
    lives) or ``stop_fd`` becomes readable (the driver shuts down); closes ``stop_fd``."""
    try:
        ready = connection.wait([*sentinels, stop_fd])
    finally:
        os.close(stop_fd)
    if stop_fd in ready:
        return
    callback = on_exit()
    if callback is not None:
        callback(ready[0])
