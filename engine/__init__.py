"""kvpilot's inference engine.

The loop is three calls (``llm_engine``): the input processor turns prompts into requests, ``step()``
schedules, executes and lets the scheduler update the requests, the output processor turns the updates
into ``RequestOutput`` objects. ``README.md`` beside this file walks one request through every module.

* ``config``: ``EngineArgs``, whose fields are the CLI flags and the CRD's ``spec.engine`` keys.
* ``engine_config``: ``EngineConfig``, resolved once from the args, the checkpoint and the tokenizer;
  the only configuration the engine's parts read.
* ``cpu_threads``: the CPU thread count the engine runs with (affinity, cgroup quota, explicit settings).
* ``errors``: the engine's typed errors (mapped to HTTP codes by the server).
* ``sampling_params``: ``SamplingParams``, validated at the edge.
* ``input_processor``: prompts -> requests: tokenization, the one validation, the ``n > 1`` fan-out.
* ``request``: one sequence's state, written only by the scheduler.
* ``block_manager``: the paged KV cache's bookkeeping: block tables, prefix cache, copy-on-write, swap.
* ``scheduler``: continuous batching with chunked prefill and preemption; ``update_from_output``.
* ``scheduler_output``: the scheduler's contracts: its config, one step's batch as a change to the
  runner's state, one sequence's ``CoreOutput``.
* ``request_queue``: the scheduler's FCFS queues, with O(1) removal (aborts) and safe iteration.
* ``model_runner``: one rank's step on the model: flatten the batch, forward, sample; KV-pool sizing.
* ``kv_cache``: one rank's KV block pools (one allocation for every layer) and its CPU swap pool.
* ``runner_state``: the runner's own copy of the requests it runs, kept from the step messages.
* ``memory``: how many KV blocks fit in the memory budget; the CPU swap pool.
* ``sampler``: logits -> next tokens (greedy, temperature, top-k/p, min-p, penalties, seeds).
* ``output_processor``: updates -> outputs: detokenizing, stop strings, ``n > 1`` merge, beam search.
* ``detokenizer``: incremental detokenization with stop strings that are never retracted.
* ``beam_search``: which beams survive each step; a search runs as rounds of plain one-token requests.
* ``outputs``: ``RequestOutput``, ``CompletionOutput`` and the runner's ``ModelRunnerOutput``.
* ``stats``: ``SchedulerStats`` and ``IterationStats``, what the stat loggers read after every step.
* ``llm_engine``: ``LLMEngine``, the three calls wired together.
* ``llm``: ``LLM``, the offline API.
* ``engine_commands``: what crosses into the engine thread: inputs, typed commands, the engine protocol.
* ``async_engine``: the engine on a background thread with per-request asyncio streams.
* ``request_stream``: one call's output stream; a lagging consumer gets the deltas merged.
* ``metrics`` / ``metrics_names``: the vLLM-named Prometheus metrics, and their names (dependency-free).
* ``models/``, ``parallel/``, ``server/``: the model path, tensor/pipeline parallelism, the OpenAI server.

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
