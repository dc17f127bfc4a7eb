"""Demand that sees queues: a queue at every scrape of the window and a TTFT p99 above the SLO (without
one: a mean queue time above ``queueTimeHighSeconds``) adds a replica whatever the KV usage, replayed
through ``kvpilot replay`` on scripted engine expositions.

The long-prompt case is llm-d-autoscaling#662: requests queue behind prefill and TTFT climbs while
``vllm:kv_cache_usage_perc`` stays near 0.32, so a rule that needs a full KV cache never fires. The
expected quantiles below are worked out by hand from vLLM's TTFT buckets (``..., 0.75, 1.0, 2.5, 5.0,
...``) the way Prometheus' ``histogram_quantile`` interpolates, not computed by the code under test.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
from collections.abc import Callable

import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.remediation.evaluate import evaluate
from kvpilot.operator.remediation.metrics import Histogram, histogram_quantile, parse_scrape
from kvpilot.operator.remediation.replay import read_records, replay
from kvpilot.operator.remediation.series import PodSeries
from kvpilot.operator.remediation.window import summarize
from tests.operator.crd_schema import schema_errors
from tests.operator.engine_metrics import EngineMetrics
from tests.operator.test_policy import ISVC
from tests.operator.test_vllm_replay import FIXTURE as VLLM_STORM
from tests.operator.test_vllm_replay import isvc as vllm_isvc

T0 = 1_735_787_045.0
INTERVAL, WINDOW_S, COOLDOWN_S = 15.0, 120.0, 600.0
SLO = {"ttftP99Seconds": 2}
TTFT = m.TIME_TO_FIRST_TOKEN_SECONDS


@dataclasses.dataclass(frozen=True)
class Load:
    """What one pod shows at a scrape, and what it served in the interval that ends there."""

    kv: float = 0.32
    waiting: float = 12
    running: float = 20
    served: int = 10  # requests that got their first token in the interval
    ttft_s: float = 0.9
    queue_s: float = 0.3
    preemptions: float = 0.0


def recording(
    duration_s: float,
    load: Callable[[float], Load],
    *,
    pods: int = 2,
    lie: Callable[[str, float, int], str] = lambda text, t, pod: text,
) -> list[str]:
    """JSON lines every 15 s for ``pods`` engines under ``load(offset)``; ``lie(text, offset, pod)`` may
    rewrite a pod's ``/metrics`` body."""
    engines = [EngineMetrics(max_num_seqs=64, latency=True) for _ in range(pods)]
    lines = []
    t = 0.0
    while t <= duration_s:
        now = load(t)
        for index, engine in enumerate(engines):
            if t > 0:
                engine.preempt(now.preemptions).serve(now.ttft_s, now.queue_s, now.served)
            engine.set(kv=now.kv, waiting=now.waiting, running=now.running)
            record = {"time": T0 + t + 0.01 * index, "tick": T0 + t, "pod": f"llama-{index}",
                      "ready": True, "metrics": lie(engine.text(), t, index)}  # fmt: skip
            lines.append(json.dumps(record))
        t += INTERVAL
    return lines


def manifest(**remediation) -> dict:
    obj = copy.deepcopy(ISVC)
    obj["spec"]["remediation"].update(remediation)
    return obj


def run(lines: list[str], **remediation) -> list[tuple[float, object, dict]]:
    """(offset from T0, decision, InferenceService after it) for every tick."""
    obj = manifest(**remediation)
    records = read_records(lines, obj)
    return [(round(t - T0, 1), d, state) for t, d, state in replay(obj, records, stale_after_s=3 * INTERVAL)]


def applied(decisions) -> list[tuple[float, str, float, float]]:
    return [(t, d.lever, d.from_, d.to) for t, d, _ in decisions if d.action == "apply"]


def long_prompts(t: float) -> Load:
    """llm-d-autoscaling#662: 12 waiting per replica all along at KV ~0.32; after 300 s TTFT (4 s) and
    queue time (5 s) climb as the prompts pile up behind prefill."""
    slow = t > 300
    return Load(ttft_s=4.0 if slow else 0.9, queue_s=5.0 if slow else 0.3)


def pressure(state: dict) -> dict:
    return next(c for c in state["status"]["conditions"] if c["type"] == "KVCachePressure")


# --- (a) the long-prompt case: demand fires and a replica is added ---------------------------------


