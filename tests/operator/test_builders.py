"""Pure manifest builders: table tests on the children, and every child valid for Kubernetes."""

from __future__ import annotations

import argparse
import re

import kubernetes_validate
import pytest

from kvpilot.engine.config import EngineArgs, engine_arg_fields, flag_name
from kvpilot.operator.api import names
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.spec import ENGINE_KEYS
from kvpilot.operator.render.builders import (
    build_children,
    build_deployment,
    build_pdb,
    build_service,
    content_hash,
    selector_string,
)
from kvpilot.operator.render.podspec import gpu_count
from tests.operator.conftest import K8S_VERSION
from tests.operator.crd_schema import schema_errors


def children_of(isvc):
    return {c["kind"]: c for c in build_children(resolve(isvc))}


def engine_container(isvc):
    deployment = build_deployment(resolve(isvc))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def serve_parser() -> argparse.ArgumentParser:
    """A parser with ``kvpilot serve``'s engine flags, built from the same config module."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--live-config-file")
    casts = {"int": int, "float": float, "str": str}
    for f in engine_arg_fields():
        base = str(f.type).split("|")[0].strip()
        if base == "bool":
            parser.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag_name(f.name), type=casts[base])
    return parser


@pytest.mark.parametrize(
    ("source", "model_arg", "volume", "mount", "env"),
    [
        (
            "pvc://models/llama-3.1-8b",
            "/mnt/models/llama-3.1-8b",
            {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            {"name": "model", "mountPath": "/mnt/models", "readOnly": True},
            {},
        ),
        (
            "pvc://weights",
            "/mnt/models",
            {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
            {"name": "model", "mountPath": "/mnt/models", "readOnly": True},
            {},
        ),
        (
            "hf://meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Llama-3.1-8B-Instruct",
            {"name": "hf-cache", "emptyDir": {}},
            {"name": "hf-cache", "mountPath": "/var/cache/huggingface"},
            {"HF_HOME": "/var/cache/huggingface"},
        ),
        ("file:///models/llama", "/models/llama", None, None, {}),
    ],
)
def test_model_sources(make_isvc, source, model_arg, volume, mount, env):
    deployment, container = engine_container(make_isvc({"spec.model.source": source}))
    pod = deployment["spec"]["template"]["spec"]
    assert container["command"] == ["kvpilot", "serve"]
    assert container["args"][0] == model_arg
    model_volumes = [v for v in pod["volumes"] if v["name"] in ("model", "hf-cache")]
    model_mounts = [m for m in container["volumeMounts"] if m["name"] in ("model", "hf-cache")]
    assert model_volumes == ([volume] if volume else [])
    assert model_mounts == ([mount] if mount else [])
    plain_env = {e["name"]: e.get("value") for e in container["env"] if "value" in e}
    assert {k: plain_env[k] for k in env} == env
    assert ("HF_HOME" in plain_env) == source.startswith("hf://")


def test_hf_cache_pvc_and_token_and_api_key_secrets(make_isvc):
    isvc = make_isvc(
        {
            "spec.model": {
                "source": "hf://org/model",
                "cache": {"claimName": "hf-cache"},
                "tokenSecretRef": {"name": "hf"},
            },
            "spec.apiKeySecretRef": {"name": "api", "key": "k"},
        }
    )
    deployment, container = engine_container(isvc)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["hf-cache"] == {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    assert secrets == {
        "HF_TOKEN": {"name": "hf", "key": "token"},
        "KVPILOT_API_KEY": {"name": "api", "key": "k"},
    }


def test_args_are_the_served_name_and_the_effective_engine_flags(make_isvc):
    isvc = make_isvc(
        {"spec.model.name": "llama-8b"},
        engine={"maxNumSeqs": 64, "enablePrefixCaching": False, "preemptionMode": "swap", "swapSpace": 8},
    )
    _, container = engine_container(isvc)
    assert container["args"] == [
        "/mnt/models/llama-3.1-8b",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "llama-8b",
        "--max-num-seqs",
        "64",
        "--no-enable-prefix-caching",
        "--preemption-mode",
        "swap",
        "--swap-space",
        "8",
        "--live-config-file",
        "/etc/kvpilot-live/live-config.json",
    ]
    parsed = serve_parser().parse_args(container["args"])
    assert (parsed.max_num_seqs, parsed.enable_prefix_caching, parsed.swap_space) == (64, False, 8.0)
    # The rendered flags build a valid EngineArgs that holds exactly the values the spec asked for.
    rendered = {f.name: getattr(parsed, f.name) for f in engine_arg_fields()}
    given = {name: value for name, value in rendered.items() if value is not None}
    args = EngineArgs(**given)
    assert given == {
        "model": "/mnt/models/llama-3.1-8b",
        "max_num_seqs": 64,
        "enable_prefix_caching": False,
        "preemption_mode": "swap",
        "swap_space": 8,
    }
    assert (args.max_num_seqs, args.enable_prefix_caching, args.preemption_mode, args.swap_space) == (
        64,
        False,
        "swap",
        8.0,
    )


def test_every_engine_key_renders_a_flag_the_engine_parses(make_isvc):
    engine = {
        "blockSize": 32,
        "gpuMemoryUtilization": 0.85,
        "kvCacheMemoryBytes": 2**30,
        "numGpuBlocksOverride": 512,
        "cpuMemoryBudgetBytes": 2**33,
        "maxNumSeqs": 32,
        "maxNumBatchedTokens": 4096,
        "maxModelLen": 4096,
        "enableChunkedPrefill": True,
        "enablePrefixCaching": True,
        "preemptionMode": "recompute",
        "swapSpace": 2,
        "tensorParallelSize": 2,
        "pipelineParallelSize": 1,
        "pipelineMicroBatches": 2,
        "distributedTimeoutS": 120.0,
        "dtype": "bfloat16",
        "kvCacheDtype": "bfloat16",
        "device": "cuda",
        "attentionBackend": "triton",
        "seed": 7,
    }
    _, container = engine_container(make_isvc(engine=engine))
    parsed = vars(serve_parser().parse_args(container["args"]))
    assert set(engine) == set(ENGINE_KEYS), "extend this table when the engine gains an argument"
    assert {key: parsed[ENGINE_KEYS[key].name] for key in engine} == engine


@pytest.mark.parametrize(
    ("resources", "engine", "gpus"),
    [
        ({}, {}, 1),
        ({"gpusPerReplica": 1}, {"tensorParallelSize": 4}, 4),
        ({"gpusPerReplica": 2}, {"tensorParallelSize": 2, "pipelineParallelSize": 2}, 8),
        ({"gpusPerReplica": 0}, {"device": "cpu"}, 0),
    ],
)
def test_gpu_limit_is_per_shard_times_tp_times_pp(make_isvc, resources, engine, gpus):
    isvc = make_isvc(resources=resources, engine=engine)
    _, container = engine_container(isvc)
    assert gpu_count(resolve(isvc).spec, resolve(isvc).effective) == gpus
    assert container["resources"].get("limits", {}).get("nvidia.com/gpu") == (str(gpus) if gpus else None)


def test_resources_probes_security_and_rollout(make_isvc):
    isvc = make_isvc(
        resources={"cpu": "8", "memory": "64Gi", "gpuResource": "amd.com/gpu", "sharedMemory": "8Gi"}
    )
    deployment, container = engine_container(isvc)
    pod = deployment["spec"]["template"]["spec"]
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "64Gi", "amd.com/gpu": "1"},
    }
    # 1800 s of model loading before the first restart; then readiness and liveness on /health.
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] == 1800
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert deployment["spec"]["progressDeadlineSeconds"] > 1800
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == ("8000", "/metrics")


def test_scheduling_fields_pass_through(make_isvc):
    pod_spec = {
        "nodeSelector": {"gpu": "l40s"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "inference",
        "runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "regcred"}],
        "labels": {"team": "ml", names.LABEL_ISVC: "hijack"},
        "terminationGracePeriodSeconds": 30,
    }
    deployment, _ = engine_container(make_isvc(pod=pod_spec))
    template = deployment["spec"]["template"]
    for key in ("nodeSelector", "tolerations", "priorityClassName", "runtimeClassName", "imagePullSecrets"):
        assert template["spec"][key] == pod_spec[key]
    assert template["spec"]["terminationGracePeriodSeconds"] == 30
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"][names.LABEL_ISVC] == "llama"  # the selector cannot be hijacked


def test_labels_selectors_and_owner_references(make_isvc):
    isvc = make_isvc()
    children = children_of(isvc)
    assert sorted(children) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]
    selector = {names.LABEL_ISVC: "llama", names.LABEL_COMPONENT: "engine"}
    for child in children.values():
        expected = "llama-live-config" if child["kind"] == "ConfigMap" else "llama"
        assert child["metadata"]["name"] == expected and child["metadata"]["namespace"] == "llm"
        assert child["metadata"]["labels"][names.LABEL_MANAGED_BY] == names.MANAGED_BY
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "serving.kvpilot.io/v1alpha1",
                "kind": "InferenceService",
                "name": "llama",
                "uid": isvc["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    assert children["Deployment"]["spec"]["selector"] == {"matchLabels": selector}
    template_labels = children["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert children["Service"]["spec"]["selector"] == selector
    assert children["Service"]["spec"]["ports"][0]["name"] == "http"
    assert children["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": selector},
    }
    assert (
        selector_string(isvc)
        == "app.kubernetes.io/component=engine,serving.kvpilot.io/inferenceservice=llama"
    )


def test_without_uid_there_is_no_owner_reference(make_isvc):
    isvc = make_isvc({"metadata.uid": make_isvc.DELETE})
    assert all("ownerReferences" not in c["metadata"] for c in build_children(resolve(isvc)))


def test_hashes_are_stable_and_follow_every_change(make_isvc):
    def hashes(isvc):
        deployment = build_deployment(resolve(isvc))
        return (
            deployment["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH],
            deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH],
        )

    base = hashes(make_isvc())
    assert hashes(make_isvc()) == base
    config_only = hashes(make_isvc(replicas=5))
    assert config_only[0] != base[0] and config_only[1] == base[1]  # scaling is not a new template
    new_args = hashes(make_isvc(engine={"maxNumSeqs": 64}))
    assert new_args[0] != base[0] and new_args[1] != base[1]
    service = build_service(make_isvc())
    assert service["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH] != base[0]
    assert content_hash({"a": 1, "b": 2}) == content_hash({"b": 2, "a": 1})


def test_service_monitor_only_when_enabled(make_isvc):
    assert "ServiceMonitor" not in children_of(make_isvc())
    isvc = make_isvc(
        monitoring={"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}}
    )
    monitor = children_of(isvc)["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
@pytest.mark.parametrize(
    "spec",
    [
        {},
        {
            "model": {
                "source": "hf://org/m",
                "cache": {"sizeLimit": "50Gi"},
                "tokenSecretRef": {"name": "hf"},
            },
            "apiKeySecretRef": {"name": "k"},
            "env": [{"name": "LOG_LEVEL", "value": "debug"}],
            "resources": {"cpu": "500m", "memory": "32Gi", "sharedMemory": "1Gi"},
            "pod": {
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "affinity": {"nodeAffinity": {}},
                "imagePullSecrets": [{"name": "regcred"}],
                "serviceAccountName": "engine",
            },
            "rollout": {"maxSurge": "25%", "maxUnavailable": 0},
        },
        {
            "model": {"source": "file:///models/x"},
            "replicas": 0,
            "resources": {"gpusPerReplica": 0},
            "engine": {"device": "cpu"},
        },
    ],
)
def test_every_child_is_a_valid_kubernetes_object(make_isvc, spec, version):
    isvc = make_isvc(**spec)
    for child in build_children(resolve(isvc)):
        kubernetes_validate.validate(child, version, strict=True)  # raises ValidationError


def test_pdb_and_service_ignore_engine_changes(make_isvc):
    a, b = make_isvc(), make_isvc(engine={"maxNumSeqs": 8})
    assert build_pdb(a) == build_pdb(b)
    assert build_service(a) == build_service(b)


EXTRAS = {
    "extraArgs": ["--log-level=debug", "--disable-access-log", "--chat-template=/etc/kvpilot/chat.jinja"],
    "extraVolumes": [{"name": "chat", "configMap": {"name": "llama-chat-template"}}],
    "extraVolumeMounts": [{"name": "chat", "mountPath": "/etc/kvpilot", "readOnly": True}],
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
}


def test_engine_pod_extras_are_appended_after_the_managed_ones(make_isvc, crd_schema):
    isvc = make_isvc(**EXTRAS)
    assert schema_errors(isvc, crd_schema) == []
    deployment, container = engine_container(isvc)
    plain_deployment, plain = engine_container(make_isvc())
    # Extra flags come last, one argv entry each, after every flag the operator renders.
    assert container["args"] == plain["args"] + EXTRAS["extraArgs"]
    assert container["command"] == ["kvpilot", "serve"]  # exec form: no shell reads the args
    known, unknown = serve_parser().parse_known_args(container["args"])
    assert unknown == EXTRAS["extraArgs"] and known.max_num_seqs == 128
    assert container["volumeMounts"] == plain["volumeMounts"] + EXTRAS["extraVolumeMounts"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["volumes"] == plain_deployment["spec"]["template"]["spec"]["volumes"] + EXTRAS["extraVolumes"]
    assert container["env"][-1] == {"name": "NCCL_DEBUG", "value": "INFO"}
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)  # raises ValidationError
    # The pod template changes, so the hash that triggers a rollout does too.
    assert content_hash(deployment) != content_hash(plain_deployment)


def mount_at(path: str) -> dict:
    return {
        "extraVolumes": [{"name": "a", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "a", "mountPath": path}],
    }


MANAGED_FLAG = "spec.extraArgs[0] --max-num-seqs is set by the operator: use spec.engine.maxNumSeqs"


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ({"extraArgs": ["--max-num-seqs=8"]}, MANAGED_FLAG),
        ({"extraArgs": ["--no-enable-prefix-caching"]}, "use spec.engine.enablePrefixCaching"),
        ({"extraArgs": ["--port=9000"]}, "spec.extraArgs[0] --port is set by the operator"),
        ({"extraArgs": ["--api-key=x"]}, "use spec.apiKeySecretRef"),
        ({"extraArgs": ["--served-model-name=other"]}, "use spec.model.name"),
        ({"extraArgs": ["--log-level", "debug"]}, "spec.extraArgs[1] 'debug' is not a flag"),
        ({"extraArgs": ["/models/other"]}, "spec.extraArgs[0] '/models/other' is not a flag"),
        ({"extraArgs": ["-p=1"]}, "is not a flag"),
        ({"extraArgs": ["--x=a; rm -rf /\n--port=1"]}, "no control characters"),
        ({"extraArgs": ["--chat-template=$(HF_TOKEN)"]}, "the kubelet expands $(VAR)"),
        ({"extraVolumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.extraVolumes[0].name tmp is one of"),
        ({"extraVolumes": [{"name": "a", "emptyDir": {}}] * 2}, "declared twice"),
        ({"extraVolumes": [{"name": "a"}]}, "names no volume source"),
        ({"extraVolumes": [{"name": "Bad_Name", "emptyDir": {}}]}, "must be a DNS-1123 label"),
        (
            {"extraVolumeMounts": [{"name": "model", "mountPath": "/opt"}]},
            "'model' is not one of spec.extraVolumes",
        ),
        (
            mount_at("/mnt/models/x"),
            "spec.extraVolumeMounts[0].mountPath /mnt/models/x overlaps the operator's",
        ),
        (mount_at("/var/cache/"), "overlaps the operator's mount /var/cache/huggingface"),
        (mount_at("/dev/shm"), "overlaps the operator's mount /dev/shm"),
        (mount_at("/etc/../tmp"), "without '..'"),
        (mount_at("/"), "must be an absolute path below /"),
    ],
)
def test_engine_pod_extras_cannot_override_managed_fields(make_isvc, extras, message):
    settings = resolve(make_isvc(**extras))
    assert not settings.spec_is_valid
    assert any(message in problem for problem in settings.problems), settings.problems


def test_extra_args_the_crd_admits_are_the_ones_validation_admits(crd_schema, make_isvc):
    """The CRD's pattern and the operator's check agree on what a flag looks like."""
    item = crd_schema["properties"]["spec"]["properties"]["extraArgs"]["items"]
    pattern = re.compile(item["pattern"])
    for arg in [
        "--log-level=debug",
        "--x",
        "--a-b=c=d",
        "-x",
        "--",
        "--X",
        "value",
        "--ok=a\nb",
        "--a=$$(b)",
    ]:
        by_schema = bool(pattern.search(arg))
        by_operator = resolve(make_isvc(extraArgs=[arg])).spec_is_valid
        assert by_schema == by_operator, arg
