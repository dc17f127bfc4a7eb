"""The InferenceService CRD: structure, descriptions, engine keys, defaults, printer columns, copies."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import re
from typing import Any

import jsonschema
import pytest
import yaml

from kvpilot.engine import config as engine_config
from kvpilot.operator.api import names
from kvpilot.operator.api.effective import LEVERS
from kvpilot.operator.api.settings import Limits, PlanSettings, RemediationSettings, resolve
from kvpilot.operator.api.spec import DEFAULTS, ENGINE_KEYS, NOT_PER_POD, apply_defaults, parse_duration
from kvpilot.operator.reconcile.status import OWNED_EFFECTIVE_KEYS, desired_status
from tests.operator.conftest import CHART, CRD_PATH
from tests.operator.crd_schema import apply_schema_defaults, schema_errors

SCHEMA_TYPES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string"}
ENUMS = {
    "preemptionMode": engine_config.PREEMPTION_MODES,
    "dtype": engine_config.DTYPES,
    "device": engine_config.DEVICES,
    "attentionBackend": engine_config.ATTENTION_BACKENDS,
}


def walk(schema: dict[str, Any], path: str = ""):
    """Yield (path, node) for every property node of a schema."""
    for key, prop in (schema.get("properties") or {}).items():
        yield f"{path}.{key}" if path else key, prop
        yield from walk(prop, f"{path}.{key}" if path else key)
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")


def test_names_scope_and_subresources(crd):
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{names.PLURAL}.{names.GROUP}"
    assert (spec["group"], spec["scope"]) == (names.GROUP, "Namespaced")
    assert spec["names"]["kind"] == names.KIND
    assert spec["names"]["plural"] == names.PLURAL
    assert spec["names"]["shortNames"] == [names.SHORT_NAME]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (names.VERSION, True, True)
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_every_field_is_described_and_typed(crd_schema):
    undocumented = [p for p, node in walk(crd_schema) if p != "metadata" and not node.get("description")]
    assert undocumented == []
    # A structural schema: every node has a type, or is int-or-string / free-form by declaration.
    untyped = [
        p for p, node in walk(crd_schema) if "type" not in node and not node.get("x-kubernetes-int-or-string")
    ]
    assert untyped == []
    # YAML 1.1 reads unquoted Off/On/Yes/No as booleans: string enums must hold strings only.
    bad_enums = [
        p
        for p, node in walk(crd_schema)
        if node.get("type") == "string" and not all(isinstance(v, str) for v in node.get("enum", []))
    ]
    assert bad_enums == []


def test_engine_keys_are_exactly_the_per_pod_engine_arguments(crd_schema):
    engine = crd_schema["properties"]["spec"]["properties"]["engine"]["properties"]
    fields = {f.name: f for f in engine_config.engine_arg_fields()}
    # Every CRD key is an EngineArgs field, and every per-pod field is in the CRD.
    assert {key: fields[ENGINE_KEYS[key].name].name for key in engine} == {
        engine_config.crd_key(name): name for name in fields if name not in NOT_PER_POD
    }
    for key, node in engine.items():
        field = fields[ENGINE_KEYS[key].name]
        base = str(field.type).split("|")[0].strip()
        assert node["type"] == SCHEMA_TYPES[base], key
        assert "default" not in node, f"{key}: the engine owns its defaults"
        if key in ENUMS:
            assert tuple(node["enum"]) == ENUMS[key], key
    assert engine_config.flag_name("max_num_seqs") == "--max-num-seqs"


@pytest.mark.parametrize(
    "spec",
    [
        {"model": {"source": "pvc://m/x"}, "image": "i"},
        {
            "model": {"source": "hf://org/name", "tokenSecretRef": {"name": "hf"}},
            "image": "i",
            "apiKeySecretRef": {"name": "k"},
            "resources": {"cpu": "4"},
            "remediation": {"mode": "Auto", "limits": {"maxReplicas": 3}},
            "monitoring": {"serviceMonitor": {"enabled": True}},
        },
    ],
)
def test_python_defaults_equal_the_crd_defaults(crd_schema, spec):
    as_written = copy.deepcopy(spec)
    by_api_server = apply_schema_defaults(copy.deepcopy({"spec": spec}), crd_schema)["spec"]
    defaulted = apply_defaults(spec)
    assert defaulted == by_api_server
    assert spec == as_written  # apply_defaults never mutates its input...
    defaulted["remediation"]["limits"]["maxReplicas"] = -1
    defaulted["model"]["source"] = "changed"
    assert spec == as_written  # ...nor shares nested objects with its result
    assert set(DEFAULTS) <= set(crd_schema["properties"]["spec"]["properties"])


def test_remediation_settings_take_the_crd_defaults_and_have_none_of_their_own(crd_schema):
    spec = {"model": {"source": "pvc://m/x"}, "image": "i"}
    isvc = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "x"}, "spec": spec}
    crd = apply_schema_defaults({"spec": spec}, crd_schema)["spec"]["remediation"]
    settings = resolve(isvc).remediation
    assert (settings.mode, settings.preemption_rate) == (crd["mode"], crd["preemptionRate"])
    assert (settings.window_s, settings.cooldown_s) == (
        parse_duration(crd["window"]),
        parse_duration(crd["cooldown"]),
    )
    snake = {key: re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower() for key in crd["limits"]}
    assert {snake[k]: v for k, v in crd["limits"].items()} == dataclasses.asdict(settings.limits)
    thresholds = crd["thresholds"]
    assert (settings.kv_usage_high, settings.waiting_high, settings.kv_usage_idle) == (
        thresholds["kvCacheUsageHigh"],
        thresholds["requestsWaitingHigh"],
        thresholds["kvCacheUsageIdle"],
    )
    assert settings.live is crd["liveLevers"] is True
    plan = crd["plan"]
    assert dataclasses.asdict(settings.plan) == {
        "enabled": plan["enabled"],
        "max_prediction_error": plan["maxPredictionError"],
        "min_requests": plan["minRequests"],
        "lookback_s": parse_duration(plan["lookback"]),
    }
    # One table of defaults (spec.DEFAULTS, checked against the CRD above): the typed settings add none.
    for cls in (RemediationSettings, Limits, PlanSettings):
        assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(cls)), cls


def test_printer_columns_answer_the_first_questions(crd, crd_schema):
    columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "Runtime": ".spec.runtime",
        "Ready": ".status.readyReplicas",
        "Replicas": ".status.effective.replicas",
        "MemFrac": ".status.effective.gpuMemoryUtilization",
        "MaxSeqs": ".status.effective.maxNumSeqs",
        "Preempt/s": ".status.signals.preemptionsPerSecond",
        "KVUsage": ".status.signals.kvCacheUsage",
        "Model": ".spec.model.source",
        "Age": ".metadata.creationTimestamp",
    }
    for path in columns.values():  # every column points at a declared field
        if path.startswith(".metadata."):
            continue
        node = crd_schema
        for key in path.strip(".").split(".")[:-1]:
            node = node["properties"][key]
        assert path.rsplit(".", 1)[1] in node["properties"], path


def test_status_the_operator_writes_fits_the_status_schema(crd_schema, make_isvc):
    isvc = make_isvc()
    isvc["status"] = {
        "effective": {"overrides": {"maxNumSeqs": {"value": 64, "specValue": 128, "reason": "storm"}}}
    }
    deployment = {
        "metadata": {"generation": 2},
        "status": {
            "observedGeneration": 2,
            "replicas": 2,
            "readyReplicas": 2,
            "availableReplicas": 2,
            "updatedReplicas": 2,
        },
    }
    now = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    status = desired_status(isvc, resolve(isvc).effective, deployment, [], "a=b", now)
    status["effective"]["overrides"] = isvc["status"]["effective"]["overrides"]
    jsonschema.Draft4Validator(crd_schema["properties"]["status"]).validate(status)
    assert status["phase"] == "Ready"
    assert status["effective"]["maxNumSeqs"] == 64
    effective_schema = crd_schema["properties"]["status"]["properties"]["effective"]["properties"]
    assert set(OWNED_EFFECTIVE_KEYS) | {"overrides"} == set(effective_schema)
    assert set(effective_schema["overrides"]["properties"]) == set(LEVERS)


def test_whole_object_with_status_validates(crd_schema, make_isvc):
    isvc = make_isvc()
    for key in ("uid", "generation"):
        isvc["metadata"].pop(key)
    deployment = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 1}}
    now = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    isvc["status"] = desired_status(isvc, resolve(isvc).effective, deployment, [], "a=b", now)
    assert {"phase", "effective", "conditions"} <= set(isvc["status"])
    assert schema_errors(isvc, crd_schema) == []
    isvc["status"]["phase"] = 7  # the status is validated too, so a wrong type in it is caught
    assert schema_errors(isvc, crd_schema) != []


def test_chart_carries_an_identical_copy_of_the_crd():
    assert (CHART / "files" / "crds" / "inferenceservice.yaml").read_bytes() == CRD_PATH.read_bytes()
    assert yaml.safe_load(CRD_PATH.read_text())["kind"] == "CustomResourceDefinition"
