"""The soak benchmark, short: both preemption modes under the mixed, partly hostile load, and the
benchmark's own pass criteria (no 5xx, every request answered or cleanly refused, the server's finished
and aborted sequences within what the clients completed and left, every block free once the load ends,
no RSS growth beyond the margin) hold."""

from __future__ import annotations

import pytest

from benchmarks.soak import SoakConfig, run_mode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_short_soak_holds_its_invariants(mode, tiny_llama, tmp_path):
    cfg = SoakConfig(
        model_dir=str(tiny_llama),
        preemption_mode=mode,
        duration_s=8.0,
        warmup_s=2.0,
        num_clients=2,
        concurrency=4,
        num_gpu_blocks=32,
        max_num_seqs=8,
        max_waiting_requests=8,
        log_dir=str(tmp_path),
        drain_limit_s=60.0,  # a bound against a hang, not a speed check: blocks must come free at all
    )
    r = run_mode(cfg)
    assert r["failures"] == [], r
    assert r["sent"] == r["completed"] + r["refused"] + r["rejected"] + r["aborted"]
    assert r["completed"] > 50 and r["rejected"] > 0 and r["aborted"] > 0, r
    assert r["preemptions"] > 0, "the pool must be small enough to preempt"
    # Leaving clients reach the server as aborts. Not one abort per left request: a stream left after
    # its last token event (before [DONE]) or a timeout racing the answer is a request the server had
    # already finished; `check` bounds the server's counts by the clients' sequences instead.
    assert r["server_aborts"] > 0 and r["left_seqs"] >= r["aborted"]
    assert r["kv_blocks_in_use_after"] == 0
    assert r["probe_ok"] > 0
