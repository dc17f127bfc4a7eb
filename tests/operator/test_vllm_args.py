"""``runtime: vllm``: the rendered command line parses with vLLM's own argument parser.

The parser runs in vLLM's virtual environment (``make test`` builds it, see ``mk/vllm.mk``), so a
flag vLLM renamed or dropped fails here rather than in a crash-looping pod. Keys vLLM has no
equivalent for are reported, never dropped.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.operator.api import runtime
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.render import vllm
from kvpilot.operator.render.builders import build_deployment
from tests.operator.conftest import BASE_ISVC

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = REPO / "tests" / "vllm" / "requirements.txt"
INSTALLER = REPO / "tests" / "vllm" / "install.py"
PARSER = REPO / "tests" / "vllm" / "parse_args.py"

# spec.engine key -> the attribute vLLM's parser stores it under.
ATTRIBUTE = {
    "blockSize": "block_size",
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "kvCacheMemoryBytes": "kv_cache_memory_bytes",
    "numGpuBlocksOverride": "num_gpu_blocks_override",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "maxModelLen": "max_model_len",
    "enableChunkedPrefill": "enable_chunked_prefill",
    "enablePrefixCaching": "enable_prefix_caching",
    "tensorParallelSize": "tensor_parallel_size",
    "pipelineParallelSize": "pipeline_parallel_size",
    "dtype": "dtype",
    "kvCacheDtype": "kv_cache_dtype",
    "seed": "seed",
}


def vllm_python() -> str:
    """vLLM's interpreter: ``$KVPILOT_VLLM_PYTHON``, else the environment ``make test`` builds.

    Missing: fails under ``KVPILOT_REQUIRE_TOOLS=1`` (``make test``), skips otherwise."""
    explicit = os.environ.get("KVPILOT_VLLM_PYTHON")
    # The key mk/vllm.mk names the environment by: the requirements and the installer, concatenated.
    key = hashlib.sha256(REQUIREMENTS.read_bytes() + INSTALLER.read_bytes()).hexdigest()[:12]
    candidate = (
        Path(explicit)
        if explicit
        else Path.home() / ".cache" / "kvpilot" / f"vllm-venv-{key}" / "bin" / "python"
    )
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    message = f"vLLM's interpreter {candidate} is missing; run `make vllm-venv`"
    if os.environ.get("KVPILOT_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def parse_with_vllm(arg_lists: list[list[str]], tmp_path: Path) -> list[dict[str, Any]]:
    """Parse every argument list with ``vllm serve``'s parser (one process; cwd outside the checkout)."""
    out = subprocess.run(
        [vllm_python(), str(PARSER)],
        input=json.dumps(arg_lists),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def manifests() -> list[Path]:
    return sorted((REPO / "examples").glob("*.yaml"))


def expected_values(engine: dict[str, Any]) -> dict[str, Any]:
    """What vLLM should parse: the keys it has, the CPU budget turned into the KV pool's bytes."""
    out = {key: value for key, value in engine.items() if key in runtime.VLLM_FLAGS}
    if runtime.cpu_kv_cache_bytes(engine) is not None:
        out["kvCacheMemoryBytes"] = runtime.cpu_kv_cache_bytes(engine)
    return out


# --- the mapping itself -------------------------------------------------------------------------------


def test_every_vllm_flag_has_an_engine_key_and_every_engine_key_a_verdict() -> None:
    from kvpilot.operator.api.spec import ENGINE_KEYS

    assert set(runtime.VLLM_FLAGS) <= set(ENGINE_KEYS)
    assert set(runtime.KVPILOT_ONLY) <= set(ENGINE_KEYS)
    # A new engine argument must be mapped or declared kvpilot-only, not fall through silently.
    assert set(ENGINE_KEYS) == set(runtime.VLLM_FLAGS) | set(runtime.KVPILOT_ONLY) | runtime.DERIVED


def test_booleans_render_both_ways_and_unset_keys_are_left_to_vllm() -> None:
    args = vllm.vllm_engine_flags(
        {"enablePrefixCaching": False, "enableChunkedPrefill": True, "maxNumSeqs": 8}
    )
    assert args == ["--max-num-seqs", "8", "--enable-chunked-prefill", "--no-enable-prefix-caching"]
    assert vllm.vllm_engine_flags({}) == []


def test_a_cpu_budget_becomes_an_explicit_kv_pool_the_memory_fraction_sizes() -> None:
    engine = {"cpuMemoryBudgetBytes": 1 << 30, "gpuMemoryUtilization": 0.25}
    args = vllm.vllm_engine_flags(engine)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)
    raised = vllm.vllm_engine_flags({**engine, "gpuMemoryUtilization": 0.3})
    assert int(raised[raised.index("--kv-cache-memory-bytes") + 1]) > 1 << 28
    # An explicit size wins over the budget.
    explicit = vllm.vllm_engine_flags({**engine, "kvCacheMemoryBytes": 12345})
    assert explicit[explicit.index("--kv-cache-memory-bytes") + 1] == "12345"