def test_long_prompts_with_ttft_above_the_slo_add_a_replica_at_a_third_full_kv_cache():
    decisions = run(recording(600, long_prompts), slo=SLO)
    # 315 s: the window (195, 315] holds 8 intervals x 2 pods x 10 requests, 20 of them at 4 s in the
    # (2.5, 5] bucket and 140 at 0.9 s in (0.75, 1]. p99: rank 0.99 x 160 = 158.4, 18.4 of the 20 into
    # (2.5, 5]: 2.5 + 2.5 x 18.4 / 20 = 4.8 s.
    assert applied(decisions) == [(315.0, "addReplica", 2, 3)]
    reason = next(d.reason for t, d, _ in decisions if t == 315.0)
    assert reason.startswith(
        "demand (12 or more waiting per replica at every scrape and TTFT p99 4.8s > SLO 2s, KV cache 32%)"
    )
    before = [d for t, d, _ in decisions if t < 315.0]
    assert before and all(d.action == "none" and d.pressure is None for d in before)
    state = decisions[-1][2]
    assert state["status"]["effective"]["overrides"]["replicas"]["value"] == 3
    assert "TTFT p99 4.8s > SLO 2s" in state["status"]["remediations"][0]["reason"]
    assert pressure(state)["reason"] == "Demand"
    assert pressure(state)["message"].startswith("demand: 12 or more waiting per replica at every scrape")


def test_the_events_name_the_rule_that_fired_with_its_numbers():
    lines = recording(315, long_prompts)
    series = {f"llama-{i}": PodSeries(f"llama-{i}") for i in range(2)}
    for record in map(json.loads, lines):
        series[record["pod"]].ingest(record["time"], record["metrics"])
    now = T0 + 315.01
    settings = resolve(manifest(slo=SLO))
    window = summarize(series, now=now, window_s=WINDOW_S, stale_after_s=45)
    assert window.ttft_p99_s == pytest.approx(4.8) and window.num_first_tokens == 160
    decision, update = evaluate(settings, window, now)
    assert (decision.action, decision.lever) == ("apply", "addReplica")
    events = {reason: (kind, message) for kind, reason, message in update.events}
    assert (
        events["Remediated"][0] == "Normal"
        and "TTFT p99 4.8s > SLO 2s, KV cache 32%" in events["Remediated"][1]
    )
    assert events["KVCachePressure"] == (
        "Warning",
        "demand: 12 or more waiting per replica at every scrape and TTFT p99 4.8s > SLO 2s, KV cache 32%",
    )


def test_without_an_slo_the_mean_queue_time_stands_in():
    decisions = run(recording(600, long_prompts))  # no spec.remediation.slo; queueTimeHighSeconds 2
    # The mean over the window passes 2 s once 3 of its 8 intervals are slow: (5 x 0.3 + 3 x 5) / 8 =
    # 2.0625 s at 345 s (two slow intervals: (6 x 0.3 + 2 x 5) / 8 = 1.475 s).
    assert applied(decisions) == [(345.0, "addReplica", 2, 3)]
    reason = next(d.reason for t, d, _ in decisions if t == 345.0)
    assert "mean queue time 2.06s > 2s (no TTFT SLO), KV cache 32%" in reason
    # A higher threshold holds it back: the window's mean tops out at 5 s.
    assert applied(run(recording(600, long_prompts), thresholds={"queueTimeHighSeconds": 6})) == []


# --- (b) the same queue with TTFT within the SLO: no demand ----------------------------------------


def test_the_same_queue_with_ttft_within_the_slo_is_no_demand():
    # TTFT 0.9 s in the (0.75, 1] bucket: p99 0.75 + 0.25 x 0.99 = 0.9975 s, under the 2 s SLO. With an
    # SLO the queue time (5 s here) is not the test: the SLO says what the service promises.
    within = lambda t: dataclasses.replace(long_prompts(t), ttft_s=0.9)  # noqa: E731
    decisions = run(recording(600, within), slo=SLO)
    assert applied(decisions) == []
    assert all(d.pressure is None for _, d, _ in decisions)
    assert "TTFT p99 0.998s over 160 request(s)" in decisions[-1][1].reason
    assert "mean queue time 5s" in decisions[-1][1].reason


# --- (c) a short-prompt storm keeps its decision ---------------------------------------------------


