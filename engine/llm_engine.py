"""The synchronous engine: requests in, one step at a time, outputs out.

Three parts, each with one job: the ``InputProcessor`` turns prompts into requests, ``step()`` runs the
core loop -- schedule, execute, ``scheduler.update_from_output`` -- and the ``OutputProcessor`` turns the
updates into ``RequestOutput`` objects. The engine wires them together and applies what the output
processor asks of the core (finish the sequences a stop string ended; queue a beam search's next round
of one-token requests).
"""

from __future__ import annotations

import logging
import time
from typing import Self

import torch

from kvpilot.engine.beam_search import BeamSearchGroup, BeamSearchParams
from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.cpu_threads import apply_num_threads
from kvpilot.engine.engine_config import EngineConfig, resolve
from kvpilot.engine.input_processor import CLIP_TO_CONTEXT, ContextRule, InputProcessor, NewRequest
from kvpilot.engine.memory import format_bytes
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.loader import resolve_model_dir
from kvpilot.engine.output_processor import OutputProcessor, StepRecord
from kvpilot.engine.outputs import ModelRunnerOutput, RequestOutput
from kvpilot.engine.parallel import ExecutorSpec, ParallelLayout, create_executor
from kvpilot.engine.request import RequestStatus
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.engine.stats import SchedulerStats, StatLoggerBase, make_iteration_stats
from kvpilot.engine.structured_output import GrammarCompiler
from kvpilot.kernels.backend import get_backend

logger = logging.getLogger("kvpilot.engine")


