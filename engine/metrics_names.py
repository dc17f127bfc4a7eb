"""The names of every metric the engine exports: the one place they are spelled.

Dependency-free on purpose: the operator imports this module to read ``/metrics`` and must not pull
in prometheus-client, torch or transformers. Names are the *exposed* names, exactly as they appear in
the Prometheus text format (counters carry their ``_total`` suffix; histograms expose
``<name>_bucket`` / ``<name>_sum`` / ``<name>_count``).

Metrics are vLLM V1's, labelled ``engine`` and ``model_name`` (the first ``--served-model-name``) as
vLLM labels them; info metrics carry no ``model_name`` label. Renames have broken autoscalers before,
so the deprecated spellings that clients still query are listed in ``DEPRECATED_ALIASES``; readers
should use ``canonical_name``.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- labels
LABEL_MODEL_NAME = "model_name"
LABEL_FINISHED_REASON = "finished_reason"
# vLLM labels every per-engine series ``engine="<index>"``; one engine per server here, so always "0".
# A constant label: sums over a metric's series are unchanged by it.
LABEL_ENGINE = "engine"
ENGINE_INDEX = "0"
# Values of ``finished_reason`` (one series each, present from start-up at 0). ``error``: a sequence
# the engine could not finish (its loop died with it in flight). vLLM's ``repetition`` is left out:
# this engine has no repetition detection, so nothing could ever end for that reason.
FINISHED_REASONS = ("stop", "length", "abort", "error")
FINISHED_ERROR = "error"

# ---------------------------------------------------------------------------------------------- gauges
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # sequences queued, preempted ones included
NUM_REQUESTS_SWAPPED = "vllm:num_requests_swapped"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # fraction 0..1 of KV blocks held by live sequences
CPU_CACHE_USAGE_PERC = "vllm:cpu_cache_usage_perc"  # fraction 0..1 of the CPU swap pool in use
# Waiting sequences by reason (``reason`` label), as vLLM splits them: ``capacity``, waiting for room in
# the batch or the KV pool (every waiting sequence here); ``deferred``, held back by a transient
# constraint (vLLM's LoRA budget or a grammar still compiling), which this engine never does: its
# grammars compile before a request is queued.
NUM_REQUESTS_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
WAITING_CAPACITY = "capacity"
WAITING_DEFERRED = "deferred"
WAITING_REASONS = (WAITING_CAPACITY, WAITING_DEFERRED)

# ---------------------------------------------------------------------------------------------- counters
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"  # labelled finished_reason
PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"  # prompt tokens looked up
PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"  # prompt tokens found
# Prompt tokens whose KV came from the prefix cache, counted once per sequence when its prefill is done
# (the hit counter above counts every lookup, a preempted sequence's second one too).
PROMPT_TOKENS_CACHED_TOTAL = "vllm:prompt_tokens_cached_total"

# ---------------------------------------------------------------------------------------------- histograms
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"
REQUEST_INFERENCE_TIME_SECONDS = "vllm:request_inference_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
REQUEST_NUM_PREEMPTIONS = "vllm:request_num_preemptions"  # per finished sequence: times it was preempted
# Per finished sequence: decode time over its tokens after the first (0 for a single token).
REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:request_time_per_output_token_seconds"
ITERATION_TOKENS_TOTAL = "vllm:iteration_tokens_total"  # a histogram despite the suffix (vLLM's name)
# Per finished sequence: its request's ``n``, and its ``max_tokens`` when the request set one.
REQUEST_PARAMS_N = "vllm:request_params_n"
REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"

# ---------------------------------------------------------------------------------------------- info
# Value 1; the configuration is in the labels (CACHE_CONFIG_LABELS / MODEL_CONFIG_LABELS).
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# Not a vLLM metric: the model's shape, so the operator can pick valid parallel sizes with the engine's
# own rule (kvpilot.engine.parallel.layout.allowed_tensor_parallel_sizes: heads, KV heads and the
# intermediate size).
MODEL_CONFIG_INFO = "kvpilot_model_config_info"  # ours alone: Prometheus naming (no ":")

# Ours: what the KV pool was sized from (engine/memory.py plan_kv_pool): the memory the fraction applies
# to, the weights and activation peak taken off it, the bytes of one block, and how the activation peak
# scales per batched token and per sequence, so that a planner can size the pool at another
# gpu_memory_utilization, max_num_batched_tokens or max_num_seqs the way the engine would. Empty values: sized
# explicitly (num_gpu_blocks_override / kv_cache_memory_bytes).
KV_POOL_INFO = "kvpilot_kv_pool_info"
KV_POOL_LABELS = (
    "memory_budget_bytes",
    "weights_bytes",
    "activation_bytes",
    "bytes_per_block",
    "activation_bytes_per_token",
    "activation_bytes_per_seq",
)

# Ours: the settings that change at run time (``POST /admin/config``), as in force at this scrape.
CONFIG_INFO = "kvpilot_config_info"
CONFIG_LABELS = ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests", "preemption_mode")

# Ours: requests answered with an error before reaching the engine, by reason (one series each, at 0
# from start-up). vLLM's ``vllm:admission_rejections`` counts its own queue bounds, not these.
REQUESTS_REFUSED_TOTAL = "kvpilot_requests_refused_total"
LABEL_REASON = "reason"
REFUSED_QUEUE_FULL = "queue_full"  # 503: --max-waiting-requests sequences already waiting
REFUSED_INVALID = "invalid_request"  # 400: a bad parameter, prompt or per-request bound
REFUSED_TOO_LARGE = "request_too_large"  # 413: the body is over the size limit
REFUSED_REASONS = (REFUSED_QUEUE_FULL, REFUSED_INVALID, REFUSED_TOO_LARGE)

# Ours: what the engine's steps cost, by their shape, for a planner to fit step time on (the plan's
# ``step_time``). Counters by ``phase`` ("decode": every sequence fed one token; "prefill": some fed
# more) and ``num_seqs`` (the batch, in power-of-two classes: "1", "2", "3-4", "5-8", ...): the steps,
# their wall seconds (``IterationStats.wall_s``), the tokens they fed, their sequences, the KV positions
# their one-token slices read, and the causal (query, key) pairs of their longer chunks. Each series'
# increase over a window is the exact sum over its steps, so means per class need no histogram.
ENGINE_STEPS_TOTAL = "kvpilot_engine_steps_total"
ENGINE_STEP_SECONDS_TOTAL = "kvpilot_engine_step_seconds_total"
ENGINE_STEP_TOKENS_TOTAL = "kvpilot_engine_step_tokens_total"
ENGINE_STEP_SEQS_TOTAL = "kvpilot_engine_step_seqs_total"
ENGINE_STEP_DECODE_CONTEXT_TOTAL = "kvpilot_engine_step_decode_context_tokens_total"
ENGINE_STEP_PREFILL_PAIRS_TOTAL = "kvpilot_engine_step_prefill_attention_pairs_total"
ENGINE_STEP_COUNTERS = (
    ENGINE_STEPS_TOTAL,
    ENGINE_STEP_SECONDS_TOTAL,
    ENGINE_STEP_TOKENS_TOTAL,
    ENGINE_STEP_SEQS_TOTAL,
    ENGINE_STEP_DECODE_CONTEXT_TOTAL,
    ENGINE_STEP_PREFILL_PAIRS_TOTAL,
)
# Ours: each decode step's wall time over the mean of the decode steps of its shape before it (its batch
# size and context's quarter octave, once that shape has ``STEP_TIME_RATIO_WARMUP`` steps): the spread of
# step time around its mean, which the counters' sums smooth out (GIL turns, stalls), for the plan to draw
# step times from.
ENGINE_STEP_TIME_RATIO = "kvpilot_engine_step_time_ratio"
STEP_TIME_RATIO_WARMUP = 32
STEP_TIME_RATIO_BUCKETS = (
    0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.4, 1.5, 1.75,
    2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 50.0,
)  # fmt: skip
# Ours: the seconds between a request's arrival (its stamp, once the server has parsed and tokenized it)
# and the arrival before it. Where requests come in a burst, the server takes them in one at a time and
# the short gaps are its time on each, which the plan's simulation spaces a burst's requests by.
ENGINE_ARRIVAL_GAP_SECONDS = "kvpilot_engine_arrival_gap_seconds"
ARRIVAL_GAP_BUCKETS = (
    0.00005, 0.0001, 0.00015, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003,
    0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Ours: the seconds the server took to answer one ``/metrics`` scrape (routing, rendering, sending). It
# runs on the interpreter the engine's steps run on, so a step that meets a scrape ends that much later;
# the count over time is how often the pod is scraped (every scraper together). The plan's simulation
# takes these turns too.
ENGINE_METRICS_RENDER_SECONDS = "kvpilot_engine_metrics_render_seconds"
METRICS_RENDER_BUCKETS = (
    0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.0045, 0.005, 0.006, 0.007, 0.008,
    0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
# Ours: the seconds the server took to take in one generation request it had to itself (no other in
# intake meanwhile): from the request reaching the application to its hand-off to the engine (routing,
# reading and validating the body, tokenizing, building its inputs). A burst reaches the engine spread
# out by such turns, and a step that meets one ends that much later; the plan's simulation draws its
# server turns from these, every request a sample, where the arrival gaps hold only the bursts'.
ENGINE_REQUEST_INTAKE_SECONDS = "kvpilot_engine_request_intake_seconds"
REQUEST_INTAKE_BUCKETS = ARRIVAL_GAP_BUCKETS
LABEL_PHASE = "phase"
LABEL_NUM_SEQS = "num_seqs"
PHASE_DECODE = "decode"
PHASE_PREFILL = "prefill"
PHASES = (PHASE_DECODE, PHASE_PREFILL)


def batch_class(num_seqs: int) -> str:
    """The ``num_seqs`` label of a step of ``num_seqs`` sequences: "1", "2", then "3-4", "5-8", ...
    (powers of two), so the series stay few whatever the batch."""
    if num_seqs <= 2:
        return str(max(1, num_seqs))
    high = 1 << (num_seqs - 1).bit_length()
    return f"{high // 2 + 1}-{high}"


def batch_classes(max_num_seqs: int) -> tuple[str, ...]:
    """Every class a batch of at most ``max_num_seqs`` sequences falls in, smallest first."""
    out: list[str] = []
    n = 1
    while n <= max(1, max_num_seqs):
        out.append(batch_class(n))
        n = 2 if n == 1 else n * 2
    if batch_class(max_num_seqs) not in out:
        out.append(batch_class(max_num_seqs))
    return tuple(out)


CACHE_CONFIG_LABELS = (
    "block_size",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "preemption_mode",
    "swap_space_bytes",
    "num_gpu_blocks_override",
    "cache_dtype",
)
MODEL_CONFIG_LABELS = (
    "architecture",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "intermediate_size",
    "head_dim",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "dtype",
)

# ---------------------------------------------------------------------------------------------- aliases
# Deprecated (vLLM V0 / early V1) spelling -> current name. The engine also exports the KV-usage alias
# (EXPORTED_ALIASES), which autoscaler configurations in the wild still query.
DEPRECATED_ALIASES = {
    "vllm:gpu_cache_usage_perc": KV_CACHE_USAGE_PERC,
    "vllm:gpu_prefix_cache_queries_total": PREFIX_CACHE_QUERIES_TOTAL,
    "vllm:gpu_prefix_cache_hits_total": PREFIX_CACHE_HITS_TOTAL,
    "vllm:time_per_output_token_seconds": INTER_TOKEN_LATENCY_SECONDS,
    "kvpilot:model_config_info": MODEL_CONFIG_INFO,
}
GPU_CACHE_USAGE_PERC = "vllm:gpu_cache_usage_perc"
# The model info's name until 0.1 (a ":" name of ours): exported alongside for one release.
MODEL_CONFIG_INFO_ALIAS = "kvpilot:model_config_info"
EXPORTED_ALIASES = (GPU_CACHE_USAGE_PERC, MODEL_CONFIG_INFO_ALIAS)

GAUGES = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    NUM_REQUESTS_SWAPPED,
    KV_CACHE_USAGE_PERC,
    CPU_CACHE_USAGE_PERC,
    NUM_REQUESTS_WAITING_BY_REASON,
)
COUNTERS = (
    NUM_PREEMPTIONS_TOTAL,
    PROMPT_TOKENS_TOTAL,
    GENERATION_TOKENS_TOTAL,
    REQUEST_SUCCESS_TOTAL,
    PREFIX_CACHE_QUERIES_TOTAL,
    PREFIX_CACHE_HITS_TOTAL,
    PROMPT_TOKENS_CACHED_TOTAL,
    REQUESTS_REFUSED_TOTAL,
    *ENGINE_STEP_COUNTERS,
)
HISTOGRAMS = (
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    E2E_REQUEST_LATENCY_SECONDS,
    REQUEST_QUEUE_TIME_SECONDS,
    REQUEST_PREFILL_TIME_SECONDS,
    REQUEST_DECODE_TIME_SECONDS,
    REQUEST_INFERENCE_TIME_SECONDS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_NUM_PREEMPTIONS,
    REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
    REQUEST_PARAMS_N,
    REQUEST_PARAMS_MAX_TOKENS,
    ITERATION_TOKENS_TOTAL,
    ENGINE_STEP_TIME_RATIO,
    ENGINE_ARRIVAL_GAP_SECONDS,
    ENGINE_METRICS_RENDER_SECONDS,
    ENGINE_REQUEST_INTAKE_SECONDS,
)
INFO = (CACHE_CONFIG_INFO, MODEL_CONFIG_INFO, CONFIG_INFO, KV_POOL_INFO)
ALL_METRICS = GAUGES + COUNTERS + HISTOGRAMS + INFO
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def canonical_name(name: str) -> str:
    """The current name of ``name`` (itself when it is not a deprecated alias)."""
    return DEPRECATED_ALIASES.get(name, name)


def base_name(sample_name: str) -> str:
    """The metric a sample belongs to: ``vllm:e2e_request_latency_seconds_count`` ->
    ``vllm:e2e_request_latency_seconds``; counters and gauges are returned unchanged."""
    for suffix in HISTOGRAM_SUFFIXES:
        stem = sample_name.removesuffix(suffix)
        if stem != sample_name and stem in HISTOGRAMS:
            return stem
    return sample_name
