"""kvpilot's inference engine.

The public names (``LLM``, ``SamplingParams``, ...) load lazily so that torch-free modules of this
package (``config``, ``metrics_names``, the scheduler) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "kvpilot.engine.llm",
    "LLMEngine": "kvpilot.engine.llm_engine",
    "BeamSearchParams": "kvpilot.engine.beam_search",
    "BeamSearchOutput": "kvpilot.engine.llm",
    "EngineArgs": "kvpilot.engine.config",
    "SamplingParams": "kvpilot.engine.sampling_params",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
