"""The workload and the step windows a recording gives: synthetic scrapes whose traffic is known, and
the recorded vLLM storm."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from pathlib import Path

import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.plan.handling import intake_time_of
from kvpilot.operator.plan.pool import KVPool
from kvpilot.operator.plan.recording import RecordingError, intervals_of, read_recording
from kvpilot.operator.plan.step_time import fit_step_time
from kvpilot.operator.plan.workload import workload_from_scrapes
from kvpilot.operator.remediation.metrics import Histogram

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-storm.jsonl.gz"
ISVC = {"metadata": {"name": "llm", "namespace": "llm"}}
PROMPT_BOUNDS = (64, 128, 256)
GEN_BOUNDS = (16, 32, 64)


def _histogram(name: str, bounds: tuple[int, ...], value: float, count: float) -> list[str]:
    """Prometheus text of a histogram holding ``count`` observations, all equal to ``value``."""
    lines = []
    for le in bounds:
        lines.append(f'{name}_bucket{{le="{float(le)}",model_name="m"}} {count if value <= le else 0.0}')
    lines.append(f'{name}_bucket{{le="+Inf",model_name="m"}} {count}')
    lines.append(f'{name}_sum{{model_name="m"}} {value * count}')
    lines.append(f'{name}_count{{model_name="m"}} {count}')
    return lines


def _scrape(
    k: int,
    *,
    finished_per_s: int = 5,
    in_flight: int = 2,
    waiting: int = 0,
    steps_per_s: int = 100,
    cache: bool = True,
    success: bool = True,
    prefix_per_s: tuple[int, int] | None = None,
    prefix_caching: bool = True,
    e2e_s: float | None = None,
) -> str:
    """The k-th scrape (one a second) of an engine that finishes ``finished_per_s`` requests a second
    (prompt 100, output 50 tokens), holds ``in_flight`` from the first second on (``waiting`` of them
    queued, the rest running), and runs ``steps_per_s`` steps of 8 tokens, each sampling 4 tokens;
    with ``e2e_s``, every request took that long end to end."""
    finished = finished_per_s * k
    running = in_flight - waiting if k else 0
    steps = steps_per_s * k
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{model_name="m"}} {running}',
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting if k else 0}',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5',
        f'vllm:num_preemptions_total{{model_name="m"}} {k}',
        f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} {finished - finished // 5}',
        f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {finished // 5}',
        f'vllm:generation_tokens_total{{model_name="m"}} {4 * steps}',
        *_histogram("vllm:request_prompt_tokens", PROMPT_BOUNDS, 100, finished),
        *_histogram("vllm:request_generation_tokens", GEN_BOUNDS, 50, finished),
        *_histogram("vllm:iteration_tokens_total", (1, 8, 16), 8, steps),
        *_histogram("vllm:inter_token_latency_seconds", (0.01, 0.1), 0.004, 4 * steps),
    ]
    if e2e_s is not None:
        lines += _histogram("vllm:e2e_request_latency_seconds", (1, 2, 4), e2e_s, finished)
    if not success:
        lines = [line for line in lines if not line.startswith("vllm:request_success_total")]
    if prefix_per_s is not None:  # prompt tokens looked up and found in the prefix cache, a second
        lines.append(f'vllm:prefix_cache_queries_total{{model_name="m"}} {prefix_per_s[0] * k}')
        lines.append(f'vllm:prefix_cache_hits_total{{model_name="m"}} {prefix_per_s[1] * k}')
    if cache:
        lines.append(
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",gpu_memory_utilization="0.5",'
            f'enable_prefix_caching="{prefix_caching}",num_gpu_blocks_override="None",'
            'num_cpu_blocks="None"} 1.0'
        )
    return "\n".join(lines) + "\n"


def _isvc(engine: dict) -> dict:
    """An InferenceService manifest with ``engine`` as its spec.engine."""
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "llm", "generation": 1},
        "spec": {"model": {"source": "pvc://models/llm"}, "engine": engine},
    }


def _write(tmp_path: Path, bodies: list[tuple[float, str, str]], name: str = "rec.jsonl") -> Path:
    path = tmp_path / name
    text = "".join(
        json.dumps({"time": t, "pod": pod, "ready": True, "metrics": body}) + "\n" for t, pod, body in bodies
    )
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_arrivals_lengths_and_pool_from_known_traffic(tmp_path) -> None:
    path = _write(tmp_path, [(1000.0 + k, "pod-a", _scrape(k)) for k in range(21)], "rec.jsonl.gz")
    workload = workload_from_scrapes(read_recording(path))
    # 5 finished a second for 20 s, and 2 still in flight at the end: 102 arrived.
    assert workload.num_requests == 102
    assert workload.duration_s == 20.0 and workload.num_pods == 1
    assert workload.arrival_rate == pytest.approx(102 / 20)
    assert workload.windows[0].num_arrivals == 7  # 5 finished + 2 in flight after the first second
    assert workload.num_preemptions == 20 and workload.preemptions_per_s == 1.0
    arrivals = workload.arrivals(seed=1)
    assert len(arrivals) == 102
    assert [a.time for a in arrivals] == sorted(a.time for a in arrivals)
    assert 0.0 <= arrivals[0].time and arrivals[-1].time <= 20.0
    # Lengths drawn from the buckets, scaled to the recorded means.
    prompts = [a.prompt_len for a in arrivals]
    outputs = [a.output_len for a in arrivals]
    assert sum(prompts) / len(prompts) == pytest.approx(100, rel=0.05)
    assert sum(outputs) / len(outputs) == pytest.approx(50, rel=0.05)
    assert min(prompts) >= 64 * 100 / 96 - 1 and max(prompts) <= 128 * 100 / 96 + 1
    assert workload.arrivals(seed=1) == arrivals and workload.arrivals(seed=2) != arrivals
    assert workload.pool == KVPool(1000, 16, 0.5, False, True, 0)
    assert workload.peak_in_flight == 2


@pytest.mark.parametrize(
    ("queued_from", "saturated"),
    # A queue at 20, 17 or 10 of the 20 scrapes with traffic (the first, before any, does not count).
    [(1, True), (4, False), (11, False)],
)
def test_a_queue_at_nearly_every_scrape_marks_the_recording_saturated(
    tmp_path, queued_from, saturated
) -> None:
    # Every other scrape holds 8 requests, the rest 4: never at the peak for long.
    bodies = [
        (1000.0 + k, "pod-a", _scrape(k, in_flight=8 if k % 2 else 4, waiting=3 if k >= queued_from else 0))
        for k in range(21)
    ]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.peak_in_flight == 8
    assert workload.saturated is saturated


@pytest.mark.parametrize(("at_peak_from", "saturated"), [(1, True), (4, False)])
def test_pods_near_their_peak_at_nearly_every_scrape_mark_the_recording_saturated(
    tmp_path, at_peak_from, saturated
) -> None:
    """Closed-loop clients all (or all but one) waiting on the engine, no queue (the engine admitted
    them all)."""
    bodies = [
        (
            1000.0 + k,
            pod,
            _scrape(k, in_flight=(peak - 1 if k % 2 else peak) if k >= at_peak_from else peak // 2),
        )
        for k in range(21)
        for pod, peak in (("pod-a", 8), ("pod-b", 5))
    ]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.peak_in_flight == 13
    assert workload.saturated is saturated


def test_a_saturated_recording_is_replayed_closed_loop(tmp_path) -> None:
    """Recorded under maxNumSeqs 2 with 8 clients (6 always queued): 5 requests a second is what the
    engine let through. Lifting the cap to 8 is planned under the load the 8 clients make, each
    sending its next request as one finishes -- faster than the recorded arrivals, and with all 8
    running at once -- not at the recorded times."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.candidates import context_of, evaluate
    from kvpilot.operator.plan.step_time import fit_step_time

    bodies = [(1000.0 + k, "pod-a", _scrape(k, in_flight=8, waiting=6)) for k in range(21)]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    doc = {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "llm", "generation": 1},
        "spec": {
            "model": {"source": "pvc://models/llm"},
            "engine": {"gpuMemoryUtilization": 0.5, "maxNumSeqs": 2, "maxModelLen": 512, "blockSize": 16},
        },
    }
    step_time = fit_step_time(workload.step_windows)
    closed = context_of(resolve(doc), workload)
    assert closed.closed_loop and closed.client_concurrency == 8
    recorded_times = dataclasses.replace(closed, closed_loop=False)
    lifted = dataclasses.replace(closed.current, max_num_seqs=8)
    fast = evaluate(lifted, closed, workload, step_time).result
    paced = evaluate(lifted, recorded_times, workload, step_time).result
    assert fast.num_finished == paced.num_finished == workload.num_requests
    assert max(s.num_running for s in fast.samples) == 8
    # The recorded arrivals pace the replay at ~5 requests a second (the simulated run spans the
    # recording); closed-loop clients are not held to that pace.
    assert paced.num_finished <= 1.1 * workload.arrival_rate * paced.duration_s
    assert fast.output_tokens_per_s > 1.33 * paced.output_tokens_per_s


