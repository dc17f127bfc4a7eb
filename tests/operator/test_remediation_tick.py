"""One reconcile pass or remediation tick resolves each InferenceService once and renders each
configuration once.

The loop runs in-process against the local platform's in-memory API (the operator's own client with a
dict for transport), its pods pointing at scripted engines; the clock is the test's. Counters wrap
``apply_defaults`` and ``build_deployment`` wherever an operator module holds them.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import sys

import pytest

from kvpilot.operator.api import names, spec
from kvpilot.operator.api.rest import object_path
from kvpilot.operator.local.api import LocalApi
from kvpilot.operator.local.platform import prepare
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile.reconciler import Reconciler
from kvpilot.operator.remediation.loop import Autotuner
from kvpilot.operator.render import builders
from tests.operator.conftest import BASE_ISVC, FAST_ROLLOUT_REMEDIATION
from tests.operator.engine_metrics import EngineMetrics, ScriptedEngine

NS, NAME, PODS = "llm", "llama", 3
ISVC_PATH = object_path(names.API_VERSION, names.KIND, NS, NAME)
DEPLOYMENT_PATH = object_path("apps/v1", "Deployment", NS, NAME)


class Calls:
    """Counts calls of the wrapped functions; ``hashes``: template hashes of the rendered Deployments."""

    def __init__(self) -> None:
        self.apply_defaults = 0
        self.hashes: list[str] = []

    def reset(self) -> None:
        self.apply_defaults, self.hashes = 0, []


@pytest.fixture
def calls(monkeypatch) -> Calls:
    counted = Calls()
    apply_defaults, build_deployment = spec.apply_defaults, builders.build_deployment

    def counting_defaults(*args, **kwargs):
        counted.apply_defaults += 1
        return apply_defaults(*args, **kwargs)

    def counting_render(*args, **kwargs):
        deployment = build_deployment(*args, **kwargs)
        counted.hashes.append(deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH])
        return deployment

    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("kvpilot.operator"):
            continue
        if getattr(module, "apply_defaults", None) is apply_defaults:
            monkeypatch.setattr(module, "apply_defaults", counting_defaults)
        if getattr(module, "build_deployment", None) is build_deployment:
            monkeypatch.setattr(module, "build_deployment", counting_render)
    return counted


def _pod(index: int, labels: dict, port: int) -> dict:
    ready = {"type": "Ready", "status": "True"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{NAME}-{index}", "namespace": NS, "uid": f"uid-{index}", "labels": labels},
        "spec": {
            "containers": [
                {
                    "name": names.ENGINE_CONTAINER,
                    "ports": [{"name": names.HTTP_PORT_NAME, "containerPort": port}],
                }
            ]
        },
        "status": {"podIP": "127.0.0.1", "phase": "Running", "conditions": [ready]},
    }


async def _ticks(calls: Calls, count: int) -> list[tuple[int, list[str], int]]:
    """(apply_defaults calls, rendered template hashes, remediations so far) for each of ``count`` ticks
    of a steady preemption storm in Auto mode."""
    api = LocalApi()
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["spec"]["replicas"] = PODS
    isvc["spec"]["remediation"] = dict(FAST_ROLLOUT_REMEDIATION)
    await api.create(prepare(isvc, NS))

    async def no_events(*_):
        return None

    reconciler = Reconciler(api, no_events)
    calls.reset()
    outcome = await reconciler.run(NS, NAME, logging.getLogger(__name__))
    assert "Created Deployment llama" in outcome.written
    assert (calls.apply_defaults, len(calls.hashes)) == (1, 1), "a reconcile pass resolves and renders once"
    labels = api.read(DEPLOYMENT_PATH)["spec"]["template"]["metadata"]["labels"]
    engines = [
        ScriptedEngine(EngineMetrics(max_num_seqs=64).set(kv=0.5, waiting=0, running=10)) for _ in range(PODS)
    ]
    for index, engine in enumerate(engines):
        api.put(object_path("v1", "Pod", NS, f"{NAME}-{index}"), _pod(index, dict(labels), engine.port))
    clock = [1_750_000_000.0]
    tuner = Autotuner(
        api, OperatorOptions(namespaces=(NS,), scrape_interval=1.0), reconciler, clock=lambda: clock[0]
    )
    rows = []
    try:
        for _ in range(count):
            for engine in engines:
                engine.metrics.preempt(10)  # 10/s per pod: a storm
            calls.reset()
            await tuner.tick()
            remediations = (api.read(ISVC_PATH).get("status") or {}).get("remediations") or []
            rows.append((calls.apply_defaults, list(calls.hashes), len(remediations)))
            clock[0] += 1.0
    finally:
        await tuner.close()
        for engine in engines:
            engine.stop()
    return rows


def test_a_tick_resolves_once_and_renders_each_configuration_once(calls):
    rows = asyncio.run(_ticks(calls, 7))
    applied = [i for i, (_, _, done) in enumerate(rows) if done and not rows[i - 1][2]]
    assert applied, f"the storm must make the loop act: {rows}"
    for index, (defaults, hashes, _) in enumerate(rows):
        assert defaults == 1, f"tick {index}: apply_defaults ran {defaults} times for one InferenceService"
        if index in applied:
            # The configuration the pods run (to tell current pods from outdated ones), then the new one.
            assert len(hashes) == 2 and hashes[0] != hashes[1], f"tick {index}: {hashes}"
        else:
            assert len(hashes) == 1, f"tick {index}: the Deployment was rendered {len(hashes)} times"
