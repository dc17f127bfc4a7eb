"""Keep the collector's full passes off the serving path.

After start-up a serving process holds a large, long-lived heap: the model's modules, the tokenizer,
transformers' and torch's own tables, the app's routes. CPython's full (generation 2) collection
walks every tracked object, so each one that runs while requests are served pauses every thread
for the whole heap's walk: with the test checkpoint about 413,000 objects and a quarter of a second
(``benchmarks/gc_pause.py``), with the engine's step and every request's first token waiting.

``freeze_startup_heap`` collects once and moves what survives into the permanent generation, which
collections skip: later passes walk only what serving itself allocates. vLLM does the same at the end
of its start-up. Call it once, after the last start-up allocation and before the first request.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object still tracked; returns how many are frozen now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