def test_a_short_prompt_storm_with_a_queue_keeps_the_storm_ladder():
    # Short prompts at a full KV cache: 4 waiting per replica (below requestsWaitingHigh), TTFT far over
    # the SLO, and preemptions from 60 s on. The queue is the preemptions': the storm ladder answers it
    # (gpuMemoryUtilization first, once the storm covers a full window), no replica is added.
    def storm(t: float) -> Load:
        return Load(kv=0.97, waiting=4, running=40, ttft_s=4.0, queue_s=3.0, preemptions=15 if t > 60 else 0)

    decisions = run(recording(600, storm), slo=SLO)
    assert applied(decisions) == [(180.0, "raiseGpuMemoryUtilization", 0.9, 0.95)]
    assert "a preemption storm" in next(d.reason for t, d, _ in decisions if t == 180.0)
    assert all(d.pressure != "demand" for _, d, _ in decisions)
    # Without an SLO, on queue time, the same.
    assert applied(run(recording(600, storm))) == [(180.0, "raiseGpuMemoryUtilization", 0.9, 0.95)]


def test_a_full_kv_cache_with_a_long_queue_is_still_the_kv_rule():
    def full(t: float) -> Load:
        return Load(kv=0.97, waiting=12, running=40)

    decisions = run(recording(300, full), slo=SLO)
    assert applied(decisions) == [(120.0, "addReplica", 2, 3)]
    reason = next(d.reason for t, d, _ in decisions if t == 120.0)
    assert "KV cache >= 90% and >= 8 waiting per replica at every scrape (lowest 97% and 12)" in reason


# --- (d) a queue at only some scrapes: no demand ---------------------------------------------------


@pytest.mark.parametrize("remediation", [{"slo": SLO}, {}], ids=["slo", "queue-time"])
def test_a_queue_at_only_some_scrapes_of_the_window_is_no_demand(remediation):
    def gaps(t: float) -> Load:  # every fourth scrape finds the queue empty; latency stays high
        return Load(waiting=0 if round(t / INTERVAL) % 4 == 0 else 12, ttft_s=4.0, queue_s=5.0)

    decisions = run(recording(900, gaps), **remediation)
    assert applied(decisions) == []
    assert all(d.pressure is None for _, d, _ in decisions)


def test_a_queue_without_a_request_served_in_the_window_gives_no_quantile():
    stuck = lambda t: Load(waiting=12, served=0)  # noqa: E731
    decisions = run(recording(600, stuck), slo=SLO)
    assert applied(decisions) == [] and "TTFT p99" not in decisions[-1][1].reason
    assert applied(run(recording(600, stuck))) == []


def test_requests_waiting_min_gates_the_latency_rule():
    one = lambda t: dataclasses.replace(long_prompts(t), waiting=1)  # noqa: E731
    assert applied(run(recording(600, one), slo=SLO)) == [(315.0, "addReplica", 2, 3)]
    assert applied(run(recording(600, one), slo=SLO, thresholds={"requestsWaitingMin": 2})) == []


# --- (e) invalid histogram data: refused, never acted on -------------------------------------------

BUCKET_5 = f'{TTFT}_bucket{{le="5.0",model_name="llama"}}'


def _set_sample(text: str, prefix: str, value: str) -> str:
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(prefix))
    lines[index] = f"{prefix} {value}"
    return "\n".join(lines) + "\n"


def test_a_ttft_histogram_whose_buckets_are_not_cumulative_is_refused():
    def lie(text: str, t: float, pod: int) -> str:  # pod 1's le=5 bucket below its le=2.5 bucket
        return _set_sample(text, BUCKET_5, "0.0") if pod == 1 and t > 300 else text

    decisions = run(recording(600, long_prompts, lie=lie), slo=SLO)
    assert applied(decisions) == []
    assert all(d.pressure is None for t, d, _ in decisions)
    late = [d.reason for t, d, _ in decisions if t > 300]
    assert late and all(
        "latency data not used (pod llama-1: vllm:time_to_first_token_seconds: buckets not cumulative" in r
        for r in late
    )
    # The same recording without the lie acts (see the long-prompt case): the refusal is the lie's.
    assert applied(run(recording(600, long_prompts), slo=SLO)) == [(315.0, "addReplica", 2, 3)]


