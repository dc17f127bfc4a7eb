"""The metric-name module and the Prometheus exporter, without a server."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as names
from kvpilot.engine.metrics import PrometheusStatLogger, one_two_five_buckets
from kvpilot.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats


def make_logger() -> PrometheusStatLogger:
    return PrometheusStatLogger(
        "m",
        cache_config={
            "block_size": 16,
            "num_gpu_blocks": 100,
            "num_cpu_blocks": 0,
            "gpu_memory_utilization": 0.9,
            "enable_prefix_caching": True,
            "preemption_mode": "recompute",
        },
        model_config={
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "tensor_parallel_size": 1,
        },
        max_model_len=4096,
        max_num_batched_tokens=8192,
    )


def sched(**changes) -> SchedulerStats:
    values = dict(
        num_running=2,
        num_waiting=1,
        num_swapped=0,
        kv_cache_usage=0.25,
        cpu_cache_usage=0.0,
        num_preemptions_total=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    values.update(changes)
    return SchedulerStats(**values)


def step(**changes) -> IterationStats:
    values = dict(
        num_batched_tokens=10,
        num_prefill_tokens=8,
        num_prompt_tokens=8,
        num_generation_tokens=2,
        num_running_seqs=2,
        num_preemptions=0,
        schedule_s=0.001,
        prepare_s=0.001,
        forward_s=0.01,
        sample_s=0.001,
        update_s=0.001,
    )
    values.update(changes)
    return IterationStats(**values)


def samples(logger: PrometheusStatLogger) -> dict[tuple, float]:
    text = generate_latest(logger.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def value(logger, name, **labels) -> float:
    if "model_name" not in labels and not name.endswith("_info"):
        labels["model_name"] = "m"
    if name.startswith("vllm:"):  # vLLM's series all carry engine="0"; kvpilot's own do not
        labels.setdefault("engine", "0")
    return samples(logger)[(name, tuple(sorted(labels.items())))]


def test_names_module_imports_nothing_heavy():
    code = (
        "import sys, kvpilot.engine.metrics_names as n; "
        "heavy = {'torch', 'transformers', 'prometheus_client', 'fastapi'} & set(sys.modules); "
        "assert not heavy, heavy; print(len(n.ALL_METRICS))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(set(names.ALL_METRICS))


def test_design_names_and_aliases():
    for name in (
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_swapped",
        "vllm:cpu_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:iteration_tokens_total",
        "vllm:cache_config_info",
    ):
        assert name in names.ALL_METRICS, name
    assert names.canonical_name("vllm:gpu_cache_usage_perc") == names.KV_CACHE_USAGE_PERC
    assert names.canonical_name(names.KV_CACHE_USAGE_PERC) == names.KV_CACHE_USAGE_PERC
    assert names.base_name("vllm:iteration_tokens_total_sum") == names.ITERATION_TOKENS_TOTAL
    assert names.base_name("vllm:num_preemptions_total") == names.NUM_PREEMPTIONS_TOTAL
    assert names.base_name("vllm:kv_cache_usage_perc_count") == "vllm:kv_cache_usage_perc_count"


def test_exporter_counts_steps_exactly():
    logger = make_logger()
    finished = FinishedRequestStats(
        finish_reason="length",
        num_prompt_tokens=8,
        num_generation_tokens=3,
        arrival_time=10.0,
        scheduled_time=10.5,
        first_token_time=11.0,
        finished_time=12.0,
        num_preemptions=1,
    )
    logger.record(
        sched(num_preemptions_total=2, prefix_cache_queries=40, prefix_cache_hits=16),
        step(time_to_first_tokens=[0.2], inter_token_latencies=[0.05, 0.07]),
    )
    logger.record(
        sched(
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            num_preemptions_total=3,
            prefix_cache_queries=48,
            prefix_cache_hits=16,
        ),
        step(num_batched_tokens=1, num_prompt_tokens=0, num_generation_tokens=1, finished=[finished]),
    )
    assert value(logger, names.GENERATION_TOKENS_TOTAL) == 3
    assert value(logger, names.PROMPT_TOKENS_TOTAL) == 8
    assert value(logger, names.NUM_PREEMPTIONS_TOTAL) == 3
    assert value(logger, names.PREFIX_CACHE_QUERIES_TOTAL) == 48
    assert value(logger, names.PREFIX_CACHE_HITS_TOTAL) == 16
    assert value(logger, names.REQUEST_SUCCESS_TOTAL, finished_reason="length") == 1
    assert value(logger, names.REQUEST_SUCCESS_TOTAL, finished_reason="stop") == 0
    assert value(logger, names.TIME_TO_FIRST_TOKEN_SECONDS + "_sum") == 0.2
    assert value(logger, names.INTER_TOKEN_LATENCY_SECONDS + "_count") == 2
    assert value(logger, names.E2E_REQUEST_LATENCY_SECONDS + "_sum") == 2.0
    assert value(logger, names.REQUEST_QUEUE_TIME_SECONDS + "_sum") == 0.5
    assert value(logger, names.REQUEST_PREFILL_TIME_SECONDS + "_sum") == 0.5
    assert value(logger, names.REQUEST_DECODE_TIME_SECONDS + "_sum") == 1.0
    assert value(logger, names.ITERATION_TOKENS_TOTAL + "_sum") == 11
    assert value(logger, names.ITERATION_TOKENS_TOTAL + "_bucket", le="1.0") == 1
    assert value(logger, names.NUM_REQUESTS_RUNNING) == 0
    assert value(logger, names.KV_CACHE_USAGE_PERC) == 0.0


def test_exporter_gauges_aborts_and_monotonic_counters():
    logger = make_logger()
    logger.record(sched(kv_cache_usage=0.5, prefix_cache_queries=30, num_preemptions_total=4), None)
    assert value(logger, names.KV_CACHE_USAGE_PERC) == 0.5
    assert value(logger, names.GPU_CACHE_USAGE_PERC) == 0.5  # the deprecated alias follows
    # A transient dip in the scheduler's total (an undone admission) must not be counted twice.
    logger.record(sched(prefix_cache_queries=20, num_preemptions_total=4), None)
    logger.record(sched(prefix_cache_queries=35, num_preemptions_total=5), None)
    assert value(logger, names.PREFIX_CACHE_QUERIES_TOTAL) == 35
    assert value(logger, names.NUM_PREEMPTIONS_TOTAL) == 5
    logger.record_aborted(2)
    assert value(logger, names.REQUEST_SUCCESS_TOTAL, finished_reason="abort") == 2


def test_info_metrics_carry_the_configuration():
    logger = make_logger()
    cache = [labels for (name, labels), _ in samples(logger).items() if name == names.CACHE_CONFIG_INFO]
    assert len(cache) == 1
    cache = dict(cache[0])
    assert cache["block_size"] == "16" and cache["num_gpu_blocks"] == "100"
    assert cache["enable_prefix_caching"] == "True" and cache["gpu_memory_utilization"] == "0.9"
    assert set(cache) == {names.LABEL_ENGINE, *names.CACHE_CONFIG_LABELS}  # vLLM's info carries engine
    model = dict(
        next(labels for (name, labels), _ in samples(logger).items() if name == names.MODEL_CONFIG_INFO)
    )
    assert (model["num_attention_heads"], model["num_key_value_heads"], model["tensor_parallel_size"]) == (
        "32",
        "8",
        "1",
    )
    assert model["intermediate_size"] == "14336"
    assert model["architecture"] == "None"  # a key the engine did not give still labels every series
    assert set(model) == set(names.MODEL_CONFIG_LABELS)
    assert value(logger, names.CACHE_CONFIG_INFO, **cache) == 1


def test_registries_are_per_engine():
    first, second = make_logger(), make_logger()  # would raise "Duplicated timeseries" on a shared registry
    first.record_aborted(1)
    assert value(second, names.REQUEST_SUCCESS_TOTAL, finished_reason="abort") == 0


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five_buckets(4096)[-1] == 2000