def test_kvpilot_only_keys_are_reported_with_the_runtime_and_the_reason() -> None:
    problems = runtime.unsupported_engine_keys(
        {"preemptionMode": "swap", "swapSpace": 8, "maxNumSeqs": 8, "attentionBackend": "auto"}
    )
    assert problems == [
        "spec.engine.preemptionMode is not supported by runtime vllm: vLLM V1 only recomputes preempted "
        "requests (no swap preemption)",
        "spec.engine.swapSpace is not supported by runtime vllm: vLLM V1 has no CPU swap pool",
    ]
    # The values vLLM behaves as anyway are accepted.
    assert runtime.unsupported_engine_keys({"preemptionMode": "recompute", "device": "auto"}) == []
    # A value of a rendered key that vLLM's parser refuses.
    assert runtime.unsupported_engine_keys({"kvCacheDtype": "float32"}) == [
        "spec.engine.kvCacheDtype float32 is not supported by runtime vllm: vLLM's KV cache types are auto, "
        "float16, bfloat16 and fp8 formats (no float32)"
    ]
    assert runtime.unsupported_engine_keys({"kvCacheDtype": "bfloat16"}) == []


# --- against vLLM's parser ------------------------------------------------------------------------------


def as_vllm(isvc: dict[str, Any]) -> dict[str, Any]:
    """``isvc`` with ``runtime: vllm``, the keys vLLM lacks taken out (each one must be refused)."""
    out = copy.deepcopy(isvc)
    out["spec"]["runtime"] = "vllm"
    engine = out["spec"].get("engine") or {}
    refused = resolve(out).problems
    for key in [k for k in engine if k in runtime.KVPILOT_ONLY]:
        if any(p.startswith(f"spec.engine.{key} is not supported by runtime vllm") for p in refused):
            del engine[key]
    return out


def rendered_args(isvc: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(effective engine, the engine container's args) of the Deployment the operator renders."""
    settings = resolve(isvc)
    assert settings.is_valid, settings.problems
    deployment = build_deployment(settings)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == vllm.VLLM_COMMAND
    return settings.effective.engine, container["args"]


def test_examples_render_to_args_vllm_parses_with_the_same_values(tmp_path: Path) -> None:
    cases: list[tuple[str, dict[str, Any], list[str]]] = []
    for path in manifests():
        engine, args = rendered_args(as_vllm(yaml.safe_load(path.read_text())))
        cases.append((path.name, engine, args))
    # The tests' own base manifest, and the remediation levers' outcomes applied to it.
    base = as_vllm(BASE_ISVC)
    cases.append(("BASE_ISVC", *rendered_args(base)))
    for lever in (
        {"gpuMemoryUtilization": 0.95},
        {"maxNumSeqs": 64},
        {"maxNumBatchedTokens": 4096},
        {"tensorParallelSize": 2},
        {"pipelineParallelSize": 2},
        {"cpuMemoryBudgetBytes": 1 << 30},
    ):
        changed = copy.deepcopy(base)
        changed["spec"]["engine"].update(lever)
        cases.append((f"lever {lever}", *rendered_args(changed)))
    results = parse_with_vllm([args for _, _, args in cases], tmp_path)
    for (name, engine, args), result in zip(cases, results, strict=True):
        assert result["ok"], (name, result.get("error"), args)
        values = result["values"]
        assert values["port"] == 8000 and values["host"] == "0.0.0.0", name
        assert values["model"] == args[args.index("--model") + 1] and values["served_model_name"], name
        for key, value in expected_values(engine).items():
            assert values[ATTRIBUTE[key]] == value, (name, key, values[ATTRIBUTE[key]], value)


def test_flags_vllm_lacks_are_rejected_by_its_parser(tmp_path: Path) -> None:
    """What :data:`runtime.KVPILOT_ONLY` claims vLLM lacks, vLLM's parser indeed refuses (a parser that
    accepted everything would pass the test above)."""
    results = parse_with_vllm(
        [
            ["--model", "/m", "--preemption-mode", "swap"],
            ["--model", "/m", "--swap-space", "4"],
            ["--model", "/m", "--max-num-seqs", "eight"],
            *(
                ["--model", "/m", "--kv-cache-dtype", value]
                for value in runtime.VLLM_REFUSED_VALUES["kvCacheDtype"][0]
            ),
            ["--model", "/m", "--kv-cache-dtype", "bfloat16"],
        ],
        tmp_path,
    )
    assert [r["ok"] for r in results] == [False, False, False, False, True], results
    assert "--max-num-seqs" in results[2]["error"]
    assert results[4]["values"]["kv_cache_dtype"] == "bfloat16"