@pytest.mark.parametrize(("waiting", "turnaround_s"), [(6, 0.1), (0, 0.0)])
def test_closed_loop_clients_turn_round_in_what_littles_law_leaves(tmp_path, waiting, turnaround_s) -> None:
    """8 clients, 5 requests finished a second, each 1.5 s end to end: a client's cycle is 8 / 5 =
    1.6 s, so 0.1 s of it is spent between a request's end and the next one's arrival. Only a
    saturated recording is replayed closed-loop; an unsaturated one's arrivals are the clients' own
    and say nothing of a turnaround."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.candidates import context_of

    # Unsaturated: 8 in flight at one scrape only, 3 at the others, no queue.
    in_flight = [8 if waiting or k == 5 else 3 for k in range(21)]
    bodies = [
        (1000.0 + k, "pod-a", _scrape(k, in_flight=n, waiting=waiting, e2e_s=1.5))
        for k, n in enumerate(in_flight)
    ]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.saturated is bool(waiting) and workload.peak_in_flight == 8
    assert workload.client_turnaround_s == pytest.approx(turnaround_s)
    doc = _isvc({"maxModelLen": 512})
    ctx = context_of(resolve(doc), workload)
    assert ctx.closed_loop is bool(waiting)
    assert ctx.client_turnaround_s == pytest.approx(turnaround_s)
    assert context_of(resolve(doc), workload, open_loop=True).client_turnaround_s == 0.0


def test_a_backlog_past_the_clients_peak_reads_as_no_turnaround(tmp_path) -> None:
    """Requests that took longer than Little's law allows for the peak (a backlog that grew past it
    between scrapes) give no negative turnaround."""
    bodies = [(1000.0 + k, "pod-a", _scrape(k, in_flight=8, waiting=6, e2e_s=3.0)) for k in range(21)]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.saturated and workload.client_turnaround_s == 0.0


def test_step_windows_from_busy_and_idle_intervals(tmp_path) -> None:
    path = _write(tmp_path, [(1000.0 + k, "pod-a", _scrape(k)) for k in range(4)])
    windows = workload_from_scrapes(read_recording(path)).step_windows
    # The first interval starts idle (nothing running at the first scrape): its steps take the mean
    # inter-token latency, 4 ms; the others are busy throughout: 1 s for 100 steps.
    assert [w.num_steps for w in windows] == [100, 100, 100]
    assert windows[0].step_seconds == pytest.approx(0.004)
    assert [w.step_seconds for w in windows[1:]] == [pytest.approx(0.01)] * 2
    assert windows[1].tokens_per_step == 8 and windows[1].seqs_per_step == 4
    assert windows[1].output_tokens_per_s == 400


def _with_step_counters(body: str, k: int) -> str:
    """``body`` plus kvpilot's step counters after ``k`` seconds: each second 60 decode steps of 3-4
    sequences (3 each, 10 ms, context 100 per sequence) and 5 prefill steps of one 200-token prompt
    (40 ms each), on two ``engine`` labels that add up."""
    per_s = {
        ("decode", "3-4"): (60, 0.6, 180, 180, 18000, 0),
        ("prefill", "1"): (5, 0.2, 1000, 5, 0, 5 * 200 * 201 // 2),
    }
    lines = []
    for (phase, batch), values in per_s.items():
        for name, value in zip(m.ENGINE_STEP_COUNTERS, values, strict=True):
            for engine in ("0", "1"):
                labels = f'engine="{engine}",model_name="m",num_seqs="{batch}",phase="{phase}"'
                lines.append(f"{name}{{{labels}}} {value * k / 2}")
    return body + "\n".join(lines) + "\n"


def test_step_windows_from_the_engines_step_counters(tmp_path) -> None:
    bodies = [(1000.0 + k, "pod-a", _with_step_counters(_scrape(k), k)) for k in range(4)]
    bodies += [(1004.0 + k, "pod-a", _with_step_counters(_scrape(k), k)) for k in range(2)]  # restarted
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    windows = workload.step_windows
    # One window per class and interval, exact: the three intervals before the restart and the one after
    # (the interval across the restart is left out, as the other counters' are).
    assert len(windows) == 2 * 4
    assert all(w.shape_known for w in windows)
    decode = [w for w in windows if w.prefill_attention_pairs == 0]
    prefill = [w for w in windows if w.prefill_attention_pairs > 0]
    assert {w.num_steps for w in decode} == {60} and {w.num_steps for w in prefill} == {5}
    assert decode[0].step_seconds == pytest.approx(0.01) and decode[0].seqs_per_step == 3
    assert decode[0].decode_context_tokens / decode[0].num_steps == 300
    assert prefill[0].step_seconds == pytest.approx(0.04) and prefill[0].tokens_per_step == 200
    step_time = fit_step_time(windows)
    assert step_time.step_seconds(3, 3, 300, 0) == pytest.approx(0.01, rel=1e-6)
    assert step_time.step_seconds(200, 1, 0, 200 * 201 // 2) == pytest.approx(0.04, rel=1e-6)


def _with_step_ratios(body: str, k: int, slow_per_s: int = 6) -> str:
    """``body`` plus kvpilot's step-time ratios after ``k`` seconds: each second 60 decode steps, all
    but ``slow_per_s`` of them at 0.95-1.0 of their mean and those at 1.75-2.0."""
    lines, cumulative = [], 0.0
    for le in (*m.STEP_TIME_RATIO_BUCKETS, float("inf")):
        cumulative += {1.0: 60 - slow_per_s, 2.0: slow_per_s}.get(le, 0) * k
        bound = "+Inf" if le == float("inf") else str(le)
        lines.append(
            f'{m.ENGINE_STEP_TIME_RATIO}_bucket{{engine="0",le="{bound}",model_name="m"}} {cumulative}'
        )
    total = (60 - slow_per_s + 1.9 * slow_per_s) * k
    lines.append(f'{m.ENGINE_STEP_TIME_RATIO}_sum{{engine="0",model_name="m"}} {total}')
    lines.append(f'{m.ENGINE_STEP_TIME_RATIO}_count{{engine="0",model_name="m"}} {60 * k}')
    return body + "\n".join(lines) + "\n"


@pytest.mark.parametrize("seconds", [21, 3])
def test_the_recorded_spread_of_single_steps_replaces_the_replayed_variation(tmp_path, seconds) -> None:
    """60 decode steps a second, a tenth of them twice their mean: with 20 s of them (1,200 steps) the
    step time asked for the spread draws every step's factor from it and replays no slow stretch; with
    2 s (120, fewer than MIN_JITTER_STEPS) it keeps the variation over time."""
    from kvpilot.operator.plan.step_time import MIN_JITTER_STEPS

    bodies = [
        (1000.0 + k, "pod-a", _with_step_ratios(_with_step_counters(_scrape(k), k), k))
        for k in range(seconds)
    ]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.step_time_ratio is not None and workload.step_time_ratio.count == 60 * (seconds - 1)
    assert workload.step_time().jitter == ()  # the replayed variation unless the spread is asked for
    step_time = workload.step_time(spread=True)
    # The decode steps' mean, the scale of the spread: 10 ms (the prefill steps' 40 ms left out).
    assert workload.decode_step_s == pytest.approx(0.01)
    if workload.step_time_ratio.count >= MIN_JITTER_STEPS:
        assert step_time.variation == () and step_time.jitter_steps == 60 * (seconds - 1)
        assert step_time.jitter_scale_s == pytest.approx(0.01)
        draws = [step_time.jitter_factor((i + 0.5) / 1000) for i in range(1000)]
        assert sum(draws) / 1000 == pytest.approx(1.0, abs=1e-3)
        assert sum(f > 1.5 for f in draws) == 100  # the slow tenth
    else:
        assert step_time.jitter == () and step_time.variation != ()
    # Without the histogram (another engine, or an older kvpilot) the variation is replayed as before.
    plain = [(1000.0 + k, "pod-a", _with_step_counters(_scrape(k), k)) for k in range(seconds)]
    old = workload_from_scrapes(read_recording(_write(tmp_path, plain, "plain.jsonl")))
    assert old.step_time_ratio is None and old.step_time(spread=True).jitter == ()


def test_a_negative_step_counter_is_refused(tmp_path) -> None:
    bodies = [(1000.0 + k, "p", _with_step_counters(_scrape(k), k)) for k in range(3)]
    bodies[1] = (bodies[1][0], "p", bodies[1][2].replace(" 30.0\n", " -30.0\n", 1))
    with pytest.raises(RecordingError, match="no plan is built on them") as info:
        read_recording(_write(tmp_path, bodies))
    assert "kvpilot_engine_step" in str(info.value) and "=-30" in str(info.value)


def test_pods_add_up_and_a_restart_is_left_out(tmp_path) -> None:
    bodies = [(1000.0 + k, "pod-a", _scrape(k)) for k in range(11)]
    bodies += [(1000.2 + k, "pod-b", _scrape(k)) for k in range(6)]
    bodies += [(1006.2 + k, "pod-b", _scrape(k)) for k in range(5)]  # restarted: counters from 0
    scrapes = read_recording(_write(tmp_path, bodies))
    intervals = intervals_of(scrapes)
    assert sum(1 for i in intervals if i.pod == "pod-b") == 9  # the 10th, across the restart, is out
    workload = workload_from_scrapes(scrapes)
    assert workload.num_pods == 2
    assert workload.peak_in_flight == 4  # the pods' peaks add up
    assert workload.num_requests == 52 + 27 + 20  # pod-a 10 s; pod-b 5 s, then 4 s after its restart


def test_blocks_at_scales_by_the_fraction() -> None:
    pool = KVPool(1000, 16, 0.5, False, False, 0)
    assert pool.blocks_at(0.5) == 1000 and pool.blocks_at(0.9) == 1800 and pool.blocks_at(0.25) == 500
    explicit = KVPool(1000, 16, 0.5, True, False, 0)
    assert explicit.blocks_at(0.9) == 1000


@pytest.mark.parametrize(
    "bodies,message",
    [
        ([(1000.0, "p", _scrape(0))], "at least two scrapes"),
        ([(1000.0 + k, "p", _scrape(k, cache=False)) for k in range(3)], "vllm:cache_config_info"),
        (
            [(1000.0 + k, "p", _scrape(k, finished_per_s=0, in_flight=0)) for k in range(3)],
            "no request finished",
        ),
        ([(1000.0 + k, "p", _scrape(k, success=False)) for k in range(3)], "vllm:request_success_total"),
    ],
    ids=["one-scrape", "no-cache-info", "nothing-finished", "no-counters"],
)
def test_unusable_recordings_give_one_clear_line(tmp_path, bodies, message) -> None:
    with pytest.raises(RecordingError, match=message) as info:
        workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert "\n" not in str(info.value)


def test_unreadable_files_give_one_clear_line(tmp_path) -> None:
    with pytest.raises(RecordingError, match="cannot read"):
        read_recording(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(RecordingError, match="line 1"):
        read_recording(bad)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(RecordingError, match="cannot read"):
        read_recording(broken)


def test_the_recorded_storm_gives_its_long_requests_to_the_storm() -> None:
    workload = workload_from_scrapes(read_recording(FIXTURE, ISVC))
    assert workload.pool.num_gpu_blocks == 24 and workload.pool.block_size == 32
    assert workload.num_requests == 612  # every request of the recording finished by its end
    assert workload.num_preemptions == 295
    phases = [json.loads(line) for line in gzip.decompress(FIXTURE.read_bytes()).decode().splitlines()]
    t0 = phases[0]["time"]
    storm = [p["time"] - t0 for p in phases if p["phase"] == "storm"]
    calm = [w for w in workload.windows if w.start + w.seconds <= storm[0]]
    stormy = [w for w in workload.windows if storm[0] + 2 <= w.start <= storm[-1] - 5]
    assert calm and stormy
    assert all(w.prompt.mean == 16 and w.generation.mean == 8 for w in calm[:-1])
    assert all(w.generation.mean > 100 for w in stormy)
    assert len(workload.step_windows) > 30


def _spoil(body: str, line_start: str, new_line: str) -> str:
    lines = body.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(line_start))
    lines[index] = new_line
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "line_start,new_line,shown",
    [
        ("vllm:num_preemptions_total", 'vllm:num_preemptions_total{model_name="m"} NaN', "=nan"),
        ("vllm:num_requests_waiting", 'vllm:num_requests_waiting{model_name="m"} -1', "=-1"),
        ("vllm:kv_cache_usage_perc", 'vllm:kv_cache_usage_perc{model_name="m"} 1.5', "=1.5"),
        (
            'vllm:request_prompt_tokens_bucket{le="64.0"',
            'vllm:request_prompt_tokens_bucket{le="64.0",model_name="m"} 99.0',
            "buckets not cumulative",
        ),
        (
            "vllm:iteration_tokens_total_count",
            'vllm:iteration_tokens_total_count{model_name="m"} 1.0',
            "is not the +Inf bucket's",
        ),
    ],
    ids=["nan-counter", "negative-gauge", "kv-above-one", "non-cumulative", "count-mismatch"],
)
def test_a_recording_with_invalid_samples_is_refused(tmp_path, line_start, new_line, shown) -> None:
    """The policy refuses to act on samples no healthy engine exports; the plan is not built on them."""
    bodies = [(1000.0 + k, "p", _scrape(k)) for k in range(4)]
    bodies[2] = (bodies[2][0], "p", _spoil(bodies[2][2], line_start, new_line))
    with pytest.raises(RecordingError, match="no plan is built on them") as info:
        read_recording(_write(tmp_path, bodies))
    assert shown in str(info.value) and "p at 1002.000" in str(info.value)
    assert "\n" not in str(info.value)
    # The same recording without the spoiled scrape is usable.
    assert workload_from_scrapes(read_recording(_write(tmp_path, bodies[:2] + bodies[3:], "ok.jsonl")))


@pytest.mark.parametrize("recorded_ttft_s", [0.5, 1e-6], ids=["engine-slower", "engine-faster"])
def test_ttft_overhead_is_calibrated_on_the_settings_in_force(tmp_path, recorded_ttft_s) -> None:
    """The recorded mean TTFT above the simulated one: the difference is added to every simulated
    TTFT, so the settings in force come out at the recorded mean; below it, nothing is taken off."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.calibrate import calibrate_ttft
    from kvpilot.operator.plan.candidates import context_of, evaluate

    bodies = []
    for k in range(11):
        ttft = _histogram("vllm:time_to_first_token_seconds", (0.001, 0.1, 1.0), recorded_ttft_s, 5 * k)
        bodies.append((1000.0 + k, "pod-a", _scrape(k) + "\n".join(ttft) + "\n"))
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.ttft_mean_s == pytest.approx(recorded_ttft_s)
    doc = {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "llm", "generation": 1},
        "spec": {"model": {"source": "pvc://models/llm"}, "engine": {"maxModelLen": 512, "blockSize": 16}},
    }
    step_time = fit_step_time(workload.step_windows)
    plain = context_of(resolve(doc), workload)
    bare = evaluate(plain.current, plain, workload, step_time).result
    simulated_mean = sum(bare.ttft_s) / len(bare.ttft_s)
    ctx, in_force = calibrate_ttft(plain, workload, step_time)
    if recorded_ttft_s > simulated_mean:
        assert ctx.ttft_overhead_s == pytest.approx(recorded_ttft_s - simulated_mean)
        mean = sum(in_force.result.ttft_s) / len(in_force.result.ttft_s)
        assert mean == pytest.approx(recorded_ttft_s)
        assert any("per request added" in note for note in ctx.notes)
        # Every candidate gets the same per-request cost on top of its own simulated TTFT.
        other = dataclasses.replace(ctx.current, max_num_seqs=1)
        shifted = evaluate(other, ctx, workload, step_time).result.ttft_s
        unshifted = evaluate(other, plain, workload, step_time).result.ttft_s
        assert [a - b for a, b in zip(shifted, unshifted, strict=True)] == pytest.approx(
            [ctx.ttft_overhead_s] * len(shifted)
        )
    else:
        assert ctx == plain and in_force.result.ttft_s == bare.ttft_s