@pytest.mark.parametrize(
    ("prefix", "value", "why"),
    [
        (BUCKET_5, "0.0", "buckets not cumulative (le=5: 0 < le=2.5: 10)"),
        (f'{TTFT}_bucket{{le="+Inf",model_name="llama"}}', "NaN", "=nan"),
        (f'{TTFT}_sum{{model_name="llama"}}', "-1.0", "=-1"),
        (f'{TTFT}_count{{model_name="llama"}}', "11.0", "_count 11 is not the +Inf bucket's 10"),
        (f'{TTFT}_bucket{{le="+Inf",model_name="llama"}}', "+Inf", "=inf"),
    ],
)
def test_latency_histograms_no_engine_emits_are_dropped_and_named(prefix, value, why):
    text = EngineMetrics(latency=True).set(kv=0.3, waiting=3, running=4).serve(0.9, 0.3, 10).text()
    assert parse_scrape(text, T0).ttft.count == 10
    scrape = parse_scrape(_set_sample(text, prefix, value), T0)
    assert scrape.ttft is None and scrape.queue_time is not None
    assert len(scrape.dropped) == 1 and scrape.dropped[0].startswith(TTFT) and why in scrape.dropped[0]
    assert scrape.invalid == () and scrape.missing == ()  # optional: the other signals stay usable


def test_a_histogram_that_falls_without_a_restart_is_not_used():
    engine = EngineMetrics(latency=True).set(kv=0.32, waiting=12, running=20)
    series = PodSeries("a")
    for index in range(10):
        text = engine.serve(4.0, 5.0, 10).text()
        if index == 6:  # the same process (same counter creation time) shows 5 first tokens, not 70
            text = "".join(
                line.replace(" 70.0", " 5.0").replace(" 280.0", " 20.0") if line.startswith(TTFT) else line
                for line in text.splitlines(keepends=True)
            )
            assert parse_scrape(text, T0).ttft.count == 5  # a sound histogram, only lower
        series.ingest(T0 + INTERVAL * index, text)
    window = summarize({"a": series}, now=T0 + 135, window_s=WINDOW_S, stale_after_s=45)
    assert window.is_complete and window.ttft_p99_s is None
    assert window.latency_invalid == (f"pod a: {TTFT}: fell without a restart, or its buckets changed",)
    assert window.queue_time_s == pytest.approx(5.0)  # the queue-time histogram is sound
    assert resolve(manifest(slo=SLO)).remediation.ttft_p99_slo_s == 2.0


# --- the window's latency: summed over pods, across restarts ---------------------------------------


def test_the_p99_comes_from_the_buckets_summed_over_pods():
    # Pod a: 98 first tokens at 0.9 s; pod b: 2 at 4 s. Summed: rank 99 lies in (2.5, 5], 1 of its 2:
    # 3.75 s. (Each pod's own p99 is 0.9975 s and 4.975 s: neither their mean nor their max.)
    series = {name: PodSeries(name) for name in ("a", "b")}
    engines = {"a": EngineMetrics(latency=True), "b": EngineMetrics(latency=True)}
    for index in range(9):
        for name, engine in engines.items():
            engine.set(kv=0.3, waiting=3, running=4)
            if index == 8 and name == "a":
                engine.serve(0.9, 0.2, 98)
            elif index == 8:
                engine.serve(4.0, 1.2, 2)
            series[name].ingest(T0 + INTERVAL * index, engine.text())
    window = summarize(series, now=T0 + 120, window_s=WINDOW_S, stale_after_s=45)
    assert window.ttft_p99_s == pytest.approx(3.75)
    assert window.num_first_tokens == 100
    assert window.queue_time_s == pytest.approx((98 * 0.2 + 2 * 1.2) / 100)


def test_a_restart_in_the_window_counts_what_the_new_process_counted():
    series = PodSeries("a")
    engine = EngineMetrics(latency=True).serve(
        0.9, 0.3, 500
    )  # an old process, 500 first tokens before the window
    for index in range(9):
        if index == 5:
            engine = EngineMetrics(latency=True)  # restarted: counters from 0, a new creation time
        engine.set(kv=0.3, waiting=3, running=4)
        if index:
            engine.serve(4.0, 5.0, 3)
        series.ingest(T0 + INTERVAL * index, engine.text())
    window = summarize({"a": series}, now=T0 + 120, window_s=WINDOW_S, stale_after_s=45)
    assert window.counter_resets == 1
    assert window.num_first_tokens == 8 * 3  # 4 intervals of the old process, 4 of the new one
    assert window.queue_time_s == pytest.approx(5.0)
    assert window.latency_invalid == ()


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        # Prometheus' interpolation: 0.5 of 100 -> the 50th of the 60 in (1, 2]: 1 + 1 x (50 - 20) / 60.
        (0.5, ((1.0, 20.0), (2.0, 80.0), (float("inf"), 100.0)), 1.5),
        # The lowest bucket starts at 0: 10 of 20 in (0, 1] -> 0.5.
        (0.1, ((1.0, 20.0), (2.0, 80.0), (float("inf"), 100.0)), 0.5),
        # A rank in +Inf -> the highest finite bound.
        (0.99, ((1.0, 20.0), (2.0, 80.0), (float("inf"), 100.0)), 2.0),
        # No observation, no +Inf bucket, a single bucket: no quantile.
        (0.99, ((1.0, 0.0), (float("inf"), 0.0)), None),
        (0.99, ((1.0, 5.0), (2.0, 10.0)), None),
        (0.99, ((float("inf"), 10.0),), None),
    ],
)
def test_histogram_quantile_interpolates_as_prometheus_does(q, buckets, expected):
    assert histogram_quantile(q, buckets) == (pytest.approx(expected) if expected is not None else None)
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(0.0, buckets)


