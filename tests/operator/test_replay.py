"""``kvpilot replay``: recorded scrapes through the policy, from the command line; ``--record`` output."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from kvpilot.cli import main
from kvpilot.operator.api.timefmt import parse_time
from kvpilot.operator.remediation.pods import Target
from kvpilot.operator.remediation.replay import read_records, replay
from kvpilot.operator.remediation.scrape import Recorder, Result
from tests.operator.engine_metrics import EngineMetrics
from tests.operator.test_policy import ISVC

T0 = 1_735_787_045.0
INTERVAL = 15.0


def storm_then_calm(storm_s: float, calm_s: float, pods: int = 1, rate: float = 1.0) -> list[dict]:
    """Records every 15 s: ``rate`` preemptions/s per pod for ``storm_s``, then none for ``calm_s``."""
    engines = [EngineMetrics(max_num_seqs=64) for _ in range(pods)]
    records = []
    t = 0.0
    while t <= storm_s + calm_s:
        for index, engine in enumerate(engines):
            storming = 0 < t <= storm_s
            engine.preempt(rate * INTERVAL if storming else 0)
            engine.set(kv=0.97 if storming else 0.5, waiting=2, running=40 if storming else 12)
            pod = f"llama-{index}"
            time_ = T0 + t + 0.01 * index
            records.append(
                {"time": time_, "tick": T0 + t, "pod": pod, "ready": True, "metrics": engine.text()}
            )
        t += INTERVAL
    return records


@pytest.fixture
def files(tmp_path):
    def write(records: list[dict], mode: str = "Auto", **remediation) -> tuple[Path, Path]:
        isvc = copy.deepcopy(ISVC)
        isvc["spec"]["replicas"] = 1
        isvc["spec"]["remediation"].update(mode=mode, **remediation)
        manifest = tmp_path / "isvc.yaml"
        manifest.write_text(yaml.safe_dump(isvc))
        samples = tmp_path / "samples.jsonl"
        samples.write_text("".join(json.dumps(r) + "\n" for r in records))
        return manifest, samples

    return write


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["replay", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output_walks_the_ladder_with_cooldown(files, capsys):
    manifest, samples = files(storm_then_calm(storm_s=1500, calm_s=300))
    code, out, err = run_cli(capsys, "-f", str(manifest), "--metrics", str(samples), "--output", "json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 1800 / INTERVAL + 1  # one decision per tick
    assert set(lines[0]) == {"time", "action", "lever", "field", "from", "to", "reason", "path"}
    applied = [line for line in lines if line["action"] == "apply"]
    # The synthetic scrapes carry no length histograms: the plan cannot be built, the ladder answers.
    assert [a["path"] for a in applied] == ["ladder"] * 3
    assert all("ladder: the plan was not used" in a["reason"] for a in applied)
    # The first full window of the storm: gpuMemoryUtilization 0.9 -> 0.95; the metrics do not react,
    # so after the cooldown (600 s) the next lever: maxNumSeqs 64 -> 30 (3/4 of the 40 that ran).
    assert [(a["lever"], a["field"], a["from"], a["to"]) for a in applied] == [
        ("raiseGpuMemoryUtilization", "gpuMemoryUtilization", 0.9, 0.95),
        ("lowerMaxNumSeqs", "maxNumSeqs", 64, 30),
        ("lowerMaxNumSeqs", "maxNumSeqs", 30, 30 * 3 // 4),
    ]
    first = applied[0]["time"] - T0
    assert 120 <= first <= 150  # a full window of storm, then at once
    assert applied[1]["time"] - applied[0]["time"] >= 600
    assert "a preemption storm" in applied[0]["reason"]
    held = [line for line in lines if "cooldown" in line["reason"]]
    assert held and all(line["action"] == "none" and line["lever"] is None for line in held)
    assert lines[-1]["action"] == "none" and "stable" in lines[-1]["reason"]


def test_table_output_and_summary(files, capsys):
    manifest, samples = files(storm_then_calm(storm_s=300, calm_s=60))
    code, out, _ = run_cli(capsys, "-f", str(manifest), "--metrics", str(samples), "--changes-only")
    assert code == 0
    header, row, footer = out.splitlines()
    assert header.split()[:8] == ["TIME", "ACTION", "LEVER", "FIELD", "FROM", "TO", "PATH", "REASON"]
    assert row.split()[1:6] == ["apply", "raiseGpuMemoryUtilization", "gpuMemoryUtilization", "0.9", "0.95"]
    assert footer.startswith("25 evaluation(s): 1 applied, 0 recommended; overrides at the end:")
    assert "gpuMemoryUtilization 0.95" in footer


def test_recommend_mode_proposes_and_mode_flag_overrides_the_manifest(files, capsys):
    manifest, samples = files(storm_then_calm(storm_s=900, calm_s=0), mode="Recommend")
    _, out, _ = run_cli(capsys, "-f", str(manifest), "--metrics", str(samples), "--output", "json")
    actions = [json.loads(line) for line in out.splitlines()]
    recommended = [a for a in actions if a["action"] == "recommend"]
    # Recommendations change nothing: the same first lever, once per cooldown.
    assert [(a["field"], a["to"]) for a in recommended] == [("gpuMemoryUtilization", 0.95)] * 2
    assert not [a for a in actions if a["action"] == "apply"]
    args = ("-f", str(manifest), "--metrics", str(samples), "--output", "json", "--mode", "Off")
    _, out, _ = run_cli(capsys, *args)
    assert {json.loads(line)["action"] for line in out.splitlines()} == {"none"}


def test_replay_never_acts_on_gaps_or_unready_pods(files, capsys):
    records = storm_then_calm(storm_s=600, calm_s=0, pods=2)
    # llama-1 stops answering for a while, then is not ready (as the operator records it): the
    # policy must wait.
    for record in records:
        offset = record["tick"] - T0
        if record["pod"] == "llama-1" and 60 < offset <= 240:
            record.update(metrics=None, error="no answer within 3s")
        elif record["pod"] == "llama-1" and 240 < offset <= 300:
            record.update(metrics=None, ready=False)
    manifest, samples = files(records)
    _, out, _ = run_cli(capsys, "-f", str(manifest), "--metrics", str(samples), "--output", "json")
    lines = [json.loads(line) for line in out.splitlines()]
    during = [line for line in lines if 120 < line["time"] - T0 <= 300]
    assert during and all(line["action"] == "none" for line in during)
    assert any("metrics stale" in line["reason"] for line in during)
    assert any("not ready: llama-1" in line["reason"] for line in during)
    applied = [line for line in lines if line["action"] == "apply"]
    assert applied and applied[0]["time"] - T0 > 300 + 100  # a full window of both pods again


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", "line 1: not a sample record"),
        ('{"time": 1, "metrics": "x"}\n', "line 1: not a sample record"),
        ("\n", "no sample records"),
    ],
)
def test_bad_samples_fail_with_the_line(files, capsys, tmp_path, content, message):
    manifest, samples = files([])
    samples.write_text(content)
    code, out, err = run_cli(capsys, "-f", str(manifest), "--metrics", str(samples))
    assert code == 1 and out == "" and message in err


def test_invalid_manifest_fails(files, capsys):
    manifest, samples = files(storm_then_calm(60, 0))
    manifest.write_text(manifest.read_text().replace("engine:1", "''"))
    code, _, err = run_cli(capsys, "-f", str(manifest), "--metrics", str(samples))
    assert code == 1 and "spec.image must name the engine image" in err


def test_the_operators_recording_replays(tmp_path):
    """``--record`` lines are what ``replay`` reads, other services' lines skipped."""
    path = tmp_path / "rec.jsonl"
    recorder = Recorder(str(path))
    engine = EngineMetrics()
    isvc = copy.deepcopy(ISVC)
    other = copy.deepcopy(ISVC)
    other["metadata"]["name"] = "other"
    target = Target("llm", "llama-0", "uid-0", "http://10.0.0.1:8000/metrics")
    for step in range(12):
        engine.preempt(30).set(kv=0.97, waiting=1, running=40)
        tick = T0 + step * INTERVAL
        recorder.write(Result(target, tick + 0.2, text=engine.text()), tick, isvc)
        recorder.write(Result(target, tick + 0.2, error="no answer within 3s"), tick, other)
    recorder.write_not_ready("llama-1", T0 + 12 * INTERVAL, isvc)
    recorder.close()
    records = read_records(path.read_text().splitlines(), isvc)
    assert len(records) == 13 and {r.pod for r in records} == {"llama-0", "llama-1"}
    first = json.loads(path.read_text().splitlines()[0])
    assert {"time", "pod", "ready", "metrics"} <= set(first) and first["ready"] is True
    isvc["spec"]["replicas"] = 1
    decisions = [(t, d) for t, d, _ in replay(isvc, records)]
    assert [d.action for _, d in decisions[:-1]].count("apply") == 1
    assert "not ready: llama-1" in decisions[-1][1].reason
    assert parse_time("2025-01-02T03:04:05.250Z") == pytest.approx(1735787045.25)


