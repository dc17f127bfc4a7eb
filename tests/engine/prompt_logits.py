"""Test helpers shared by the engine-against-reference tests: deterministic prompts, and the logits an
engine's runner computes at every prompt position (prefilled in chunks, so that later chunks read the
earlier ones' K/V back from the pool)."""

from __future__ import annotations

import random

import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.request import Request
from kvpilot.engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput


def random_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of varied lengths (1 .. ~150 tokens), deterministic."""
    rng = random.Random(seed)
    lengths = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 47, 64, 65, 100, 129, 150]
    lengths += [rng.randint(1, 150) for _ in range(max(0, n - len(lengths)))]
    vocab = len(tokenizer)
    return [[rng.randrange(5, vocab) for _ in range(length)] for length in lengths[:n]]


def prompt_logits(llm: LLM, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits at every prompt position, computed by the engine's runner in prefill chunks of ``chunk``."""
    engine = llm.llm_engine
    runner, bm = engine.runner, engine.block_manager
    req = Request("logits", prompt, SamplingParams(temperature=0.0))
    bm.allocate_prefix(req)
    rows = []
    try:
        for start in range(0, len(prompt), chunk):
            ids = prompt[start : start + chunk]
            assert bm.allocate_slots(req, len(ids))
            table = bm.get_block_table("logits")
            new = NewRequestData(prompt, [], req.sampling_params, None) if start == 0 else None
            cut = 0 if start == 0 else start // bm.block_size
            item = ScheduledRequest("logits", start, len(ids), False, [], cut, table[cut:], new)
            inputs = runner.prepare_inputs(SchedulerOutput([item], len(ids)))
            assert inputs.input_ids.tolist() == ids
            with torch.inference_mode():
                hidden = runner.model(
                    inputs.input_ids, inputs.positions, runner.kv_cache.layers, inputs.metadata
                )
                rows.append(runner.model.compute_logits(hidden))
            req.num_computed_tokens += len(ids)
    finally:
        bm.free(req)
        runner.update_states(SchedulerOutput([], 0, finished_req_ids=["logits"]))
    return torch.cat(rows)
