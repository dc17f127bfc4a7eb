"""Checks of an InferenceService beyond what the CRD schema enforces.

The schema (types, enums, ranges, CEL rules) rejects most mistakes at ``kubectl apply``. What it
cannot express is checked here: the engine's own argument validation (``EngineArgs``), model
source URIs, quantities, names that must fit the children, and a few cross-field rules. The same
checks run for manifests read from files (``kvpilot render``), where no API server has validated
anything, so the basic shape is checked too. ``settings.resolve`` runs them, on the spec it has
applied the defaults to.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from kvpilot.engine.config import EngineArgs, crd_key, flag_name
from kvpilot.engine.errors import ConfigError
from kvpilot.operator.api import names
from kvpilot.operator.api import runtime as runtimes
from kvpilot.operator.api.effective import Effective
from kvpilot.operator.api.spec import (
    DEFAULTS,
    ENGINE_KEYS,
    ModelSourceError,
    engine_snake_args,
    parse_duration,
    parse_model_source,
    parse_quantity,
)

# Service names are DNS-1035 labels; the Deployment, Service and PDB all take the object's name.
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_EXTRA_ARG = re.compile(r"--([a-z0-9][-a-z0-9]*)(=[^\x00-\x1f\x7f]*)?")
# $(VAR) that the kubelet would expand in container args ($$ escapes a dollar).
_KUBELET_EXPANSION = re.compile(r"(?<!\$)(\$\$)*\$\(")
_VOLUME_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Flag -> the spec field that sets it: every engine argument's flag (and its --no- form) and the
# server flags the operator renders. spec.extraArgs may name none of them.
_MANAGED_FLAGS = {
    **{flag_name(f.name): f"spec.engine.{key}" for key, f in ENGINE_KEYS.items()},
    **{"--no-" + flag_name(f.name)[2:]: f"spec.engine.{key}" for key, f in ENGINE_KEYS.items()},
    **{flag: "the operator (fixed)" for flag in names.MANAGED_SERVER_FLAGS},
    "--api-key": "spec.apiKeySecretRef",
    "--served-model-name": "spec.model.name",
    "--tokenizer": "spec.model.source",
}
# The same for runtime vllm: the vLLM flags the operator renders.
_MANAGED_VLLM_FLAGS = {
    **{flag: f"spec.engine.{key}" for key, flag in runtimes.VLLM_FLAGS.items()},
    **{"--no-" + flag[2:]: f"spec.engine.{key}" for key, flag in runtimes.VLLM_FLAGS.items()},
    **{flag: "the operator (fixed)" for flag in names.MANAGED_SERVER_FLAGS},
    "--model": "spec.model.source",
    "--download-dir": "spec.model.cache",
    "--api-key": "spec.apiKeySecretRef",
    "--served-model-name": "spec.model.name",
    "--tokenizer": "spec.model.source",
}
# Fallbacks for a manifest read from a file whose remediation objects are not objects.
_LIMITS = DEFAULTS["remediation"]["limits"]
_THRESHOLDS = DEFAULTS["remediation"]["thresholds"]


class SpecError(ValueError):
    """An InferenceService cannot be reconciled; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _engine_problems(engine: dict[str, Any], where: str) -> list[str]:
    problems = []
    for key in engine:
        if key not in ENGINE_KEYS:
            hint = difflib.get_close_matches(key, list(ENGINE_KEYS), n=1)
            suggestion = f" (did you mean {hint[0]}?)" if hint else ""
            problems.append(f"{where}.{key}: unknown engine argument{suggestion}")
    if problems:
        return problems
    try:
        EngineArgs(**engine_snake_args(engine))
    except ConfigError as exc:
        message = str(exc)
        # The engine names its arguments in snake_case; speak the CRD's camelCase here.
        for f in ENGINE_KEYS.values():
            message = re.sub(rf"\b{f.name}\b", crd_key(f.name), message)
        problems.append(f"{where}: {message}")
    except TypeError as exc:  # a value of the wrong type in a manifest read from a file
        problems.append(f"{where}: {exc}")
    return problems


def _model_problems(spec: dict[str, Any]) -> list[str]:
    model = spec.get("model")
    if not isinstance(model, dict) or not model.get("source"):
        return ["spec.model.source is required (pvc://, hf:// or file://)"]
    try:
        source = parse_model_source(model["source"])
    except ModelSourceError as exc:
        return [f"spec.model.source: {exc}"]
    problems = []
    if model.get("cache") and source.scheme != "hf":
        problems.append("spec.model.cache applies to hf:// sources only (the hub download cache)")
    if model.get("tokenSecretRef") and source.scheme != "hf":
        problems.append("spec.model.tokenSecretRef applies to hf:// sources only")
    cache = model.get("cache") or {}
    if cache.get("claimName") and cache.get("sizeLimit"):
        problems.append("spec.model.cache: set claimName or sizeLimit (of an emptyDir), not both")
    return problems


