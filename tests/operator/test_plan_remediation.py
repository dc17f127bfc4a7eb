"""Remediation that jumps (``spec.remediation.plan``): the policy asks its planner for a storm's
restart-lever change, takes a trusted answer straight to its value, and falls back on the ladder --
saying why -- otherwise; the planner itself on the recorded vLLM storm, and on traffic whose in-force
prediction matches what was served.

The policy tests hand ``decide`` a planner that answers from a table (the policy's part is what it asks
and what it does with the answer); the planner tests run the real simulation.
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

from kvpilot.operator.api.settings import resolve
from kvpilot.operator.plan.advise import (
    ScrapeHistory,
    lever_values,
    plan_storm,
    planner_for,
    smallest_sufficient,
)
from kvpilot.operator.plan.candidates import context_of
from kvpilot.operator.plan.recording import read_recording
from kvpilot.operator.plan.workload import workload_from_scrapes
from kvpilot.operator.remediation.decision import APPLY, NONE, RECOMMEND_ACTION, Change
from kvpilot.operator.remediation.evaluate import evaluate
from kvpilot.operator.remediation.planned import LADDER, PLAN, PlannedChange, PlanQuestion, PlanVerdict
from kvpilot.operator.remediation.policy import decide
from kvpilot.operator.remediation.replay import read_records, replay
from tests.operator.test_policy import AT_GMU_LIMIT, NOW, STORM, isvc, window

FIXTURES = Path(__file__).parent / "fixtures"
STORM_FIXTURE = FIXTURES / "vllm-0.32-cpu-storm.jsonl.gz"
PREDICTION = {"maxPreemptionsPerSecond": 0.0, "kvCacheUsage": 0.6, "ttftP99Seconds": 0.4}


class TablePlanner:
    """Answers every question with ``verdict`` and remembers the questions."""

    def __init__(self, verdict: PlanVerdict) -> None:
        self.verdict = verdict
        self.questions: list[PlanQuestion] = []

    def __call__(self, question: PlanQuestion) -> PlanVerdict:
        self.questions.append(question)
        return self.verdict


def trusted(field: str, frm: float, to: float) -> TablePlanner:
    return TablePlanner(PlanVerdict(PlannedChange(field, frm, to, PREDICTION), "simulated", {"requests": 99}))


def test_a_trusted_plan_goes_straight_to_its_value():
    planner = trusted("gpuMemoryUtilization", 0.9, 0.95)
    got = decide(STORM, resolve(isvc()), [], NOW, planner)
    assert (got.action, got.lever, got.field, got.from_, got.to) == (
        APPLY,
        "raiseGpuMemoryUtilization",
        "gpuMemoryUtilization",
        0.9,
        0.95,
    )
    assert got.path == PLAN and "plan: simulated" in got.reason
    # It was asked for the levers the ladder could move, in the ladder's order; replicas are not
    # offered while tensor parallelism could still shard the model (the ladder reaches it first).
    (question,) = planner.questions
    assert question.storm and question.levers == ("gpuMemoryUtilization", "maxNumSeqs", "maxNumBatchedTokens")
    assert got.change(NOW, 5).to_status()["path"] == PLAN


def test_a_plan_may_answer_with_another_lever_than_the_ladders_next_rung():
    planner = trusted("maxNumSeqs", 64, 24)
    got = decide(STORM, resolve(isvc()), [], NOW, planner)
    assert (got.lever, got.field, got.from_, got.to, got.path) == (
        "lowerMaxNumSeqs",
        "maxNumSeqs",
        64,
        24,
        PLAN,
    )
    assert isinstance(got.to, int)


def test_an_untrusted_plan_leaves_the_ladder_rung_and_says_why():
    planner = TablePlanner(PlanVerdict(None, "too little traffic since the last change: 3 requests"))
    got = decide(STORM, resolve(isvc()), [], NOW, planner)
    assert (got.lever, got.from_, got.to, got.path) == ("raiseGpuMemoryUtilization", 0.9, 0.95, LADDER)
    assert "ladder: the plan was not used: too little traffic" in got.reason


def test_a_failing_planner_never_stops_remediation():
    def broken(question: PlanQuestion) -> PlanVerdict:
        raise RuntimeError("boom")

    got = decide(STORM, resolve(isvc()), [], NOW, broken)
    assert got.action == APPLY and got.path == LADDER and "the planner failed" in got.reason


def test_the_plan_is_not_asked_when_disabled_held_back_or_not_a_storm():
    planner = trusted("gpuMemoryUtilization", 0.9, 0.95)
    off = isvc(remediation={"plan": {"enabled": False}})
    assert decide(STORM, resolve(off), [], NOW, planner).path is None
    recent = [Change(NOW - 60, "raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.85, 0.9, "", 5)]
    held = decide(STORM, resolve(isvc()), recent, NOW, planner)
    assert held.action == NONE and "cooldown" in held.reason
    calm = decide(window(), resolve(isvc()), [], NOW, planner)
    assert calm.action == NONE
    demand = decide(window(kv=0.95, waiting=12), resolve(isvc()), [], NOW, planner)
    assert demand.lever == "addReplica" and demand.path is None  # demand adds a replica, unplanned
    assert planner.questions == []


def test_levers_at_their_limits_are_not_offered():
    planner = TablePlanner(PlanVerdict(None, "no single change"))
    decide(STORM, resolve(isvc(AT_GMU_LIMIT)), [], NOW, planner)
    assert planner.questions[0].levers == ("maxNumSeqs", "maxNumBatchedTokens")
    # Without GPUs (no sharding) replicas are offered too, when below maxReplicas.
    cpu = isvc(resources={"gpusPerReplica": 0})
    planner = TablePlanner(PlanVerdict(None, "no single change"))
    decide(STORM, resolve(cpu), [], NOW, planner)
    assert planner.questions[0].levers[-1] == "replicas"


def test_after_a_live_relief_the_restart_lever_is_planned_from_the_restored_max_num_seqs():
    relieved = isvc(
        remediation={"liveLevers": True}, overrides={"maxNumSeqs": {"value": 30, "specValue": 64}}
    )
    relief = Change(NOW - 1400, "relieveMaxNumSeqs", "maxNumSeqs", 64, 30, "test", 5)
    planner = trusted("gpuMemoryUtilization", 0.9, 0.93)
    got = decide(window(), resolve(relieved), [relief], NOW, planner)
    assert (got.lever, got.to, got.path) == ("raiseGpuMemoryUtilization", 0.93, PLAN)
    (question,) = planner.questions
    assert question.levers == ("gpuMemoryUtilization",) and dict(question.base) == {"maxNumSeqs": 64}
    assert not question.storm  # the relief holds the storm back: the window shows none


def test_recommend_mode_writes_the_planned_settings_and_their_prediction():
    obj = isvc(remediation={"mode": "Recommend"})
    obj["metadata"]["generation"] = 5
    planner = trusted("gpuMemoryUtilization", 0.9, 0.95)
    decision, update = evaluate(resolve(obj), STORM, NOW, planner=planner)
    assert decision.action == RECOMMEND_ACTION and decision.path == PLAN
    rec = update.patch["recommendation"]
    assert rec["settings"]["gpuMemoryUtilization"] == 0.95 and rec["settings"]["replicas"] == 2
    assert rec["settings"]["maxNumSeqs"] == 64  # the levers in force beside the planned one
    assert rec["prediction"] == PREDICTION and rec["inForce"] == {"requests": 99}
    assert update.patch["recommendations"][0]["path"] == PLAN
    # Auto writes no recommendation: the change itself is the plan, and the condition says so.
    decision, update = evaluate(resolve(isvc()), STORM, NOW, planner=planner)
    assert decision.action == APPLY and "recommendation" not in update.patch
    remediating = next(c for c in update.patch["conditions"] if c["type"] == "Remediating")
    assert "(planned)" in remediating["message"]
    assert any("plan: simulated" in message for _, _, message in update.events)


# The planner on real traffic.


def _storm_isvc(**remediation) -> dict:
    from tests.operator.test_vllm_replay import isvc as vllm_isvc

    obj = vllm_isvc("Auto")
    obj["spec"]["remediation"].update(remediation)
    return obj


@pytest.fixture(scope="module")
def storm_scrapes():
    return read_recording(STORM_FIXTURE, _storm_isvc())


def test_lever_values_stay_within_the_limits_smallest_change_first(storm_scrapes):
    settings = resolve(_storm_isvc(limits={"maxGpuMemoryUtilization": 0.8, "minMaxNumSeqs": 8}))
    ctx = context_of(settings, workload_from_scrapes(storm_scrapes))
    fractions = lever_values("gpuMemoryUtilization", ctx, ctx.current)
    assert fractions == [round(0.5 + 0.01 * k, 2) for k in range(1, 31)]
    assert lever_values("maxNumSeqs", ctx, ctx.current) == list(range(31, 7, -1))
    assert lever_values("replicas", ctx, ctx.current) == list(range(2, 9))
    tokens = lever_values("maxNumBatchedTokens", ctx, ctx.current)
    assert tokens == sorted(tokens, reverse=True) and len(tokens) <= 16
    assert tokens[0] < ctx.current.max_num_batched_tokens and tokens[-1] == 2048  # minMaxNumBatchedTokens
    at_top = dataclass_replace(ctx.current, gpu_memory_utilization=0.8)
    assert lever_values("gpuMemoryUtilization", ctx, at_top) == []


@pytest.mark.parametrize("threshold", [0, 1, 7, 29, 30])
def test_smallest_sufficient_bisects_to_the_first_value_that_ends_the_storm(threshold):
    values = list(range(30))
    calls = []

    def ends(value):
        calls.append(value)
        return f"result {value}" if value >= threshold else None

    got = smallest_sufficient(values, ends)
    if threshold >= 30:
        assert got is None and calls == [29]  # the largest change first: none ends it
    else:
        assert got == (threshold, f"result {threshold}")
    assert len(calls) <= 1 + 5  # log2(30) rounded up, after the largest change
    assert smallest_sufficient([], ends) is None


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_the_planner_checks_the_settings_in_force_against_what_was_served(storm_scrapes):
    settings = resolve(_storm_isvc())
    question = PlanQuestion(("gpuMemoryUtilization", "maxNumSeqs"), storm=True)
    verdict = plan_storm(settings, storm_scrapes, question)
    check = verdict.in_force
    # The check ran: predicted and served output tok/s side by side, within the bound or said otherwise.
    assert check["recordedOutputTokensPerSecond"] > 0 and check["predictedOutputTokensPerSecond"] > 0
    error = check["outputTokensError"]
    assert error == pytest.approx(
        abs(check["predictedOutputTokensPerSecond"] - check["recordedOutputTokensPerSecond"])
        / check["recordedOutputTokensPerSecond"],
        abs=1e-4,  # the check's numbers are rounded to 4 places
    )
    # A bound tighter than the error refuses the plan and names both numbers.
    strict = resolve(_storm_isvc(plan={"maxPredictionError": max(error / 2, 1e-4)}))
    refused = plan_storm(strict, storm_scrapes, question)
    assert not refused.trusted and "mispredicted" in refused.reason and "served" in refused.reason
    # Asked as if the window showed no storm, the in-force prediction (a storm) contradicts it.
    calm = plan_storm(settings, storm_scrapes, PlanQuestion(("gpuMemoryUtilization",), storm=False))
    assert not calm.trusted and "the simulation shows a storm" in calm.reason


def test_too_little_traffic_is_no_plan(storm_scrapes):
    settings = resolve(_storm_isvc(plan={"minRequests": 100000}))
    verdict = plan_storm(settings, storm_scrapes, PlanQuestion(("gpuMemoryUtilization",), storm=True))
    assert not verdict.trusted and "too little traffic" in verdict.reason
    none = plan_storm(settings, [], PlanQuestion(("gpuMemoryUtilization",), storm=True))
    assert not none.trusted and "cannot be simulated" in none.reason


def test_a_trusted_plan_on_the_recorded_storm_ends_it_in_simulation_within_the_limits(storm_scrapes):
    """With replicas allowed (no sharding to try first), the recorded vLLM storm has a single change
    that ends it in simulation; the planned value is within the limits and its prediction under half
    the threshold."""
    settings = resolve(_storm_isvc(limits={"maxReplicas": 8, "maxTensorParallelSize": 1}))
    question = PlanQuestion(("gpuMemoryUtilization", "maxNumSeqs", "replicas"), storm=True)
    verdict = plan_storm(settings, storm_scrapes, question)
    assert verdict.trusted, verdict.reason
    change = verdict.change
    assert change.field in question.levers
    if change.field == "replicas":
        assert 1 < change.to <= 8
    elif change.field == "gpuMemoryUtilization":
        assert 0.5 < change.to <= 0.95
    else:
        assert 16 <= change.to < 32
    assert change.prediction["maxPreemptionsPerSecond"] <= 0.5 * settings.remediation.preemption_rate


def test_replay_shows_both_paths(storm_scrapes):
    """``kvpilot replay`` with the plan and without it, on the same recording: the same storm, each
    path's change and its reason."""
    lines = gzip.decompress(STORM_FIXTURE.read_bytes()).decode().splitlines()
    obj = _storm_isvc(limits={"maxReplicas": 8, "maxTensorParallelSize": 1})
    paths = {}
    for plan in (True, False):
        records = read_records(lines, obj)
        applied = [d for _, d, _ in replay(obj, records, plan=plan) if d.action == APPLY]
        paths[plan] = applied[0]
    planned, ladder = paths[True], paths[False]
    assert planned.path == PLAN and ladder.path is None
    assert (ladder.field, ladder.from_, ladder.to) == ("gpuMemoryUtilization", 0.5, 0.55)
    assert (planned.field, planned.to) != (ladder.field, ladder.to)