def _prefix_doc() -> dict:
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "llm", "generation": 1},
        "spec": {"model": {"source": "pvc://models/llm"}, "engine": {"maxModelLen": 512, "blockSize": 16}},
    }


def test_the_prefix_hit_rate_comes_from_the_cache_counters(tmp_path) -> None:
    def rate(**kwargs) -> float | None:
        bodies = [(1000.0 + k, "pod-a", _scrape(k, **kwargs)) for k in range(6)]
        return workload_from_scrapes(read_recording(_write(tmp_path, bodies))).prefix_hit_rate

    assert rate(prefix_per_s=(500, 200)) == pytest.approx(0.4)
    # The deprecated spelling of vLLM's early V1 counts as the current one.
    bodies = [
        (
            1000.0 + k,
            "pod-a",
            _scrape(k, prefix_per_s=(500, 200)).replace("vllm:prefix_cache", "vllm:gpu_prefix_cache"),
        )
        for k in range(6)
    ]
    assert workload_from_scrapes(read_recording(_write(tmp_path, bodies, "old.jsonl"))).prefix_hit_rate == (
        pytest.approx(0.4)
    )
    assert rate() is None  # no counters
    assert rate(prefix_per_s=(0, 0)) is None  # no lookup
    assert rate(prefix_per_s=(500, 200), prefix_caching=False) is None  # a pool that caches no prefixes


