"""The worker process of one non-driver rank.

Started by ``MultiProcExecutor`` (spawn). Protocol over its pipe, every message a pickled tuple:

    worker -> driver   ("ready", pid)                      once imports are done, before the rendezvous
    driver -> worker   ("load",) | ("plan",) | ("allocate", num_blocks, num_cpu_blocks)
    worker -> driver   ("ok", result)                      reply to each of those
    driver -> worker   ("execute", sched_out) | ("block_ops", sched_out)   every step, no reply ...
    worker -> driver   ("ok", ModelRunnerOutput)           ... except from the sampling rank after "execute"
    driver -> worker   ("shutdown",)                       reply ("ok", None), then exit
    worker -> driver   ("error", exception, traceback)     on any failure, then exit(1)

A worker never outlives its driver: the pipe's EOF, a watch on the parent process id and the
collectives' errors all end it. It ignores SIGINT (Ctrl-C reaches the whole process group; the driver
decides when workers stop).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback

_PARENT_POLL_S = 1.0


def encode(message: tuple) -> bytes:
    """A protocol message as bytes for ``Connection.send_bytes``."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def error_message(exc: BaseException) -> bytes:
    """``("error", exc, traceback)``; the exception as a string when it does not pickle."""
    tb = "".join(traceback.format_exception(exc))
    try:
        return encode(("error", exc, tb))
    except Exception:
        return encode(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), tb))


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="kvpilot-parent-watch", daemon=True).start()


def worker_main(spec, rank: int, num_threads: int, parent_pid: int, conn) -> None:
    """Entry point of the worker for ``rank`` of ``spec`` (a ``RankSpec``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(parent_pid)
    code = 0
    try:
        import torch

        from kvpilot.engine.gc_heap import freeze_startup_heap
        from kvpilot.engine.parallel.rank import Rank

        if spec.device_type == "cpu":
            torch.set_num_threads(num_threads)
        else:
            torch.cuda.set_device(rank)  # a device that cannot be used fails before the rendezvous
        conn.send_bytes(encode(("ready", os.getpid())))
        worker = Rank(spec, rank)
        while True:
            try:
                payload = conn.recv_bytes()
            except EOFError:  # the driver is gone
                break
            command, *args = pickle.loads(payload)
            if command == "execute":
                out = worker.execute(*args)
                if worker.shard.is_sampler:
                    conn.send_bytes(encode(("ok", out)))
            elif command == "block_ops":
                worker.apply_block_ops(*args)
            elif command == "load":
                conn.send_bytes(encode(("ok", worker.load())))
            elif command == "plan":
                conn.send_bytes(encode(("ok", (worker.plan_kv(), worker.num_cpu_blocks()))))
            elif command == "allocate":  # the last start-up command: what lives now lives on
                worker.allocate(*args)
                freeze_startup_heap()
                conn.send_bytes(encode(("ok", None)))
            elif command == "shutdown":
                conn.send_bytes(encode(("ok", None)))
                break
            else:
                raise ValueError(f"unknown worker command {command!r}")
    except BaseException as exc:  # report anything, then exit: the driver turns it into an engine error
        code = 1
        try:
            conn.send_bytes(error_message(exc))
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: process-group destructors may wait on peers that are already gone.
    os._exit(code)
