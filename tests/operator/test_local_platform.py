"""The local platform with real engines: the front door streams and balances, a crashed replica comes
back, a new configuration restarts replicas with the args the builders render, replicas are added and
removed, and nothing outlives a stop (nor the platform's abrupt end). The platform runs in-process (a
thread of its own); every engine is a real ``kvpilot serve`` on the session's tiny checkpoint."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import re
import signal
import threading

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as m
from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from tests.operator.conftest import wait_for
from tests.operator.local_support import (
    MODEL_NAME,
    PlatformThread,
    Traffic,
    leftovers,
    tiny_isvc,
    write_manifest,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
START_S = 90  # engine start-up on a busy 2-core machine, generously


@pytest.fixture
def platforms(tmp_path):
    """Start platforms with ``start(isvc, **options)``; all are stopped (and checked) afterwards."""
    started: list[PlatformThread] = []

    def start(isvc: dict, **options) -> PlatformThread:
        platform = PlatformThread(isvc, tmp_path, **options)
        started.append(platform)
        return platform.start()

    yield start
    for platform in started:
        platform.stop()


def samples(url: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def successes(url: str) -> float:
    return sum(s.value for s in samples(url).get(m.REQUEST_SUCCESS_TOTAL, []))


def override_memory_fraction(platform: PlatformThread, value: float) -> None:
    """What remediation writes in Auto mode (``status.effective.overrides``), then its re-render."""
    path = object_path(names.API_VERSION, names.KIND, "local", "tiny")
    override = {"value": value, "specValue": 0.5, "time": "2026-01-01T00:00:00.000Z", "reason": "test"}
    patch = {"status": {"effective": {"overrides": {"gpuMemoryUtilization": override}}}}
    platform.call(platform.platform.api.merge_patch(path + "/status", patch))
    platform.call(platform.platform.reconcile())


def test_front_door_streams_balances_survives_a_crash_and_stop_leaves_nothing(platforms, tiny_llama):
    platform = platforms(tiny_isvc(tiny_llama, replicas=2))
    replicas = wait_for(lambda: platform.ready_replicas(2), timeout=START_S, what="two ready replicas")
    assert httpx.get(platform.url + "/health").status_code == 200
    pids = [r["pid"] for r in replicas]
    assert len({r["url"] for r in replicas}) == 2 and all(pids)

    # Streaming through the door gives what one replica answers directly (greedy: the same tokens).
    client = openai.OpenAI(base_url=platform.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello there"}]
    # Long enough that the door relays chunks while the replica still generates: a consumer that lags
    # behind a fast engine gets merged deltas, so a short answer may fairly arrive in one chunk.
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=96, temperature=0, stream=True
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert sum(1 for p in pieces if p) >= 2, "tokens must arrive as separate chunks"
    assert chunks[-1].choices[0].finish_reason == "length"
    direct = openai.OpenAI(base_url=replicas[0]["url"] + "/v1", api_key="unused", max_retries=0)
    answer = direct.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=96, temperature=0)
    assert "".join(pieces) == answer.choices[0].message.content

    # Concurrent requests spread over both replicas (each counted by the replica itself).
    before = {r["url"]: successes(r["url"]) for r in replicas}

    def complete(i: int) -> int:
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=f"request {i}",
            max_tokens=48,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return sum(1 for _ in stream)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(n > 1 for n in pool.map(complete, range(16)))
    served = {url: successes(url) - count for url, count in before.items()}
    assert sum(served.values()) == 16
    assert min(served.values()) >= 4, f"the door must balance: {served}"
    door = platform.status()["frontDoor"]
    assert sum(door["served"].values()) == 16 + 1  # and the chat stream (the direct request bypassed it)

    # A replica crashes: the door routes around it at once, the kubelet restarts the same pod.
    crashed = replicas[0]
    os.kill(crashed["pid"], signal.SIGKILL)  # a replica this test's platform started
    for i in range(4):
        assert complete(100 + i) > 1, "requests must keep succeeding on the other replica"

    def restarted():
        now = next(r for r in platform.status()["replicas"] if r["name"] == crashed["name"])
        return now if now["ready"] and now["restarts"] == 1 else None

    after = wait_for(restarted, timeout=START_S, what="the crashed replica to come back")
    assert after["url"] == crashed["url"] and after["pid"] != crashed["pid"]
    assert after["lastExitCode"] == -signal.SIGKILL
    pod = platform.platform.api.read(object_path("v1", "Pod", "local", crashed["name"]))
    (container,) = pod["status"]["containerStatuses"]
    assert container["restartCount"] == 1 and container["lastState"]["terminated"]["reason"] == "Error"
    assert "running" in container["state"]
    assert platform.status()["inferenceService"]["status"]["phase"] == "Ready"
    assert successes(after["url"]) == 0  # a new process: its counters start again
    assert complete(200) > 1

    platform.stop()
    assert leftovers([*pids, after["pid"]]) == [], "no engine process may outlive the platform"
    with pytest.raises(httpx.HTTPError):
        httpx.get(platform.url + "/health", timeout=2)


def test_new_configuration_restarts_with_the_rendered_args_and_scales(platforms, tiny_llama, tmp_path):
    isvc = tiny_isvc(tiny_llama, replicas=1)
    manifest = write_manifest(tmp_path / "isvc.yaml", isvc)
    platform = platforms(isvc, manifest=manifest)
    (first,) = wait_for(lambda: platform.ready_replicas(1), timeout=START_S, what="a ready replica")
    assert first["args"][first["args"].index("--gpu-memory-utilization") + 1] == "0.5"

    api = platform.platform.api
    override_memory_fraction(platform, 0.6)
    (second,) = wait_for(lambda: platform.ready_replicas(1), timeout=START_S, what="the new replica")
    assert second["name"] != first["name"] and leftovers([first["pid"]]) == []
    deployment = api.read(object_path("apps/v1", "Deployment", "local", "tiny"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    rendered = list(container["args"])
    expected = rendered[1:]
    expected[expected.index("--host") + 1] = "127.0.0.1"
    expected[expected.index("--port") + 1] = second["url"].rsplit(":", 1)[1]
    # The live-config ConfigMap's file, where the local kubelet mounts it.
    local_file = second["args"][second["args"].index("--live-config-file") + 1]
    assert (
        local_file.endswith("/tiny-live-config.json")
        and local_file != rendered[rendered.index("--live-config-file") + 1]
    )
    expected[expected.index("--live-config-file") + 1] = local_file
    assert second["args"][1:] == expected, "the replica runs exactly the args the builders rendered"
    assert second["args"][second["args"].index("--gpu-memory-utilization") + 1] == "0.6"
    info = samples(second["url"])[m.CACHE_CONFIG_INFO][0].labels
    assert info["gpu_memory_utilization"] == "0.6"

    # The user edits the spec (kubectl apply): two replicas, the override still applies (gmu untouched).
    isvc["spec"]["replicas"] = 2
    manifest.write_text(yaml.safe_dump(isvc))
    two = wait_for(lambda: platform.ready_replicas(2), timeout=START_S, what="a second replica")
    assert second["name"] in {r["name"] for r in two}, "scaling up restarts nobody"
    assert all(r["args"][r["args"].index("--gpu-memory-utilization") + 1] == "0.6" for r in two)
    status = platform.status()["inferenceService"]
    assert status["metadata"]["generation"] == 2 and status["status"]["effective"]["replicas"] == 2

    isvc["spec"]["replicas"] = 1
    manifest.write_text(yaml.safe_dump(isvc))
    (one,) = wait_for(lambda: platform.ready_replicas(1), timeout=30, what="the scale-down")
    gone = [r["pid"] for r in two if r["name"] != one["name"]]
    wait_for(lambda: leftovers(gone) == [], timeout=15, what="the removed replica to exit")
    assert status["metadata"]["uid"] == platform.status()["inferenceService"]["metadata"]["uid"]
    pods = api.list("pods", "local")
    assert [p["metadata"]["name"] for p in pods] == [one["name"]]
    # The platform dies without cleaning up (its thread ends): the replica goes too (PR_SET_PDEATHSIG).
    platform.loop.call_soon_threadsafe(platform.loop.stop)
    platform.thread.join(timeout=10)
    wait_for(lambda: leftovers([one["pid"]]) == [], timeout=20, what="the orphaned replica to exit")


def test_a_new_configuration_rolls_over_under_traffic_without_dropping_a_request(platforms, tiny_llama):
    """maxSurge 1 / maxUnavailable 0: the new replica starts beside the old one, the door moves to it
    once it is ready, the old one stops only then. Traffic through the door across the whole rollover:
    nothing refused, nothing cut short, and both replicas served part of it."""
    isvc = tiny_isvc(tiny_llama, replicas=1)
    isvc["spec"]["rollout"] = {"maxSurge": 1, "maxUnavailable": 0}
    platform = platforms(isvc)
    (old,) = wait_for(lambda: platform.ready_replicas(1), timeout=START_S, what="a ready replica")
    traffic = Traffic(platform.url).start()
    try:
        wait_for(lambda: traffic.completed >= 3, timeout=START_S, what="traffic on the first replica")
        override_memory_fraction(platform, 0.6)
        (new,) = wait_for(lambda: platform.ready_replicas(1), timeout=START_S, what="the rolled-over replica")
        assert new["name"] != old["name"]
        assert new["args"][new["args"].index("--gpu-memory-utilization") + 1] == "0.6"
        wait_for(lambda: leftovers([old["pid"]]) == [], timeout=60, what="the old replica to exit")
        served_new = lambda: platform.status()["frontDoor"]["served"].get(new["url"], 0)  # noqa: E731
        wait_for(lambda: served_new() >= 3, timeout=START_S, what="traffic on the new replica")
    finally:
        traffic.stop()
    dropped = (traffic.by_kind["refused"], traffic.by_kind["cut_short"])
    assert dropped == (0, 0), (traffic.refused, traffic.cut_short)
    served = platform.status()["frontDoor"]["served"]
    assert served[old["url"]] >= 3 and served[new["url"]] >= 3, served
    assert sum(served.values()) == traffic.completed
    assert traffic.by_kind["completed"] == traffic.completed


class KubeletLog(logging.Handler):
    """Keeps the local kubelet's log records (the platform's thread writes them) and lets the test wait
    for one that matches."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.records.append(record)

    def matching(self, pattern: str) -> list[tuple[float, re.Match]]:
        """(time the record was made, match) of each record whose message matches ``pattern``."""
        with self._lock:
            records = list(self.records)
        found = ((r.created, re.search(pattern, r.getMessage())) for r in records)
        return [(t, m) for t, m in found if m]