@pytest.mark.parametrize("recorded", [0.3, 0.6])
def test_the_recorded_hit_rate_becomes_a_shared_prefix_the_settings_in_force_hit_as_often(
    tmp_path, recorded
) -> None:
    """Prompts of 100 tokens, 16-token blocks: a cache holding a shared prefix of L tokens finds
    L // 16 * 16 of each prompt but the first. The prefix is the whole blocks that come closest to the
    recorded rate in simulation of the settings in force, every candidate runs with it, and a
    recording without hits leaves the prompts apart."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.calibrate import calibrate_prefix
    from kvpilot.operator.plan.candidates import context_of, evaluate

    per_s = (1000, round(1000 * recorded))
    bodies = [(1000.0 + k, "pod-a", _scrape(k, prefix_per_s=per_s)) for k in range(11)]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    step_time = fit_step_time(workload.step_windows)
    plain = context_of(resolve(_prefix_doc()), workload)
    bare = evaluate(plain.current, plain, workload, step_time).result
    assert bare.prefix_hit_rate == 0.0  # drawn prompts share nothing
    ctx, in_force = calibrate_prefix(plain, workload, step_time)
    # The whole blocks that reach the rate: 32 tokens (0.32 of each prompt) for 0.3, 64 for 0.6.
    assert ctx.shared_prefix_len == {0.3: 32, 0.6: 64}[recorded]
    # Every prompt but the first (the cache starts cold) finds the whole shared prefix.
    n = in_force.result.num_arrivals
    assert in_force.result.prefix_hit_rate == pytest.approx(ctx.shared_prefix_len * (n - 1) / (100 * n))
    assert any(f"hit rate {recorded:.0%}" in note for note in ctx.notes)
    # Another candidate runs on the same prompts: fewer prefill tokens than without the prefix.
    other = dataclasses.replace(ctx.current, max_num_seqs=1)
    with_prefix = evaluate(other, ctx, workload, step_time).result
    without = evaluate(other, plain, workload, step_time).result
    assert with_prefix.prefix_hit_rate > recorded - 0.05 and without.prefix_hit_rate == 0.0
    assert with_prefix.num_output_tokens == without.num_output_tokens

    none_bodies = [(1000.0 + k, "pod-a", _scrape(k, prefix_per_s=(1000, 0))) for k in range(11)]
    none = workload_from_scrapes(read_recording(_write(tmp_path, none_bodies, "none.jsonl")))
    assert calibrate_prefix(context_of(resolve(_prefix_doc()), none), none, step_time) == (
        context_of(resolve(_prefix_doc()), none),
        None,
    )


def test_hits_a_recompute_explains_add_no_shared_prefix(tmp_path) -> None:
    """A pool of 16 blocks admits two prompts of 100 tokens but not their 50 output tokens each,
    so it preempts, and a recomputed request finds its own blocks again: the simulated settings in
    force hit the cache with no prefix shared. A recording whose hit rate is just that gets no shared
    prefix; one with more gets one."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.calibrate import calibrate_prefix
    from kvpilot.operator.plan.candidates import context_of, evaluate

    def workload_with(hits_per_1000: int):
        bodies = [
            (
                1000.0 + k,
                "pod-a",
                _scrape(k, prefix_per_s=(1000, hits_per_1000)).replace(
                    'num_gpu_blocks="1000"', 'num_gpu_blocks="16"'
                ),
            )
            for k in range(11)
        ]
        return workload_from_scrapes(read_recording(_write(tmp_path, bodies, f"rec{hits_per_1000}.jsonl")))

    probe = workload_with(1)
    step_time = fit_step_time(probe.step_windows)
    ctx = context_of(resolve(_prefix_doc()), probe)
    baseline = evaluate(ctx.current, ctx, probe, step_time).result
    assert baseline.num_preemptions > 0 and baseline.prefix_hit_rate > 0.05
    own = round(1000 * baseline.prefix_hit_rate)

    explained = workload_with(own)
    calibrated, in_force = calibrate_prefix(
        context_of(resolve(_prefix_doc()), explained), explained, step_time
    )
    assert calibrated.shared_prefix_len == 0 and in_force.result.prefix_hit_rate == baseline.prefix_hit_rate

    more = workload_with(min(900, own + 300))
    calibrated, in_force = calibrate_prefix(context_of(resolve(_prefix_doc()), more), more, step_time)
    assert calibrated.shared_prefix_len > 0
    assert abs(in_force.result.prefix_hit_rate - more.prefix_hit_rate) < abs(
        baseline.prefix_hit_rate - more.prefix_hit_rate
    )


