"""The remediation policy on metrics recorded from a real vLLM server under a preemption storm.

``fixtures/vllm-0.32-cpu-storm.jsonl.gz`` was recorded by ``benchmarks/vllm_storm.py`` from vLLM 0.32's
CPU build on the ~7M random-weight checkpoint: a calm phase, a storm (many concurrent long requests
against a KV pool that holds a few), and calm again, one scrape a second. vLLM's own metric names and
label sets are what the operator reads here, not our engine's rendition of them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvpilot.operator.remediation.metrics import capacity_of, parse_scrape, shape_of
from kvpilot.operator.remediation.replay import read_records, replay

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-storm.jsonl.gz"


def isvc(mode: str = "Auto") -> dict:
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "llm", "generation": 1},
        "spec": {
            "model": {"source": "pvc://models/llm"},
            "runtime": "vllm",  # the recording is vLLM's: no live levers, the memory fraction first
            "image": "vllm/vllm-openai:v0.32.0",
            "engine": {"gpuMemoryUtilization": 0.5, "maxNumSeqs": 32, "maxModelLen": 512, "blockSize": 32},
            "remediation": {"mode": mode, "window": "10s", "cooldown": "10m", "preemptionRate": 0.5},
        },
    }


@pytest.fixture(scope="module")
def lines() -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(FIXTURE.read_bytes()).decode().splitlines()]


def test_the_recording_is_real_vllm_output_with_a_storm_in_it(lines) -> None:
    """What the replay below relies on is in the file: vLLM's metric names, its cache_config_info
    capacity, preemptions only while the storm ran."""
    first = parse_scrape(lines[0]["metrics"], lines[0]["time"])
    capacity = capacity_of(first)
    assert capacity is not None and capacity.block_size == 32 and capacity.num_gpu_blocks > 0
    assert not capacity.explicit_size  # sized by bytes, so the memory fraction is the lever
    assert shape_of(first) is None  # vLLM exports no kvpilot:model_config_info
    totals = {}
    for line in lines:
        scrape = parse_scrape(line["metrics"], line["time"])
        totals.setdefault(line["phase"], []).append(scrape.preemptions)
        assert not scrape.missing and not scrape.invalid, (scrape.missing, scrape.invalid)
    assert totals["calm"][-1] == totals["calm"][0] == 0
    assert totals["storm"][-1] > 10
    assert totals["calm-after"][-1] == totals["calm-after"][0]  # nothing preempted once the load ended


def _decisions(lines, mode: str):
    records = read_records((json.dumps(line) for line in lines), isvc(mode))
    return [(line_phase(lines, t), decision, t) for t, decision, _ in replay(isvc(mode), records)]


def line_phase(lines, time: float) -> str:
    return next(line["phase"] for line in reversed(lines) if line["time"] <= time)


def test_calm_gives_nothing_and_the_storm_raises_the_memory_fraction_first(lines) -> None:
    decisions = _decisions(lines, "Auto")
    calm = [d for phase, d, _ in decisions if phase == "calm"]
    assert calm and all(d.action == "none" for d in calm), [d.reason for d in calm if d.action != "none"]
    applied = [(phase, d, t) for phase, d, t in decisions if d.action == "apply"]
    assert applied, [d.reason for _, d, _ in decisions]
    phase, first, acted_at = applied[0]
    assert phase == "storm"
    assert (first.field, first.from_) == ("gpuMemoryUtilization", 0.5) and first.to > 0.5
    # Not before the storm filled the 10 s window (one scrape interval of slack for the phase marker).
    storm_began = next(line["time"] for line in lines if line["phase"] == "storm")
    assert acted_at - storm_began >= 9.0
    assert len(applied) == 1  # the cooldown holds everything after it


def test_recommend_mode_names_the_same_step_and_changes_nothing(lines) -> None:
    decisions = [d for _, d, _ in _decisions(lines, "Recommend")]
    recommended = [d for d in decisions if d.action == "recommend"]
    assert recommended and recommended[0].field == "gpuMemoryUtilization"
    assert not any(d.action == "apply" for d in decisions)


# ``fixtures/vllm-0.32-cpu-near-threshold.jsonl.gz``: the same server and checkpoint, a KV pool of 224
# blocks of 32 under 24 concurrent streams of 96 + 96..384 tokens, scraped every 2 s (``vllm_storm.py
# --kv-blocks 224 --storm-s 90 --storm-concurrency 24 --scrape-interval 2 --max-tokens 96
# --max-tokens-spread 288``). vLLM preempted 64 times in the 90 s storm, in clumps: 0.7/s overall,
# with stretches of 6-10 s without one. Against 0.5/s over 30 s, no scrape interval rule would see it.
NEAR = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-near-threshold.jsonl.gz"


@pytest.fixture(scope="module")
def near_lines() -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(NEAR.read_bytes()).decode().splitlines()]


def near_isvc() -> dict:
    obj = isvc("Auto")
    obj["spec"]["remediation"]["window"] = "30s"
    return obj


def test_the_near_threshold_recording_is_a_real_clumpy_storm(near_lines) -> None:
    counts = [parse_scrape(line["metrics"], line["time"]).preemptions for line in near_lines]
    storm = [c for line, c in zip(near_lines, counts, strict=True) if line["phase"] == "storm"]
    assert counts[0] == 0 and 40 <= storm[-1] <= 100
    steps = [b - a for a, b in zip(storm, storm[1:], strict=False)]
    assert steps.count(0) > len(steps) / 2  # most 2 s intervals hold no preemption


def test_a_near_threshold_storm_of_real_vllm_is_acted_on_once_it_covers_the_window(near_lines) -> None:
    obj = near_isvc()
    records = read_records((json.dumps(line) for line in near_lines), obj)
    decisions = [(t, d) for t, d, _ in replay(obj, records)]
    applied = [(t, d) for t, d in decisions if d.action == "apply"]
    assert len(applied) == 1, [d.reason for _, d in decisions]
    acted_at, first = applied[0]
    assert line_phase(near_lines, acted_at) == "storm"
    assert (first.field, first.from_, first.to) == ("gpuMemoryUtilization", 0.5, 0.55)
    assert "4 parts of 8s, every one >= 0.25/s" in first.reason and "threshold 0.5" in first.reason
    # Not before the storm phase has filled the window; and every quarter held preemptions then, the
    # first of them included, although the first 2 s interval with one came 6 s into the storm.
    storm_began = next(line["time"] for line in near_lines if line["phase"] == "storm")
    assert acted_at - storm_began >= 30.0 - 0.5
    calm = [d for t, d in decisions if line_phase(near_lines, t) == "calm"]
    assert calm and all(d.action == "none" for d in calm)
