"""Names that cross module boundaries: the API group, labels, annotations, ports.

Every other operator module imports its constants from here, so a label key or a port number
is spelled exactly once.
"""

from __future__ import annotations

GROUP = "serving.kvpilot.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SHORT_NAME = "kvisvc"

# The server-side-apply field manager: the owner of every field the operator writes.
FIELD_MANAGER = "kvpilot-operator"

# Labels on every child object (the recommended app.kubernetes.io set plus our own).
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ISVC = f"{GROUP}/inferenceservice"
# On engine pods only: which rendering of the pod template a pod runs (metrics of pods with an
# outdated hash describe the previous configuration and must not drive remediation).
LABEL_TEMPLATE_HASH = f"{GROUP}/template-hash"

ENGINE_NAME = "kvpilot-engine"
COMPONENT = "engine"
MANAGED_BY = "kvpilot-operator"


def live_config_name(isvc_name: str) -> str:
    """The ConfigMap holding an InferenceService's live configuration (runtime kvpilot)."""
    return f"{isvc_name}-live-config"


# On every child: a hash of the desired manifest; an unchanged hash means nothing to write.
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"

# On an InferenceService at zero replicas: when a request began waiting for it at a front door
# (RFC 3339). Remediation wakes the service (addReplica 0 -> 1) for a request newer than its last change.
ANNOTATION_WAKE = f"{GROUP}/wake-requested-at"

# kopf keeps its bookkeeping (last handled spec, retry state) in annotations under this prefix.
KOPF_PREFIX = GROUP

ENGINE_CONTAINER = "engine"
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"

# Mount points inside the engine container.
MODEL_MOUNT = "/mnt/models"
HF_HOME = "/var/cache/huggingface"
TMP_MOUNT = "/tmp"
SHM_MOUNT = "/dev/shm"
# The live configuration (runtime kvpilot): the run-time engine settings in force, which an engine pod
# applies at start (``kvpilot serve --live-config-file``). A ConfigMap of the operator's, one per
# InferenceService; its content never enters the pod template, so a live change rolls nothing out.
LIVE_CONFIG_MOUNT = "/etc/kvpilot-live"
LIVE_CONFIG_KEY = "live-config.json"
LIVE_CONFIG_FILE = f"{LIVE_CONFIG_MOUNT}/{LIVE_CONFIG_KEY}"
LIVE_CONFIG_FLAG = "--live-config-file"
ADMIN_CONFIG_PATH = "/admin/config"
MANAGED_MOUNTS = (TMP_MOUNT, SHM_MOUNT, MODEL_MOUNT, HF_HOME, LIVE_CONFIG_MOUNT)
# Volumes of the engine pod the operator manages (spec.extraVolumes cannot replace them).
VOLUME_TMP = "tmp"
VOLUME_SHM = "dshm"
VOLUME_MODEL = "model"
VOLUME_HF_CACHE = "hf-cache"
VOLUME_LIVE_CONFIG = "live-config"
MANAGED_VOLUMES = frozenset({VOLUME_TMP, VOLUME_SHM, VOLUME_MODEL, VOLUME_HF_CACHE, VOLUME_LIVE_CONFIG})
# Server flags of `kvpilot serve` the operator sets (spec.extraArgs cannot repeat them); every engine
# argument's flag is managed too, through spec.engine.
MANAGED_SERVER_FLAGS = frozenset({"--host", "--port", "--served-model-name", "--api-key", LIVE_CONFIG_FLAG})

# Environment variables the engine reads.
ENV_HF_HOME = "HF_HOME"
ENV_HF_TOKEN = "HF_TOKEN"
ENV_API_KEY = "KVPILOT_API_KEY"
ENV_VLLM_API_KEY = "VLLM_API_KEY"  # the same for runtime vllm
MANAGED_ENV = frozenset(
    {ENV_HF_HOME, ENV_HF_TOKEN, ENV_API_KEY, ENV_VLLM_API_KEY, "TRITON_CACHE_DIR", "XDG_CACHE_HOME"}
)
# Set by the operator in vLLM containers only (an unprivileged user's home on the /tmp volume).
MANAGED_ENV_VLLM = MANAGED_ENV | {"HOME"}
