"""``kvpilot serve --request-trace FILE``: one line per finished request with its arrival and lengths,
no text; ``kvpilot plan --trace`` replays those arrivals instead of the histograms' distributions."""

from __future__ import annotations

import json
import time

import pytest

from kvpilot.engine.request_trace import RequestTraceLogger
from kvpilot.engine.stats import FinishedRequestStats, IterationStats
from kvpilot.operator.plan.recording import RecordingError
from kvpilot.operator.plan.trace import read_trace
from tests.server.conftest import MODEL_NAME, ServerProcess

PROMPTS = ["the secret word is pelican", "a b c d e f g h i j k l m n o p", "x"]


@pytest.fixture(scope="module")
def traced(server_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace")
    trace = folder / "requests.jsonl"
    flags = ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--request-trace", str(trace)]
    proc = ServerProcess(server_model, folder / "server.log", flags)
    try:
        yield proc.wait_ready(), trace
    finally:
        proc.stop()


def test_each_finished_request_is_one_line_with_its_lengths_and_no_text(traced):
    server, trace = traced
    before = time.time()
    usages = []
    for index, prompt in enumerate(PROMPTS):
        out = server.client().completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=3 + 4 * index, temperature=0, seed=0
        )
        usages.append((out.usage.prompt_tokens, out.usage.completion_tokens))
    after = time.time()
    deadline = time.monotonic() + 10
    while len(trace.read_text().splitlines()) < len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.05)
    text = trace.read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(line["prompt_tokens"], line["output_tokens"]) for line in lines] == usages
    assert all(before - 1 <= line["arrival"] <= after for line in lines)
    assert [line["arrival"] for line in lines] == sorted(line["arrival"] for line in lines)
    assert all(0 <= line["ttft_s"] <= line["e2e_s"] for line in lines)
    assert {line["finish_reason"] for line in lines} <= {"length", "stop"}
    assert "pelican" not in text and "secret" not in text  # no prompt text...
    # ...and the plan reads it back as arrivals within a span.
    arrivals = read_trace([str(trace)], before - 1, after)
    assert [(a.prompt_len, a.output_len) for a in arrivals] == usages
    assert arrivals[0].time >= 0
    with pytest.raises(RecordingError, match="no request of the trace"):
        read_trace([str(trace)], after + 100, after + 200)


def test_the_trace_rotates_past_its_bound(tmp_path):
    path = tmp_path / "t.jsonl"
    logger = RequestTraceLogger(str(path), max_bytes=400)
    stats = FinishedRequestStats("stop", 10, 5, time.monotonic(), None, time.monotonic(), time.monotonic(), 0)
    for _ in range(5):
        logger.record(None, IterationStats(1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, finished=[stats] * 2))
    logger.close()
    assert (tmp_path / "t.jsonl.1").exists()
    assert path.stat().st_size <= 400 and (tmp_path / "t.jsonl.1").stat().st_size <= 400
    total = len(path.read_text().splitlines()) + len((tmp_path / "t.jsonl.1").read_text().splitlines())
    assert 2 <= total <= 10 and total % 2 == 0  # whole batches of lines; older rotations dropped


def test_a_prompt_the_prefix_cache_held_is_traced_with_its_cached_tokens(traced):
    """The same 40-odd-token prompt twice: the second finds the first's whole blocks in the prefix
    cache, and the plan reads them back as a shared prefix of that length."""
    server, trace = traced
    prompt = " ".join(f"w{i}" for i in range(40))
    before = time.time()
    for _ in range(2):
        server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 10
    lines: list[dict] = []
    while len(lines) < 2 and time.monotonic() < deadline:
        lines = [
            line for line in map(json.loads, trace.read_text().splitlines()) if line["arrival"] >= before - 1
        ]
        time.sleep(0.05)
    first, second = lines[-2:]
    assert first["prompt_tokens"] == second["prompt_tokens"] > 32
    assert first["cached_tokens"] == 0
    # Whole 16-token blocks, never the last prompt token (it is computed to sample the first token).
    assert second["cached_tokens"] == (second["prompt_tokens"] - 1) // 16 * 16
    arrivals = read_trace([str(trace)], before - 1, time.time())
    assert (arrivals[-2].prefix_group, arrivals[-2].prefix_len) == (None, 0)
    assert (arrivals[-1].prefix_group, arrivals[-1].prefix_len) == (0, second["cached_tokens"])


def test_cached_tokens_become_a_shared_prefix_and_older_traces_read_as_before(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"arrival": 100.0, "prompt_tokens": 50, "output_tokens": 4},  # an older trace: no cached_tokens
        {"arrival": 101.0, "prompt_tokens": 50, "output_tokens": 4, "cached_tokens": 0},
        {"arrival": 102.0, "prompt_tokens": 50, "output_tokens": 4, "cached_tokens": 48},
        {"arrival": 103.0, "prompt_tokens": 20, "output_tokens": 4, "cached_tokens": 64},  # capped below it
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    arrivals = read_trace([str(path)], 100.0, 103.0)
    assert [(a.time, a.prefix_group, a.prefix_len) for a in arrivals] == [
        (0.0, None, 0),
        (1.0, None, 0),
        (2.0, 0, 48),
        (3.0, 0, 19),
    ]
    path.write_text(json.dumps({**rows[2], "cached_tokens": "many"}) + "\n")
    with pytest.raises(RecordingError, match="line 1: not a request trace line"):
        read_trace([str(path)], 100.0, 103.0)
