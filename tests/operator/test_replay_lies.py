"""``kvpilot replay`` on recordings that lie: whatever the data does, no change before a storm has
lasted a full window, changes a cooldown apart and within the limits."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.remediation.replay import read_records, replay
from tests.operator.engine_metrics import EngineMetrics
from tests.operator.test_policy import ISVC

T0 = 1_735_787_045.0
INTERVAL, WINDOW_S, COOLDOWN_S = 15.0, 120.0, 600.0
CALM = (None, None)


def recording(
    duration_s: float,
    storm: tuple[float | None, float | None] = CALM,
    *,
    pods: int = 1,
    lie: Callable[[dict, float], dict | list[dict] | None] = lambda record, t: record,
) -> list[str]:
    """JSON lines every 15 s; each pod preempts 1/s in ``storm`` (start, end offsets), else not.
    ``lie(record, offset)`` may rewrite a record, drop it (None) or add copies (a list)."""
    engines = [EngineMetrics(max_num_seqs=64) for _ in range(pods)]
    start, end = storm
    lines = []
    t = 0.0
    while t <= duration_s:
        for index, engine in enumerate(engines):
            storming = start is not None and start < t <= end
            engine.preempt(INTERVAL if storming else 0)
            engine.set(kv=0.97 if storming else 0.5, waiting=0, running=40 if storming else 12)
            record = {"time": T0 + t + 0.01 * index, "tick": T0 + t, "pod": f"llama-{index}",
                      "ready": True, "metrics": engine.text()}  # fmt: skip
            out = lie(record, t)
            for item in out if isinstance(out, list) else [out] if out else []:
                lines.append(json.dumps(item))
        t += INTERVAL
    return lines


def run(lines: list[str], pods: int = 1) -> list[tuple[float, object]]:
    isvc = copy.deepcopy(ISVC)
    isvc["spec"]["replicas"] = pods
    records = read_records(lines, isvc)
    return [(t - T0, d) for t, d, _ in replay(isvc, records, stale_after_s=3 * INTERVAL)]


def check(decisions, storm_start: float | None, earliest: float | None = None) -> list[tuple[float, object]]:
    """The applied changes, after asserting the invariants: none before ``earliest`` (default: a full
    window after the storm began; no storm: none at all), a cooldown apart, within the limits."""
    applied = [(t, d) for t, d in decisions if d.action == "apply"]
    if storm_start is None:
        assert not applied, [d.reason for _, d in applied]
        return applied
    bound = earliest if earliest is not None else storm_start + WINDOW_S
    assert all(t >= bound for t, _ in applied), [(t, d.reason) for t, d in applied]
    for (a, _), (b, _) in zip(applied, applied[1:], strict=False):
        assert b - a >= COOLDOWN_S
    for _, d in applied:
        if d.field == "gpuMemoryUtilization":
            assert d.to <= 0.95
        if d.field == "maxNumSeqs":
            assert d.to >= 16
        if d.field == "replicas":
            assert d.to <= 4
    return applied


def replace_metric(text: str, name: str, value: str) -> str:
    return "\n".join(
        f"{line.rsplit(' ', 1)[0]} {value}" if line.startswith(name + "{") else line
        for line in text.split("\n")
    )


def every(n: int, change: Callable[[dict], dict | None]) -> Callable[[dict, float], dict | None]:
    """Apply ``change`` to all records but every ``n``-th tick."""
    return lambda record, t: record if int(t // INTERVAL) % n == 0 else change(record)


def with_metrics(fn: Callable[[str], object]) -> Callable[[dict], dict]:
    return lambda record: {**record, "metrics": fn(record["metrics"])}


LIES_IN_CALM = {
    "unparsable scrapes": every(2, with_metrics(lambda text: "<html>502 Bad Gateway</html> {")),
    "the counter missing": every(
        2, with_metrics(lambda text: replace_metric(text, m.NUM_PREEMPTIONS_TOTAL, ""))
    ),
    "NaN counters": every(4, with_metrics(lambda text: replace_metric(text, m.NUM_PREEMPTIONS_TOTAL, "NaN"))),
    "negative counters": every(
        4, with_metrics(lambda text: replace_metric(text, m.NUM_PREEMPTIONS_TOTAL, "-1"))
    ),
    "a counter that dips to 0 and back": every(
        3, with_metrics(lambda text: replace_metric(text, m.NUM_PREEMPTIONS_TOTAL, "0.0"))
    ),
    "+Inf KV usage": every(2, with_metrics(lambda text: replace_metric(text, m.KV_CACHE_USAGE_PERC, "+Inf"))),
    "negative gauges": every(
        2, with_metrics(lambda text: replace_metric(text, m.NUM_REQUESTS_WAITING, "-3"))
    ),
    "truncated bodies": every(2, with_metrics(lambda text: text[: len(text) // 3])),
}


@pytest.mark.parametrize("lie", list(LIES_IN_CALM), ids=list(LIES_IN_CALM))
def test_lies_in_a_calm_recording_never_make_a_storm(lie):
    # A calm engine that had counted 500 preemptions before the recording began.
    def calm_with_history(record, t):
        record = {**record, "metrics": replace_metric(record["metrics"], m.NUM_PREEMPTIONS_TOTAL, "500.0")}
        return LIES_IN_CALM[lie](record, t)

    decisions = run(recording(1800, lie=calm_with_history))
    check(decisions, None)
    assert all(d.pressure is None for _, d in decisions)


@pytest.mark.parametrize("lie", list(LIES_IN_CALM), ids=list(LIES_IN_CALM))
def test_lies_during_a_storm_delay_but_never_hasten_the_change(lie):
    storm_start = 300.0

    def lies_after_the_storm_began(record, t):
        return LIES_IN_CALM[lie](record, t) if storm_start < t <= storm_start + 200 else record

    decisions = run(recording(2400, (storm_start, 2400), lie=lies_after_the_storm_began))
    applied = check(decisions, storm_start)
    assert applied, "the storm outlasts the lies: it must be acted on"
    lying = [d for t, d in decisions if storm_start < t <= storm_start + 200 and int(t // INTERVAL) % 2]
    assert all(d.action == "none" for d in lying)


def test_only_an_unready_pod_storming_is_never_acted_on():
    def unready_storm(record, t):
        if record["pod"] == "llama-1":
            return {**record, "ready": False}
        return {**record, "metrics": replace_metric(record["metrics"], m.NUM_PREEMPTIONS_TOTAL, "0.0")}

    decisions = run(recording(1800, (60, 1800), pods=2, lie=unready_storm), pods=2)
    check(decisions, None)
    assert any("not ready: llama-1" in d.reason for _, d in decisions)


def test_a_twenty_minute_hole_refills_the_window_before_any_change():
    hole = (300.0, 1500.0)
    lines = recording(2400, (0, 2400), lie=lambda r, t: None if hole[0] < t <= hole[1] else r)
    decisions = run(lines)
    applied = check(decisions, 0.0)
    assert applied[0][0] < hole[0], "the storm before the hole was acted on"
    later = [t for t, _ in applied if t > hole[0]]
    assert later and later[0] >= hole[1] + WINDOW_S
    during = [d for t, d in decisions if hole[1] < t < hole[1] + WINDOW_S]
    assert during and all(d.action == "none" for d in during)


def test_duplicate_and_out_of_order_scrapes_change_nothing():
    def shuffled(record, t):
        late = {**record, "time": record["time"] - 40}  # an old answer, arriving late
        return [record, dict(record), late]

    storm_start = 300.0
    plain = run(recording(1800, (storm_start, 1800)))
    lying = run(recording(1800, (storm_start, 1800), lie=shuffled))
    check(lying, storm_start)
    assert [(t, d.action, d.field, d.to) for t, d in lying] == [
        (t, d.action, d.field, d.to) for t, d in plain
    ]


def test_a_storm_shorter_than_the_window_never_triggers_and_a_full_one_does_at_once():
    short = run(recording(1800, (300, 300 + WINDOW_S - INTERVAL)))
    check(short, None)
    full = run(recording(1800, (300, 1800)))
    applied = check(full, 300.0)
    assert applied[0][0] == 300 + WINDOW_S  # the first evaluation after a full window of storm
