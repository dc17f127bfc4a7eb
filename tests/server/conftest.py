"""Live ``kvpilot serve`` subprocesses for the server tests.

Three servers over one tiny checkpoint (4,096 positions, so that long requests outlive the checks made
while they run) start in parallel once per session:

* ``server``: the API under test, with an API key (given through ``KVPILOT_API_KEY``, newline-ended);
* ``pool_server``: a KV pool of 8 blocks x 16 tokens, where a few concurrent requests must preempt;
* ``queue_server``: one running sequence and ``--max-waiting-requests 1``, for backpressure.

Each binds ``--port 0`` and the tests read the address from its "listening on" log line, so no two
servers ever race for a port. Every process is terminated (then killed) at session end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import build_checkpoint

API_KEY = "test-key-0123456789"
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 2048
_LISTENING = re.compile(r"listening on (http://\S+)")


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the test process dies, so no server outlives a killed test run."""
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def kvpilot_command() -> list[str]:
    script = Path(sys.executable).with_name("kvpilot")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvpilot.cli"]


class ServerProcess:
    """One ``kvpilot serve`` subprocess; its log goes to a file (read for the address and on failure)."""

    def __init__(self, model_dir: Path, log_path: Path, flags: list[str], api_key: str | None = None) -> None:
        env = dict(os.environ)
        env.pop("KVPILOT_API_KEY", None)
        if api_key:
            # As a Secret made with ``kubectl create secret --from-file`` holds it: with a final newline.
            env["KVPILOT_API_KEY"] = api_key + "\n"
        # The test machine has two cores shared by every process: one intra-op thread each avoids
        # oversubscription (which slows a tiny model's steps tenfold).
        env.setdefault("OMP_NUM_THREADS", "1")
        self.api_key = api_key
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop()
        cmd = [
            *kvpilot_command(),
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--served-model-name",
            MODEL_NAME,
            "--device",
            "cpu",
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
        self.url: str | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while self.url is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpilot serve exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvpilot serve did not start in {timeout_s} s:\n{self.log()}")
            match = _LISTENING.search(self.log())
            if match:
                self.url = match.group(1)
            else:
                time.sleep(0.1)
        response = httpx.get(f"{self.url}/health", timeout=10)
        assert response.status_code == 200, self.log()
        return self

    def client(self, api_key: str | None = None, timeout: float = 60.0) -> openai.OpenAI:
        key = api_key if api_key is not None else (self.api_key or "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=timeout)

    def async_client(self, timeout: float = 60.0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=timeout
        )

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {**self.headers(), **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", 60)
        return httpx.post(f"{self.url}{path}", headers=headers, **kwargs)

    def metrics(self) -> Metrics:
        response = httpx.get(f"{self.url}/metrics", timeout=10)
        assert response.status_code == 200
        return Metrics(response.text)

    def wait_metric(self, name: str, predicate, timeout_s: float = 1.0, **labels) -> float:
        """Poll ``/metrics`` until ``predicate(value)``; returns the value, or fails with the last one."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metrics().value(name, **labels)
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} = {value} after {timeout_s} s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


class Metrics:
    """``/metrics`` parsed with prometheus-client's text parser: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels) -> float:
        """The one sample called ``name`` whose labels include ``labels`` (``model_name`` defaulted)."""
        if name.startswith("vllm:") and "model_name" not in labels and not name.endswith("_info"):
            labels["model_name"] = MODEL_NAME
        found = [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items())
        ]
        assert len(found) == 1, f"{len(found)} samples of {name}{labels}"
        return found[0]

    def labels(self, name: str) -> dict[str, str]:
        found = [s.labels for s in self.samples if s.name == name]
        assert len(found) == 1, f"{len(found)} samples of {name}"
        return found[0]


@pytest.fixture(scope="session")
def server_model(tmp_path_factory, tokenizer_dir) -> Path:
    """The tiny test checkpoint with room for 4,096 positions."""
    return build_checkpoint(
        tmp_path_factory.mktemp("server-model"), tokenizer_dir, max_position_embeddings=4096
    )


@pytest.fixture(scope="session")
def _servers(server_model, tmp_path_factory):
    """Start every server at once (they load in parallel); stop them all at session end."""
    logs = tmp_path_factory.mktemp("server-logs")
    procs = {
        "server": ServerProcess(
            server_model,
            logs / "server.log",
            [
                "--num-gpu-blocks-override",
                "512",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--seed",
                "0",
            ],
            api_key=API_KEY,
        ),
        "pool": ServerProcess(
            server_model,
            logs / "pool.log",
            [
                "--num-gpu-blocks-override",
                "8",
                "--max-model-len",
                "128",
                "--max-num-seqs",
                "4",
                "--no-enable-prefix-caching",
            ],
        ),
        "queue": ServerProcess(
            server_model,
            logs / "queue.log",
            [
                "--num-gpu-blocks-override",
                "512",
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--max-num-seqs",
                "1",
                "--max-waiting-requests",
                "1",
            ],
        ),
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="session")
def server(_servers) -> ServerProcess:
    return _servers["server"].wait_ready()


@pytest.fixture(scope="session")
def pool_server(_servers) -> ServerProcess:
    return _servers["pool"].wait_ready()


@pytest.fixture(scope="session")
def queue_server(_servers) -> ServerProcess:
    return _servers["queue"].wait_ready()


@pytest.fixture(scope="session")
def swap_server(server_model, tmp_path_factory):
    """The pool server's tiny KV pool under swap preemption (started only by the tests that use it)."""
    logs = tmp_path_factory.mktemp("swap-server-logs")
    flags = ["--num-gpu-blocks-override", "8", "--max-model-len", "128", "--max-num-seqs", "4"]
    flags += ["--no-enable-prefix-caching", "--preemption-mode", "swap", "--swap-space", "0.05"]
    proc = ServerProcess(server_model, logs / "swap.log", flags)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def offline_llm(server_model):
    """The offline engine over the same checkpoint (the reference for greedy outputs)."""
    from kvpilot.engine import LLM

    return LLM(str(server_model), num_gpu_blocks_override=512, max_model_len=MAX_MODEL_LEN, device="cpu")


@pytest.fixture(scope="session")
def tokenizer(server_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_model)