def test_a_crash_looping_replica_restarts_again_and_again_with_growing_back_off(platforms, tmp_path):
    """A model directory the engine cannot load: every start exits with an error. The kubelet restarts
    the same replica each time, after a back-off that doubles, and its Pod says CrashLoopBackOff with
    the restart count, as a kubelet's would."""
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    log = KubeletLog()
    logger = logging.getLogger("kvpilot.local")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.DEBUG)
    try:
        platform = platforms(tiny_isvc(broken, replicas=1))
        restarts = 3
        wait_for(
            lambda: log.matching(rf"started \(restart {restarts}\), pid"),
            timeout=START_S,
            what=f"restart {restarts} of the crashing replica",
        )
        exits = log.matching(r"replica (\S+): .*; restarting in ([0-9.]+)s \(restart (\d+)\)")
        starts = log.matching(r"replica (\S+): started(?: \(restart (\d+)\))?, pid (\d+)")
        status = platform.status()
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)

    # One replica, started once and then once per restart, each run a process of its own.
    assert (
        {m.group(1) for _, m in starts} == {m.group(1) for _, m in exits} == {status["replicas"][0]["name"]}
    )
    assert [int(m.group(2) or 0) for _, m in starts][: restarts + 1] == list(range(restarts + 1))
    assert len({m.group(3) for _, m in starts}) == len(starts), "a new process each time"
    assert [int(m.group(3)) for _, m in exits][:restarts] == list(range(1, restarts + 1))
    planned = [float(m.group(2)) for _, m in exits][:restarts]
    assert all(b == 2 * a for a, b in itertools.pairwise(planned)), f"the back-off doubles: {planned}"
    # Observed: from the exit seen to the next start. Never before the planned back-off, and growing.
    waited = [
        start[0] - exit_[0] for exit_, start in zip(exits[:restarts], starts[1 : restarts + 1], strict=True)
    ]
    assert all(w >= b for w, b in zip(waited, planned, strict=True)), (waited, planned)
    assert waited[-1] > waited[0], waited

    (replica,) = status["replicas"]
    assert replica["restarts"] >= restarts and replica["lastExitCode"] not in (None, 0)
    assert not replica["ready"]
    pod = platform.platform.api.read(object_path("v1", "Pod", "local", replica["name"]))
    (container,) = pod["status"]["containerStatuses"]
    assert container["restartCount"] >= restarts
    assert container["lastState"]["terminated"]["reason"] == "Error"
    assert platform.status()["inferenceService"]["status"]["phase"] != "Ready"
