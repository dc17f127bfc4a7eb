"""Export the engine's statistics: Prometheus metrics (vLLM V1 names) and a periodic log line.

Both are stat loggers (``stats.StatLoggerBase``): the engine calls their ``record`` after every step,
on the engine's thread, and between steps when adds or aborts changed the scheduler's state (an abort
that leaves the engine idle). ``PrometheusStatLogger`` also counts aborts from outside the engine
(``record_aborted``: a request that never reached the engine's finish path) and shows run-time
settings changes (``record_live_config``).

Semantics (per sequence, as vLLM V1 counts ``n > 1`` children):

* ``prompt_tokens_total``: a sequence's prompt length, counted when its prefill completes (its first
  token is sampled); ``request_prompt_tokens``: the same, observed when it finishes;
* ``generation_tokens_total``: tokens sampled, counted every step;
* ``request_success_total{finished_reason}``: finished sequences by reason (``abort`` included);
* ``num_preemptions_total`` and the prefix-cache counters follow the scheduler's cumulative totals.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.engine import metrics_names as names
from kvpilot.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLoggerBase
from kvpilot.engine.step_metrics import ServerTurns, StepShapeCounters

GiB = 1 << 30

# vLLM V1's buckets, so that dashboards built for vLLM read the same quantiles.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
# fmt: on


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (token-count histograms)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > limit:
                return buckets
            buckets.append(float(value))
        scale *= 10


def _label(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)


class PrometheusStatLogger(StatLoggerBase):
    """Prometheus metrics of one engine, in a registry of its own (``self.registry``).

    ``cache_config`` and ``model_config`` become the labels of the two info metrics (keys as in
    ``metrics_names.CACHE_CONFIG_LABELS`` / ``MODEL_CONFIG_LABELS``); ``max_model_len`` sizes the
    token-count histograms.
    """

    def __init__(
        self,
        model_name: str,
        *,
        cache_config: dict[str, Any],
        model_config: dict[str, Any],
        max_model_len: int,
        max_num_batched_tokens: int,
        registry: CollectorRegistry | None = None,
        kv_pool: dict[str, Any] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry = registry if registry is not None else CollectorRegistry()
        # vLLM's label set for per-engine series: {engine="0", model_name=...}.
        label = [names.LABEL_ENGINE, names.LABEL_MODEL_NAME]
        engine = names.ENGINE_INDEX

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, label, registry=registry).labels(engine, model_name)

        def counter(name: str, doc: str) -> Any:
            metric = Counter(name.removesuffix("_total"), doc, label, registry=registry)
            return metric.labels(engine, model_name)

        def histogram(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, label, buckets=buckets, registry=registry).labels(engine, model_name)

        def info(name: str, doc: str, keys: tuple[str, ...], config: dict[str, Any]) -> Gauge:
            # Value 1; a key missing from ``config`` reads "None". vLLM's own info metric carries the
            # ``engine`` label too (a fixed value, so not part of ``keys``); kvpilot's do not.
            fixed = {names.LABEL_ENGINE: engine} if name.startswith("vllm:") else {}
            gauge = Gauge(name, doc, [*fixed, *keys], registry=registry)
            gauge.labels(**fixed, **{k: _label(config.get(k)) for k in keys}).set(1)
            return gauge

        self.running = gauge(names.NUM_REQUESTS_RUNNING, "Number of sequences in model execution batches.")
        self.waiting = gauge(names.NUM_REQUESTS_WAITING, "Number of sequences waiting to be processed.")
        self.swapped = gauge(names.NUM_REQUESTS_SWAPPED, "Number of sequences swapped to CPU.")
        self.kv_usage = gauge(names.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_usage_alias = gauge(
            names.GPU_CACHE_USAGE_PERC, f"Deprecated alias of {names.KV_CACHE_USAGE_PERC}."
        )
        self.cpu_usage = gauge(names.CPU_CACHE_USAGE_PERC, "CPU swap-pool usage. 1 means 100 percent usage.")
        by_reason = Gauge(
            names.NUM_REQUESTS_WAITING_BY_REASON,
            "Number of waiting sequences by reason: 'capacity' = waiting for room in the batch or the KV "
            "pool; 'deferred' = held back by a transient constraint (never, in this engine).",
            [*label, names.LABEL_REASON],
            registry=registry,
        )
        self.waiting_by_reason = {r: by_reason.labels(engine, model_name, r) for r in names.WAITING_REASONS}

        self.preemptions = counter(names.NUM_PREEMPTIONS_TOTAL, "Cumulative number of preemptions.")
        self.prompt_tokens = counter(names.PROMPT_TOKENS_TOTAL, "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            names.GENERATION_TOKENS_TOTAL, "Number of generation tokens processed."
        )
        self.prefix_queries = counter(
            names.PREFIX_CACHE_QUERIES_TOTAL, "Prefix-cache queries, in prompt tokens looked up."
        )
        self.prefix_hits = counter(
            names.PREFIX_CACHE_HITS_TOTAL, "Prefix-cache hits, in prompt tokens found."
        )
        self.prompt_tokens_cached = counter(
            names.PROMPT_TOKENS_CACHED_TOTAL,
            "Prompt tokens whose KV came from the prefix cache, once per sequence at its first token.",
        )
        success = Counter(
            names.REQUEST_SUCCESS_TOTAL.removesuffix("_total"),
            "Count of finished sequences by finish reason.",
            [*label, names.LABEL_FINISHED_REASON],
            registry=registry,
        )
        self.success = {
            reason: success.labels(engine, model_name, reason) for reason in names.FINISHED_REASONS
        }
        refused = Counter(
            names.REQUESTS_REFUSED_TOTAL.removesuffix("_total"),
            "Requests answered with an error before reaching the engine, by reason.",
            [names.LABEL_MODEL_NAME, names.LABEL_REASON],
            registry=registry,
        )
        self.refused = {reason: refused.labels(model_name, reason) for reason in names.REFUSED_REASONS}

        self.ttft = histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            names.INTER_TOKEN_LATENCY_SECONDS, "Inter-token latency in seconds.", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            names.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Decode time per output token (after the first) of finished sequences, in seconds.",
            ITL_BUCKETS,
        )
        self.request_preemptions = histogram(
            names.REQUEST_NUM_PREEMPTIONS,
            "Number of times a finished sequence was preempted.",
            PREEMPTION_BUCKETS,
        )

        def latency(name: str, doc: str) -> Any:
            return histogram(name, doc, REQUEST_LATENCY_BUCKETS)

        self.e2e = latency(names.E2E_REQUEST_LATENCY_SECONDS, "End-to-end request latency in seconds.")
        self.queue_time = latency(
            names.REQUEST_QUEUE_TIME_SECONDS, "Time spent waiting before first scheduled."
        )
        self.prefill_time = latency(
            names.REQUEST_PREFILL_TIME_SECONDS, "Time from first scheduled to first token."
        )
        self.decode_time = latency(names.REQUEST_DECODE_TIME_SECONDS, "Time from first token to finish.")
        self.inference_time = latency(
            names.REQUEST_INFERENCE_TIME_SECONDS, "Time from first scheduled to finish."
        )
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            names.REQUEST_PROMPT_TOKENS, "Prompt length of finished sequences.", token_buckets
        )
        self.request_generation_tokens = histogram(
            names.REQUEST_GENERATION_TOKENS, "Generated length of finished sequences.", token_buckets
        )
        self.request_params_n = histogram(
            names.REQUEST_PARAMS_N, "The n parameter of finished sequences' requests.", PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            names.REQUEST_PARAMS_MAX_TOKENS,
            "The max_tokens parameter of finished sequences' requests (those that set one).",
            token_buckets,
        )
        iteration_buckets = sorted(
            {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384} | {max_num_batched_tokens}
        )
        self.iteration_tokens = histogram(
            names.ITERATION_TOKENS_TOTAL,
            "Tokens processed per engine step.",
            [float(b) for b in iteration_buckets if b <= max_num_batched_tokens],
        )

        self.step_shape = StepShapeCounters(
            registry, (engine, model_name), int(model_config.get("max_num_seqs") or 1)
        )
        self.server_turns = ServerTurns(registry, (engine, model_name))

        self._cache_config = dict(cache_config)
        self._cache_info = info(
            names.CACHE_CONFIG_INFO,
            "Information of the KV-cache configuration.",
            names.CACHE_CONFIG_LABELS,
            cache_config,
        )
        self._live_config = {
            "max_num_seqs": model_config.get("max_num_seqs"),
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_waiting_requests": None,
            "preemption_mode": cache_config.get("preemption_mode"),
        }
        self._config_info = info(
            names.CONFIG_INFO,
            "The settings that change at run time (POST /admin/config), as in force.",
            names.CONFIG_LABELS,
            self._live_config,
        )
        info(
            names.KV_POOL_INFO,
            "What the KV pool was sized from: memory budget, weights, activation peak, bytes per block.",
            names.KV_POOL_LABELS,
            dict(kv_pool or {}),
        )
        info(
            names.MODEL_CONFIG_INFO,
            "Model shape and parallelism of this engine.",
            names.MODEL_CONFIG_LABELS,
            model_config,
        )
        info(
            names.MODEL_CONFIG_INFO_ALIAS,
            f"Deprecated alias of {names.MODEL_CONFIG_INFO}.",
            names.MODEL_CONFIG_LABELS,
            model_config,
        )

        # Cumulative scheduler totals already exported (monotonic high-water marks).
        self._seen_preemptions = 0
        self._seen_prefix_queries = 0
        self._seen_prefix_hits = 0

    @classmethod
    def from_engine(
        cls, engine, model_name: str, registry: CollectorRegistry | None = None
    ) -> PrometheusStatLogger:
        """Build the exporter for an ``LLMEngine`` (reads its KV plan, configuration and model shape)."""
        config = engine.engine_config
        plan = engine.kv_plan
        num_cpu_blocks = engine.num_cpu_blocks
        cfg = engine.model_config
        dtype = str(engine.dtype).removeprefix("torch.")
        kv_dtype = str(engine.kv_cache_dtype).removeprefix("torch.")
        cache_config = {
            "block_size": plan.block_size,
            "num_gpu_blocks": plan.num_blocks,
            "num_cpu_blocks": num_cpu_blocks,
            "gpu_memory_utilization": config.cache.gpu_memory_utilization,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "preemption_mode": config.scheduler.preemption_mode,
            "swap_space_bytes": int(config.cache.swap_space_gib * GiB),
            "num_gpu_blocks_override": config.cache.num_gpu_blocks_override,
            "cache_dtype": kv_dtype,
        }
        model_config = {
            "architecture": cfg.architecture,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "num_hidden_layers": cfg.num_hidden_layers,
            "intermediate_size": cfg.intermediate_size,
            "head_dim": cfg.head_dim,
            "tensor_parallel_size": config.parallel_layout.tensor_parallel_size,
            "pipeline_parallel_size": config.parallel_layout.pipeline_parallel_size,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "dtype": dtype,
        }
        kv_pool = {
            "memory_budget_bytes": plan.budget_bytes,
            "weights_bytes": plan.weights_bytes,
            "activation_bytes": plan.activation_bytes,
            "bytes_per_block": plan.bytes_per_block,
            "activation_bytes_per_token": plan.activation_bytes_per_token,
            "activation_bytes_per_seq": plan.activation_bytes_per_seq,
        }
        return cls(
            model_name,
            cache_config=cache_config,
            model_config=model_config,
            kv_pool=kv_pool,
            max_model_len=engine.max_model_len,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            registry=registry,
        )

    def record_live_config(self, live: Any) -> None:
        """The run-time settings changed (``live_config.LiveConfig``): both info metrics show the new
        values from this scrape on (one label set each, the old one removed)."""
        self._replace_info(self._config_info, names.CONFIG_LABELS, self._live_config, live.as_dict(), {})
        cache = {**self._cache_config, "preemption_mode": live.preemption_mode}
        engine = {names.LABEL_ENGINE: names.ENGINE_INDEX}
        self._replace_info(self._cache_info, names.CACHE_CONFIG_LABELS, self._cache_config, cache, engine)

    @staticmethod
    def _replace_info(
        gauge: Gauge, keys: tuple[str, ...], old: dict[str, Any], new: dict[str, Any], fixed: dict[str, str]
    ) -> None:
        # ``fixed``: the labels that never change (``engine`` on vLLM's info metric), listed first.
        before = {**fixed, **{k: _label(old.get(k)) for k in keys}}
        after = {**fixed, **{k: _label(new.get(k)) for k in keys}}
        if before != after:
            gauge.remove(*before.values())
            gauge.labels(**after).set(1)
        old.clear()
        old.update(new)

    # ------------------------------------------------------------------ entry points
    def record(self, sched: SchedulerStats, it: IterationStats | None) -> None:
        """Record one engine step, or (``it`` None) the scheduler's state between steps."""
        self._record_scheduler_stats(sched)
        if it is None:
            return
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_cached_prompt_tokens:
            self.prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
        self.iteration_tokens.observe(it.num_batched_tokens)
        self.step_shape.record(it)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for fin in it.finished:
            self._observe_finished(fin)

    def _record_scheduler_stats(self, sched: SchedulerStats) -> None:
        """Refresh the gauges and scheduler-cumulative counters."""
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.waiting_by_reason[names.WAITING_CAPACITY].set(sched.num_waiting)
        self.waiting_by_reason[names.WAITING_DEFERRED].set(0)
        self.swapped.set(sched.num_swapped)
        self.kv_usage.set(sched.kv_cache_usage)
        self.gpu_usage_alias.set(sched.kv_cache_usage)
        self.cpu_usage.set(sched.cpu_cache_usage)
        self._seen_preemptions = self._advance(
            self.preemptions, self._seen_preemptions, sched.num_preemptions_total
        )
        self._seen_prefix_queries = self._advance(
            self.prefix_queries, self._seen_prefix_queries, sched.prefix_cache_queries
        )
        self._seen_prefix_hits = self._advance(
            self.prefix_hits, self._seen_prefix_hits, sched.prefix_cache_hits
        )

    def record_scrape(self, seconds: float) -> None:
        """One /metrics answer took the server ``seconds`` (seen from the next scrape on)."""
        self.server_turns.record_scrape(seconds)

    def record_intake(self, seconds: float) -> None:
        """The server took ``seconds`` to take in one request it had to itself."""
        self.server_turns.record_intake(seconds)

    def record_arrival(self, arrival_time: float) -> None:
        self.server_turns.record_arrival(arrival_time)

    def record_aborted(self, num_seqs: int) -> None:
        """Count ``num_seqs`` sequences aborted from outside the engine (client gone)."""
        if num_seqs > 0:
            self.success["abort"].inc(num_seqs)

    def record_errored(self, num_seqs: int) -> None:
        """Count ``num_seqs`` sequences the engine failed (``finished_reason="error"``)."""
        if num_seqs > 0:
            self.success[names.FINISHED_ERROR].inc(num_seqs)

    def record_refused(self, reason: str) -> None:
        """Count one request refused for ``reason`` (one of ``metrics_names.REFUSED_REASONS``)."""
        self.refused[reason].inc()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _advance(counter, seen: int, total: int) -> int:
        # The scheduler's totals may dip transiently (an admission undone within a step); export only
        # growth past the high-water mark so that the counter never double counts.
        if total > seen:
            counter.inc(total - seen)
            return total
        return seen

    def _observe_finished(self, fin: FinishedRequestStats) -> None:
        success = self.success.get(fin.finish_reason)
        if success is not None:
            success.inc()
        self.request_prompt_tokens.observe(fin.num_prompt_tokens)
        self.request_generation_tokens.observe(fin.num_generation_tokens)
        self.request_preemptions.observe(fin.num_preemptions)
        self.request_params_n.observe(fin.n)
        if fin.max_tokens is not None:
            self.request_params_max_tokens.observe(fin.max_tokens)
        self.e2e.observe(max(0.0, fin.finished_time - fin.arrival_time))
        if fin.scheduled_time is not None:
            self.queue_time.observe(max(0.0, fin.scheduled_time - fin.arrival_time))
            self.inference_time.observe(max(0.0, fin.finished_time - fin.scheduled_time))
            if fin.first_token_time is not None:
                self.prefill_time.observe(max(0.0, fin.first_token_time - fin.scheduled_time))
        if fin.first_token_time is not None:
            decode_s = max(0.0, fin.finished_time - fin.first_token_time)
            self.decode_time.observe(decode_s)
            # The first token belongs to the prefill; a single-token sequence observes 0 (as vLLM).
            num_decoded = fin.num_generation_tokens - 1
            self.time_per_output_token.observe(decode_s / num_decoded if num_decoded > 0 else 0.0)