def test_scrape_history_keeps_the_lookback_and_the_traffic_since_a_change():
    lines = [json.loads(line) for line in gzip.decompress(STORM_FIXTURE.read_bytes()).decode().splitlines()]
    kept = ScrapeHistory(lookback_s=30.0, eager=True)
    for line in lines:
        kept.add("k", line["pod"], line["time"], line["metrics"])
    end = lines[-1]["time"]
    got = kept.scrapes(["k"], float("-inf"), end)
    assert got and min(s.time for s in got) >= end - 30.0
    since = end - 10.0
    assert all(s.time > since for s in kept.scrapes(["k"], since, end))
    assert kept.scrapes(["other"], float("-inf"), end) == []
    kept.forget([])
    assert kept.scrapes(["k"], float("-inf"), end) == []
    # An invalid body is left out, not fatal.
    bad = ScrapeHistory(lookback_s=30.0)
    bad.add("k", "p", 1.0, "vllm:num_requests_running NaN\n")
    assert bad.scrapes(["k"], float("-inf"), 2.0) == []


def test_planner_for_asks_once_per_question(storm_scrapes):
    calls = []

    def scrapes():
        calls.append(1)
        return storm_scrapes

    planner = planner_for(resolve(_storm_isvc(plan={"minRequests": 100000})), scrapes)
    question = PlanQuestion(("gpuMemoryUtilization",), storm=True, base={"maxNumSeqs": 32})
    first = planner(question)
    assert planner(copy.deepcopy(question)) is first and len(calls) == 1


