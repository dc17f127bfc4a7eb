"""``kvpilot serve --request-trace FILE``: one JSON line per finished sequence, no text.

For capacity planning (``kvpilot plan --trace FILE``): what the metrics' histograms cannot say -- when
each request arrived, and how its prompt and output lengths paired up. A line::

    {"arrival": 1796425813.412, "prompt_tokens": 212, "output_tokens": 96, "finish_reason": "length",
     "ttft_s": 0.081, "e2e_s": 1.93, "preemptions": 0, "cached_tokens": 64}

``arrival`` is unix seconds (the engine's monotonic clock mapped once, at start). ``cached_tokens``:
the prompt tokens the prefix cache held at the admission that gave the request its first token (the
plan gives the request a prefix of that length shared with the others). Nothing of the prompt or the
output is written. The file is appended to, line-buffered, and rotated to ``FILE.1``
past ``max_bytes`` so that it stays bounded.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO

from kvpilot.engine.stats import IterationStats, SchedulerStats, StatLoggerBase

DEFAULT_MAX_BYTES = 256 << 20


class RequestTraceLogger(StatLoggerBase):
    """Appends a line per finished sequence to ``path`` (see the module doc)."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._offset = time.time() - time.monotonic()  # monotonic -> unix seconds
        self._lock = threading.Lock()
        self._handle: IO[str] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._size = self._handle.tell()

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is None or not iteration_stats.finished:
            return
        lines = []
        for f in iteration_stats.finished:
            entry = {
                "arrival": round(f.arrival_time + self._offset, 4),
                "prompt_tokens": f.num_prompt_tokens,
                "output_tokens": f.num_generation_tokens,
                "finish_reason": f.finish_reason,
                "ttft_s": None
                if f.first_token_time is None
                else round(f.first_token_time - f.arrival_time, 5),
                "e2e_s": round(f.finished_time - f.arrival_time, 5),
                "preemptions": f.num_preemptions,
                "cached_tokens": f.num_cached_tokens,
            }
            lines.append(json.dumps(entry, separators=(",", ":")) + "\n")
        text = "".join(lines)
        with self._lock:
            if self._size + len(text) > self.max_bytes:
                self._rotate()
            self._handle.write(text)
            self._size += len(text)

    def _rotate(self) -> None:
        self._handle.close()
        os.replace(self.path, self.path + ".1")
        self._handle = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        with self._lock:
            self._handle.close()
