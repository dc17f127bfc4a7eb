"""Samples no healthy engine emits, and counter falls that are not restarts: dropped, never a storm."""

from __future__ import annotations

import math

import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.remediation.metrics import parse_scrape
from kvpilot.operator.remediation.policy import decide
from kvpilot.operator.remediation.series import PodSeries
from kvpilot.operator.remediation.window import summarize
from tests.operator.test_policy import isvc

T0 = 1_700_000_000.0


def body(
    preemptions: float, kv: float = 0.5, waiting: float = 0, running: float = 4, start: float | None = None
):
    """A ``/metrics`` body with the four required metrics (and the process start time, if given)."""
    lines = [
        f'{m.NUM_PREEMPTIONS_TOTAL}{{model_name="x"}} {preemptions}',
        f'{m.KV_CACHE_USAGE_PERC}{{model_name="x"}} {kv}',
        f'{m.NUM_REQUESTS_WAITING}{{model_name="x"}} {waiting}',
        f'{m.NUM_REQUESTS_RUNNING}{{model_name="x"}} {running}',
    ]
    if start is not None:
        lines.append(f"process_start_time_seconds {start}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("metrics", "invalid"),
    [
        (body(float("nan")), f"{m.NUM_PREEMPTIONS_TOTAL}=nan"),
        (body(-1), f"{m.NUM_PREEMPTIONS_TOTAL}=-1"),
        (body(float("inf")), f"{m.NUM_PREEMPTIONS_TOTAL}=inf"),
        (body(3, kv=float("nan")), f"{m.KV_CACHE_USAGE_PERC}=nan"),
        (body(3, kv=float("inf")), f"{m.KV_CACHE_USAGE_PERC}=inf"),
        (body(3, kv=-0.5), f"{m.KV_CACHE_USAGE_PERC}=-0.5"),
        (body(3, kv=1.5), f"{m.KV_CACHE_USAGE_PERC}=1.5"),
        (body(3, waiting=-2), f"{m.NUM_REQUESTS_WAITING}=-2"),
        (body(3, running=-1), f"{m.NUM_REQUESTS_RUNNING}=-1"),
        (body(3), None),
        (body(0, kv=1.0), None),
    ],
)
def test_values_no_engine_emits_are_dropped_and_named(metrics, invalid):
    scrape = parse_scrape(metrics, T0)
    assert scrape.invalid == ((invalid,) if invalid else ())
    series = PodSeries("p")
    series.ingest(T0, metrics)
    if invalid:
        assert series.last is None and series.problem == f"invalid samples: {invalid}"
        with pytest.raises(ValueError, match="invalid"):
            series.add(scrape)
    else:
        assert series.last is not None and series.problem is None


def test_an_invalid_scrape_makes_the_tick_bad_and_the_next_good_one_clears_it():
    series = PodSeries("p")
    for t in range(0, 130, 10):
        series.ingest(T0 + t, body(t))
    series.ingest(T0 + 130, body(-1))
    window = summarize({"p": series}, now=T0 + 130, window_s=120, stale_after_s=45)
    assert not window.is_complete
    assert window.problems == (
        f"pod p: bad data in the latest scrape: invalid samples: {m.NUM_PREEMPTIONS_TOTAL}=-1",
    )
    decision = decide(window, resolve(isvc(replicas=1)), [], T0 + 130)
    assert decision.action == "none" and decision.reason.startswith("not acting on incomplete data")
    series.ingest(T0 + 140, body(140))
    assert summarize({"p": series}, now=T0 + 140, window_s=120, stale_after_s=45).is_complete


def test_a_calm_recording_with_mostly_invalid_counters_is_no_storm():
    # 3 scrapes out of 4 carry NaN or -1 for the counter; the engine never preempts (value 7 throughout).
    series = PodSeries("p")
    decisions = []
    for tick in range(200):
        t = T0 + tick * 15
        value = (7, float("nan"), -1, float("nan"))[tick % 4]
        series.ingest(t, body(value))
        window = summarize({"p": series}, now=t, window_s=120, stale_after_s=45)
        decisions.append(decide(window, resolve(isvc(replicas=1)), [], t))
        assert window.num_preemptions == 0
    assert {d.action for d in decisions} == {"none"}
    assert not series.resets


def test_a_dip_that_comes_back_is_no_reset_and_no_increase():
    series = PodSeries("p")
    for t, value in [(0, 500), (10, 500), (20, 0), (30, 500), (40, 501)]:
        series.ingest(T0 + t, body(value))
        if t == 20:
            assert series.problem and "fell from 500 to 0" in series.problem
    assert not series.resets and series.problem is None
    assert [p.preemptions for p in series.points()] == [0, 0, 0, 1]


def test_a_fall_that_keeps_rising_from_the_new_base_is_a_restart():
    series = PodSeries("p")
    for t, value in [(0, 500), (10, 510), (20, 2), (30, 6), (40, 9)]:
        series.ingest(T0 + t, body(value))
    assert list(series.resets) == [T0 + 20]
    assert [p.preemptions for p in series.points()] == [0, 10, 12, 16, 19]


def test_a_moved_process_start_time_is_a_restart_at_once_even_when_the_count_grew():
    series = PodSeries("p")
    series.ingest(T0, body(5, start=T0 - 100))
    series.ingest(T0 + 10, body(8, start=T0 + 5))  # a new process, 8 since it started
    assert list(series.resets) == [T0 + 10] and series.problem is None
    assert series.points()[-1].preemptions == 8
    series.ingest(T0 + 20, body(2, start=T0 + 5))  # same process, counter falls: suspect
    assert series.problem is not None and len(series.resets) == 1


def test_start_time_and_created_are_read_and_bad_ones_ignored():
    scrape = parse_scrape(body(1, start=T0), T0)
    assert scrape.process_start == T0 and scrape.started == (T0, None)
    assert parse_scrape(body(1, start=math.nan), T0).process_start is None


def test_duplicate_and_out_of_order_answers_are_ignored():
    series = PodSeries("p")
    for t, value in [(0, 0), (10, 10), (10, 10), (5, 999), (20, 20)]:
        series.ingest(T0 + t, body(value))
    series.ingest(T0 + 15, "garbage {")  # a late, unparsable answer says nothing about now
    assert [p.scrape.time - T0 for p in series.points()] == [0, 10, 20] and series.problem is None
