"""The fidelity benchmark's CPU shares per run (``benchmarks/fidelity_cpu.py``): steal and busy time
from ``/proc/stat`` between two readings."""

from __future__ import annotations

import math

import pytest

from benchmarks import fidelity_cpu

# user nice system idle iowait irq softirq steal guest guest_nice
BEFORE = "cpu  1000 0 200 5000 100 0 10 50 0 0\ncpu0 500 0 100 2500 50 0 5 25 0 0\n"
AFTER = "cpu  1600 0 300 5600 100 0 20 250 0 0\ncpu0 800 0 150 2800 50 0 10 125 0 0\n"


def test_shares_between_two_readings(tmp_path) -> None:
    (tmp_path / "a").write_text(BEFORE)
    (tmp_path / "b").write_text(AFTER)
    before, after = fidelity_cpu.cpu_times(tmp_path / "a"), fidelity_cpu.cpu_times(tmp_path / "b")
    assert before is not None
    assert (before["user"], before["idle"], before["steal"]) == (1000, 5000, 50)
    got = fidelity_cpu.shares(before, after)
    # 1,510 ticks between them: 600 user + 100 system + 10 softirq busy, 600 idle, 200 stolen.
    assert got["steal"] == pytest.approx(200 / 1510)
    assert got["busy"] == pytest.approx(710 / 1510)


def test_no_reading_gives_nan_and_a_kept_run_reads_back(tmp_path) -> None:
    assert fidelity_cpu.cpu_times(tmp_path / "absent") is None
    (tmp_path / "odd").write_text("intr 1 2 3\n")
    assert fidelity_cpu.cpu_times(tmp_path / "odd") is None
    assert all(math.isnan(v) for v in fidelity_cpu.shares(None, {"idle": 1}).values())
    same = {"user": 5, "idle": 5}
    assert all(math.isnan(v) for v in fidelity_cpu.shares(same, same).values())  # no time between them
    (tmp_path / "a").write_text(BEFORE)
    (tmp_path / "b").write_text(AFTER)
    kept = tmp_path / "run.cpu.json"
    fidelity_cpu.write(kept, fidelity_cpu.cpu_times(tmp_path / "a"), fidelity_cpu.cpu_times(tmp_path / "b"))
    assert fidelity_cpu.read(kept)["steal"] == pytest.approx(200 / 1510)
    assert all(math.isnan(v) for v in fidelity_cpu.read(tmp_path / "none.cpu.json").values())