def test_a_replay_judges_each_tick_when_the_operator_did(tmp_path):
    """The operator judges a tick after its scrapes are in, and a window is full once its first scrape
    lies at or before ``now - window``. A tick whose last scrape came 1 ms sooner after the first than
    the window is long was judged full by the operator a few ms later: the replay, reading the
    ``evaluated`` time of the recording, acts on the same tick."""
    path = tmp_path / "rec.jsonl"
    recorder = Recorder(str(path))
    engine = EngineMetrics()
    isvc = copy.deepcopy(ISVC)
    isvc["spec"]["replicas"] = 1
    target = Target("llm", "llama-0", "uid-0", "http://10.0.0.1:8000/metrics")
    window_s, steps = 120.0, 9  # 8 intervals of 15 s fill the window
    for step in range(steps):
        engine.preempt(30).set(kv=0.97, waiting=1, running=40)
        tick = T0 + step * INTERVAL
        scraped = tick + (0.2 if step == 0 else 0.199)  # the last scrape: 119.999 s after the first
        recorder.write(Result(target, scraped, text=engine.text()), tick, isvc, evaluated=tick + 0.25)
    recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(line["evaluated"] == pytest.approx(line["tick"] + 0.25) for line in lines)
    assert lines[-1]["time"] - lines[0]["time"] < window_s
    decisions = [d for _, d, _ in replay(isvc, read_records(path.read_text().splitlines(), isvc))]
    assert [d.action for d in decisions].index("apply") == 8, [d.reason for d in decisions]
    # The same scrapes without the judging time: judged at the last scrape, the window is 1 ms short.
    bare = [json.dumps({k: v for k, v in line.items() if k != "evaluated"}) for line in lines]
    assert "apply" not in [d.action for _, d, _ in replay(isvc, read_records(bare, isvc))]


def test_operator_refuses_a_recording_it_cannot_write(tmp_path, capsys):
    path = tmp_path / "missing-dir" / "scrapes.jsonl"
    assert main(["operator", "-n", "llm", "--record", str(path)]) == 2
    assert f"cannot record to {path}" in capsys.readouterr().err
