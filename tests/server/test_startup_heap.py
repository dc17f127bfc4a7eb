"""``kvpilot serve`` freezes its start-up heap (``engine.gc_heap``) before it listens: no full
collection while it serves walks the model, torch, transformers and the app."""

from __future__ import annotations

import re


def test_serve_freezes_its_heap_before_it_listens(server) -> None:
    log = server.log()
    frozen = re.search(r"start-up heap frozen objects=(\d+)", log)
    assert frozen, log
    # The engine, torch, transformers and the app: far more than a bare interpreter's few thousand.
    assert int(frozen.group(1)) > 50_000
    assert frozen.start() < log.index("listening on")