def _with_histogram(body: str, k: int, name: str, buckets, per_s: dict[float, int], sum_per_s: float) -> str:
    """``body`` plus the histogram ``name`` after ``k`` seconds of ``per_s`` observations a second (by
    bucket bound), summing to ``sum_per_s`` a second."""
    lines, cumulative = [], 0.0
    for le in (*buckets, float("inf")):
        cumulative += per_s.get(le, 0) * k
        bound = "+Inf" if le == float("inf") else str(le)
        lines.append(f'{name}_bucket{{engine="0",le="{bound}",model_name="m"}} {cumulative}')
    lines.append(f'{name}_sum{{engine="0",model_name="m"}} {sum_per_s * k}')
    lines.append(f'{name}_count{{engine="0",model_name="m"}} {sum(per_s.values()) * k}')
    return body + "\n".join(lines) + "\n"


def _with_arrival_gaps(body: str, k: int) -> str:
    """``body`` plus kvpilot's arrival gaps after ``k`` seconds: each second three gaps of 0.2-0.3 ms
    and one of 0.4-0.5 ms (a burst's requests, one server turn apart), and one of 0.1-0.25 s."""
    per_s = {0.0003: 3, 0.0005: 1, 0.25: 1}
    return _with_histogram(body, k, m.ENGINE_ARRIVAL_GAP_SECONDS, m.ARRIVAL_GAP_BUCKETS, per_s, 0.2012)