def _resource_problems(spec: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    resources = spec.get("resources") or {}
    problems = []
    memory_bytes = None
    for key in ("cpu", "memory", "sharedMemory"):
        if key in resources:
            try:
                value = parse_quantity(resources[key])
            except ValueError as exc:
                problems.append(f"spec.resources.{key}: {exc}")
                continue
            if value <= 0:
                problems.append(f"spec.resources.{key} must be positive, got {resources[key]!r}")
            if key == "memory":
                memory_bytes = value
    gpus = resources.get("gpusPerReplica")
    if engine.get("device") == "cuda" and gpus == 0:
        problems.append("spec.engine.device is cuda but spec.resources.gpusPerReplica is 0")
    swap = engine.get("swapSpace", ENGINE_KEYS["swapSpace"].default)
    if engine.get("preemptionMode") == "swap" and not swap:
        problems.append("spec.engine: preemptionMode swap needs swapSpace > 0")
    if engine.get("preemptionMode") == "swap" and memory_bytes is not None and swap is not None:
        if memory_bytes <= float(swap) * 2**30:
            problems.append(
                f"spec.resources.memory {resources['memory']} cannot hold swapSpace {swap} GiB of swapped "
                "KV blocks plus the engine process: raise the memory or lower engine.swapSpace"
            )
    if (
        engine.get("enableChunkedPrefill") is False
        and engine.get("maxNumBatchedTokens") is not None
        and engine.get("maxModelLen") is not None
        and engine["maxNumBatchedTokens"] < engine["maxModelLen"]
    ):
        problems.append(
            "spec.engine.maxNumBatchedTokens must be >= maxModelLen when enableChunkedPrefill is false "
            "(a whole prompt must fit one step)"
        )
    return problems


def _misc_problems(spec: dict[str, Any]) -> list[str]:
    problems = []
    vllm_pods = spec.get("runtime") == runtimes.RUNTIME_VLLM
    managed_env = names.MANAGED_ENV_VLLM if vllm_pods else names.MANAGED_ENV
    for index, item in enumerate(spec.get("env") or []):
        name = (item or {}).get("name", "")
        if not _ENV_NAME.match(name):
            problems.append(f"spec.env[{index}].name {name!r} is not a valid environment variable name")
        elif name in managed_env:
            problems.append(f"spec.env[{index}].name {name} is set by the operator; use the dedicated field")
    rollout = spec.get("rollout") or {}
    if rollout.get("maxSurge") in (0, "0%") and rollout.get("maxUnavailable") in (0, "0%"):
        problems.append("spec.rollout: maxSurge and maxUnavailable cannot both be 0")
    remediation = spec.get("remediation") or {}
    for key in ("window", "cooldown"):
        if key in remediation:
            try:
                parse_duration(remediation[key])
            except ValueError as exc:
                problems.append(f"spec.remediation.{key}: {exc}")
    limits = remediation.get("limits") or {}
    if limits.get("minReplicas", _LIMITS["minReplicas"]) > limits.get("maxReplicas", _LIMITS["maxReplicas"]):
        problems.append("spec.remediation.limits.minReplicas must be <= maxReplicas")
    thresholds = remediation.get("thresholds") or {}
    idle = thresholds.get("kvCacheUsageIdle", _THRESHOLDS["kvCacheUsageIdle"])
    high = thresholds.get("kvCacheUsageHigh", _THRESHOLDS["kvCacheUsageHigh"])
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (idle, high))
    if not numbers:
        problems.append("spec.remediation.thresholds: kvCacheUsageIdle and kvCacheUsageHigh must be numbers")
    elif idle >= high:
        problems.append(
            "spec.remediation.thresholds.kvCacheUsageIdle must be below kvCacheUsageHigh "
            "(the gap keeps replicas from flapping)"
        )
    interval = ((spec.get("monitoring") or {}).get("serviceMonitor") or {}).get("interval")
    if interval is not None:
        try:
            parse_duration(interval)
        except ValueError as exc:
            problems.append(f"spec.monitoring.serviceMonitor.interval: {exc}")
    return problems


