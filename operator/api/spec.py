"""Reading an InferenceService spec: defaults, engine keys, model sources, quantities, durations.

Pure functions over plain dicts (the objects as the API server returns them). The defaults here
mirror the CRD's ``default:`` values (a test walks the schema and checks that they agree), so a
manifest read from a file (``kvpilot render``) builds exactly what the operator builds for the
same object read from the cluster, where the API server has already applied the defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from kvpilot.engine.config import crd_key, engine_arg_fields

# Engine arguments that are not per-pod settings: the model source decides the model and
# tokenizer directories, so they never appear under ``spec.engine``.
NOT_PER_POD = frozenset({"model", "tokenizer"})

# spec.engine key (camelCase) -> EngineArgs field (snake_case), in the engine's declaration order.
ENGINE_KEYS: dict[str, dataclasses.Field] = {
    crd_key(f.name): f for f in engine_arg_fields() if f.name not in NOT_PER_POD
}

DEFAULTS: dict[str, Any] = {
    "imagePullPolicy": "IfNotPresent",
    "runtime": "kvpilot",
    "replicas": 1,
    "resources": {"gpusPerReplica": 1, "gpuResource": "nvidia.com/gpu"},
    "pod": {"terminationGracePeriodSeconds": 120},
    "rollout": {"maxSurge": 0, "maxUnavailable": 1},
    "probes": {"startupTimeoutSeconds": 1800},
    "monitoring": {"serviceMonitor": {"enabled": False, "interval": "30s"}},
    "remediation": {
        "mode": "Recommend",
        "preemptionRate": 0.05,
        "window": "120s",
        "cooldown": "600s",
        "liveLevers": True,
        "idleAfter": "15m",
        "plan": {"enabled": True, "maxPredictionError": 0.25, "minRequests": 32, "lookback": "10m"},
        "limits": {
            "maxGpuMemoryUtilization": 0.95,
            "minMaxNumSeqs": 16,
            "minMaxNumBatchedTokens": 2048,
            "minReplicas": 1,
            "maxReplicas": 8,
            "maxTensorParallelSize": 8,
            "maxPipelineParallelSize": 1,
        },
        "thresholds": {
            "kvCacheUsageHigh": 0.9,
            "requestsWaitingHigh": 8,
            "kvCacheUsageIdle": 0.3,
            "requestsWaitingMin": 1,
            "queueTimeHighSeconds": 2,
        },
    },
}
# Defaults of optional objects that only apply once the user sets the object.
SECRET_REF_DEFAULT_KEYS = {"tokenSecretRef": "token", "apiKeySecretRef": "api-key"}
# The same for spec.router and spec.autoscaling: a value is filled in only inside an object the user
# set (as the API server defaults), never creating the object itself.
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "router": {
        "inferencePool": {
            "failureMode": "FailClose",
            "endpointPickerRef": {"port": 9002},
            "endpointPicker": {"replicas": 1, "port": 9002},
            "httpRoute": {"pathPrefix": "/"},
        },
        "frontDoor": {"replicas": 1, "port": 8000},
    },
    "autoscaling": {
        "hpa": {"minReplicas": 1, "metric": "vllm:num_requests_waiting", "targetAverageValue": "4"},
        "keda": {
            "minReplicaCount": 0,
            "pollingInterval": 30,
            "cooldownPeriod": 300,
            "prometheus": {"threshold": "8"},
        },
    },
}


def _merge_defaults(value: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    for key, default in defaults.items():
        if key not in value:
            value[key] = copy.deepcopy(default)
        elif isinstance(default, dict) and isinstance(value[key], dict):
            _merge_defaults(value[key], default)
    return value


def _merge_present(value: dict[str, Any], defaults: dict[str, Any]) -> None:
    for key, default in defaults.items():
        if isinstance(default, dict):
            if isinstance(value.get(key), dict):
                _merge_present(value[key], default)
        else:
            value.setdefault(key, default)


def apply_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``spec`` with the CRD's defaults filled in (absent keys only)."""
    result = _merge_defaults(copy.deepcopy(spec or {}), DEFAULTS)
    _merge_present(result, OPTIONAL_DEFAULTS)
    model = result.get("model")
    if isinstance(model, dict) and isinstance(model.get("tokenSecretRef"), dict):
        model["tokenSecretRef"].setdefault("key", SECRET_REF_DEFAULT_KEYS["tokenSecretRef"])
    if isinstance(result.get("apiKeySecretRef"), dict):
        result["apiKeySecretRef"].setdefault("key", SECRET_REF_DEFAULT_KEYS["apiKeySecretRef"])
    return result


