"""Runs one scheduler step on one rank's model: flatten the batch, forward once, sample.

The runner owns the model, the KV cache tensors and (on the sampling rank) the sampler. It reads only
the ``SchedulerOutput``: every rank of a parallel engine prepares the same flattened inputs from the same
step and runs its share of the forward. A rank's KV cache holds its own layers and KV heads, with the
same number of blocks everywhere (block ids and slot mappings are global).

Pipeline micro-batching (``pipeline_micro_batches`` M > 1 with pipeline stages): a step's requests are
split into M runs balanced by tokens that flow through the stages one after the other, so that stage s
works on run i while stage s+1 works on run i-1::

    stage 0   [mb0][mb1]
    stage 1        [mb0][mb1] -> logits of both -> sample once

Requests are independent, so the split changes nothing but the matmul shapes (bfloat16 results can then
differ in the last bit). It is off by default: smaller matmuls and blocking stage-to-stage sends can
cost more than the overlap gains.
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.kv_cache import KVCache
from kvpilot.engine.memory import KVPoolPlan, cpu_activation_estimate, plan_kv_pool, total_system_memory
from kvpilot.engine.models.layers import prepack_cpu_linears
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.runner_state import CachedRequests, CachedRequestState
from kvpilot.engine.sampler import PenaltyCounts, Sampler, SamplingRow
from kvpilot.engine.scheduler_output import ScheduledRequest, SchedulerConfig, SchedulerOutput
from kvpilot.engine.structured_output import GrammarCompiler, StructuredOutputs
from kvpilot.kernels.backend import AttentionBackend
from kvpilot.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvpilot.engine.engine_config import CacheConfig


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_rows] token index whose hidden state is sampled


def split_micro_batches(items: list[ScheduledRequest], num: int) -> list[tuple[int, int]]:
    """``items`` as at most ``num`` contiguous, non-empty ``(start, end)`` runs of about equal token
    counts (the order, decodes first, is kept within each run)."""
    num = min(num, len(items))
    if num <= 1:
        return [(0, len(items))]
    ends = list(itertools.accumulate(item.num_tokens for item in items))
    bounds = [0]
    for k in range(1, num):
        cut = bisect_left(ends, k * ends[-1] / num) + 1  # the run ends after the item reaching k/num
        bounds.append(min(max(cut, bounds[-1] + 1), len(items) - (num - k)))
    bounds.append(len(items))
    return list(itertools.pairwise(bounds))


class ModelRunner:
    """Runs steps on ``model`` (one rank's share). ``sampler`` is None except on the sampling rank, and
    ``execute`` then returns None. ``num_micro_batches``: see the module doc (every rank of an engine
    uses the same number)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        device: torch.device,
        block_size: int,
        sampler: Sampler | None,
        num_micro_batches: int = 1,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.sampler = sampler
        self.num_micro_batches = num_micro_batches
        # Weights and activations share one dtype; the KV pool may store a narrower one (float32 compute
        # over a bfloat16 pool on CPUs without native bfloat16), which the kernels widen as they read.
        self.dtype = next(model.parameters()).dtype
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.kv_cache: KVCache | None = None
        # The requests this runner holds, kept from step to step (see ``runner_state``).
        self.requests = CachedRequests()
        # On CPU: bfloat16 weights reordered once into oneDNN's layout (bit-identical results, about
        # 1.6x faster matmuls at decode batch sizes), or float32 weights that are bfloat16 values kept
        # as bfloat16 panels only (half the bytes); packed weights count as weights in KV sizing.
        self.packed_weight_bytes = prepack_cpu_linears(model) if device.type == "cpu" else 0
        # The sampling rank's structured-output matchers (``enable_structured_outputs``); None: no
        # request may be constrained.
        self.structured_output: StructuredOutputs | None = None

    def enable_structured_outputs(self, compiler: GrammarCompiler) -> None:
        """Let constrained requests run here, their grammars compiled by ``compiler`` (the one the
        input processor compiles with at admission, so the runner's compilations are cache hits).
        Only the sampling rank holds matchers."""
        if self.sampler is not None:
            self.structured_output = StructuredOutputs(compiler)

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights: its parameters and packed weights."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + self.packed_weight_bytes

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block on this rank (its layers and KV heads)."""
        shard = self.model.shard
        return KVCache.bytes_per_block(
            shard.num_layers,
            self.block_size,
            shard.num_kv_heads,
            self.model.config.head_dim,
            self.kv_cache_dtype,
        )

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> KVCache:
        shard = self.model.shard
        self.kv_cache = KVCache(
            shard.num_layers,
            num_blocks,
            self.block_size,
            shard.num_kv_heads,
            self.model.config.head_dim,
            self.kv_cache_dtype,
            self.device,
            num_cpu_blocks,
            head_major=self.backend.head_major_kv,
            zero_fill=self.backend.needs_zeroed_kv,
        )
        return self.kv_cache

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """A step that runs nothing: forget the requests it names, then move its blocks."""
        self.update_states(out)
        self._block_ops(out)

    def _block_ops(self, out: SchedulerOutput) -> None:
        """Swap out, copy on write, swap in -- in that order (see ``BlockManager``)."""
        if not out.has_block_ops:
            return
        kv = self.kv_cache
        if out.blocks_to_swap_out:
            mapping = torch.tensor(out.blocks_to_swap_out, dtype=torch.int64)
            self.backend.swap_blocks(kv.blocks_view(), kv.blocks_view(on_cpu=True), mapping)
        if out.blocks_to_copy:
            layers = kv.layers
            mapping = torch.tensor(out.blocks_to_copy, dtype=torch.int64, device=self.device)
            sources = {src for src, _ in out.blocks_to_copy}
            if any(dst in sources for _, dst in out.blocks_to_copy):
                # A block freed after being read can be a later copy's target: keep the list's order.
                for row in mapping:
                    self.backend.copy_blocks([k for k, _ in layers], [v for _, v in layers], row[None])
            else:
                self.backend.copy_blocks([k for k, _ in layers], [v for _, v in layers], mapping)
        if out.blocks_to_swap_in:
            mapping = torch.tensor(out.blocks_to_swap_in, dtype=torch.int64)
            self.backend.swap_blocks(kv.blocks_view(on_cpu=True), kv.blocks_view(), mapping)

    def update_states(self, out: SchedulerOutput) -> list[CachedRequestState]:
        """Apply the step's changes to the requests this runner holds (every step, once); returns the
        scheduled requests' states. Matchers of the requests it forgets are released."""
        if self.structured_output is not None and out.finished_req_ids:
            self.structured_output.release(out.finished_req_ids)
        return self.requests.update(out)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        """Apply the step's changes, then flatten it into token ids, positions, slots and block tables."""
        return self._flatten(out.scheduled, self.update_states(out))

    def _flatten(self, scheduled: list[ScheduledRequest], states: list[CachedRequestState]) -> ModelInputs:
        # Per request in Python, per token in torch: positions and slots come from index arithmetic
        # over the flattened batch, not from a Python loop over its tokens.
        bs = self.block_size
        num_reqs = len(scheduled)
        counts = [item.num_tokens for item in scheduled]
        starts = [item.start_pos for item in scheduled]
        seq_lens = [start + n for start, n in zip(starts, counts, strict=True)]
        qsl = [0, *itertools.accumulate(counts)]
        num_tokens = qsl[-1]
        max_blocks = -(-max(seq_lens) // bs)
        logits_indices = [qsl[i + 1] - 1 for i, item in enumerate(scheduled) if item.do_sample]
        # Decodes come first: they are the leading run of one-token slices.
        num_decodes = next((i for i, n in enumerate(counts) if n != 1), num_reqs)
        flat_tables: list[int] = []
        for state in states:
            row = state.block_ids[:max_blocks]
            flat_tables += row
            if len(row) < max_blocks:
                flat_tables += [0] * (max_blocks - len(row))
        tables = torch.tensor(flat_tables, dtype=torch.int32).view(num_reqs, max_blocks)
        if num_tokens == num_reqs:  # decodes: each feeds its newest token
            token_ids = [
                state.token_slice(item.start_pos, item.start_pos + 1)[0]
                for item, state in zip(scheduled, states, strict=True)
            ]
        else:
            token_ids = list(
                itertools.chain.from_iterable(
                    state.token_slice(item.start_pos, item.start_pos + item.num_tokens)
                    for item, state in zip(scheduled, states, strict=True)
                )
            )
        input_ids = torch.tensor(token_ids, dtype=torch.int64)
        if num_tokens == num_reqs:  # one token per request
            positions = torch.tensor(starts, dtype=torch.int64)
            req_of_token = torch.arange(num_reqs)
        else:
            req_of_token = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(counts))
            # Token t of request r sits at position start[r] + (t - qsl[r]).
            offsets = torch.tensor(starts, dtype=torch.int64) - torch.tensor(qsl[:-1], dtype=torch.int64)
            positions = torch.arange(num_tokens, dtype=torch.int64) + offsets.index_select(0, req_of_token)
        # index_select, not tensor[index]: advanced indexing on CPU costs milliseconds at 4k tokens.
        blocks = tables.view(-1).index_select(0, req_of_token * max_blocks + positions // bs)
        slots = blocks.to(torch.int64) * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
        )
        return ModelInputs(
            input_ids=input_ids.to(dev),
            positions=positions.to(dev),
            metadata=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Block operations, one forward over the flattened batch (per micro-batch), then sample the
        requests that need it; None on a rank that does not sample."""
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        t0 = time.perf_counter()
        states = self.update_states(out)
        prepare_s = time.perf_counter() - t0
        if out.has_block_ops:
            self._block_ops(out)
        if not out.scheduled:
            return ModelRunnerOutput([], [], []) if self.sampler is not None else None
        # Constrained rows' masks fill on a worker thread while the forward runs (module doc of
        # ``structured_output``); nothing happens here for a batch without constraints.
        pending = None
        if self.structured_output is not None:
            pending = self.structured_output.start(
                [state for item, state in zip(out.scheduled, states, strict=True) if item.do_sample]
            )
        sampling: list[CachedRequestState] = []
        logits_parts: list[torch.Tensor] = []
        for a, b in split_micro_batches(out.scheduled, self.num_micro_batches):
            t = time.perf_counter()
            items = out.scheduled[a:b]
            inputs = self._flatten(items, states[a:b])
            prepare_s += time.perf_counter() - t
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.metadata)
            rows = [state for item, state in zip(items, states[a:b], strict=True) if item.do_sample]
            if rows:
                # Collective on the last stage (the vocabulary-parallel head gathers to the sampling rank).
                logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
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
            SamplingRow(
                s.sampling_params,
                s.prompt_token_ids,
                s.output_token_ids,
                s.eos_token_id,
                self._penalty_counts(s, logits.shape[1]) if s.sampling_params.has_penalties else None,
            )
            for s in sampling
        ]
        sampled = self.sampler(logits, rows, pending.result() if pending is not None else None)
        return ModelRunnerOutput(
            [state.req_id for state in sampling],
            sampled.token_ids,
            sampled.logprobs,
            prepare_s=prepare_s,
            forward_s=t2 - t0 - prepare_s,
            sample_s=time.perf_counter() - t2,
        )

    def _penalty_counts(self, state: CachedRequestState, vocab: int) -> PenaltyCounts:
        """``state``'s penalty counts, made at its first sampling step and kept with it from then on."""
        if state.penalties is None:
            state.penalties = PenaltyCounts(vocab, self.device, state.prompt_token_ids)
        return state.penalties

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, max_num_seqs: int) -> None:
        """One forward at the largest step shape (``num_tokens`` tokens) without a KV cache, to measure
        peak activation memory. Uses a throwaway one-block cache per layer and drops the writes. A
        collective on a parallel engine: every rank profiles at the same time."""
        cfg, shard = self.model.config, self.model.shard
        dtype = self.kv_cache_dtype
        num_reqs = max(1, min(max_num_seqs, num_tokens))
        per_req = [num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0) for i in range(num_reqs)]
        scratch_blocks = -(-max(per_req) // self.block_size)
        k = torch.zeros(
            scratch_blocks,
            self.block_size,
            shard.num_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=self.device,
        )
        caches = [(k, k) for _ in range(shard.num_layers)]
        qsl = [0]
        for n in per_req:
            qsl.append(qsl[-1] + n)
        table = list(range(scratch_blocks))
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(per_req, dtype=torch.int32, device=self.device),
            block_tables=torch.tensor([table] * num_reqs, dtype=torch.int32, device=self.device),
            max_query_len=max(per_req),
            max_seq_len=max(per_req),
            num_decodes=sum(1 for n in per_req if n == 1) if all(n == 1 for n in per_req) else 0,
            query_start_loc_host=qsl,
            seq_lens_host=per_req,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in per_req])
        hidden = self.model(ids, pos, caches, meta)
        self.model.compute_logits(hidden[torch.tensor(qsl[1:], device=self.device) - 1])

    def size_kv_pool(self, cache: CacheConfig, scheduler: SchedulerConfig) -> KVPoolPlan:
        """How many KV blocks this rank can hold.

        The memory budget (``gpu_memory_utilization`` of the device, or of ``cpu_memory_budget_bytes``
        on CPU) applies per rank, as device memory does per GPU. On CUDA the profiling forward is a
        collective: every rank must plan at the same time.
        """
        cfg, shard, dtype, device = self.model.config, self.model.shard, self.dtype, self.device
        weights = self.weight_bytes
        explicit = cache.is_sized_explicitly
        activation = 0
        budget = 0
        used = 0
        per_token = per_seq = 0
        if not explicit:
            tokens = scheduler.max_num_batched_tokens
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                self.profile_forward(tokens, scheduler.max_num_seqs)
                torch.cuda.synchronize(device)
                activation = torch.cuda.max_memory_allocated(device) - before
                per_token, per_seq = max(0, activation) // max(1, tokens), 0
                free, budget = torch.cuda.mem_get_info(device)
                used = budget - free - weights  # other processes and the CUDA context
            else:
                budget = cache.cpu_memory_budget_bytes or total_system_memory() // 2
                # The logits this rank materialises: all of them on the sampling rank, its shard of the
                # vocabulary on the other ranks of the last stage.
                if shard.is_sampler:
                    logits_vocab = cfg.vocab_size
                else:
                    logits_vocab = shard.num_vocab_rows if shard.is_last_stage else 0
                shape = (
                    cfg.hidden_size,
                    shard.intermediate_size,
                    (shard.num_heads + 2 * shard.num_kv_heads) * cfg.head_dim,
                    logits_vocab,
                )
                activation = cpu_activation_estimate(
                    tokens, *shape, num_seqs=scheduler.max_num_seqs, dtype_bytes=dtype.itemsize
                )
                per_token = cpu_activation_estimate(1, *shape, num_seqs=0, dtype_bytes=dtype.itemsize)
                per_seq = cpu_activation_estimate(0, *shape, num_seqs=1, dtype_bytes=dtype.itemsize)
        plan = plan_kv_pool(
            block_size=cache.block_size,
            bytes_per_block=self.kv_bytes_per_block,
            max_model_len=scheduler.max_model_len,
            num_blocks_override=cache.num_gpu_blocks_override,
            kv_cache_memory_bytes=cache.kv_cache_memory_bytes,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            budget_bytes=budget,
            weights_bytes=weights,
            activation_bytes=activation,
            already_used_bytes=max(0, used),
        )
        if not explicit:
            plan.activation_bytes_per_token, plan.activation_bytes_per_seq = per_token, per_seq
        return plan
