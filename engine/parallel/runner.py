"""The model runner of one rank, and KV-pool sizing for one rank.

Every rank prepares the same flattened inputs from the same ``SchedulerOutput`` and runs its shard of
the forward; the KV cache of a rank holds its own layers and KV heads, with the same number of blocks
everywhere (block ids and slot mappings are global). Only the sampling rank samples.

Pipeline micro-batching (``KVPILOT_PP_MICRO_BATCHES=M``, default 1 = off): a step's requests are split
into M runs balanced by tokens that flow through the stages one after the other, so that stage s works
on run i while stage s+1 works on run i-1::

    stage 0   [mb0][mb1]
    stage 1        [mb0][mb1] -> logits of both -> sample once

Requests are independent, so the split changes nothing but the matmul shapes (bfloat16 results can then
differ in the last bit). It is off by default because it did not pay on CPU: measured on the 100M
checkpoint with two 1-thread stages on 2 cores, M=2 ran at 0.64x the speed of M=1 (smaller matmuls, and
each blocking gloo send waits for the next stage's receive).
"""

from __future__ import annotations

import itertools
import os
import time
from bisect import bisect_left

import torch

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.memory import KVPoolPlan, cpu_activation_estimate, plan_kv_pool, total_system_memory
from kvpilot.engine.model_runner import KVCache, ModelRunner
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.sampler import SamplingRow
from kvpilot.engine.scheduler import ScheduledRequest, SchedulerOutput


def micro_batch_count(pipeline_parallel_size: int) -> int:
    """Micro-batches per step: ``KVPILOT_PP_MICRO_BATCHES`` with pipeline stages, else 1."""
    raw = os.environ.get("KVPILOT_PP_MICRO_BATCHES")
    if not raw or pipeline_parallel_size == 1:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"KVPILOT_PP_MICRO_BATCHES must be a positive integer, got {raw!r}")
    return int(raw)


def split_micro_batches(items: list[ScheduledRequest], num: int) -> list[list[ScheduledRequest]]:
    """``items`` in at most ``num`` contiguous, non-empty runs of about equal token counts (the order,
    decodes first, is kept within each run)."""
    num = min(num, len(items))
    if num <= 1:
        return [items]
    ends = list(itertools.accumulate(len(item.token_ids) for item in items))
    bounds = [0]
    for k in range(1, num):
        cut = bisect_left(ends, k * ends[-1] / num) + 1  # the run ends after the item reaching k/num
        bounds.append(min(max(cut, bounds[-1] + 1), len(items) - (num - k)))
    bounds.append(len(items))
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


class ParallelModelRunner(ModelRunner):
    """``ModelRunner`` over a ``ParallelLlamaForCausalLM`` shard. ``sampler`` is None except on the
    sampling rank; ``execute`` returns None on every other rank. ``num_micro_batches``: see the module
    doc (every rank must use the same number)."""

    def __init__(self, *args, num_micro_batches: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_micro_batches = num_micro_batches

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        if out.has_block_ops:
            self.apply_block_ops(out)
        if not out.scheduled:
            return ModelRunnerOutput([], [], []) if self.sampler is not None else None
        prepare_s = 0.0
        t0 = time.perf_counter()
        sampling: list[ScheduledRequest] = []
        logits_parts: list[torch.Tensor] = []
        for items in split_micro_batches(out.scheduled, self.num_micro_batches):
            t = time.perf_counter()
            inputs = self.prepare_inputs(SchedulerOutput(items, sum(len(i.token_ids) for i in items)))
            prepare_s += time.perf_counter() - t
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.metadata)
            rows = [item for item in items if item.do_sample]
            if rows:
                # Collective on the last stage (the vocabulary-parallel head gathers to the sampling rank).
                logits = self.model.compute_logits(hidden[inputs.logits_indices])
                if logits is not None:
                    logits_parts.append(logits)
                sampling += rows
        if self.sampler is None:
            return None
        t2 = time.perf_counter()
        if not sampling:
            return ModelRunnerOutput([], [], [], prepare_s, t2 - t0 - prepare_s)
        logits = logits_parts[0] if len(logits_parts) == 1 else torch.cat(logits_parts)
        rows = [
            SamplingRow(item.sampling_params, item.prompt_token_ids, item.output_token_ids, item.eos_token_id)
            for item in sampling
        ]
        sampled = self.sampler(logits, rows)
        return ModelRunnerOutput(
            [item.req_id for item in sampling],
            sampled.token_ids,
            sampled.logprobs,
            prepare_s=prepare_s,
            forward_s=t2 - t0 - prepare_s,
            sample_s=time.perf_counter() - t2,
        )


def plan_rank_kv_pool(
    runner: ModelRunner,
    cfg: ModelConfig,
    args: EngineArgs,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    max_num_batched_tokens: int,
    logits_vocab: int,
) -> KVPoolPlan:
    """How many KV blocks this rank can hold.

    ``cfg`` is the config as the rank sees it (its layers, heads, KV heads, intermediate size);
    ``logits_vocab`` the width of the logits it materialises (the full vocabulary on the sampling rank).
    The memory budget (``gpu_memory_utilization`` of the device, or of ``cpu_memory_budget_bytes`` on
    CPU) and ``swap_space`` apply per rank, as device memory does per GPU. On CUDA the profiling forward
    is a collective: every rank must plan at the same time.
    """
    bytes_per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, args.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype
    )
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    explicit = args.num_gpu_blocks_override is not None or args.kv_cache_memory_bytes is not None
    activation = 0
    budget = 0
    used = 0
    if not explicit:
        tokens = max_num_batched_tokens
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            runner.profile_forward(tokens, args.max_num_seqs)
            torch.cuda.synchronize(device)
            activation = torch.cuda.max_memory_allocated(device) - before
            free, budget = torch.cuda.mem_get_info(device)
            used = budget - free - weights  # other processes and the CUDA context
        else:
            budget = args.cpu_memory_budget_bytes or total_system_memory() // 2
            activation = cpu_activation_estimate(
                tokens,
                cfg.hidden_size,
                cfg.intermediate_size,
                (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim,
                logits_vocab,
                args.max_num_seqs,
                dtype.itemsize,
            )
    return plan_kv_pool(
        block_size=args.block_size,
        bytes_per_block=bytes_per_block,
        max_model_len=max_model_len,
        num_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_bytes=activation,
        already_used_bytes=max(0, used),
    )
