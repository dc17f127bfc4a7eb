"""The command line of an upstream vLLM engine pod (``spec.runtime: vllm``).

``vllm serve`` flags from the same ``spec.engine`` keys ``kvpilot serve`` takes (the mapping and the
keys vLLM lacks are in ``api.runtime``). The args start with ``--model`` so both ``vllm serve`` (the
official images' command) and ``python -m vllm.entrypoints.openai.api_server`` (what the local
platform starts: the console script of vLLM's CPU wheel fails) take them unchanged.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.runtime import VLLM_FLAGS, cpu_kv_cache_bytes

# The container command for vLLM images (the official images ship the ``vllm`` console script).
VLLM_COMMAND = ["vllm", "serve"]
VLLM_MODULE = "vllm.entrypoints.openai.api_server"

# The environment variable vLLM reads its API key from (the key stays out of the pod's args).
ENV_VLLM_API_KEY = names.ENV_VLLM_API_KEY


def vllm_engine_flags(engine: dict[str, Any]) -> list[str]:
    """``spec.engine`` (camelCase, effective values) -> vLLM flags, in :data:`VLLM_FLAGS` order."""
    kv_bytes = cpu_kv_cache_bytes(engine)
    if kv_bytes is not None:
        engine = {**engine, "kvCacheMemoryBytes": kv_bytes}
    args: list[str] = []
    for key, flag in VLLM_FLAGS.items():
        value = engine.get(key)
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args.extend([flag, str(value)])
    return args


def vllm_args(
    model: str,
    served_model_name: str,
    engine: dict[str, Any],
    *,
    host: str,
    port: int,
    download_dir: str | None = None,
) -> list[str]:
    """The args of ``vllm serve`` (also valid after ``python -m`` :data:`VLLM_MODULE`)."""
    head = ["--model", model, "--host", host, "--port", str(port), "--served-model-name", served_model_name]
    if download_dir:
        head += ["--download-dir", download_dir]
    return head + vllm_engine_flags(engine)