def test_kvpilot_replay_both_paths_prints_each_run_and_their_changes(tmp_path, capsys):
    import yaml

    from kvpilot.cli import main

    manifest = tmp_path / "isvc.yaml"
    manifest.write_text(yaml.safe_dump(_storm_isvc(limits={"maxReplicas": 8, "maxTensorParallelSize": 1})))
    args = ["replay", "-f", str(manifest), "--metrics", str(tmp_path / "s.jsonl"), "--changes-only"]
    (tmp_path / "s.jsonl").write_bytes(gzip.decompress(STORM_FIXTURE.read_bytes()))
    assert main([*args, "--both-paths"]) == 0
    out = capsys.readouterr().out
    assert "== with the plan ==" in out and "== the ladder alone (plan disabled) ==" in out
    planned_line = next(line for line in out.splitlines() if line.startswith("with the plan: "))
    ladder_line = next(line for line in out.splitlines() if line.startswith("the ladder alone: "))
    assert "replicas 1 → " in planned_line and "gpuMemoryUtilization 0.5 → 0.55" in ladder_line
    # The table's PATH column: plan for the planned run's change.
    rows = [line.split() for line in out.splitlines() if " apply " in line]
    assert rows[0][6] == "plan" and rows[-1][6] == "-"
    assert main([*args, "--no-plan", "--output", "json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["path"] for line in lines if line["action"] == "apply"] == [None]


def test_latency_quantiles_pool_draws_of_a_short_recording(storm_scrapes, monkeypatch):
    """A recording of a few hundred requests is drawn again until its latencies rest on
    MIN_LATENCY_SAMPLES requests; the other predictions stay the first draw's, and a trace (the same
    requests every time) is drawn once."""
    import dataclasses

    from kvpilot.operator.plan import candidates as cand

    doc = _storm_isvc()
    workload = workload_from_scrapes(storm_scrapes)
    step_time = workload.step_time()
    ctx = context_of(resolve(doc), workload)
    first = cand.evaluate(ctx.current, ctx, workload, step_time, seed=0)
    draws = min(-(-cand.MIN_LATENCY_SAMPLES // workload.num_requests), cand.MAX_REALIZATIONS)  # 2 here
    monkeypatch.setattr(cand, "MAX_REALIZATIONS", 1)
    alone = cand.evaluate(ctx.current, ctx, workload, step_time, seed=0)
    assert len(alone.result.ttft_s) == workload.num_requests < cand.MIN_LATENCY_SAMPLES
    assert len(first.result.ttft_s) == draws * workload.num_requests
    assert first.result.ttft_s[: workload.num_requests] == alone.result.ttft_s
    assert first.result.samples == alone.result.samples  # the rest is the first draw's
    monkeypatch.setattr(cand, "MAX_REALIZATIONS", 8)
    traced = dataclasses.replace(workload, trace=tuple(workload.arrivals(0)))
    assert len(cand.evaluate(ctx.current, ctx, traced, step_time).result.ttft_s) == workload.num_requests


def test_latency_samples_pool_more_draws_and_stop_at_their_cap(storm_scrapes, monkeypatch):
    """PlanContext.latency_samples (kvpilot plan --latency-samples) raises the requests the latency
    quantiles rest on: the draws go on until they hold that many, at most MAX_REALIZATIONS per
    MIN_LATENCY_SAMPLES; the first draw's latencies lead, and the rest of the prediction is the
    first draw's as before."""
    import dataclasses

    from kvpilot.operator.plan import candidates as cand

    doc = _storm_isvc()
    workload = workload_from_scrapes(storm_scrapes)
    step_time = workload.step_time()
    ctx = context_of(resolve(doc), workload)
    n = workload.num_requests
    base = cand.evaluate(ctx.current, ctx, workload, step_time, seed=0)
    wanted = 3 * cand.MIN_LATENCY_SAMPLES
    more = cand.evaluate(
        ctx.current, dataclasses.replace(ctx, latency_samples=wanted), workload, step_time, seed=0
    )
    assert len(more.result.ttft_s) == -(-wanted // n) * n > len(base.result.ttft_s)
    assert more.result.ttft_s[: len(base.result.ttft_s)] == base.result.ttft_s
    assert more.result.samples == base.result.samples
    assert cand.max_realizations(wanted) == 3 * cand.MAX_REALIZATIONS
    # The cap: one draw per MIN_LATENCY_SAMPLES here, so the pool stops at three draws.
    monkeypatch.setattr(cand, "MAX_REALIZATIONS", 1)
    capped = cand.evaluate(
        ctx.current, dataclasses.replace(ctx, latency_samples=wanted), workload, step_time, seed=0
    )
    assert len(capped.result.ttft_s) == 3 * n
