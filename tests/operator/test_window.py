"""The metric reader's pure half: parsing /metrics, per-pod series (counter resets), the window."""

from __future__ import annotations

import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.remediation.metrics import MetricsParseError, parse_scrape
from kvpilot.operator.remediation.series import PodSeries
from kvpilot.operator.remediation.window import summarize
from tests.operator.engine_metrics import EngineMetrics

T0 = 1_700_000_000.0


def series_of(
    points: list[tuple[float, float]], name: str = "pod-a", kv: float = 0.5, **engine
) -> tuple[PodSeries, EngineMetrics]:
    """A series from (seconds after T0, counter increase since the previous point) pairs."""
    metrics = EngineMetrics(**engine).set(kv=kv, waiting=1, running=10)
    series = PodSeries(name)
    for offset, increase in points:
        metrics.preempt(increase)
        series.add(parse_scrape(metrics.text(), T0 + offset))
    return series, metrics


def test_parses_the_engine_exposition_with_info_labels():
    metrics = EngineMetrics(num_gpu_blocks=512, max_model_len=2048).set(kv=0.75, waiting=3, running=12)
    metrics.preempt(7)
    scrape = parse_scrape(metrics.text(), T0)
    assert (scrape.preemptions, scrape.kv_usage, scrape.waiting, scrape.running) == (7, 0.75, 3, 12)
    assert scrape.preemptions_created is not None and scrape.missing == ()
    assert scrape.cache_info["num_gpu_blocks"] == "512"
    assert scrape.model_info["max_model_len"] == "2048"


def test_deprecated_kv_usage_alias_is_accepted_and_the_current_name_wins():
    alias = parse_scrape(EngineMetrics(alias_only=True).set(kv=0.4, waiting=0, running=1).text(), T0)
    assert alias.kv_usage == 0.4 and alias.missing == ()
    both = "\n".join(
        [
            f'{m.KV_CACHE_USAGE_PERC}{{model_name="x"}} 0.6',
            f'{m.GPU_CACHE_USAGE_PERC}{{model_name="x"}} 0.1',
            f'{m.NUM_PREEMPTIONS_TOTAL}{{model_name="x"}} 2',
            f'{m.NUM_REQUESTS_WAITING}{{model_name="x"}} 0',
            f'{m.NUM_REQUESTS_RUNNING}{{model_name="x"}} 0',
            "",
        ]
    )
    assert parse_scrape(both, T0).kv_usage == 0.6


def test_parsed_samples_are_accepted_as_well_as_text():
    scrape = parse_scrape(
        {
            m.NUM_PREEMPTIONS_TOTAL: 3,
            m.GPU_CACHE_USAGE_PERC: 0.5,
            m.NUM_REQUESTS_WAITING: 1,
            m.NUM_REQUESTS_RUNNING: 2,
        },
        T0,
    )
    assert (scrape.preemptions, scrape.kv_usage, scrape.missing) == (3, 0.5, ())
    listed = parse_scrape([{"name": m.NUM_PREEMPTIONS_TOTAL, "labels": {"model_name": "x"}, "value": 4}], T0)
    assert listed.preemptions == 4 and m.KV_CACHE_USAGE_PERC in listed.missing


def test_missing_metrics_and_garbage_are_reported():
    partial = parse_scrape(f'{m.NUM_PREEMPTIONS_TOTAL}{{model_name="x"}} 1\n', T0)
    assert set(partial.missing) == {m.KV_CACHE_USAGE_PERC, m.NUM_REQUESTS_WAITING, m.NUM_REQUESTS_RUNNING}
    with pytest.raises(ValueError, match="partial"):
        PodSeries("p").add(partial)
    with pytest.raises(MetricsParseError):
        parse_scrape("this is { not prometheus", T0)
    with pytest.raises(MetricsParseError):
        parse_scrape([{"name": "x"}], T0)


def test_counter_reset_by_restart_counts_what_the_new_process_counted():
    series, _ = series_of([(0, 0), (10, 10), (20, 10)])
    restarted = EngineMetrics().set(kv=0.5, waiting=1, running=10).preempt(4)  # new process: 4 since start
    series.add(parse_scrape(restarted.text(), T0 + 30))
    restarted.preempt(6)
    series.add(parse_scrape(restarted.text(), T0 + 40))
    window = summarize({"pod-a": series}, now=T0 + 40, window_s=40, stale_after_s=30)
    assert window.num_preemptions == 10 + 10 + 4 + 6
    assert window.preemption_rate == pytest.approx(30 / 40)
    assert window.counter_resets == 1