def test_the_servers_turn_on_a_request_comes_from_the_short_arrival_gaps(tmp_path) -> None:
    """Of five gaps a second, the four within the mean decode step (10 ms) are a burst's: the server's
    time on a request is drawn from them, 0.3 ms on average. The turnaround Little's law gives (0.1 s)
    holds that time, which the simulation adds itself, so the clients' own is 0.1 s less 0.3 ms."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.candidates import context_of

    bodies = [
        (
            1000.0 + k,
            "pod-a",
            _with_arrival_gaps(_with_step_counters(_scrape(k, in_flight=8, waiting=6, e2e_s=1.5), k), k),
        )
        for k in range(21)
    ]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.arrival_gaps is not None and workload.arrival_gaps.count == 100
    assert workload.decode_step_s == pytest.approx(0.01)
    handling = workload.handling_time
    assert handling is not None and handling.samples == 80
    assert handling.mean_s == pytest.approx(0.0003)
    assert handling.pieces == ((0.75, 0.0002, 0.0003), (1.0, 0.0004, 0.0005))
    # The steps' 0.8 s a second hold two turns of every request; the step time leaves them out.
    seconds = sum(w.seconds for w in workload.step_windows)
    assert seconds == pytest.approx(16.0)
    keep = 1 - 2 * 0.0003 * workload.num_requests / seconds
    fitted = fit_step_time(workload.step_windows)
    assert workload.step_time().a == pytest.approx(fitted.a * keep)
    assert workload.step_time().c == pytest.approx(fitted.c * keep) and keep < 0.999
    doc = _isvc({"maxModelLen": 512})
    ctx = context_of(resolve(doc), workload)
    assert ctx.closed_loop and ctx.handling == handling
    assert ctx.client_turnaround_s == pytest.approx(0.1 - 0.0003)
    # Without the histogram (vLLM, an older kvpilot): no handling, the whole turnaround the clients'.
    plain = [(1000.0 + k, "pod-a", _scrape(k, in_flight=8, waiting=6, e2e_s=1.5)) for k in range(21)]
    old = workload_from_scrapes(read_recording(_write(tmp_path, plain, "plain.jsonl")))
    assert old.handling_time is None
    assert context_of(resolve(doc), old).client_turnaround_s == pytest.approx(0.1)


def _with_renders(body: str, k: int) -> str:
    """``body`` plus kvpilot's /metrics render times after ``k`` seconds: one render a second, 4-4.5 ms."""
    lines = []
    for le in (*m.METRICS_RENDER_BUCKETS, float("inf")):
        bound = "+Inf" if le == float("inf") else str(le)
        lines.append(
            f'{m.ENGINE_METRICS_RENDER_SECONDS}_bucket{{engine="0",le="{bound}",model_name="m"}} '
            f"{k if le >= 0.0045 else 0}"
        )
    lines.append(f'{m.ENGINE_METRICS_RENDER_SECONDS}_sum{{engine="0",model_name="m"}} {0.00425 * k}')
    lines.append(f'{m.ENGINE_METRICS_RENDER_SECONDS}_count{{engine="0",model_name="m"}} {k}')
    return body + "\n".join(lines) + "\n"


