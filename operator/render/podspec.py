"""The engine pod template: container command and args, model volumes, env, probes, security.

Pure: takes the spec with its defaults applied and the effective engine configuration
(``Settings.spec`` and ``Settings.effective``), returns plain dicts.
The container runs::

    kvpilot serve MODEL --host 0.0.0.0 --port 8000 --served-model-name NAME <engine flags>

where the engine flags come from ``kvpilot.engine.config.to_cli_args``, the same module the
engine's own argument parser is built from, so a rendered flag always parses. With ``spec.runtime:
vllm`` it runs ``vllm serve --model MODEL ...`` instead, flags from ``render.vllm`` (checked against
vLLM's own parser in the tests), the API key in ``VLLM_API_KEY``.
"""

from __future__ import annotations

import math
from typing import Any

from kvpilot.engine.config import to_cli_args
from kvpilot.operator.api import live, names
from kvpilot.operator.api.effective import Effective
from kvpilot.operator.api.runtime import RUNTIME_VLLM
from kvpilot.operator.api.spec import DEFAULTS, ModelSource, engine_snake_args, parse_model_source
from kvpilot.operator.render import vllm

# Probe timing. The startup probe covers the model load (minutes for large checkpoints); once it
# passes, readiness takes a pod out of the Service within ~15 s and liveness restarts a pod whose
# engine loop has been dead for a minute.
PROBE_PERIOD_S = 10
READINESS = {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3}
LIVENESS = {"periodSeconds": 15, "timeoutSeconds": 10, "failureThreshold": 4}
# The user vLLM containers run as (the kvpilot engine image sets a non-root user itself).
VLLM_UID = 1000
# For a manifest from a file whose spec.pod is not an object (the defaults could not be merged in).
_GRACE_DEFAULT = DEFAULTS["pod"]["terminationGracePeriodSeconds"]


def served_model_name(spec: dict[str, Any], source: ModelSource) -> str:
    """The name clients pass as ``model`` (``spec.model.name``, else derived from the source)."""
    return spec["model"].get("name") or source.default_served_name


def model_argument(source: ModelSource) -> str:
    """What ``kvpilot serve`` gets as MODEL: a local directory or a hub repository id."""
    if source.scheme == "pvc":
        return f"{names.MODEL_MOUNT}/{source.path}" if source.path else names.MODEL_MOUNT
    return source.path  # hf: the repository id (resolved into HF_HOME); file: the image path


def gpu_count(spec: dict[str, Any], effective: Effective) -> int:
    """GPUs one pod requests: gpusPerReplica × tensorParallelSize × pipelineParallelSize."""
    per_shard = int(spec["resources"]["gpusPerReplica"])
    tp = int(effective.engine.get("tensorParallelSize", 1))
    pp = int(effective.engine.get("pipelineParallelSize", 1))
    return per_shard * tp * pp


def is_vllm(spec: dict[str, Any]) -> bool:
    """Whether the pods run upstream vLLM (``spec.runtime: vllm``) rather than kvpilot's engine."""
    return spec.get("runtime") == RUNTIME_VLLM


def engine_command(spec: dict[str, Any]) -> list[str]:
    """The container command: ``kvpilot serve`` or ``vllm serve``."""
    return list(vllm.VLLM_COMMAND) if is_vllm(spec) else ["kvpilot", "serve"]


def engine_args(spec: dict[str, Any], effective: Effective) -> list[str]:
    """The container args (after :func:`engine_command`)."""
    source = parse_model_source(spec["model"]["source"])
    # spec.extraArgs last, each one argv entry (validation keeps them off every managed flag).
    extra = [str(arg) for arg in spec.get("extraArgs") or []]
    if is_vllm(spec):
        download_dir = f"{names.HF_HOME}/hub" if source.scheme == "hf" else None
        args = vllm.vllm_args(
            model_argument(source),
            served_model_name(spec, source),
            effective.engine,
            host="0.0.0.0",
            port=names.HTTP_PORT,
            download_dir=download_dir,
        )
        return args + extra
    head = [
        model_argument(source),
        "--host",
        "0.0.0.0",
        "--port",
        str(names.HTTP_PORT),
        "--served-model-name",
        served_model_name(spec, source),
    ]
    # The live values are not in the template (a live change rolls nothing out): each pod reads them
    # from the live-config ConfigMap at start.
    engine = to_cli_args(engine_snake_args(live.startup_engine(spec, effective)))
    return head + engine + [names.LIVE_CONFIG_FLAG, names.LIVE_CONFIG_FILE] + extra


def _secret_env(name: str, ref: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}


