"""Scripted engine metrics for the remediation tests: ``/metrics`` text as an engine serves it.

``EngineMetrics`` renders the text with prometheus-client, exactly as ``kvpilot serve`` does (same
library, same metric names from ``metrics_names``, counters with their ``_created`` sample), so the
reader is tested against the real exposition format. A new ``EngineMetrics`` is a restarted engine:
its counter starts at 0 with a new creation time. With ``latency=True`` it also exports the latency
histograms (time to first token, queue time) with the engine's buckets (vLLM's), empty until ``serve``
observes requests; without, the exposition is the small one the other tests size their caps by.

``ScriptedEngine`` serves one on 127.0.0.1 (a thread), its preemption counter advancing at a set rate
in real time: the "pod" of the operator integration tests. It also answers ``GET``/``POST
/admin/config`` as ``kvpilot serve`` does (API key, a 400 error body for a refused update, the values
in force), recording every update it is sent.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpilot.engine import metrics_names as m
from kvpilot.engine.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS


class EngineMetrics:
    """One engine's metrics; set the gauges, add preemptions, render ``text()``."""

    def __init__(
        self,
        *,
        num_gpu_blocks: int = 1024,
        block_size: int = 16,
        max_model_len: int = 4096,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        num_hidden_layers: int = 32,
        intermediate_size: int = 14336,
        num_gpu_blocks_override: int | None = None,
        alias_only: bool = False,
        model_name: str = "llama",
        latency: bool = False,
    ) -> None:
        self.registry = registry = CollectorRegistry()
        label = [m.LABEL_MODEL_NAME]
        counter = Counter(
            m.NUM_PREEMPTIONS_TOTAL.removesuffix("_total"), "Preemptions.", label, registry=registry
        )
        self._preemptions = counter.labels(model_name)
        usage_name = m.GPU_CACHE_USAGE_PERC if alias_only else m.KV_CACHE_USAGE_PERC
        self._kv = Gauge(usage_name, "KV usage.", label, registry=registry).labels(model_name)
        self._waiting = Gauge(m.NUM_REQUESTS_WAITING, "Waiting.", label, registry=registry).labels(model_name)
        self._running = Gauge(m.NUM_REQUESTS_RUNNING, "Running.", label, registry=registry).labels(model_name)
        # Before the info metrics, which come last (as in the engine's exposition).
        buckets = (16, 64, 256, 1024, 4096)
        self._prompt_tokens = Histogram(
            m.REQUEST_PROMPT_TOKENS, "Prompt length.", label, buckets=buckets, registry=registry
        ).labels(model_name)
        self._generation_tokens = Histogram(
            m.REQUEST_GENERATION_TOKENS, "Generated length.", label, buckets=buckets, registry=registry
        ).labels(model_name)
        self._ttft = self._queue_time = None
        if latency:
            self._ttft = Histogram(
                m.TIME_TO_FIRST_TOKEN_SECONDS, "TTFT.", label, buckets=TTFT_BUCKETS, registry=registry
            ).labels(model_name)
            self._queue_time = Histogram(
                m.REQUEST_QUEUE_TIME_SECONDS,
                "Queue time.",
                label,
                buckets=REQUEST_LATENCY_BUCKETS,
                registry=registry,
            ).labels(model_name)
        cache = Gauge(m.CACHE_CONFIG_INFO, "Cache config.", list(m.CACHE_CONFIG_LABELS), registry=registry)
        cache_labels = dict.fromkeys(m.CACHE_CONFIG_LABELS, "None")
        cache_labels.update(
            block_size=str(block_size),
            num_gpu_blocks=str(num_gpu_blocks),
            num_gpu_blocks_override=str(num_gpu_blocks_override),
        )
        cache.labels(**cache_labels).set(1)
        model = Gauge(m.MODEL_CONFIG_INFO, "Model config.", list(m.MODEL_CONFIG_LABELS), registry=registry)
        model_labels = dict.fromkeys(m.MODEL_CONFIG_LABELS, "None")
        model_labels.update(
            num_attention_heads=str(num_attention_heads),
            num_key_value_heads=str(num_key_value_heads),
            num_hidden_layers=str(num_hidden_layers),
            intermediate_size=str(intermediate_size),
            max_model_len=str(max_model_len),
            max_num_seqs=str(max_num_seqs),
            max_num_batched_tokens=str(max_num_batched_tokens),
        )
        model.labels(**model_labels).set(1)
        self._lock = threading.Lock()

    def set(self, *, kv: float | None = None, waiting: float | None = None, running: float | None = None):
        """Set gauges (None: unchanged)."""
        with self._lock:
            if kv is not None:
                self._kv.set(kv)
            if waiting is not None:
                self._waiting.set(waiting)
            if running is not None:
                self._running.set(running)
        return self

    def preempt(self, count: float) -> EngineMetrics:
        """Count ``count`` more preemptions."""
        with self._lock:
            if count:
                self._preemptions.inc(count)
        return self

    def finish(self, prompt_tokens: int, output_tokens: int, count: int = 1) -> EngineMetrics:
        """``count`` requests finished, each of ``prompt_tokens`` + ``output_tokens``."""
        with self._lock:
            for _ in range(count):
                self._prompt_tokens.observe(prompt_tokens)
                self._generation_tokens.observe(output_tokens)
        return self

    def serve(self, ttft_s: float, queue_s: float, count: int = 1) -> EngineMetrics:
        """``count`` requests got their first token ``ttft_s`` seconds after arriving, of which they
        spent ``queue_s`` waiting to be scheduled (needs ``latency=True``)."""
        if self._ttft is None or self._queue_time is None:
            raise ValueError("EngineMetrics(latency=True) exports the latency histograms; this one does not")
        with self._lock:
            for _ in range(count):
                self._ttft.observe(ttft_s)
                self._queue_time.observe(queue_s)
        return self

    @property
    def preemptions(self) -> float:
        return self._preemptions._value.get()

    def text(self) -> str:
        """The ``/metrics`` body."""
        with self._lock:
            return generate_latest(self.registry).decode()