def test_reset_is_seen_from_created_even_when_the_new_count_is_higher():
    series, old = series_of([(0, 0), (10, 2)])
    fresh = EngineMetrics().set(kv=0.5, waiting=1, running=10).preempt(5)  # 5 > 2, but a new counter
    assert (
        parse_scrape(fresh.text(), T0).preemptions_created != parse_scrape(old.text(), T0).preemptions_created
    )
    series.add(parse_scrape(fresh.text(), T0 + 20))
    window = summarize({"pod-a": series}, now=T0 + 20, window_s=20, stale_after_s=30)
    assert window.num_preemptions == 2 + 5  # not 2 + (5 - 2)
    assert window.counter_resets == 1


def test_intervals_separate_a_burst_from_a_sustained_rate():
    sustained, _ = series_of([(t, 5) for t in range(0, 130, 10)])
    burst, _ = series_of([(t, 60 if t == 20 else 0) for t in range(0, 130, 10)])
    a = summarize({"p": sustained}, now=T0 + 120, window_s=120, stale_after_s=45)
    b = summarize({"p": burst}, now=T0 + 120, window_s=120, stale_after_s=45)
    assert a.preemption_rate == pytest.approx(0.5) and b.preemption_rate == pytest.approx(0.5)
    assert [i.preemption_rate for i in a.intervals] == pytest.approx([0.5] * 12)
    assert [i.preemption_rate for i in b.intervals] == pytest.approx([0, 6.0] + [0] * 10)
    assert a.full and b.full


@pytest.mark.parametrize(
    ("storm_s", "now", "full", "lowest"),
    [
        (75, 120, True, 0.0),  # a storm 75 s old in a 120 s window: the older intervals are calm
        (120, 120, True, 0.5),  # it has lasted the window: every interval storms
        (200, 110, False, 0.5),  # the pod is younger than the window: not full (yet)
    ],
)
def test_every_interval_of_a_full_window_is_judged(storm_s, now, full, lowest):
    start = 120 - storm_s
    series, _ = series_of([(t, 5 if t > start else 0) for t in range(0, now + 1, 10)])
    window = summarize({"p": series}, now=T0 + now, window_s=120, stale_after_s=45)
    assert window.is_complete and window.full == full
    assert min(i.preemption_rate for i in window.intervals) == pytest.approx(lowest)


def test_intervals_of_several_pods_are_averaged_per_replica():
    a, _ = series_of([(t, 10) for t in range(0, 130, 10)], "a")
    b, _ = series_of([(t, 0 if t <= 60 else 10) for t in range(0, 130, 10)], "b")
    window = summarize({"a": a, "b": b}, now=T0 + 120, window_s=120, stale_after_s=45)
    assert [i.preemption_rate for i in window.intervals] == pytest.approx([0.5] * 6 + [1.0] * 6)


def test_window_uses_the_sample_before_its_start_and_drops_older_ones():
    series, _ = series_of([(t, 100 if t < 60 else 1) for t in range(0, 190, 10)])
    window = summarize({"p": series}, now=T0 + 180, window_s=60, stale_after_s=30)
    assert window.start == T0 + 120 and window.num_preemptions == 6
    assert window.covered_s == 60


@pytest.mark.parametrize(
    ("offsets", "now", "problem"),
    [
        ([0, 10, 20, 30], 100, "metrics stale, last complete scrape 70s ago"),
        ([0, 10], 10, "2 scrape(s) over 10s of the 120s window"),
        ([0, 40, 80, 119], 119, None),  # 119 s >= 0.9 x 120 s, no gap above 45 s: complete
        ([0, 60, 119], 119, "a gap of 60s between scrapes in the window (more than 45s)"),
        ([100, 110, 120], 120, "3 scrape(s) over 20s of the 120s window"),
    ],
)
def test_stale_short_or_sparse_data_is_a_problem(offsets, now, problem):
    series, _ = series_of([(t, 1) for t in offsets])
    window = summarize({"pod-a": series}, now=T0 + now, window_s=120, stale_after_s=45)
    if problem is None:
        assert window.is_complete, window.problems
    else:
        assert not window.is_complete and any(problem in p for p in window.problems), window.problems


def test_failed_scrapes_are_reported_with_the_error():
    series, _ = series_of([(0, 1), (10, 1), (20, 1)])
    series.fail("no answer within 3s")
    window = summarize({"pod-a": series}, now=T0 + 100, window_s=20, stale_after_s=45)
    assert not window.is_complete
    assert "pod pod-a: metrics stale, last complete scrape 80s ago (no answer within 3s)" in window.problems


