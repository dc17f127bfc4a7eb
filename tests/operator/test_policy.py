"""Table tests of the pure remediation policy: ``decide(window, settings, history, now)``."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from kvpilot.operator.api.settings import resolve
from kvpilot.operator.remediation import decision as decision_names
from kvpilot.operator.remediation.decision import APPLY, NONE, RECOMMEND_ACTION, Change, Decision
from kvpilot.operator.remediation.metrics import Capacity, ModelShape, parse_scrape
from kvpilot.operator.remediation.pods import Failure
from kvpilot.operator.remediation.policy import decide
from kvpilot.operator.remediation.series import PodSeries
from kvpilot.operator.remediation.window import Interval, MetricWindow, summarize
from tests.operator.engine_metrics import EngineMetrics

# Every lever the decision module names (a constant in it whose value is a lever name).
LEVERS = [
    value
    for name, value in vars(decision_names).items()
    if name.isupper()
    and name.startswith(("RAISE_", "LOWER_", "ADD_", "REMOVE_", "REVERT", "RELIEVE_", "RESTORE_"))
]

NOW = 1_750_000_000.0
WINDOW_S, COOLDOWN_S = 120.0, 600.0
SHAPE = ModelShape(
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    intermediate_size=14336,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_model_len=4096,
)
ISVC: dict[str, Any] = {
    "apiVersion": "serving.kvpilot.io/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llama", "namespace": "llm", "generation": 5},
    "spec": {
        "model": {"source": "pvc://models/llama"},
        "image": "engine:1",
        "replicas": 2,
        "engine": {"gpuMemoryUtilization": 0.9, "maxNumSeqs": 64},
        "remediation": {
            "mode": "Auto",
            "preemptionRate": 0.05,
            "window": "120s",
            "cooldown": "600s",
            # The ladder as without live levers; the live relief's order has its own tests below.
            "liveLevers": False,
            "limits": {"maxReplicas": 4, "maxPipelineParallelSize": 2},
        },
    },
}


def isvc(engine: dict | None = None, overrides: dict | None = None, **spec: Any) -> dict[str, Any]:
    """ISVC with ``spec.engine`` keys replaced (None deletes), other spec keys replaced, overrides."""
    obj = copy.deepcopy(ISVC)
    for key, value in (engine or {}).items():
        if value is None:
            obj["spec"]["engine"].pop(key, None)
        else:
            obj["spec"]["engine"][key] = value
    for key, value in spec.items():
        if key == "remediation":
            for rkey, rvalue in value.items():
                if isinstance(rvalue, dict):
                    obj["spec"]["remediation"].setdefault(rkey, {}).update(rvalue)
                else:
                    obj["spec"]["remediation"][rkey] = rvalue
        else:
            obj["spec"][key] = value
    if overrides:
        obj["status"] = {"effective": {"overrides": overrides}}
    return obj


def window(
    rate: float = 0.0,
    kv: float = 0.5,
    waiting: float = 0.0,
    running: float = 40.0,
    intervals: tuple[float, ...] | None = None,
    pods: int = 2,
    **fields: Any,
) -> MetricWindow:
    """A complete, full window whose 8 scrape intervals all show ``rate``/``kv``/``waiting`` unless
    ``intervals`` (their rates)."""
    rates = intervals or (rate,) * 8
    values = dict(
        end=NOW,
        window_s=WINDOW_S,
        pods=tuple(f"llama-{i}" for i in range(pods)),
        start=NOW - WINDOW_S,
        preemption_rate=sum(rates) / len(rates),
        num_preemptions=sum(rates) / len(rates) * WINDOW_S * pods,
        kv_usage=kv,
        kv_usage_max=kv,
        waiting=waiting,
        waiting_max=waiting,
        running=running,
        intervals=tuple(Interval(r, kv, waiting, WINDOW_S / len(rates)) for r in rates),
        full=True,
        capacity=Capacity(num_gpu_blocks=2048, block_size=16, max_model_len=4096),
        shape=SHAPE,
    )
    values.update(fields)
    return MetricWindow(**values)


def change(ago: float, lever: str, field: str, from_: float, to: float, generation: int = 5) -> Change:
    return Change(NOW - ago, lever, field, from_, to, "test", generation)


STORM = window(rate=0.5)
DEMAND = window(rate=0.0, kv=0.95, waiting=12)
IDLE = window(kv=0.1, running=2)
AT_GMU_LIMIT = {"gpuMemoryUtilization": 0.95}
AT_SEQS_FLOOR = {**AT_GMU_LIMIT, "maxNumSeqs": 16}
AT_TOKENS_FLOOR = {**AT_SEQS_FLOOR, "maxNumBatchedTokens": 2048}


LIVE_REMEDIATION = {"liveLevers": True}
LIVE_ISVC = isvc(remediation=LIVE_REMEDIATION)
RELIEF = change(1400, "relieveMaxNumSeqs", "maxNumSeqs", 64, 30)
DURABLE = change(700, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)
RELIEVED = isvc(remediation=LIVE_REMEDIATION, overrides={"maxNumSeqs": {"value": 30, "specValue": 64}})
RESTORABLE = isvc(
    remediation=LIVE_REMEDIATION,
    overrides={
        "maxNumSeqs": {"value": 30, "specValue": 64},
        "gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9},
    },
)


@dataclasses.dataclass
class Case:
    id: str
    window: MetricWindow
    isvc: dict[str, Any] = dataclasses.field(default_factory=isvc)
    history: list[Change] = dataclasses.field(default_factory=list)
    action: str = "none"
    lever: str | None = None
    field: str | None = None
    from_: float | None = None
    to: float | None = None
    reason: str = ""
    exhausted: bool = False


CASES = [
    # --- the storm ladder, one lever position at a time
    Case("storm raises the memory fraction first", STORM, action="apply",
         lever="raiseGpuMemoryUtilization", field="gpuMemoryUtilization", from_=0.9, to=0.95,
         reason="a preemption storm"),
    Case("memory fraction step stops at its limit", STORM, isvc({"gpuMemoryUtilization": 0.93}),
         action="apply", field="gpuMemoryUtilization", from_=0.93, to=0.95),
    Case("memory fraction unset: from the engine default 0.9", STORM, isvc({"gpuMemoryUtilization": None}),
         action="apply", field="gpuMemoryUtilization", from_=0.9, to=0.95),
    Case("memory fraction at its limit: lower maxNumSeqs below what ran", window(rate=0.5, running=40),
         isvc(AT_GMU_LIMIT), action="apply", lever="lowerMaxNumSeqs", field="maxNumSeqs", from_=64, to=30),
    Case("maxNumSeqs never goes below its floor", window(rate=0.5, running=12), isvc(AT_GMU_LIMIT),
         action="apply", field="maxNumSeqs", from_=64, to=16),
    Case("explicitly sized pool: the memory fraction is skipped", STORM,
         isvc({"numGpuBlocksOverride": 512}), action="apply", field="maxNumSeqs", from_=64, to=30),
    Case("engine reports an explicit pool: skipped too",
         window(rate=0.5, capacity=Capacity(512, 16, 4096, explicit_size=True)),
         action="apply", field="maxNumSeqs"),
    Case("maxNumSeqs at its floor: lower maxNumBatchedTokens (engine-reported 8192)", STORM,
         isvc(AT_SEQS_FLOOR), action="apply", lever="lowerMaxNumBatchedTokens",
         field="maxNumBatchedTokens", from_=8192, to=6144),
    Case("without chunked prefill the token budget keeps a whole prompt", STORM,
         isvc({**AT_SEQS_FLOOR, "enableChunkedPrefill": False, "maxModelLen": 4096,
               "maxNumBatchedTokens": 5000}),
         action="apply", field="maxNumBatchedTokens", from_=5000, to=4096),
    Case("token budget at its floor: raise tensor parallelism to a divisor of the KV heads", STORM,
         isvc(AT_TOKENS_FLOOR), action="apply", lever="raiseTensorParallelSize",
         field="tensorParallelSize", from_=1, to=2),
    Case("tensor parallelism skips sizes that do not divide the heads",
         window(rate=0.5, shape=dataclasses.replace(SHAPE, num_attention_heads=24, num_key_value_heads=6,
                                                    intermediate_size=12288)),
         isvc({**AT_TOKENS_FLOOR, "tensorParallelSize": 3}),
         action="apply", field="tensorParallelSize", from_=3, to=6),
    Case("a size that replicates the KV heads is allowed (the engine's rule)",
         window(rate=0.5, shape=dataclasses.replace(SHAPE, num_key_value_heads=2)),
         isvc({**AT_TOKENS_FLOOR, "tensorParallelSize": 2}), action="apply", field="tensorParallelSize",
         from_=2, to=4, reason="2 KV heads are replicated over them"),
    Case("a size that does not divide the intermediate size is not: raise pipeline parallelism",
         window(rate=0.5, shape=dataclasses.replace(SHAPE, intermediate_size=11004)),
         isvc({**AT_TOKENS_FLOOR, "tensorParallelSize": 4}), action="apply",
         lever="raisePipelineParallelSize", field="pipelineParallelSize", from_=1, to=2),
    Case("the tensor-parallel reason names the engine's rule",
         window(rate=0.5, shape=dataclasses.replace(SHAPE, intermediate_size=11004)),
         isvc({**AT_TOKENS_FLOOR, "tensorParallelSize": 4, "pipelineParallelSize": 2}, replicas=4),
         reason="no larger size up to 8 splits 32 attention heads, 8 KV heads and intermediate size 11004",
         exhausted=True),
    Case("intermediate size unknown: tensor parallelism is skipped, not guessed",
         window(rate=0.5, shape=dataclasses.replace(SHAPE, intermediate_size=None)),
         isvc(AT_TOKENS_FLOOR), action="apply", field="pipelineParallelSize", from_=1, to=2),
    Case("no larger divisor within the limit: raise pipeline parallelism", STORM,
         isvc({**AT_TOKENS_FLOOR, "tensorParallelSize": 8}), action="apply",
         lever="raisePipelineParallelSize", field="pipelineParallelSize", from_=1, to=2),
    Case("model shape unknown: tensor parallelism is skipped, not guessed", window(rate=0.5, shape=None),
         isvc({**AT_TOKENS_FLOOR, "maxNumBatchedTokens": 2048}), action="apply",
         field="pipelineParallelSize", from_=1, to=2),
    Case("parallelism at its limits: add a replica", STORM,
         isvc({**AT_TOKENS_FLOOR, "tensorParallelSize": 8, "pipelineParallelSize": 2}),
         action="apply", lever="addReplica", field="replicas", from_=2, to=3),
    Case("pods without GPUs: no parallelism, straight to replicas", STORM,
         isvc(AT_TOKENS_FLOOR, resources={"gpusPerReplica": 0}), action="apply",
         field="replicas", from_=2, to=3),
    Case("every lever at its limit: nothing, and says so",
         STORM, isvc({**AT_TOKENS_FLOOR, "tensorParallelSize": 8, "pipelineParallelSize": 2}, replicas=4),
         reason="every lever is at its limit", exhausted=True),
    # --- demand, idleness
    Case("demand adds a replica", DEMAND, action="apply", lever="addReplica", field="replicas",
         from_=2, to=3, reason="demand"),
    Case("demand at maxReplicas without preemption: nothing to do", DEMAND, isvc(replicas=4),
         reason="raise limits.maxReplicas", exhausted=True),
    Case("demand at maxReplicas with a storm: relieve it per pod",
         window(rate=0.5, kv=0.95, waiting=12), isvc(replicas=4), action="apply",
         field="gpuMemoryUtilization", reason="under demand at maxReplicas 4"),
    Case("a full KV cache without a queue is not demand", window(kv=0.97, waiting=1), reason="stable"),
    Case("sustained idleness removes one replica", IDLE, isvc(replicas=3), action="apply",
         lever="removeReplica", field="replicas", from_=3, to=2),
    Case("idle at minReplicas: nothing", IDLE, isvc(replicas=1), reason="idle at minReplicas"),
    Case("one queued request in the window is not idle", dataclasses.replace(IDLE, waiting_max=1),
         isvc(replicas=3), reason="stable"),
    Case("no scale-down within two cooldowns of a scale-up", IDLE, isvc(replicas=3),
         history=[change(900, "addReplica", "replicas", 2, 3)], reason="a replica was added 900s ago"),
    # --- hysteresis: bursts, cooldown, fresh windows
    Case("a burst in one half is not a storm", window(intervals=(2.0,) * 4 + (0.0,) * 4), reason="stable"),
    Case("a storm in all intervals but one is not sustained", window(intervals=(0.0,) + (1.0,) * 7),
         reason="stable"),
    Case("a storm that has not lasted a full window is not one", window(rate=1.0, full=False),
         reason="stable"),
    Case("demand that has not lasted a full window adds nothing",
         window(kv=0.95, waiting=12, full=False), reason="stable"),
    Case("idleness that has not lasted a full window removes nothing", window(kv=0.1, running=2, full=False),
         reason="stable"),
    Case("a rate exactly at the threshold is not a storm", window(rate=0.05), reason="stable"),
    Case("cooldown holds the next step and names it", STORM,
         history=[change(100, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.85, 0.9)],
         lever="raiseGpuMemoryUtilization", reason="cooldown: the last change was 100s ago"),
    Case("after the cooldown, a window that began before the change is not enough",
         dataclasses.replace(STORM, start=NOW - 700),
         history=[change(650, "addReplica", "replicas", 1, 2)], reason="waiting for a full window"),
    Case("after the cooldown and a full window: the next step", STORM,
         history=[change(650, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.85, 0.9)],
         action="apply", field="gpuMemoryUtilization", from_=0.9, to=0.95),
    # --- incomplete data is never acted upon
    Case("stale or missing pods: nothing",
         dataclasses.replace(STORM, problems=("pod llama-1: metrics stale",)),
         reason="not acting on incomplete data: pod llama-1: metrics stale"),
    Case("no pods at all: nothing", MetricWindow(end=NOW, window_s=WINDOW_S, problems=("no data",)),
         reason="not acting"),
    # --- modes
    Case("Recommend proposes instead of applying", STORM, isvc(remediation={"mode": "Recommend"}),
         action="recommend", field="gpuMemoryUtilization", from_=0.9, to=0.95),
    Case("Off only observes, naming what it would do", STORM, isvc(remediation={"mode": "Off"}),
         lever="raiseGpuMemoryUtilization", reason="remediation is Off; would raiseGpuMemoryUtilization"),
    # --- the user wins; failures are undone
    Case("a spec edit supersedes an override: the policy starts from the user's value", STORM,
         isvc({"gpuMemoryUtilization": 0.8},
              overrides={"gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         action="apply", field="gpuMemoryUtilization", from_=0.8, to=0.85),
    Case("an override in effect is the starting point", STORM,
         isvc(overrides={"gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         action="apply", field="maxNumSeqs", from_=64),
    Case("pods failing after our change: revert at once, cooldown or not",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "OOMKilled (2 restart(s))", NOW - 10),)),
         isvc(overrides={"gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         history=[change(30, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)],
         action="apply", lever="revert", field="gpuMemoryUtilization", from_=0.95, to=0.9,
         reason="OOMKilled"),
    Case("failing pods the user's own edit started: not ours to revert",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "CrashLoopBackOff", NOW - 10),)),
         isvc({"gpuMemoryUtilization": 0.8}),
         history=[change(30, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)],
         reason="not acting: pods fail"),
    Case("a pod stamped in the second of our change (timestamps are whole seconds) is blamed",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "CrashLoopBackOff", NOW - 30),)),
         isvc(overrides={"gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         history=[change(29.6, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)],
         action="apply", lever="revert"),
    Case("a failure from before our change is not blamed on it",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "CrashLoopBackOff", NOW - 60),)),
         isvc(overrides={"gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         history=[change(30, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)],
         reason="not acting: pods fail"),
    Case("a failure long after an old change is not blamed on it (a week-old addReplica stays)",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "CrashLoopBackOff", NOW - 10),)),
         isvc(overrides={"replicas": {"value": 3, "specValue": 2}}),
         history=[change(7 * 86400, "addReplica", "replicas", 2, 3)],
         reason="not acting: pods fail"),
    Case("a failure of unknown time is not blamed",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "CrashLoopBackOff"),)),
         isvc(overrides={"gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         history=[change(30, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)],
         reason="not acting: pods fail"),
    Case("a ready pod with an old OOM kill does not block: it serves and is judged by its metrics",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "OOMKilled (1 restart(s))", NOW - 900,
                                                     ready=True),)),
         isvc(overrides={"replicas": {"value": 3, "specValue": 2}}),
         history=[change(7 * 86400, "addReplica", "replicas", 2, 3)],
         action="apply", field="gpuMemoryUtilization"),
    Case("a ready pod OOM-killed after our change: revert",
         dataclasses.replace(STORM, failing=(Failure("llama-7f-x", "OOMKilled (1 restart(s))", NOW - 10,
                                                     ready=True),)),
         isvc(overrides={"gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         history=[change(30, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)],
         action="apply", lever="revert", field="gpuMemoryUtilization", to=0.9),
    Case("a reverted lever stays put: the ladder moves on", STORM,
         history=[change(700, "revert", "gpuMemoryUtilization", 0.95, 0.9),
                  change(800, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95)],
         action="apply", field="maxNumSeqs"),
    Case("a revert from an older generation does not block", STORM,
         history=[change(700, "revert", "gpuMemoryUtilization", 0.95, 0.9, generation=4)],
         action="apply", field="gpuMemoryUtilization"),
    # --- live levers: relief in place first, the restart lever after it, then the relief ends
    Case("with live levers a storm is relieved live first (shrinking what ran)", STORM, LIVE_ISVC,
         action="apply", lever="relieveMaxNumSeqs", field="maxNumSeqs", from_=64, to=30,
         reason="raiseGpuMemoryUtilization follows after the cooldown"),
    Case("the relief is sized to what the KV pool holds at the mean request length",
         window(rate=0.5, capacity=Capacity(100, 16, 4096), mean_request_tokens=150.0),
         isvc(remediation={"liveLevers": True, "limits": {"minMaxNumSeqs": 4}}),
         action="apply", lever="relieveMaxNumSeqs", from_=64, to=10,
         reason="100 blocks / 10 per request (mean 150 tokens)"),
    Case("the relief never goes below the maxNumSeqs floor",
         window(rate=0.5, capacity=Capacity(10, 16, 4096), mean_request_tokens=150.0), LIVE_ISVC,
         action="apply", lever="relieveMaxNumSeqs", from_=64, to=16),
    Case("the restart lever follows the relief even when the relief ended the storm", window(), RELIEVED,
         history=[RELIEF], action="apply", lever="raiseGpuMemoryUtilization", from_=0.9, to=0.95,
         reason="the storm the live relief holds back"),
    Case("and when it did not", STORM, RELIEVED, history=[RELIEF], action="apply",
         lever="raiseGpuMemoryUtilization", reason="a preemption storm"),
    Case("the restart lever after a relief waits for the cooldown", window(), RELIEVED,
         history=[change(100, "relieveMaxNumSeqs", "maxNumSeqs", 64, 30)],
         lever="raiseGpuMemoryUtilization", reason="cooldown"),
    Case("maxNumSeqs comes back once the restart lever rolled out and the storm stayed away", window(),
         RESTORABLE, history=[DURABLE, RELIEF], action="apply", lever="restoreMaxNumSeqs",
         field="maxNumSeqs", from_=30, to=64, reason="raiseGpuMemoryUtilization rolled out"),
    Case("a storm after the restart lever: relieved again, further", STORM,
         isvc(remediation={"liveLevers": True, "limits": {"maxGpuMemoryUtilization": 0.99}},
              overrides=RESTORABLE["status"]["effective"]["overrides"]),
         history=[DURABLE, RELIEF], action="apply", lever="relieveMaxNumSeqs", from_=30, to=22),
    Case("a storm after the restart lever, at the memory limit: the ladder's lowering stays", STORM,
         RESTORABLE, history=[DURABLE, RELIEF], action="apply", lever="lowerMaxNumSeqs", from_=30, to=22),
    Case("chained reliefs restore to the value before the first", window(),
         isvc({"gpuMemoryUtilization": 0.9}, remediation=LIVE_REMEDIATION,
              overrides={"maxNumSeqs": {"value": 22, "specValue": 64},
                         "gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9}}),
         history=[change(700, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.92, 0.95),
                  change(1400, "relieveMaxNumSeqs", "maxNumSeqs", 30, 22), DURABLE, RELIEF],
         action="apply", lever="restoreMaxNumSeqs", from_=22, to=64),
    Case("a relief whose restart lever failed stays (as a lowering would)", window(), RESTORABLE,
         history=[change(300, "revert", "gpuMemoryUtilization", 0.95, 0.9), DURABLE, RELIEF],
         reason="stable"),
    Case("a relief the user overrode by editing maxNumSeqs is over", window(),
         isvc({"maxNumSeqs": 48}, remediation=LIVE_REMEDIATION,
              overrides={"maxNumSeqs": {"value": 30, "specValue": 64}}),
         history=[RELIEF], reason="stable"),
    Case("no room for the restart lever: no relief, the ladder's lowering", STORM,
         isvc(AT_GMU_LIMIT, remediation=LIVE_REMEDIATION), action="apply", lever="lowerMaxNumSeqs", to=30),
    Case("maxNumSeqs reverted: the restart lever at once", STORM, LIVE_ISVC,
         history=[change(700, "revert", "maxNumSeqs", 30, 64)], action="apply",
         lever="raiseGpuMemoryUtilization"),
    Case("Recommend mode proposes the restart lever, not a relief", STORM,
         isvc(remediation={"mode": "Recommend", "liveLevers": True}), action="recommend",
         lever="raiseGpuMemoryUtilization"),
    Case("vLLM has no live levers: the restart lever first", STORM,
         isvc(remediation=LIVE_REMEDIATION, runtime="vllm"), action="apply",
         lever="raiseGpuMemoryUtilization"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decide(case: Case):
    obj = case.isvc
    decision = decide(case.window, resolve(obj), case.history, NOW)
    assert decision.action == case.action, decision.reason
    for name in ("lever", "field", "from_", "to"):
        expected = getattr(case, name)
        if expected is not None:
            assert getattr(decision, name) == expected, (name, decision)
    assert case.reason in decision.reason
    assert decision.exhausted == case.exhausted
    if decision.action != "none":
        assert decision.lever and decision.field and decision.from_ != decision.to
    assert decision.reason  # every decision explains itself


def test_the_cases_reach_every_lever_action_and_outcome_of_the_policy():
    """What ``decide`` returns on the table, not what the table declares: a lever or an outcome the
    policy can no longer reach (or a new one nobody tested) fails here."""
    decisions = [decide(c.window, resolve(c.isvc), c.history, NOW) for c in CASES]
    assert len(CASES) >= 25
    assert {d.lever for d in decisions if d.action != NONE} == set(LEVERS)
    assert {d.action for d in decisions} == {NONE, APPLY, RECOMMEND_ACTION}
    assert {d.exhausted for d in decisions} == {True, False}


def test_decisions_are_pure_and_deterministic():
    obj = isvc()
    before = copy.deepcopy(obj)
    first = decide(STORM, resolve(obj), [], NOW)
    assert decide(STORM, resolve(obj), [], NOW) == first
    assert obj == before


def _series(pod: str, increases: list[float | str], kv: float = 0.6) -> PodSeries:
    """Scrapes every 10 s; ``"restart:N"``: a fresh process that has counted N so far."""
    metrics = EngineMetrics().set(kv=kv, waiting=0, running=20)
    series = PodSeries(pod)
    for index, increase in enumerate(increases):
        if isinstance(increase, str):
            metrics = EngineMetrics().set(kv=kv, waiting=0, running=20)
            increase = float(increase.split(":")[1])
        metrics.preempt(increase)
        series.add(parse_scrape(metrics.text(), NOW - 120 + index * 10))
    return series


def test_counter_reset_mid_window_neither_hides_nor_fakes_a_storm():
    obj = isvc(replicas=1)
    # 1 preemption/s, with a restart in the middle that re-counts from 0: still a storm of 1/s.
    increases = [0] + [10] * 6 + ["restart:10"] + [10] * 5
    storm = summarize({"a": _series("a", increases)}, now=NOW, window_s=120, stale_after_s=45)
    assert storm.preemption_rate == pytest.approx(1.0)
    assert decide(storm, resolve(obj), [], NOW).action == "apply"
    # A restart of a calm engine (its counter drops from 500 to 0) is not a negative rate, nor a storm.
    increases = [500] + [0] * 6 + ["restart:0"] + [0] * 5
    calm = summarize({"a": _series("a", increases)}, now=NOW, window_s=120, stale_after_s=45)
    assert calm.preemption_rate == 0 and calm.counter_resets == 1
    assert decide(calm, resolve(obj), [], NOW).action == "none"


def simulate(windows: list[MetricWindow], obj: dict[str, Any], step_s: float = 60.0) -> list[Decision]:
    """Run decide every ``step_s`` over ``windows``, feeding applied changes back like the operator."""
    history: list[Change] = []
    decisions = []
    for index, base in enumerate(windows):
        now = NOW + index * step_s
        current = dataclasses.replace(base, end=now, start=now - WINDOW_S)
        decision = decide(current, resolve(obj), history, now)
        if decision.action == "apply":
            history.insert(0, decision.change(now, obj["metadata"]["generation"]))
            overrides = obj.setdefault("status", {}).setdefault("effective", {}).setdefault("overrides", {})
            spec = obj["spec"]
            spec_value = (
                spec["replicas"] if decision.field == "replicas" else spec["engine"].get(decision.field)
            )
            overrides[decision.field] = {"value": decision.to, "specValue": spec_value}
        decisions.append(decision)
    return decisions


def test_flapping_load_does_not_flap_the_output():
    # Two hours of scrapes every 15 s; every 30 s the load flips between a queue at a full KV cache and
    # an idle engine. Each window holds both: neither sustained demand nor sustained idleness.
    obj = isvc(replicas=2)
    metrics = [EngineMetrics(), EngineMetrics()]
    pods = {f"llama-{i}": PodSeries(f"llama-{i}") for i in range(2)}
    history: list[Change] = []
    actions = []
    for tick in range(2 * 3600 // 15):
        now = NOW + tick * 15
        busy = (tick // 2) % 2 == 0
        for engine, series in zip(metrics, pods.values(), strict=True):
            engine.set(kv=0.97 if busy else 0.05, waiting=12 if busy else 0, running=30 if busy else 1)
            series.add(parse_scrape(engine.text(), now))
        current = summarize(pods, now=now, window_s=WINDOW_S, stale_after_s=45, expected_replicas=2)
        decision = decide(current, resolve(obj), history, now)
        actions.append(decision.action)
    assert set(actions) == {"none"}


def test_flapping_windows_change_at_most_once_per_cooldown_and_never_reverse_quickly():
    # Whole windows alternating between demand and idleness every minute, for an hour.
    obj = isvc(replicas=2)
    decisions = simulate([DEMAND if i % 2 else IDLE for i in range(60)], obj)
    changes = [(i, d.lever) for i, d in enumerate(decisions) if d.action == "apply"]
    assert len(changes) >= 2, f"the scenario must make the policy act more than once: {changes}"
    for (i, a), (j, b) in zip(changes, changes[1:], strict=False):
        assert (j - i) * 60 >= COOLDOWN_S
        if a == "addReplica" and b == "removeReplica":
            assert (j - i) * 60 >= 2 * COOLDOWN_S
    # Windows whose intervals disagree (storm, then calm) never act.
    assert all(d.action == "none" for d in simulate([window(intervals=(0.5, 0.0) * 4)] * 30, isvc()))


def test_a_steady_storm_walks_the_ladder_one_step_per_cooldown():
    obj = isvc({**AT_GMU_LIMIT, "maxNumSeqs": 32}, replicas=1)
    decisions = simulate([window(rate=0.5, running=30)] * 60, obj)
    steps = [(i, d.lever, d.to) for i, d in enumerate(decisions) if d.action == "apply"]
    assert [s[1] for s in steps][:3] == ["lowerMaxNumSeqs", "lowerMaxNumSeqs", "lowerMaxNumBatchedTokens"]
    assert steps[0][2] == 22 and steps[1][2] == 16  # 3/4 of what ran, then the floor
    assert all(b[0] - a[0] >= COOLDOWN_S / 60 for a, b in zip(steps, steps[1:], strict=False))
