"""The synchronous engine: requests in, one step at a time, outputs out.

``step()`` is three calls -- schedule, run the model, update from the output -- plus turning the
updates into ``RequestOutput`` objects (detokenization, stop strings).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvpilot.engine.beam_search import BeamSearchGroup, BeamSearchParams, BeamSearchState
from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.config import ConfigError, EngineArgs
from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.memory import GiB, format_bytes
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.loader import resolve_model_dir
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.parallel import ExecutorSpec, create_executor, validate_parallel_sizes
from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from kvpilot.engine.stats import FinishedRequestStats, IterationStats
from kvpilot.kernels import get_backend

logger = logging.getLogger("kvpilot.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class _Tracked:
    """Engine-side state of one user request (``n`` sequences)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    num_finished: int = 0
    # Streaming: token ids not yet handed out, per sequence.
    pending_ids: list[list[int]] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible")
    return torch.device(name)


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    dtype = _DTYPES.get(str(model_cfg.torch_dtype), torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        # float16 matmuls are slow on CPUs; bfloat16 has the same size and a wider range.
        logger.info("dtype float16 -> bfloat16 on CPU")
        dtype = torch.bfloat16
    return dtype


class LLMEngine:
    """Owns the tokenizer, model runner, block manager and scheduler of one engine instance."""

    def __init__(self, args: EngineArgs) -> None:
        t0 = time.monotonic()
        self.args = args
        self.model_dir = resolve_model_dir(args.model)
        self.model_config = cfg = ModelConfig.from_pretrained(self.model_dir)
        self.device = resolve_device(args.device)
        self.parallel_layout = validate_parallel_sizes(
            cfg,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            self.device.type,
            torch.cuda.device_count() if self.device.type == "cuda" else 0,
        )
        self.dtype = resolve_dtype(args.dtype, cfg, self.device)
        self.tokenizer = self._load_tokenizer(args.tokenizer or self.model_dir)
        self.eos_token_id = self._eos_token_id()
        self.max_model_len = self._max_model_len()
        max_batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
        if not args.enable_chunked_prefill:
            max_batched = (
                max(max_batched, self.max_model_len) if args.max_num_batched_tokens is None else max_batched
            )
            if max_batched < self.max_model_len:
                raise ConfigError(
                    f"without chunked prefill max_num_batched_tokens ({max_batched}) must be >= "
                    "max_model_len "
                    f"({self.max_model_len}); enable chunked prefill or raise it"
                )
        self.max_num_batched_tokens = max_batched

        self.backend = get_backend(args.attention_backend, self.device.type)
        torch.manual_seed(args.seed)
        # Loads the model (sharded over worker processes when parallel), sizes and allocates the KV cache.
        self.executor = create_executor(
            ExecutorSpec(
                self.model_dir,
                cfg,
                args,
                self.parallel_layout,
                self.dtype,
                self.device,
                self.backend,
                self.max_model_len,
                max_batched,
            )
        )
        self.runner = self.executor.runner  # this process's runner (rank 0 when parallel)
        self.model = self.runner.model
        self.sampler = self.runner.sampler
        self.kv_plan = self.executor.kv_plan  # per rank when parallel; every rank holds num_blocks
        self.num_cpu_blocks = self.executor.num_cpu_blocks
        self.block_manager = BlockManager(
            self.kv_plan.num_blocks, args.block_size, args.enable_prefix_caching, self.num_cpu_blocks
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=args.enable_chunked_prefill,
                preemption_mode=args.preemption_mode,
            ),
            self.block_manager,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._seq_owner: dict[str, _Tracked] = {}  # sequence id -> its user request
        self._seqs: dict[str, Request] = {}  # sequence id -> sequence
        self._beam_groups: dict[str, BeamSearchGroup] = {}
        self._beam_of: dict[str, BeamSearchGroup] = {}  # beam sequence id -> its search
        self.num_steps = 0
        # Callables (SchedulerStats, IterationStats) -> None, called after every step.
        self.stat_loggers: list = []
        logger.info(
            "model %s (%s, %d layers, %d/%d heads), dtype %s, device %s, attention backend %s, "
            "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d; loaded in %.1fs",
            self.model_dir,
            cfg.architecture,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.backend.name,
            self.max_model_len,
            args.max_num_seqs,
            max_batched,
            time.monotonic() - t0,
        )
        kv_line = self.kv_plan.describe(self.max_model_len)
        if self.parallel_layout.is_parallel:
            num_ranks = self.parallel_layout.world_size
            kv_line += f" (bytes per rank: each of the {num_ranks} ranks holds these blocks)"
        logger.info(kv_line)
        if self.num_cpu_blocks:
            logger.info(
                "swap space: %s, %d CPU blocks",
                format_bytes(self.num_cpu_blocks * self.kv_plan.bytes_per_block),
                self.num_cpu_blocks,
            )

    # ------------------------------------------------------------------ set-up helpers
    @staticmethod
    def _load_tokenizer(path: str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    def _eos_token_id(self) -> int | None:
        if self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        return self.model_config.eos_token_ids[0] if self.model_config.eos_token_ids else None

    def _max_model_len(self) -> int:
        cfg = self.model_config
        limit = cfg.max_position_embeddings
        if cfg.sliding_window is not None and cfg.sliding_window < limit:
            logger.info("sliding window %d: max_model_len limited to it", cfg.sliding_window)
            limit = cfg.sliding_window
        if self.args.max_model_len is None:
            return limit
        if self.args.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {self.args.max_model_len} exceeds what the model supports ({limit})"
            )
        return self.args.max_model_len

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        stream: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request (a text prompt, or token ids). ``n > 1`` runs ``n`` sequences.

        Raises ValueError for an empty or too-long prompt, out-of-vocabulary ids or a duplicate id.
        """
        params = params or SamplingParams()
        if request_id in self._tracked:
            raise ValueError(f"duplicate request id {request_id!r}")
        vocab = self.model_config.vocab_size
        bad_stops = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stops:
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}; got {bad_stops[:5]}")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._prompt_token_ids(prompt)
        seqs = []
        for i in range(params.n):
            seq_params = params
            if params.n > 1:
                # Siblings draw different samples: each gets its own seed offset.
                seed = None if params.seed is None else params.seed + i
                seq_params = _replace_params(params, n=1, seed=seed)
            seqs.append(
                Request(
                    req_id=request_id if params.n == 1 else f"{request_id}#{i}",
                    prompt_token_ids=token_ids,
                    sampling_params=seq_params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                )
            )
        # All or nothing: the scheduler validates every sequence before queueing any.
        self.scheduler.add_request(seqs[0], siblings=seqs[1:])
        detoks = [
            IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                params.skip_special_tokens,
                params.stop_strings,
                params.include_stop_str_in_output,
            )
            for _ in seqs
        ]
        tracked = _Tracked(
            request_id, text, token_ids, params, stream, seqs, detoks, pending_ids=[[] for _ in seqs]
        )
        self._tracked[request_id] = tracked
        for seq in seqs:
            self._seq_owner[seq.req_id] = tracked
            self._seqs[seq.req_id] = seq

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return token_ids

    def abort_request(self, request_ids: str | list[str]) -> int:
        """Abort requests now; their KV blocks are free when this returns. Unknown ids are ignored.

        Returns the number of sequences that were still unfinished and got aborted.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        num_aborted = 0
        for rid in request_ids:
            group = self._beam_groups.get(rid)
            if group is not None:
                num_aborted += len(self.scheduler.abort_requests(b.req_id for b in group.beams))
                self._forget_beams(group)
                continue
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            num_aborted += len(self.scheduler.abort_requests(s.req_id for s in tracked.seqs))
            self._forget(tracked)
        return num_aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked or self._beam_groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._tracked) + len(self._beam_groups)

    # ------------------------------------------------------------------ beam search
    def add_beam_search_request(
        self, request_id: str, prompt: str | list[int], params: BeamSearchParams
    ) -> None:
        """Queue a beam search; its output (``beam_width`` sequences, best first) comes from ``step()``
        when the search ends. Raises ValueError like ``add_request``."""
        if request_id in self._tracked or request_id in self._beam_groups:
            raise ValueError(f"duplicate request id {request_id!r}")
        token_ids = self._prompt_token_ids(prompt)
        if params.beam_width > self.args.max_num_seqs:
            raise ValueError(
                f"beam_width {params.beam_width} exceeds max_num_seqs ({self.args.max_num_seqs}): "
                "every beam runs as a sequence"
            )
        room = self.max_model_len - len(token_ids)
        limited = BeamSearchParams(
            params.beam_width, min(params.max_tokens, max(room, 1)), params.length_penalty, params.ignore_eos
        )
        state = BeamSearchState(limited, self.eos_token_id)
        # Beams sample greedily and report their top candidates; the group decides when they stop.
        seq_params = SamplingParams(
            temperature=0.0,
            max_tokens=state.params.max_tokens,
            logprobs=state.num_candidates,
            ignore_eos=True,
        )
        first = Request(f"{request_id}#b0", token_ids, seq_params, eos_token_id=self.eos_token_id)
        self.scheduler.add_request(first)
        group = BeamSearchGroup(request_id, prompt if isinstance(prompt, str) else None, state, first)
        self._beam_groups[request_id] = group
        self._register_beams(group)

    def _register_beams(self, group: BeamSearchGroup) -> None:
        for seq in group.beams:
            self._beam_of[seq.req_id] = group
            self._seqs[seq.req_id] = seq

    def _forget_beams(self, group: BeamSearchGroup) -> None:
        for rid in [rid for rid, g in self._beam_of.items() if g is group]:
            del self._beam_of[rid]
            self._seqs.pop(rid, None)
        self._beam_groups.pop(group.request_id, None)

    def _advance_beam_groups(self, updates) -> list[RequestOutput]:
        ready = {}
        for upd in updates:
            group = self._beam_of.get(upd.request.req_id)
            if group is not None and group.on_sampled(upd.request):
                ready[group.request_id] = group
        outputs = []
        for group in ready.values():
            if group.advance(self.scheduler):
                outputs.append(self._beam_output(group))
                self._forget_beams(group)
            else:
                self._register_beams(group)
        return outputs

    def _beam_output(self, group: BeamSearchGroup) -> RequestOutput:
        first = group.beams[0] if group.beams else None
        completions = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                token_ids=h.token_ids,
                cumulative_logprob=h.cum_logprob,
                finish_reason=h.finish_reason,
            )
            for i, h in enumerate(group.state.results())
        ]
        prompt_ids = first.prompt_token_ids if first is not None else []
        return RequestOutput(group.request_id, group.prompt, prompt_ids, completions, finished=True)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that finished (and, for streaming
        requests, of those that produced new tokens)."""
        t0 = time.perf_counter()
        preempted_before = self.scheduler.num_preemptions_total
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return []
        if not sched_out.scheduled:
            # Everything runnable was preempted: only move the blocks this step released.
            self.executor.apply_block_ops(sched_out)
            return []
        t1 = time.perf_counter()
        result = self.executor.execute(sched_out)
        t2 = time.perf_counter()
        # Only the stat loggers need the previous token times (inter-token latencies).
        prev_token_time = (
            {} if not self.stat_loggers else {rid: self._seqs[rid].last_token_time for rid in result.req_ids}
        )
        sampled = dict(zip(result.req_ids, result.token_ids, strict=True))
        updates = self.scheduler.update_from_output(sched_out, sampled)
        self.num_steps += 1
        for req_id, lp in zip(result.req_ids, result.logprobs, strict=True):
            if lp is not None:
                self._seqs[req_id].logprobs.append(lp)
        outputs = self._process_updates([u for u in updates if u.request.req_id not in self._beam_of])
        if self._beam_groups:
            outputs += self._advance_beam_groups(updates)
        if self.stat_loggers:
            self._log_stats(sched_out, result, updates, prev_token_time, preempted_before, t0, t1, t2)
        return outputs

    def _log_stats(self, sched_out, result, updates, prev_token_time, preempted_before, t0, t1, t2) -> None:
        num_sampled = len(result.req_ids)
        stats = IterationStats(
            num_batched_tokens=sched_out.num_batched_tokens,
            # Decode tokens are single tokens past the prompt; everything else is (re)prefill.
            num_prefill_tokens=sched_out.num_batched_tokens
            - sum(
                1
                for item in sched_out.scheduled
                if len(item.token_ids) == 1 and item.start_pos >= len(item.prompt_token_ids)
            ),
            num_prompt_tokens=sum(
                u.request.num_prompt_tokens for u in updates if prev_token_time.get(u.request.req_id) is None
            ),
            num_generation_tokens=num_sampled,
            num_running_seqs=len(sched_out.scheduled),
            num_preemptions=self.scheduler.num_preemptions_total - preempted_before,
            schedule_s=t1 - t0,
            prepare_s=result.prepare_s,
            forward_s=result.forward_s,
            sample_s=result.sample_s,
            update_s=max(0.0, time.perf_counter() - t2),
        )
        for upd in updates:
            req = upd.request
            prev = prev_token_time.get(req.req_id)
            if prev is None:
                stats.time_to_first_tokens.append(req.first_token_time - req.arrival_time)
            else:
                stats.inter_token_latencies.append(req.last_token_time - prev)
            if req.is_finished:
                stats.finished.append(
                    FinishedRequestStats(
                        finish_reason=req.finish_reason,
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_generation_tokens=req.num_output_tokens,
                        arrival_time=req.arrival_time,
                        scheduled_time=req.scheduled_time,
                        first_token_time=req.first_token_time,
                        finished_time=req.finished_time,
                        num_preemptions=req.num_preemptions,
                    )
                )
        sched_stats = self.scheduler.stats()
        for logger_fn in self.stat_loggers:
            logger_fn(sched_stats, stats)

    def _process_updates(self, updates) -> list[RequestOutput]:
        touched: dict[str, _Tracked] = {}
        for upd in updates:
            req = upd.request
            tracked = self._seq_owner[req.req_id]
            i = tracked.seqs.index(req)
            detok = tracked.detoks[i]
            detok.add_token(upd.new_token_id)
            tracked.pending_ids[i].append(upd.new_token_id)
            finished = upd.finished
            if detok.stop_string is not None and not finished:
                self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_STOPPED)
                req.stop_reason = detok.stop_string
                finished = True
            if finished:
                tracked.num_finished += 1
            touched[tracked.request_id] = tracked
        outputs = []
        for tracked in touched.values():
            finished = tracked.num_finished == len(tracked.seqs)
            if finished or tracked.stream:
                outputs.append(self._make_output(tracked, finished))
            if finished:
                self._forget(tracked)
        return outputs

    def _forget(self, tracked: _Tracked) -> None:
        del self._tracked[tracked.request_id]
        for s in tracked.seqs:
            self._seq_owner.pop(s.req_id, None)
            self._seqs.pop(s.req_id, None)

    def _make_output(self, tracked: _Tracked, finished: bool) -> RequestOutput:
        completions = []
        deltas, delta_ids = [], []
        for i, (seq, detok) in enumerate(zip(tracked.seqs, tracked.detoks, strict=True)):
            done = seq.is_finished
            deltas.append(detok.pop_delta(final=done))
            delta_ids.append(tracked.pending_ids[i])
            tracked.pending_ids[i] = []
            cumulative = None
            if seq.logprobs is not None:
                cumulative = sum(next(iter(entry.values())) for entry in seq.logprobs)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=detok.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=cumulative,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = tracked.seqs[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            scheduled_time=first.scheduled_time,
            first_token_time=min(
                (s.first_token_time for s in tracked.seqs if s.first_token_time), default=None
            ),
            last_token_time=max((s.last_token_time for s in tracked.seqs if s.last_token_time), default=None),
            finished_time=max((s.finished_time for s in tracked.seqs if s.finished_time), default=None),
            num_preemptions=sum(s.num_preemptions for s in tracked.seqs),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(
            request_id=tracked.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
            delta_text=deltas,
            delta_token_ids=delta_ids,
        )

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    @property
    def kv_pool_gib(self) -> float:
        return self.kv_plan.kv_bytes / GiB

    # ------------------------------------------------------------------ lifecycle
    def check_health(self) -> None:
        """Raise the error that makes this engine unusable (a dead parallel worker), if any."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (idempotent; also done at interpreter exit)."""
        self.executor.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


def _replace_params(params: SamplingParams, **changes) -> SamplingParams:
    import dataclasses

    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    values.update(changes)
    return SamplingParams(**values)