def _model_volumes(spec: dict[str, Any], source: ModelSource) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, volumeMounts, env) for the model source."""
    if source.scheme == "pvc":
        volume = {
            "name": names.VOLUME_MODEL,
            "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
        }
        mount = {"name": names.VOLUME_MODEL, "mountPath": names.MODEL_MOUNT, "readOnly": True}
        return [volume], [mount], []
    if source.scheme == "hf":
        cache = spec["model"].get("cache") or {}
        if cache.get("claimName"):
            volume = {
                "name": names.VOLUME_HF_CACHE,
                "persistentVolumeClaim": {"claimName": cache["claimName"]},
            }
        else:
            empty_dir = {"sizeLimit": str(cache["sizeLimit"])} if cache.get("sizeLimit") else {}
            volume = {"name": names.VOLUME_HF_CACHE, "emptyDir": empty_dir}
        mount = {"name": names.VOLUME_HF_CACHE, "mountPath": names.HF_HOME}
        env = [{"name": names.ENV_HF_HOME, "value": names.HF_HOME}]
        if spec["model"].get("tokenSecretRef"):
            env.append(_secret_env(names.ENV_HF_TOKEN, spec["model"]["tokenSecretRef"]))
        return [volume], [mount], env
    return [], [], []  # file://: the weights are part of the image


def _live_config_volumes(spec: dict[str, Any], isvc_name: str) -> list[dict[str, Any]]:
    """The live-config ConfigMap as a volume (runtime kvpilot). Optional: a pod that starts before the
    operator wrote it runs the start-up values."""
    if not live.supports_live(spec):
        return []
    config_map = {"name": names.live_config_name(isvc_name), "optional": True}
    return [{"name": names.VOLUME_LIVE_CONFIG, "configMap": config_map}]


def _live_config_mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    if not live.supports_live(spec):
        return []
    return [{"name": names.VOLUME_LIVE_CONFIG, "mountPath": names.LIVE_CONFIG_MOUNT, "readOnly": True}]


def _resources(spec: dict[str, Any], effective: Effective) -> dict[str, Any]:
    resources = spec["resources"]
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if resources.get("cpu") is not None:
        requests["cpu"] = str(resources["cpu"])  # no CPU limit: throttling a serving loop hurts latency
    if resources.get("memory") is not None:
        requests["memory"] = limits["memory"] = str(resources["memory"])
    gpus = gpu_count(spec, effective)
    if gpus:
        limits[resources["gpuResource"]] = str(gpus)  # extended resources: the request follows the limit
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _probe(**timing: int) -> dict[str, Any]:
    return {"httpGet": {"path": names.HEALTH_PATH, "port": names.HTTP_PORT_NAME}, **timing}


def build_container(spec: dict[str, Any], effective: Effective) -> dict[str, Any]:
    """The ``engine`` container."""
    source = parse_model_source(spec["model"]["source"])
    _, mounts, model_env = _model_volumes(spec, source)
    env = [
        # The root filesystem is read-only: kernel and download caches go to the /tmp volume.
        {"name": "TRITON_CACHE_DIR", "value": f"{names.TMP_MOUNT}/triton"},
        {"name": "XDG_CACHE_HOME", "value": f"{names.TMP_MOUNT}/cache"},
        *model_env,
    ]
    if is_vllm(spec):
        # vLLM's image runs as root by default; the pod runs it as an unprivileged user whose home is
        # the /tmp volume (compile caches, its config directory).
        env.append({"name": "HOME", "value": names.TMP_MOUNT})
    if spec.get("apiKeySecretRef"):
        key_env = vllm.ENV_VLLM_API_KEY if is_vllm(spec) else names.ENV_API_KEY
        env.append(_secret_env(key_env, spec["apiKeySecretRef"]))
    env += [dict(item) for item in spec.get("env") or []]
    startup_timeout = int(spec["probes"]["startupTimeoutSeconds"])
    container: dict[str, Any] = {
        "name": names.ENGINE_CONTAINER,
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": engine_command(spec),
        "args": engine_args(spec, effective),
        "ports": [{"name": names.HTTP_PORT_NAME, "containerPort": names.HTTP_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": _resources(spec, effective),
        "startupProbe": _probe(
            periodSeconds=PROBE_PERIOD_S,
            timeoutSeconds=5,
            failureThreshold=max(1, math.ceil(startup_timeout / PROBE_PERIOD_S)),
        ),
        "readinessProbe": _probe(**READINESS),
        "livenessProbe": _probe(**LIVENESS),
        "volumeMounts": [
            {"name": names.VOLUME_TMP, "mountPath": names.TMP_MOUNT},
            {"name": names.VOLUME_SHM, "mountPath": names.SHM_MOUNT},
            *mounts,
            *_live_config_mounts(spec),
            *(dict(item) for item in spec.get("extraVolumeMounts") or []),
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if is_vllm(spec):
        container["securityContext"].update(runAsUser=VLLM_UID, runAsGroup=VLLM_UID)
    return container


def build_pod_spec(spec: dict[str, Any], effective: Effective, isvc_name: str) -> dict[str, Any]:
    """The pod spec of the engine Deployment's template (``isvc_name``: its InferenceService's name,
    which names the live-config ConfigMap)."""
    source = parse_model_source(spec["model"]["source"])
    volumes, _, _ = _model_volumes(spec, source)
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec["resources"].get("sharedMemory") is not None:
        shm["sizeLimit"] = str(spec["resources"]["sharedMemory"])
    pod = spec.get("pod") or {}
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the engine never talks to the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": int(pod.get("terminationGracePeriodSeconds", _GRACE_DEFAULT)),
        "securityContext": {
            "runAsNonRoot": True,
            "fsGroup": 1000,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [build_container(spec, effective)],
        "volumes": [
            {"name": names.VOLUME_TMP, "emptyDir": {}},
            # NCCL and torch's worker processes exchange tensors through /dev/shm.
            {"name": names.VOLUME_SHM, "emptyDir": shm},
            *volumes,
            *_live_config_volumes(spec, isvc_name),
            *(dict(item) for item in spec.get("extraVolumes") or []),
        ],
    }
    for key in ("serviceAccountName", "priorityClassName", "runtimeClassName", "schedulerName"):
        if pod.get(key):
            pod_spec[key] = pod[key]
    for key in ("nodeSelector", "affinity", "tolerations", "imagePullSecrets", "topologySpreadConstraints"):
        if pod.get(key):
            pod_spec[key] = pod[key]
    return pod_spec