def _extra_arg_problems(spec: dict[str, Any]) -> list[str]:
    extra = spec.get("extraArgs")
    if extra is None:
        return []
    if not isinstance(extra, list):
        return ["spec.extraArgs must be a list of flags"]
    managed = _MANAGED_VLLM_FLAGS if spec.get("runtime") == runtimes.RUNTIME_VLLM else _MANAGED_FLAGS
    problems = []
    for index, arg in enumerate(extra):
        where = f"spec.extraArgs[{index}]"
        match = _EXTRA_ARG.fullmatch(arg) if isinstance(arg, str) else None
        if not match:
            problems.append(
                f"{where} {arg!r} is not a flag: use --name or --name=value (no control characters; "
                "each list item is one argument, no shell reads them)"
            )
            continue
        flag = f"--{match.group(1)}"
        if flag in managed:
            problems.append(f"{where} {flag} is set by the operator: use {managed[flag]}")
        elif _KUBELET_EXPANSION.search(arg):
            problems.append(
                f"{where} {arg!r}: the kubelet expands $(VAR) in container args; write $$( instead"
            )
    return problems


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _extra_volume_problems(spec: dict[str, Any]) -> list[str]:
    volumes = spec.get("extraVolumes") or []
    mounts = spec.get("extraVolumeMounts") or []
    if not isinstance(volumes, list) or not isinstance(mounts, list):
        return ["spec.extraVolumes and spec.extraVolumeMounts must be lists"]
    problems = []
    declared: set[str] = set()
    for index, volume in enumerate(volumes):
        name = volume.get("name") if isinstance(volume, dict) else None
        where = f"spec.extraVolumes[{index}]"
        if not isinstance(name, str) or not _VOLUME_NAME.match(name) or len(name) > 63:
            problems.append(f"{where}.name {name!r} must be a DNS-1123 label")
        elif name in names.MANAGED_VOLUMES:
            managed = ", ".join(sorted(names.MANAGED_VOLUMES))
            problems.append(f"{where}.name {name} is one of the operator's own volumes ({managed})")
        elif name in declared:
            problems.append(f"{where}.name {name} is declared twice")
        else:
            declared.add(name)
            if len(volume) < 2:
                problems.append(f"{where} ({name}) names no volume source (configMap, secret, ...)")
    seen_paths: set[str] = set()
    for index, mount in enumerate(mounts):
        where = f"spec.extraVolumeMounts[{index}]"
        if not isinstance(mount, dict):
            problems.append(f"{where} must be an object")
            continue
        if mount.get("name") not in declared:
            problems.append(f"{where}.name {mount.get('name')!r} is not one of spec.extraVolumes")
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/") or path == "/":
            problems.append(f"{where}.mountPath {path!r} must be an absolute path below / without '..'")
            continue
        path = path.rstrip("/")
        clash = [m for m in names.MANAGED_MOUNTS if _under(path, m) or _under(m, path)]
        if clash:
            problems.append(f"{where}.mountPath {path} overlaps the operator's mount {clash[0]}")
        elif path in seen_paths:
            problems.append(f"{where}.mountPath {path} is mounted twice")
        seen_paths.add(path)
    return problems


def _runtime_problems(spec: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    runtime = spec.get("runtime", runtimes.RUNTIME_KVPILOT)
    if runtime not in runtimes.RUNTIMES:
        return [f"spec.runtime must be one of {', '.join(runtimes.RUNTIMES)}; got {runtime!r}"]
    if runtime == runtimes.RUNTIME_VLLM:
        return runtimes.unsupported_engine_keys(engine)
    return []


def spec_problems(isvc: Any, spec: dict[str, Any]) -> list[str]:
    """Every reason the object ``isvc`` and its ``spec`` (with its defaults applied) cannot be
    reconciled, the status overrides aside; an empty list when they are valid."""
    if not isinstance(isvc, dict):
        return ["the manifest is not an object"]
    problems = []
    if isvc.get("apiVersion") not in (None, names.API_VERSION) or isvc.get("kind") not in (None, names.KIND):
        problems.append(
            f"not an {names.KIND} ({names.API_VERSION}): {isvc.get('apiVersion')}/{isvc.get('kind')}"
        )
    name = (isvc.get("metadata") or {}).get("name") or ""
    if not _DNS1035_LABEL.match(name) or len(name) > 63:
        problems.append(
            f"metadata.name {name!r} must be a DNS-1035 label (lower case letters, digits and '-', "
            "starting with a letter, at most 63 characters): it names the engine's Service"
        )
    raw_spec = isvc.get("spec")
    if not isinstance(raw_spec, dict):
        return problems + ["spec is required"]
    if not spec.get("image"):
        problems.append("spec.image must name the engine image (or be left out: the operator's default)")
    engine = spec.get("engine") or {}
    if not isinstance(engine, dict):
        return problems + ["spec.engine must be an object"]
    problems += _model_problems(spec)
    problems += _engine_problems(engine, "spec.engine")
    problems += _resource_problems(spec, engine)
    problems += _misc_problems(spec)
    problems += _runtime_problems(spec, engine)
    problems += _extra_arg_problems(spec)
    problems += _extra_volume_problems(spec)
    return problems


def override_problems(effective: Effective) -> list[str]:
    """Why the remediation overrides in ``effective`` give a configuration the engine rejects (they
    must never), or an empty list."""
    if not effective.applied_overrides:
        return []
    return _engine_problems(effective.engine, "status.effective (spec.engine with overrides)")
