"""Several recordings of one service given to the plan (``kvpilot plan --recording A --recording B``):
laid end to end as one longer recording, each recording's pods apart from the others'."""

from __future__ import annotations

import json

import pytest

from kvpilot.cli import main
from kvpilot.operator.plan.recording import RecordingError, intervals_of, read_recording, read_recordings
from kvpilot.operator.plan.trace import with_trace
from kvpilot.operator.plan.workload import workload_from_scrapes
from tests.operator.test_plan_cli import FIXTURE, _manifest, isvc
from tests.operator.test_plan_workload import _scrape, _write


def _two(tmp_path):
    """Recording A (21 scrapes from 1000 s, a second apart) and B (11) an hour later, of one pod name."""
    a = _write(tmp_path, [(1000.0 + k, "pod-a", _scrape(k)) for k in range(21)], "a.jsonl")
    b = _write(tmp_path, [(4600.0 + k, "pod-a", _scrape(k)) for k in range(11)], "b.jsonl.gz")
    return a, b


def test_recordings_are_laid_end_to_end_and_add_up(tmp_path) -> None:
    a, b = _two(tmp_path)
    alone = [workload_from_scrapes(read_recording(p)) for p in (a, b)]
    scrapes = read_recordings([b, a])  # given in any order: laid out in the order they were recorded
    assert [s.time for s in scrapes] == [1000.0 + k for k in range(21)] + [1020.0 + k for k in range(11)]
    assert {s.segment for s in scrapes[:21]} == {0} and {s.segment for s in scrapes[21:]} == {1}
    assert scrapes[21].shift_s == 1020.0 - 4600.0
    intervals = intervals_of(scrapes)
    assert len(intervals) == 20 + 10  # none across the join: the pod restarted between the two
    workload = workload_from_scrapes(scrapes)
    assert workload.num_requests == alone[0].num_requests + alone[1].num_requests == 102 + 52
    assert workload.duration_s == 30.0
    # One pod at a time: the same preemption rate per pod and the same peak, not the two added up.
    assert workload.num_pods == 1
    assert workload.num_preemptions == 30 and workload.preemptions_per_s == 1.0
    assert workload.peak_in_flight == alone[0].peak_in_flight == 2
    # B's arrivals fall in its stretch of the joined clock.
    late = [w for w in workload.windows if w.start >= 20.0]
    assert sum(w.num_arrivals for w in late) == 52 and max(w.start for w in late) == 29.0
    assert read_recordings([a]) == read_recording(a)  # one recording: as it was recorded


def test_a_recording_laid_end_to_end_keeps_its_own_quiet_stretches(tmp_path) -> None:
    # Each recording: an idle first scrape, 9 s with a request waiting at every scrape, 2 idle scrapes.
    def bodies(start: float) -> list:
        busy = [(start + k, "p", _scrape(k, waiting=1, in_flight=3)) for k in range(10)]
        quiet = _scrape(10, in_flight=0, waiting=0).replace("vllm:num_requests_running", "x_running")
        quiet += 'vllm:num_requests_running{model_name="m"} 0\n'
        return busy + [(start + 10, "p", quiet), (start + 11, "p", quiet)]

    a = _write(tmp_path, bodies(1000.0), "a.jsonl")
    b = _write(tmp_path, bodies(2000.0), "b.jsonl")
    assert workload_from_scrapes(read_recording(a)).saturated
    # Each recording's traffic is queued throughout, so the two together are too: the quiet scrapes
    # at the join (A's end, B's start) are outside each one's traffic and do not count.
    assert workload_from_scrapes(read_recordings([a, b])).saturated


def test_recordings_that_overlap_or_ran_on_other_pools_are_refused(tmp_path) -> None:
    a = _write(tmp_path, [(1000.0 + k, "p", _scrape(k)) for k in range(11)], "a.jsonl")
    b = _write(tmp_path, [(1005.0 + k, "q", _scrape(k)) for k in range(11)], "b.jsonl")
    with pytest.raises(RecordingError, match=r"b\.jsonl overlaps .*a\.jsonl in time"):
        read_recordings([a, b])
    smaller = [_scrape(k).replace('num_gpu_blocks="1000"', 'num_gpu_blocks="64"') for k in range(11)]
    other = _write(tmp_path, [(2000.0 + k, "p", body) for k, body in enumerate(smaller)], "c.jsonl")
    with pytest.raises(RecordingError, match="different KV pools .*1000 blocks of 16.*64 blocks of 16"):
        read_recordings([a, other])


def test_a_trace_follows_its_recording_to_the_joined_clock(tmp_path) -> None:
    a, b = _two(tmp_path)
    trace = tmp_path / "requests.jsonl"
    arrivals = [1002.5, 4603.0, 3000.0]  # in A, in B, and between the two (in neither)
    trace.write_text(
        "".join(json.dumps({"arrival": t, "prompt_tokens": 30, "output_tokens": 5}) + "\n" for t in arrivals)
    )
    scrapes = read_recordings([a, b])
    traced = with_trace(workload_from_scrapes(scrapes), scrapes, [str(trace)])
    assert [x.time for x in traced.trace] == [2.5, 23.0]
    alone = read_recording(b)
    assert [x.time for x in with_trace(workload_from_scrapes(alone), alone, [str(trace)]).trace] == [3.0]
    # The scrapes of the one pod come along on the same clock: A's at 0-20 s, B's from where A's end
    # (its first one and A's last are one scrape there), at 20-30.
    assert traced.scrape_times == tuple(float(k) for k in range(31))
    assert workload_from_scrapes(scrapes).scrape_times == ()  # drawn, without a trace


def test_a_trace_of_several_pods_leaves_the_scrape_times_to_be_drawn(tmp_path) -> None:
    rows = [(1000.0 + k + 0.5 * (pod == "q"), pod, _scrape(k)) for k in range(11) for pod in ("p", "q")]
    path = _write(tmp_path, rows, "two-pods.jsonl")
    trace = tmp_path / "requests.jsonl"
    trace.write_text(json.dumps({"arrival": 1002.0, "prompt_tokens": 30, "output_tokens": 5}) + "\n")
    scrapes = read_recording(path)
    traced = with_trace(workload_from_scrapes(scrapes), scrapes, [str(trace)])
    assert [x.time for x in traced.trace] == [2.0] and traced.scrape_times == ()


def test_plan_takes_several_recordings(tmp_path, capsys) -> None:
    a, b = _two(tmp_path)
    manifest = _manifest(tmp_path, isvc())
    out_json = tmp_path / "plan.json"
    args = ["plan", "-f", str(manifest), "--no-progress", "--recording", str(a), "--recording", str(b)]
    assert main([*args, "--json", str(out_json)]) == 0
    assert capsys.readouterr().out.startswith("workload: 154 requests over 30s")
    document = json.loads(out_json.read_text())
    assert document["recordings"] == [str(a), str(b)] and document["workload"]["num_pods"] == 1
    overlapping = ["plan", "-f", str(manifest), "--no-progress", "--recording", str(FIXTURE)]
    assert main([*overlapping, "--recording", str(FIXTURE)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "overlaps" in err and err.count("\n") == 1
