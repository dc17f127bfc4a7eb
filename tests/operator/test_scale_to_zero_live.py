"""Scale to zero and back on the local platform with real engines: an idle service (minReplicas 0)
loses its last replica after ``idleAfter`` without a request, says so in its condition, its Event and
its remediation history; a request that then arrives at the front door waits there, the door asks for
a replica (``wake-requested-at``), remediation adds one (0 -> 1) and the request succeeds on it."""

from __future__ import annotations

import time

import httpx
import pytest

from kvpilot.operator.api import names
from tests.operator.conftest import wait_for
from tests.operator.local_support import MODEL_NAME, PlatformThread, leftovers, tiny_isvc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
START_S = 90  # engine start-up on a busy 2-core machine, generously


@pytest.fixture
def platform(tmp_path, tiny_llama):
    isvc = tiny_isvc(tiny_llama, replicas=1)
    isvc["spec"]["remediation"] = {
        "mode": "Auto",
        "window": "3s",
        "cooldown": "4s",
        "idleAfter": "4s",
        "limits": {"minReplicas": 0, "maxReplicas": 1},
    }
    started = PlatformThread(isvc, tmp_path).start()
    yield started
    started.stop()


def _status(platform: PlatformThread) -> dict:
    return platform.status()["inferenceService"]


def test_an_idle_service_scales_to_zero_and_a_request_wakes_it(platform):
    (first,) = wait_for(lambda: platform.ready_replicas(1), timeout=START_S, what="a ready replica")

    # No request comes: after idleAfter the last replica goes.
    def at_zero() -> dict | None:
        isvc = _status(platform)
        gone = not platform.status()["replicas"]
        return isvc if gone and isvc["status"].get("effective", {}).get("replicas") == 0 else None

    asleep = wait_for(at_zero, timeout=60, what="the service at zero replicas")
    wait_for(lambda: leftovers([first["pid"]]) == [], timeout=20, what="the replica's process to exit")
    (down,) = asleep["status"]["remediations"]
    assert (down["lever"], down["from"], down["to"]) == ("removeReplica", 1, 0), down
    assert "scale to zero" in down["reason"] and "no request for" in down["reason"], down["reason"]
    wait_for(
        lambda: (
            next(c for c in _status(platform)["status"]["conditions"] if c["type"] == "Remediating")["reason"]
            == "ScaledToZero"
        ),
        timeout=30,
        what="the ScaledToZero condition",
    )
    events = platform.status()["events"]
    assert any(e["reason"] == "Remediated" and "scale to zero" in e["message"] for e in events), [
        (e["reason"], e["message"][:80]) for e in events
    ]

    # A request at the door: it waits while a replica starts, then succeeds.
    sent = time.monotonic()
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 4, "ignore_eos": True}
    answer = httpx.post(platform.url + "/v1/completions", json=body, timeout=START_S + 30)
    waited = time.monotonic() - sent
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    awake = _status(platform)
    assert names.ANNOTATION_WAKE in awake["metadata"]["annotations"]
    up = awake["status"]["remediations"][0]
    assert (up["lever"], up["from"], up["to"]) == ("addReplica", 0, 1), up
    assert "woken" in up["reason"], up["reason"]
    door = platform.status()["frontDoor"]
    assert door["held"]["ready"] == 1 and door["held"]["wakes"] >= 1 and door["held"]["waiting"] == 0
    (second,) = platform.ready_replicas(1)
    assert second["name"] != first["name"]
    print(f"\nscale from zero: the held request answered after {waited:.1f} s (replica start included)")
    assert awake["spec"]["replicas"] == 1, "the operator never writes spec"
