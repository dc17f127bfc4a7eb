"""KVCachePressure for latency demand clears with hysteresis too: a queue with a TTFT p99 (or mean
queue time) still above half its threshold keeps it True (subsiding), so the condition does not flap
as the latency crosses the SLO back and forth."""

from __future__ import annotations

from kvpilot.operator.api.settings import resolve
from kvpilot.operator.remediation.evaluate import pressure_condition
from tests.operator.test_policy import isvc, window

SLO = {"slo": {"ttftP99Seconds": 2.0}}


def _pressure(win, previous, **remediation):
    return pressure_condition(win, resolve(isvc(remediation=remediation)).remediation, previous)


def test_latency_demand_subsides_before_it_clears():
    demand = window(kv=0.3, waiting=2, ttft_p99_s=3.0, num_first_tokens=40)
    was = _pressure(demand, None, **SLO)
    assert (was["status"], was["reason"]) == ("True", "Demand")
    near = window(kv=0.3, waiting=1, ttft_p99_s=1.5, num_first_tokens=40)  # under the SLO, above half
    still = _pressure(near, was, **SLO)
    assert (still["status"], still["reason"]) == ("True", "Demand") and "subsiding" in still["message"]
    assert _pressure(near, None, **SLO)["status"] == "False"  # never entered: no pressure
    gone = window(kv=0.3, waiting=1, ttft_p99_s=0.5, num_first_tokens=40)
    assert _pressure(gone, still, **SLO)["status"] == "False"
    drained = window(kv=0.3, waiting=0, ttft_p99_s=1.5, num_first_tokens=40)
    assert _pressure(drained, still, **SLO)["status"] == "False"


def test_without_an_slo_the_mean_queue_time_subsides_the_same_way():
    demand = window(kv=0.3, waiting=2, queue_time_s=3.0, num_first_tokens=40)
    was = _pressure(demand, None)
    assert was["reason"] == "Demand"
    assert _pressure(window(kv=0.3, waiting=2, queue_time_s=1.5), was)["status"] == "True"
    assert _pressure(window(kv=0.3, waiting=2, queue_time_s=0.5), was)["status"] == "False"
