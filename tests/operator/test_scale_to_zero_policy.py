"""Scale to zero (``limits.minReplicas: 0`` with ``idleAfter``): the last replica goes only after no
request came for ``idleAfter`` (``status.idleSince``, kept by evaluate), and a service at zero wakes
at once (no cooldown) for a front door's wake request newer than its last change."""

from __future__ import annotations

from kvpilot.operator.api import names
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.timefmt import format_time
from kvpilot.operator.remediation.decision import APPLY, NONE, RECOMMEND_ACTION, Change
from kvpilot.operator.remediation.evaluate import evaluate
from kvpilot.operator.remediation.policy import decide
from kvpilot.operator.remediation.window import MetricWindow
from tests.operator.test_policy import IDLE, NOW, isvc, window

QUIET = window(kv=0.0, running=0.0, pods=1)
LIGHT = window(kv=0.05, running=1.0, pods=1)  # idle by KV usage, but requests still come
TO_ZERO = {"limits": {"minReplicas": 0}, "idleAfter": "10m"}


def _isvc(idle_since: float | None = None, wake: float | None = None, replicas: int = 1, **remediation):
    obj = isvc(replicas=replicas, remediation={**TO_ZERO, **remediation})
    if idle_since is not None:
        obj.setdefault("status", {})["idleSince"] = format_time(idle_since)
    if wake is not None:
        obj["metadata"]["annotations"] = {names.ANNOTATION_WAKE: format_time(wake)}
    return obj


def test_the_last_replica_goes_only_after_idle_after_without_a_request():
    # Light use is idle by KV usage, yet never scaled to zero.
    light = decide(LIGHT, resolve(_isvc(idle_since=None)), [], NOW)
    assert light.action == NONE and "scale to zero after idleAfter 600s" in light.reason
    young = decide(QUIET, resolve(_isvc(idle_since=NOW - 300)), [], NOW)
    assert young.action == NONE and "no request for 300s" in young.reason
    old = decide(QUIET, resolve(_isvc(idle_since=NOW - 601)), [], NOW)
    assert (old.action, old.lever, old.from_, old.to) == (APPLY, "removeReplica", 1, 0)
    assert "no request for 601s" in old.reason and "scale to zero" in old.reason
    # minReplicas 1 (the default) never reaches zero.
    assert decide(QUIET, resolve(isvc(replicas=1)), [], NOW).action == NONE
    # Above one replica the usual idle rule removes replicas without waiting for idleAfter.
    assert decide(IDLE, resolve(_isvc(replicas=2)), [], NOW).to == 1


def test_evaluate_keeps_idle_since():
    _, update = evaluate(resolve(_isvc()), QUIET, NOW)
    assert update.patch["idleSince"] == format_time(QUIET.start)
    _, update = evaluate(resolve(_isvc(idle_since=NOW - 50)), QUIET, NOW)
    assert "idleSince" not in (update.patch or {})  # written once, not every tick
    _, update = evaluate(resolve(_isvc(idle_since=NOW - 50)), LIGHT, NOW)
    assert update.patch["idleSince"] is None  # a request came: the quiet time starts over


def test_at_zero_a_wake_request_newer_than_the_last_change_adds_one_replica_at_once():
    to_zero = Change(NOW - 30, "removeReplica", "replicas", 1, 0, "scale to zero", 5)
    overrides = {"replicas": {"value": 0, "specValue": 1}}
    asleep = _isvc(wake=None)
    asleep["status"] = {"effective": {"overrides": overrides}}
    no_pods = MetricWindow(end=NOW, window_s=120.0)
    assert resolve(asleep).effective.replicas == 0
    idle = decide(no_pods, resolve(asleep), [to_zero], NOW)
    assert idle.action == NONE and "scaled to zero" in idle.reason
    stale = _isvc(wake=NOW - 60)  # before the change: no wake
    stale["status"] = {"effective": {"overrides": overrides}}
    assert decide(no_pods, resolve(stale), [to_zero], NOW).action == NONE
    woken = _isvc(wake=NOW - 1)
    woken["status"] = {"effective": {"overrides": overrides}}
    got = decide(no_pods, resolve(woken), [to_zero], NOW)  # 30 s after the last change: no cooldown
    assert (got.action, got.lever, got.from_, got.to) == (APPLY, "addReplica", 0, 1)
    assert "woken" in got.reason
    recommend = _isvc(wake=NOW - 1, mode="Recommend")
    recommend["status"] = {"effective": {"overrides": overrides}}
    assert decide(no_pods, resolve(recommend), [to_zero], NOW).action == RECOMMEND_ACTION
    _, update = evaluate(resolve(asleep), no_pods, NOW)
    remediating = next(c for c in update.patch["conditions"] if c["type"] == "Remediating")
    assert remediating["reason"] == "ScaledToZero" and names.ANNOTATION_WAKE in remediating["message"]