class ScriptedEngine:
    """An HTTP server on 127.0.0.1 serving an ``EngineMetrics`` whose counter grows at ``rate``/s.

    ``restart()`` swaps in a fresh ``EngineMetrics`` (a counter reset); ``fail = True`` answers 500.
    ``config``: the run-time settings in force (``/admin/config``, and ``kvpilot_config_info`` in the
    metrics, as ``kvpilot serve`` exports them); ``api_key``: required there when
    set; ``refuse = True`` answers every update with a 400; ``updates``: the bodies posted to it.
    """

    def __init__(
        self, metrics: EngineMetrics | None = None, rate: float = 0.0, api_key: str | None = None
    ) -> None:
        self.metrics = metrics or EngineMetrics()
        self.rate = rate
        self.fail = False
        self.refuse = False
        self.api_key = api_key
        self.config = {
            "max_num_seqs": 64,
            "max_num_batched_tokens": 8192,
            "max_waiting_requests": None,
            "preemption_mode": "recompute",
        }
        self.updates: list[dict] = []
        self.requests = 0
        self._last = time.monotonic()
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/admin/config":
                    self._admin(None)
                    return
                body, status = engine._render()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                self._admin(json.loads(self.rfile.read(length) or b"null"))

            def _admin(self, update) -> None:
                status, answer = engine._admin(self.path, self.headers.get("Authorization"), update)
                body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def _render(self) -> tuple[bytes, int]:
        with self._lock:
            now = time.monotonic()
            self.metrics.preempt(self.rate * (now - self._last))
            self._last = now
            self.requests += 1
            if self.fail:
                return b"engine error", 500
            labels = ",".join(f'{k}="{self.config.get(k)}"' for k in m.CONFIG_LABELS)
            config = f"# TYPE {m.CONFIG_INFO} gauge\n{m.CONFIG_INFO}{{{labels}}} 1.0\n"
            return (self.metrics.text() + config).encode(), 200

    def _admin(self, path: str, authorization: str | None, update) -> tuple[int, dict]:
        def error(status: int, message: str) -> tuple[int, dict]:
            return status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}

        if path != "/admin/config":
            return error(404, "not found")
        if self.api_key is not None and authorization != f"Bearer {self.api_key}":
            return error(401, "invalid API key")
        with self._lock:
            if update is None:
                return 200, dict(self.config)
            self.updates.append(update)
            if self.refuse:
                return error(400, f"{next(iter(update), 'the update')} cannot change at run time")
            self.config.update(update)
            return 200, dict(self.config)

    def set_rate(self, rate: float) -> None:
        """From now on, ``rate`` preemptions per second."""
        with self._lock:
            now = time.monotonic()
            self.metrics.preempt(self.rate * (now - self._last))
            self._last = now
            self.rate = rate

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
