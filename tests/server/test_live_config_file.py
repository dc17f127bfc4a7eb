"""``kvpilot serve --live-config-file``: a pod started after a live change runs the values in force.

The operator keeps the live values in a ConfigMap mounted into every engine pod; the server applies
them once the engine is built, validated as ``POST /admin/config`` validates them, before ``/health``
answers 200. A missing file changes nothing; an invalid one fails start-up with one clear line."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from kvpilot.engine.errors import ConfigError
from kvpilot.engine.server.startup_inputs import read_live_config_file

from .conftest import ServerProcess

FLAGS = ["--num-gpu-blocks-override", "128", "--max-model-len", "512", "--max-num-seqs", "8"]
FLAGS += ["--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--disable-log-stats"]


def test_reading_the_file(tmp_path) -> None:
    assert read_live_config_file(None) is None
    assert read_live_config_file(str(tmp_path / "absent.json")) is None
    path = tmp_path / "live.json"
    path.write_text('{"max_num_seqs": 3}\n')
    assert read_live_config_file(str(path)) == {"max_num_seqs": 3}
    path.write_text("")
    assert read_live_config_file(str(path)) == {}
    path.write_text("{max_num_seqs: 3")
    with pytest.raises(ConfigError, match="is not JSON"):
        read_live_config_file(str(path))
    path.write_text("[3]")
    with pytest.raises(ConfigError, match="must hold a JSON object, got list"):
        read_live_config_file(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        read_live_config_file(str(tmp_path))  # a directory


def test_a_server_starts_with_the_file_values_and_refuses_an_invalid_file(server_model, tmp_path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"max_num_seqs": 3, "max_num_batched_tokens": 256}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_num_seqs": 64}))  # above the start-up value 8
    missing = tmp_path / "missing.json"
    procs = {
        name: ServerProcess(server_model, tmp_path / f"{name}.log", [*FLAGS, "--live-config-file", str(path)])
        for name, path in (("good", good), ("bad", bad), ("missing", missing))
    }
    try:
        deadline = time.monotonic() + 120
        while procs["bad"].proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert procs["bad"].proc.returncode == 1, procs["bad"].log()
        errors = [line for line in procs["bad"].log().splitlines() if "ERROR" in line]
        assert len(errors) == 1, procs["bad"].log()
        assert "invalid live config file" in errors[0] and "above its start-up value 8" in errors[0]
        assert "listening on" not in procs["bad"].log()

        url = procs["good"].wait_ready().url
        config = httpx.get(url + "/admin/config", timeout=10).json()
        assert config["max_num_seqs"] == 3 and config["max_num_batched_tokens"] == 256
        # The start-up value stays the ceiling: back up to 8 is allowed, as for POST /admin/config.
        answer = httpx.post(url + "/admin/config", json={"max_num_seqs": 8}, timeout=10)
        assert answer.status_code == 200 and answer.json()["max_num_seqs"] == 8

        url = procs["missing"].wait_ready().url
        assert httpx.get(url + "/admin/config", timeout=10).json()["max_num_seqs"] == 8
    finally:
        for proc in procs.values():
            proc.stop()