def test_missing_replicas_and_caller_problems_block_the_window():
    series, _ = series_of([(t, 1) for t in range(0, 130, 10)])
    window = summarize(
        {"pod-a": series}, now=T0 + 120, window_s=120, stale_after_s=45, expected_replicas=2, problems=["x"]
    )
    assert window.problems == ("x", "1 of 2 replica(s) ready on the current configuration")
    assert window.preemption_rate == pytest.approx(0.1)  # the numbers are still there, for status


def test_per_replica_means_capacity_and_shape_over_pods():
    a, _ = series_of([(t, 10) for t in range(0, 130, 10)], "a", kv=0.9, num_gpu_blocks=900)
    b, _ = series_of([(t, 0) for t in range(0, 130, 10)], "b", kv=0.5, num_gpu_blocks=800)
    window = summarize({"a": a, "b": b}, now=T0 + 120, window_s=120, stale_after_s=45, expected_replicas=2)
    assert window.is_complete and window.pods == ("a", "b")
    assert window.preemption_rate == pytest.approx(0.5)  # (1.0 + 0.0) / 2 replicas
    assert window.kv_usage == pytest.approx(0.7) and window.kv_usage_max == pytest.approx(0.9)
    assert (window.waiting, window.running) == (1, 10)
    assert window.capacity.num_gpu_blocks == 800  # pods that disagree: the smallest pool
    assert window.capacity.kv_cache_tokens == 800 * 16
    assert window.capacity.max_concurrency == pytest.approx(800 * 16 / 4096)
    assert (window.shape.num_attention_heads, window.shape.num_key_value_heads) == (32, 8)


def test_series_keeps_only_its_retention():
    series = PodSeries("p", retention_s=30)
    metrics = EngineMetrics().set(kv=0, waiting=0, running=0)
    for t in range(0, 200, 10):
        series.add(parse_scrape(metrics.text(), T0 + t))
    assert len(series.points()) <= 5
    series.add(parse_scrape(metrics.text(), T0 + 100))  # out of order: ignored
    assert series.last.time == T0 + 190


def test_the_mean_request_length_comes_from_the_requests_finished_in_the_window():
    metrics = EngineMetrics().set(kv=0.9, waiting=0, running=8)
    metrics.finish(1000, 1000, count=50)  # before the window: not counted
    series = PodSeries("pod-a")
    for index in range(13):
        if index:
            metrics.finish(16, 96, count=2)
        series.add(parse_scrape(metrics.text(), T0 + 10 * index))
    window = summarize({"pod-a": series}, now=T0 + 120, window_s=110, stale_after_s=45)
    assert window.is_complete
    assert window.mean_request_tokens == pytest.approx(112)


def test_the_mean_request_length_is_unknown_across_a_restart_or_without_finished_requests():
    quiet, _ = series_of([(10 * i, 0) for i in range(13)])
    window = summarize({"pod-a": quiet}, now=T0 + 120, window_s=110, stale_after_s=45)
    assert window.is_complete and window.mean_request_tokens is None
    series = PodSeries("pod-b")
    metrics = EngineMetrics().set(kv=0.5, waiting=0, running=4)
    for index in range(13):
        if index == 6:
            metrics = EngineMetrics().set(kv=0.5, waiting=0, running=4)  # a new process
        metrics.finish(16, 96)
        series.add(parse_scrape(metrics.text(), T0 + 10 * index))
    window = summarize({"pod-b": series}, now=T0 + 120, window_s=110, stale_after_s=45)
    assert window.is_complete and window.mean_request_tokens is None


def test_request_lengths_that_no_engine_emits_are_ignored_not_trusted():
    text = EngineMetrics().set(kv=0.5, waiting=0, running=4).finish(16, 96).text()
    scrape = parse_scrape(text, T0)
    assert (scrape.request_tokens, scrape.requests_finished) == (112, 1)
    line = 'vllm:request_generation_tokens_sum{model_name="llama"} 96.0'
    assert line in text
    for broken in (
        text.replace(line, line.replace("96.0", "NaN")),
        text.replace(line, line.replace("96.0", "-96.0")),
        text.replace("vllm:request_prompt_tokens_sum{", "vllm:request_prompt_tokens_other{"),
    ):
        scrape = parse_scrape(broken, T0)
        assert scrape.missing == () and scrape.invalid == ()  # optional: the scrape stays usable
        assert (scrape.request_tokens, scrape.requests_finished) == (None, None)
