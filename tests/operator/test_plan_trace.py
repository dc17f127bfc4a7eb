"""``kvpilot plan --trace``: a per-request trace replaces the histograms' arrivals and lengths."""

from __future__ import annotations

import json

from kvpilot.cli import main
from kvpilot.operator.plan.recording import read_recording
from tests.operator.test_plan_cli import FIXTURE, _manifest, isvc


def test_plan_simulates_the_traced_requests(tmp_path, capsys) -> None:
    scrapes = read_recording(FIXTURE, isvc())
    start, end = min(s.time for s in scrapes), max(s.time for s in scrapes)
    trace = tmp_path / "requests.jsonl"
    # 40 requests, one every second from the start, 30 prompt + 20 output tokens each, and one outside.
    lines = [{"arrival": start + i, "prompt_tokens": 30, "output_tokens": 20} for i in range(40)]
    lines.append({"arrival": end + 60, "prompt_tokens": 30, "output_tokens": 20})
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out_json = tmp_path / "plan.json"
    args = ["plan", "-f", str(_manifest(tmp_path, isvc())), "--recording", str(FIXTURE), "--no-progress"]
    assert main([*args, "--json", str(out_json), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("workload: 40 requests")
    traced = json.loads(out_json.read_text())
    in_force = traced["candidates"][0]["per_replica"]
    # 40 small requests at 1/s on the recorded pool: no storm, every token generated.
    assert in_force["num_arrivals"] == 40 and in_force["num_finished"] == 40
    assert in_force["num_preemptions"] == 0
    assert main([*args]) == 0  # without the trace: the recorded storm's hundreds of requests
    assert not capsys.readouterr().out.startswith("workload: 40 requests")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main([*args, "--trace", str(bad)]) == 1
    assert "not a request trace line" in capsys.readouterr().err