def load_tokenizer(path: str):
    """The Hugging Face tokenizer in ``path``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class ShutdownOnExit:
    """``with`` support for a class with an idempotent ``shutdown()``: leaving the block shuts it down."""

    def shutdown(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


class LLMEngine(ShutdownOnExit):
    """Owns the tokenizer, model executor, block manager and scheduler of one engine instance.

    Raises ``ConfigError`` (or a subclass) at construction for arguments the model or the machine
    cannot take.
    """

    def __init__(self, args: EngineArgs) -> None:
        t0 = time.monotonic()
        model_dir = resolve_model_dir(args.model)
        cfg = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = load_tokenizer(args.tokenizer or model_dir)
        # The arguments end here: everything below reads the one resolved configuration.
        self.engine_config: EngineConfig = resolve(args, model_dir, cfg, self.tokenizer)
        config = self.engine_config
        self.model_dir, self.model_config = config.model_dir, config.model_config
        if config.num_threads:
            apply_num_threads(config.num_threads, config.threads_reason)

        self.backend = get_backend(config.attention_backend, self.device.type)
        torch.manual_seed(config.seed)
        # Loads the model (sharded over worker processes when parallel), sizes and allocates the KV cache.
        self.executor = create_executor(ExecutorSpec(config, self.backend))
        self.runner = self.executor.runner  # this process's runner (rank 0 when parallel)
        self.model = self.runner.model
        self.sampler = self.runner.sampler
        self.kv_plan = self.executor.kv_plan  # per rank when parallel; every rank holds num_blocks
        self.num_cpu_blocks = self.executor.num_cpu_blocks
        self.block_manager = BlockManager(
            self.kv_plan.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            self.num_cpu_blocks,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Structured outputs need the matchers on the sampling rank: this process's runner samples
        # unless a pipeline's last stage does (then constrained requests are refused at admission).
        grammar_compiler = None
        if self.runner.sampler is not None:
            grammar_compiler = GrammarCompiler(self.tokenizer, cfg.vocab_size, config.eos_token_id)
            self.runner.enable_structured_outputs(grammar_compiler)
        self.input_processor = InputProcessor(
            self.tokenizer,
            cfg.vocab_size,
            config.eos_token_id,
            self.scheduler,
            active_request_ids=self.output_processor,
            live_sequence_ids=self.output_processor.live_sequence_ids,
            grammar_compiler=grammar_compiler,
        )
        self.num_steps = 0
        # When the engine last ended a step with work left (perf_counter), None when it went idle.
        self._busy_since: float | None = None
        # Callables (SchedulerStats, IterationStats) -> None, called after every step.
        self.stat_loggers: list[StatLoggerBase] = []
        self._log_start(time.monotonic() - t0)

    def _log_start(self, load_s: float) -> None:
        cfg = self.model_config
        logger.info(
            "model %s (%s, %d layers, %d/%d heads), dtype %s, KV cache %s, device %s, attention backend %s, "
            "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d; loaded in %.1fs",
            self.model_dir,
            cfg.architecture,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            str(self.dtype).removeprefix("torch."),
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.device,
            self.backend.name,
            self.max_model_len,
            self.engine_config.scheduler.max_num_seqs,
            self.max_num_batched_tokens,
            load_s,
        )
        weights = self.kv_plan.weights_bytes
        logger.info(
            "%s; weights %s, %.0f KV blocks per GiB",
            self.engine_config.dtype_reason,
            format_bytes(weights),
            (1 << 30) / self.kv_plan.bytes_per_block,
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

    # ------------------------------------------------------------------ resolved settings
    @property
    def device(self) -> torch.device:
        return self.engine_config.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine_config.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.engine_config.kv_cache_dtype

    @property
    def parallel_layout(self) -> ParallelLayout:
        return self.engine_config.parallel_layout

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.engine_config.max_num_batched_tokens

    @property
    def eos_token_id(self) -> int | None:
        """The EOS id stamped on new requests (settable: requests already queued keep theirs)."""
        return self.input_processor.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.input_processor.eos_token_id = value

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        stream: bool = False,
        arrival_time: float | None = None,
        context: ContextRule = CLIP_TO_CONTEXT,
    ) -> None:
        """Queue a request (a text prompt, or token ids). ``n > 1`` runs ``n`` sequences.

        Raises ``InvalidRequestError`` for an empty or too-long prompt, out-of-vocabulary ids, a
        duplicate id or more sequences than fit; nothing is queued then.
        """
        self.queue_request(self.check_request(request_id, prompt, params, arrival_time, context), stream)

    def check_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        context: ContextRule = CLIP_TO_CONTEXT,
    ) -> NewRequest:
        """The request checked (``InputProcessor``: raises ``InvalidRequestError``), nothing queued."""
        return self.input_processor.process(
            request_id, prompt, params or SamplingParams(), arrival_time, context
        )

    def queue_request(self, new: NewRequest, stream: bool = False) -> None:
        """Queue a request ``check_request`` returned (before any other request is added)."""
        for seq in new.seqs:  # n > 1: independent sequences, sharing the prompt through the prefix cache
            self.scheduler.add_request(seq)
        self.output_processor.add_request(
            new.request_id,
            new.prompt_text,
            new.prompt_token_ids,
            new.params,
            [seq.req_id for seq in new.seqs],
            new.seqs[0].arrival_time,
            stream,
        )
        for stat_logger in self.stat_loggers:
            stat_logger.record_arrival(new.seqs[0].arrival_time)

    def add_beam_search_request(
        self, request_id: str, prompt: str | list[int], params: BeamSearchParams
    ) -> None:
        """Queue a beam search; its output (``beam_width`` sequences, best first) comes from ``step()``
        when the search ends. Raises ``InvalidRequestError`` like ``add_request``, and for a
        ``beam_width`` above ``max_num_seqs``."""
        group = self.input_processor.process_beam_search(request_id, prompt, params)
        self._queue_round(group, self.output_processor.add_beam_search(group))

    def _queue_round(self, group: BeamSearchGroup, round_: list[tuple[str, list[int]]]) -> None:
        """Queue one round of a beam search: ordinary one-token requests, one per running beam."""
        for req in self.input_processor.beam_requests(group, round_):
            self.scheduler.add_request(req)

    def abort_request(self, request_ids: str | list[str]) -> int:
        """Abort requests now; their KV blocks are free when this returns. Unknown ids are ignored.

        Returns the number of sequences that were still unfinished and got aborted.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        num_aborted = 0
        for rid in request_ids:
            num_aborted += len(self.scheduler.abort_requests(self.output_processor.abort(rid)))
        return num_aborted

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that finished (and, for streaming
        requests, of those that produced new tokens)."""
        t0 = time.perf_counter()
        num_preemptions_before = self.scheduler.num_preemptions_total
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            self._busy_since = None
            return []
        if not sched_out.scheduled:
            # Everything runnable was preempted: only move the blocks this step released.
            self.executor.apply_block_ops(sched_out)
            return []
        t1 = time.perf_counter()
        runner_out = self.executor.execute(sched_out)
        t2 = time.perf_counter()
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        self.num_steps += 1
        processed = self.output_processor.process(core_outputs, time.monotonic())
        # What flows back into the core: the ids to finish (stop strings), and new requests (the beam
        # searches' next rounds).
        self.scheduler.finish_requests(processed.stop_ids, RequestStatus.FINISHED_STOPPED)
        for group, round_ in processed.beam_rounds:
            self._queue_round(group, round_)
        outputs = self.output_processor.make_outputs(processed)
        if self.stat_loggers:
            num_preemptions = self.scheduler.num_preemptions_total - num_preemptions_before
            ended = self._log_stats(sched_out, runner_out, processed.record, num_preemptions, t1 - t0, t2, t0)
            # The next step's wall time runs from this one's end, so what the loggers take counts too:
            # a running sequence waits it between two tokens.
            self._busy_since = ended if self.scheduler.requests else None
        return outputs

    def _log_stats(
        self,
        sched_out: SchedulerOutput,
        runner_out: ModelRunnerOutput,
        record: StepRecord,
        num_preemptions: int,
        schedule_s: float,
        executed_at: float,
        step_began: float,
    ) -> float:
        """Hand the step's stats to the loggers; returns when its wall time was taken (its end)."""
        now = time.perf_counter()
        update_s = max(0.0, now - executed_at)
        # Busy since the previous step ended (work was left then): the step held the engine from then
        # on, the gap between the two included (commands, the event loop's share of the GIL).
        began = self._busy_since if self._busy_since is not None else step_began
        stats = make_iteration_stats(
            sched_out, runner_out, record, num_preemptions, schedule_s, update_s, wall_s=now - began
        )
        sched_stats = self.scheduler.stats()
        for stat_logger in self.stat_loggers:
            stat_logger.record(sched_stats, stats)
        return now

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ------------------------------------------------------------------ lifecycle
    def check_health(self) -> None:
        """Raise the error that makes this engine unusable (a dead parallel worker), if any."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (idempotent; also done at interpreter exit)."""
        self.executor.shutdown()