def test_the_scrapes_come_from_the_render_times_and_leave_the_fit(tmp_path) -> None:
    """One render a second, 4-4.5 ms: the simulation takes a 4.25 ms scrape turn every second, and the
    fitted step time leaves out that 0.425 % of the pod's time. Without the histogram, no scrapes."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.candidates import context_of

    bodies = [(1000.0 + k, "pod-a", _with_renders(_with_step_counters(_scrape(k), k), k)) for k in range(21)]
    workload = workload_from_scrapes(read_recording(_write(tmp_path, bodies)))
    assert workload.metrics_renders is not None and workload.metrics_renders.count == 20
    turns = workload.scrape_turns
    assert turns is not None
    assert turns.period_s == pytest.approx(1.0) and turns.render.mean_s == pytest.approx(0.00425)
    fitted = fit_step_time(workload.step_windows)
    assert workload.step_time().a == pytest.approx(fitted.a * (1 - 0.00425))
    assert context_of(resolve(_isvc({"maxModelLen": 512})), workload).scrapes == turns
    plain = [(1000.0 + k, "pod-a", _with_step_counters(_scrape(k), k)) for k in range(21)]
    old = workload_from_scrapes(read_recording(_write(tmp_path, plain, "plain.jsonl")))
    assert old.scrape_turns is None and old.step_time().a == pytest.approx(fitted.a)


def _with_intakes(body: str, k: int) -> str:
    """``body`` plus kvpilot's timed intakes after ``k`` seconds: each second two of 0.4-0.5 ms and one
    of 10-25 ms (a turn that met a slow moment; longer than the decode step, and still the server's)."""
    per_s = {0.0005: 2, 0.025: 1}
    return _with_histogram(body, k, m.ENGINE_REQUEST_INTAKE_SECONDS, m.REQUEST_INTAKE_BUCKETS, per_s, 0.0184)


def test_the_timed_intakes_give_the_servers_turn_over_the_arrival_gaps(tmp_path) -> None:
    """With both histograms the turn comes from the intakes, all of them: the 10-25 ms ones are past the
    decode step (10 ms), where the gaps would stop, and still the server's own time (6.3 ms on
    average). Without them, or with fewer than three, the gaps give it."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.plan.candidates import context_of

    def recording(name: str, intakes: bool):
        bodies = []
        for k in range(21):
            body = _with_step_counters(_scrape(k, in_flight=8, waiting=6, e2e_s=1.5), k)
            body = _with_arrival_gaps(body, k)
            bodies.append((1000.0 + k, "pod-a", _with_intakes(body, k) if intakes else body))
        return workload_from_scrapes(read_recording(_write(tmp_path, bodies, name)))

    workload = recording("both.jsonl", intakes=True)
    handling = workload.handling_time
    assert handling is not None and handling.samples == 60 and handling.source == "timed intakes"
    assert handling.pieces == ((2 / 3, 0.00040, 0.0005), (1.0, 0.01, 0.025))
    assert handling.mean_s == pytest.approx((2 * 0.00045 + 0.0175) / 3)
    assert "60 timed intakes" in handling.describe()
    assert context_of(resolve(_isvc({"maxModelLen": 512})), workload).handling == handling
    gaps = recording("gaps.jsonl", intakes=False).handling_time
    assert gaps is not None and gaps.source == "short arrival gaps" and gaps.samples == 80
    two = Histogram(((0.0005, 2.0), (math.inf, 2.0)), 0.0009, 2.0)
    assert intake_time_of(two) is None
    assert dataclasses.replace(workload, request_intakes=two).handling_time == gaps