def engine_snake_args(engine: dict[str, Any]) -> dict[str, Any]:
    """``spec.engine`` (camelCase keys) -> EngineArgs keyword arguments (snake_case).

    Raises KeyError naming the first unknown key (validation reports them all beforehand).
    """
    return {ENGINE_KEYS[key].name: value for key, value in engine.items()}


# --- model sources ---------------------------------------------------------------------------

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelSourceError(ValueError):
    """``spec.model.source`` is not a supported URI; the message says what is accepted."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the engine finds its weights.

    ``scheme``: ``pvc`` (a PersistentVolumeClaim mounted read-only), ``hf`` (a Hugging Face hub
    repository downloaded into ``HF_HOME``) or ``file`` (a path already inside the container: baked
    into the image). ``claim`` is the PVC name, ``path`` the path inside the claim (pvc), the
    repository id (hf) or the absolute path (file).
    """

    scheme: str
    path: str
    claim: str | None = None

    @property
    def default_served_name(self) -> str:
        """The model name clients use when ``spec.model.name`` is not set."""
        if self.scheme == "hf":
            return self.path
        segments = [s for s in self.path.split("/") if s]
        return segments[-1] if segments else (self.claim or "model")


def parse_model_source(uri: str) -> ModelSource:
    """Parse ``pvc://claim/sub/path``, ``hf://org/name`` or ``file:///abs/path``.

    Raises ModelSourceError with the accepted forms when ``uri`` is none of them.
    """
    forms = "pvc://<claim>[/<path>], hf://<org>/<name> or file:///<absolute path>"
    if not isinstance(uri, str) or "://" not in uri:
        raise ModelSourceError(f"model source {uri!r} is not a URI; use {forms}")
    scheme, rest = uri.split("://", 1)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not _DNS1123_SUBDOMAIN.match(claim) or len(claim) > 253:
            raise ModelSourceError(
                f"model source {uri!r}: {claim!r} is not a valid PersistentVolumeClaim name"
            )
        path = path.strip("/")
        if ".." in path.split("/"):
            raise ModelSourceError(f"model source {uri!r}: the path must not contain '..'")
        return ModelSource("pvc", path, claim)
    if scheme == "hf":
        if not _HF_REPO_ID.match(rest) or ".." in rest:
            raise ModelSourceError(f"model source {uri!r}: {rest!r} is not a Hugging Face repository id")
        return ModelSource("hf", rest)
    if scheme == "file":
        if not rest.startswith("/") or rest == "/":
            raise ModelSourceError(f"model source {uri!r}: file:// needs an absolute path (file:///models/x)")
        if ".." in rest.split("/"):
            raise ModelSourceError(f"model source {uri!r}: the path must not contain '..'")
        return ModelSource("file", rest.rstrip("/"))
    raise ModelSourceError(f"model source {uri!r} has an unsupported scheme {scheme!r}; use {forms}")


# --- quantities and durations ----------------------------------------------------------------

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[a-zA-Z]*)$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity (``64Gi``, ``500m``, ``1e3``, ``2``) as a Decimal.

    Raises ValueError for anything the API server would reject.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a quantity")
    number, suffix = match.groups()
    try:
        base = Decimal(number)
    except InvalidOperation as exc:
        raise ValueError(f"{value!r} is not a quantity") from exc
    if suffix in _BINARY:
        return base * _BINARY[suffix]
    if suffix in _DECIMAL:
        return base * _DECIMAL[suffix]
    if suffix[:1] in "eE" and suffix[1:].lstrip("+-").isdigit():
        return base * (Decimal(10) ** int(suffix[1:]))
    raise ValueError(f"{value!r} has an unknown unit {suffix!r}")


_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|ms|m|s))+$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(value: str) -> float:
    """A Go-style duration (``120s``, ``10m``, ``1h30m``, ``500ms``) in seconds.

    Raises ValueError for anything else (bare numbers included: the unit is required).
    """
    if not isinstance(value, str) or not _DURATION.match(value):
        raise ValueError(f"{value!r} is not a duration such as 120s, 10m or 1h30m")
    return sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(value))