# --- the spec fields -------------------------------------------------------------------------------


def test_the_slo_and_the_queue_thresholds_in_the_crd_and_the_settings(crd_schema):
    defaults = resolve(manifest()).remediation
    assert (defaults.ttft_p99_slo_s, defaults.waiting_min, defaults.queue_time_high_s) == (None, 1.0, 2.0)
    settings = resolve(
        manifest(slo={"ttftP99Seconds": 1.5}, thresholds={"queueTimeHighSeconds": 4})
    ).remediation
    assert (settings.ttft_p99_slo_s, settings.queue_time_high_s) == (1.5, 4.0)
    assert schema_errors(manifest(slo={"ttftP99Seconds": 1.5}), crd_schema) == []
    for bad in ({"ttftP99Seconds": 0}, {"ttftP99Seconds": -1}, {"ttftP99Seconds": "2s"}, {"ttftP99": 2}):
        assert schema_errors(manifest(slo=bad), crd_schema), bad
    for bad in ({"queueTimeHighSeconds": 0}, {"requestsWaitingMin": 0}):
        assert schema_errors(manifest(thresholds=bad), crd_schema), bad


def test_an_engine_without_latency_histograms_gives_no_latency_and_no_complaint():
    series = PodSeries("a")
    engine = EngineMetrics().set(kv=0.32, waiting=12, running=20)  # the histograms not exported
    for index in range(9):
        series.ingest(T0 + INTERVAL * index, engine.text())
    window = summarize({"a": series}, now=T0 + 120, window_s=WINDOW_S, stale_after_s=45)
    assert window.is_complete and (window.ttft_p99_s, window.queue_time_s) == (None, None)
    assert window.latency_invalid == ()
    with pytest.raises(ValueError, match="latency=True"):
        engine.serve(1.0, 0.5)


def test_an_increase_in_which_a_bucket_loses_observations_is_none():
    inf = float("inf")
    before = Histogram(((1.0, 3.0), (inf, 10.0)), 9.0, 10.0)
    # Both cumulative, every cumulative count grew, but le=1 gained 5 while the total gained 1: the
    # (1, +Inf] bucket lost 4 observations, which no counter does.
    assert Histogram(((1.0, 8.0), (inf, 11.0)), 10.0, 11.0).increase(before) is None
    grown = Histogram(((1.0, 5.0), (inf, 13.0)), 12.5, 13.0).increase(before)
    assert grown == Histogram(((1.0, 2.0), (inf, 3.0)), 3.5, 3.0)
    assert Histogram(((2.0, 5.0), (inf, 13.0)), 12.5, 13.0).increase(before) is None  # other bounds


def test_real_vllm_storm_with_an_slo_its_ttft_breaks_keeps_the_storm_ladder():
    """``fixtures/vllm-0.32-cpu-storm.jsonl.gz`` (see test_vllm_replay): vLLM's own histograms are read
    (the reason shows their p99), 13-14 requests queue at every scrape and TTFT passes 1 s, but the
    queue is the storm's: the memory fraction is raised, as without an SLO."""
    lines = gzip.decompress(VLLM_STORM.read_bytes()).decode().splitlines()
    obj = vllm_isvc("Auto")
    obj["spec"]["remediation"]["slo"] = {"ttftP99Seconds": 1}
    changes = [d for _, d, _ in replay(obj, read_records(lines, obj)) if d.action == "apply"]
    assert [(d.field, d.from_, d.to) for d in changes] == [("gpuMemoryUtilization", 0.5, 0.55)]
    assert (
        "a preemption storm" in changes[0].reason and "TTFT p99 2.48s over 56 request(s)" in changes[0].reason
    )
