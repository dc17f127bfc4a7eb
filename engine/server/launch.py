"""Build the engine, its metrics and the app for ``kvpilot serve``, log the start-up summary, and run
uvicorn on the socket the CLI bound."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import time
from typing import Any

import prometheus_client
import uvicorn
from transformers import AutoTokenizer

from kvpilot import __version__
from kvpilot.engine.async_engine import AsyncEngine
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.gc_heap import freeze_startup_heap
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.log_stats import LoggingStatLogger
from kvpilot.engine.metrics import PrometheusStatLogger
from kvpilot.engine.request_trace import RequestTraceLogger
from kvpilot.engine.server.app import build_app
from kvpilot.engine.server.cli import request_limits_from
from kvpilot.engine.server.protocol import GENERATION_CONFIG_KEYS
from kvpilot.engine.server.serving import ServerState
from kvpilot.engine.server.startup_inputs import read_live_config_file

logger = logging.getLogger("kvpilot.serve")


class Server(uvicorn.Server):
    """uvicorn's server, logging the address it really listens on (``--port 0`` picks one)."""

    def __init__(self, config: uvicorn.Config, listen_fields: dict[str, Any]) -> None:
        super().__init__(config)
        self.listen_fields = listen_fields

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            logger.info(f"listening on http://{shown}:{port}", extra={"fields": self.listen_fields})


def serve(
    args: argparse.Namespace,
    engine_args: EngineArgs,
    api_key: str | None,
    chat_template: str | None,
    sock: socket.socket,
) -> int:
    """Load the engine and serve on ``sock`` until SIGINT/SIGTERM; returns the exit code."""
    t0 = time.monotonic()
    try:
        engine = LLMEngine(engine_args)
    except Exception as exc:  # a clear one-line reason; the traceback only at debug level
        logger.error("cannot start the engine: %s: %s", type(exc).__name__, exc)
        logger.debug("engine start-up failure", exc_info=True)
        return 1
    served = args.served_model_name or [args.model]
    prometheus_client.disable_created_metrics()
    metrics = PrometheusStatLogger.from_engine(engine, served[0])
    prometheus_client.ProcessCollector(registry=metrics.registry)
    prometheus_client.PlatformCollector(registry=metrics.registry)
    engine.stat_loggers.append(metrics)
    if not args.disable_log_stats:
        engine.stat_loggers.append(LoggingStatLogger(logging.getLogger("kvpilot.stats")))
    if args.request_trace:
        try:
            engine.stat_loggers.append(RequestTraceLogger(args.request_trace))
        except OSError as exc:
            logger.error("cannot open the request trace %s: %s", args.request_trace, exc)
            engine.shutdown()
            return 1
    defaults = generation_defaults(engine.model_dir) if args.generation_config == "auto" else {}
    state = ServerState(
        engine=AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests),
        # The server's own tokenizer instance: the engine thread detokenizes with the engine's.
        tokenizer=AutoTokenizer.from_pretrained(engine_args.tokenizer or engine.model_dir),
        served_model_names=served,
        model_dir=engine.model_dir,
        max_model_len=engine.max_model_len,
        api_key=api_key,
        metrics=metrics,
        sampling_defaults=defaults,
        chat_template=chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        limits=request_limits_from(args),
    )
    try:
        applied = apply_live_config_file(state.engine, args.live_config_file)
    except ConfigError as exc:  # one clear line: the pod's log says why it does not start
        logger.error("invalid live config file %s: %s", args.live_config_file, exc)
        engine.shutdown()
        return 1
    if applied is not None:
        logger.info("run-time settings from %s", args.live_config_file, extra={"fields": applied})
    metrics.record_live_config(state.engine.live_config())  # the admission bound is the server's
    cfg = engine.model_config
    logger.info(
        "engine ready",
        extra={
            "fields": {
                "version": __version__,
                "model": engine.model_dir,
                "served_model_name": ",".join(served),
                "architecture": cfg.architecture,
                "dtype": str(engine.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
                "device": str(engine.device),
                "attention_backend": engine.backend.name,
                "max_model_len": engine.max_model_len,
                "max_num_seqs": engine_args.max_num_seqs,
                "max_num_batched_tokens": engine.max_num_batched_tokens,
                "preemption_mode": engine_args.preemption_mode,
                "enable_prefix_caching": engine_args.enable_prefix_caching,
                "startup_s": round(time.monotonic() - t0, 2),
            }
        },
    )
    plan = engine.kv_plan
    logger.info(
        "kv cache",
        extra={
            "fields": {
                "num_gpu_blocks": plan.num_blocks,
                "block_size": plan.block_size,
                "kv_cache_tokens": plan.num_tokens,
                "kv_cache_bytes": plan.kv_bytes,
                "max_concurrency": round(plan.num_tokens / engine.max_model_len, 2),
            }
        },
    )
    if defaults:
        logger.info(
            "default sampling parameters from the model's generation_config.json", extra={"fields": defaults}
        )

    config = uvicorn.Config(
        build_app(state),
        log_config=None,
        access_log=not args.disable_access_log,
        timeout_keep_alive=5,
        lifespan="on",
    )
    server = Server(
        config,
        {
            "api_key": "required" if api_key else "none",
            "max_waiting_requests": args.max_waiting_requests,
            "max_sequences_per_request": args.max_sequences_per_request,
        },
    )
    # Everything above lives as long as the process: out of the collector's full passes from here on.
    logger.info("start-up heap frozen", extra={"fields": {"objects": freeze_startup_heap()}})
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # stops the worker processes of a parallel engine
    return 0 if server.started else 1


def apply_live_config_file(engine: AsyncEngine, path: str | None) -> dict[str, Any] | None:
    """Apply the settings of ``--live-config-file`` to ``engine`` (call before its loop starts: this
    writes the scheduler from the calling thread), validated as
    ``POST /admin/config`` validates them (``live_config.apply_update``): all or nothing. Returns the
    settings in force afterwards, or None when there is no file. Raises ConfigError for an invalid one."""
    update = read_live_config_file(path)
    if update is None:
        return None
    return engine.reconfigure_before_start(update).as_dict()


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """Request defaults from ``generation_config.json`` (as ``vllm serve --generation-config auto``)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return {}
    return {
        ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items() if raw.get(theirs) is not None
    }
