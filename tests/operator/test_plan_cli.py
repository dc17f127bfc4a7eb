"""``kvpilot plan`` on the recorded vLLM storm: it predicts the storm for the settings in force and
proposes a candidate within the limits that has none."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from kvpilot.cli import main
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.plan.candidates import Candidate, candidate_grid, context_of, evaluate
from kvpilot.operator.plan.recording import read_recording
from kvpilot.operator.plan.step_time import fit_step_time
from kvpilot.operator.plan.workload import workload_from_scrapes

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-storm.jsonl.gz"
# The same server with a KV pool just short of its 24 concurrent clients (test_vllm_replay.py).
NEAR = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-near-threshold.jsonl.gz"


def isvc(limits: dict | None = None) -> dict:
    """The InferenceService the storm was recorded under (as tests/operator/test_vllm_replay.py)."""
    remediation = {"mode": "Recommend", "window": "10s", "cooldown": "10m", "preemptionRate": 0.5}
    if limits:
        remediation["limits"] = limits
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "llm", "generation": 1},
        "spec": {
            "model": {"source": "pvc://models/llm"},
            "runtime": "vllm",
            "image": "vllm/vllm-openai:v0.32.0",
            "engine": {"gpuMemoryUtilization": 0.5, "maxNumSeqs": 32, "maxModelLen": 512, "blockSize": 32},
            "remediation": remediation,
        },
    }


def _manifest(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_predicts_the_storm_and_a_way_out(tmp_path, capsys) -> None:
    out_json = tmp_path / "plan.json"
    rc = main(
        ["plan", "-f", str(_manifest(tmp_path, isvc())), "--recording", str(FIXTURE), "--json", str(out_json)]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    plan = json.loads(out_json.read_text())
    rows = plan["candidates"]
    current = rows[0]
    assert current["in_force"] and current["label"] == "in force"
    # The recording is a storm: ~5.6 preemptions/s recorded; the prediction is one too.
    assert plan["workload"]["recorded_preemptions"] == 295
    assert current["sustained_preemption"]
    assert current["per_replica"]["preemptions_per_s"] > 10 * plan["threshold"]["preemption_rate"]
    assert current["per_replica"]["kv_usage_p99"] == 1.0
    assert current["per_replica"]["num_finished"] == plan["workload"]["num_requests"]
    timeline = current["timeline"]
    assert len(timeline) > 30 and all(0.0 <= p["kv_usage"] <= 1.0 for p in timeline)
    assert timeline[-1]["num_preemptions"] == current["per_replica"]["num_preemptions"]
    # A way out within the limits (maxGpuMemoryUtilization 0.95, maxReplicas 8 by default).
    assert plan["pick"] is not None
    chosen = rows[plan["pick"]]
    assert not chosen["sustained_preemption"] and chosen["keeps_up"]
    assert chosen["max_preemption_rate"] <= plan["threshold"]["preemption_rate"]
    assert chosen["candidate"]["gpuMemoryUtilization"] <= 0.95 and chosen["candidate"]["replicas"] <= 8
    # Cheapest: no eligible candidate uses fewer GPUs.
    eligible = [r for r in rows if not r["sustained_preemption"] and r["keeps_up"]]
    assert chosen["num_gpus"] == min(r["num_gpus"] for r in eligible)
    # More memory alone helps but is not enough here: fewer preemptions than in force, still a storm.
    more_memory = next(r for r in rows if r["label"] == "gpuMemoryUtilization 0.95")
    assert more_memory["num_gpu_blocks"] == 45
    assert 0 < more_memory["per_replica"]["preemptions_per_s"] < current["per_replica"]["preemptions_per_s"]
    # The table: one row per candidate, the pick marked.
    lines = captured.out.splitlines()
    marked = [line for line in lines if line.startswith("*  ")]
    assert len(marked) == 1 and chosen["label"] in marked[0]
    threshold = "(0.5 preemptions/s per replica over 10s)"
    assert f"cheapest that avoids sustained preemption {threshold}: {chosen['label']}" in captured.out
    assert "simulating" in captured.err  # the progress bar


def test_a_ttft_slo_keeps_candidates_predicted_above_it_out_of_the_pick(tmp_path, capsys) -> None:
    """With spec.remediation.slo.ttftP99Seconds a candidate predicted above it is not picked: an SLO
    every storm-free candidate meets leaves the pick as it was, one below all of them leaves none."""

    def run(slo: float | None, name: str) -> dict:
        doc = isvc()
        if slo is not None:
            doc["spec"]["remediation"]["slo"] = {"ttftP99Seconds": slo}
        manifest, out_json = tmp_path / f"{name}.yaml", tmp_path / f"{name}.json"
        manifest.write_text(yaml.safe_dump(doc))
        args = ["plan", "-f", str(manifest), "--recording", str(FIXTURE), "--json", str(out_json)]
        assert main([*args, "--no-progress"]) == 0
        return json.loads(out_json.read_text())

    free = run(None, "free")
    ok = [r for r in free["candidates"] if not r["sustained_preemption"] and r["keeps_up"]]
    ttfts = [r["per_replica"]["ttft_p99_s"] for r in ok]
    loose = run(max(ttfts) * 1.01, "loose")
    storm_free = {r["label"] for r in ok}
    assert loose["pick"] == free["pick"]
    assert [r["meets_slo"] for r in loose["candidates"] if r["label"] in storm_free] == [True] * len(ok)
    capsys.readouterr()
    tight = run(min(ttfts) / 2, "tight")
    assert tight["pick"] is None and tight["ttft_p99_slo_s"] == pytest.approx(min(ttfts) / 2)
    assert not any(r["meets_slo"] for r in tight["candidates"])
    out = capsys.readouterr().out
    assert "no candidate within the limits avoids sustained preemption and keeps TTFT p99 within" in out


def test_limits_that_leave_no_way_out_say_so(tmp_path, capsys) -> None:
    doc = isvc({"maxGpuMemoryUtilization": 0.5, "maxReplicas": 1, "minMaxNumSeqs": 32})
    out_json = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "-f",
            str(_manifest(tmp_path, doc)),
            "--recording",
            str(FIXTURE),
            "--json",
            str(out_json),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    plan = json.loads(out_json.read_text())
    assert plan["pick"] is None
    assert all(
        r["candidate"]["replicas"] == 1 and r["candidate"]["gpuMemoryUtilization"] == 0.5
        for r in plan["candidates"]
    )
    assert "no candidate within the limits avoids sustained preemption" in captured.out
    assert captured.err == ""


def test_the_grid_stays_within_the_limits() -> None:
    doc = isvc(
        {"maxGpuMemoryUtilization": 0.8, "maxReplicas": 3, "minMaxNumSeqs": 8, "minMaxNumBatchedTokens": 4096}
    )
    settings = resolve(doc)
    workload = workload_from_scrapes(read_recording(FIXTURE, doc))
    ctx = context_of(settings, workload)
    assert ctx.current == Candidate(0.5, 32, 8192, 1)
    grid = candidate_grid(ctx)
    assert grid[0] == ctx.current and len(set(grid)) == len(grid)
    assert {c.gpu_memory_utilization for c in grid} == {0.5, 0.65, 0.8}
    assert {c.max_num_seqs for c in grid} == {32, 16, 8}
    assert {c.max_num_batched_tokens for c in grid} == {8192, 4096}
    assert {c.replicas for c in grid} == {1, 2, 3}
    assert all(len(c.changes(ctx.current)) <= 2 for c in grid)
    assert candidate_grid(ctx, can_resize_pool=False) == [c for c in grid if c.gpu_memory_utilization == 0.5]


@pytest.mark.parametrize(
    "recording_text,message",
    [
        ("", "no sample records"),
        ('{"time": 1, "pod": "p", "metrics": "vllm:num_requests_running 1\\n"}\n', "at least two scrapes"),
        ("{oops\n", "line 1"),
    ],
    ids=["empty", "one-scrape", "garbage"],
)
def test_an_unusable_recording_is_one_error_line(tmp_path, capsys, recording_text, message) -> None:
    recording = tmp_path / "rec.jsonl"
    recording.write_text(recording_text)
    rc = main(
        ["plan", "-f", str(_manifest(tmp_path, isvc())), "--recording", str(recording), "--no-progress"]
    )
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and message in captured.err


def test_an_invalid_manifest_is_one_error_line(tmp_path, capsys) -> None:
    doc = isvc()
    doc["spec"]["engine"]["maxNumSeqs"] = -1
    rc = main(["plan", "-f", str(_manifest(tmp_path, doc)), "--recording", str(FIXTURE), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.err.startswith("error: invalid InferenceService")
    assert len(captured.err.strip().splitlines()) == 1


def test_near_the_threshold_the_clients_concurrency_keeps_the_prediction_close() -> None:
    """The near-threshold recording: 64 preemptions with 24 clients in flight at most. Capped at
    that concurrency the prediction is of the recorded order; sent open loop, a simulation a little
    slower than the real engine piles up requests no client sent, and the storm runs away."""
    doc = isvc()
    workload = workload_from_scrapes(read_recording(NEAR, doc))
    step_time = fit_step_time(workload.step_windows)
    assert workload.num_preemptions == 64 and workload.peak_in_flight == 24
    closed = context_of(resolve(doc), workload)
    open_loop = context_of(resolve(doc), workload, open_loop=True)
    assert closed.client_concurrency == 24 and open_loop.client_concurrency is None
    predicted = evaluate(closed.current, closed, workload, step_time).result
    unbounded = evaluate(open_loop.current, open_loop, workload, step_time).result
    assert 64 / 4 <= predicted.num_preemptions <= 64 * 4
    assert unbounded.num_preemptions > 4 * predicted.num_preemptions
    # A little more memory ends it.
    more = dataclasses.replace(closed.current, gpu_memory_utilization=0.725)
    assert evaluate(more, closed, workload, step_time).result.num_preemptions == 0


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_shows_predicted_vs_recorded_and_the_candidates(tmp_path, capsys, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from kvpilot.operator.plan import plot

    summaries = []
    draw = plot.write_plan_plot

    def recorded(*args, **kwargs):
        summaries.append(draw(*args, **kwargs))
        return summaries[-1]

    monkeypatch.setattr(plot, "write_plan_plot", recorded)
    # A small grid with a way out: memory up to 0.95, two replicas at most, the batch limits kept.
    doc = isvc(
        {
            "maxGpuMemoryUtilization": 0.95,
            "maxReplicas": 2,
            "minMaxNumSeqs": 32,
            "minMaxNumBatchedTokens": 8192,
        }
    )
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(
        [
            "plan",
            "-f",
            str(_manifest(tmp_path, doc)),
            "--recording",
            str(FIXTURE),
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE
    plan = json.loads(out_json.read_text())
    rows = plan["candidates"]
    (summary,) = summaries
    assert len(summary["panels"]) == 2
    assert summary["panels"][0] == "predicted vs recorded, settings in force"
    assert summary["panels"][1].startswith("candidates: cost vs predicted preemption")
    # One point per simulated candidate; the settings in force and the pick labelled.
    assert summary["num_points"] == len(rows) == 5 and summary["skipped"] == []
    chosen = rows[plan["pick"]]["label"]
    assert summary["in_force"] == "in force" and summary["chosen"] == chosen
    assert summary["labels"] == ["in force", f"pick: {chosen}"]
    # The windows cover the recording (52 s of ~1 s scrapes) and add up to what each side counted.
    assert summary["num_windows"] >= 40
    assert summary["preemptions"]["recorded"] == pytest.approx(plan["workload"]["recorded_preemptions"])
    assert summary["preemptions"]["predicted"] == pytest.approx(rows[0]["per_replica"]["num_preemptions"])
    # The storm starts in the same window or the next, recorded and predicted.
    storm = plan["threshold"]["preemption_rate"]
    first = [
        next(i for i, r in enumerate(summary[key]) if r > storm)
        for key in ("recorded_per_s", "predicted_per_s")
    ]
    assert abs(first[0] - first[1]) <= 1 and summary["windows_s"][first[0]] > 5
    assert f"plot: {out_png} ({summary['num_windows']} windows predicted vs recorded, 5 candidates)" in (
        captured.out
    )


def test_plot_without_matplotlib_is_skipped_with_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    doc = isvc({"maxGpuMemoryUtilization": 0.5, "maxReplicas": 1, "minMaxNumSeqs": 32})
    out_png = tmp_path / "plan.png"
    rc = main(
        [
            "plan",
            "-f",
            str(_manifest(tmp_path, doc)),
            "--recording",
            str(FIXTURE),
            "--plot",
            str(out_png),
            "--no-progress",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0 and not out_png.exists()
    assert "in force" in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "plot skipped" in lines[0] and "matplotlib is not installed" in lines[0]


def test_plan_cli_latency_samples(tmp_path, capsys):
    """--latency-samples takes a whole number of at least 1 (else argparse's usage error, exit 2) and
    the plan's JSON says how many requests its latency quantiles rest on."""
    manifest = _manifest(tmp_path, isvc())
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "-f", str(manifest), "--recording", str(FIXTURE), "--latency-samples", bad])
        assert exit_info.value.code == 2
        assert "--latency-samples" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    args = ["plan", "-f", str(manifest), "--recording", str(FIXTURE), "--no-progress", "--json", str(out)]
    assert main([*args, "--latency-samples", "1500"]) == 0
    assert json.loads(out.read_text())["latency_samples"] == 1500
