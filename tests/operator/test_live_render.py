"""Live levers in the rendered children: a live override goes to the live-config ConfigMap (which the
pods apply at start), never into the pod template; a restart lever, a raise above the start-up value,
and every lever of runtime vllm stay in the template. Plus the pure revert of a refused live change."""

from __future__ import annotations

import copy
import json

import pytest

from kvpilot.operator.api import live, names
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.remediation.decision import Change
from kvpilot.operator.remediation.evaluate import EVENT_REVERTED, revert_update
from kvpilot.operator.render.builders import build_children
from tests.operator.crd_schema import schema_errors


def with_override(isvc: dict, field: str, value, spec_value) -> dict:
    isvc = copy.deepcopy(isvc)
    entry = {"value": value, "reason": "storm"}
    if spec_value is not None:
        entry["specValue"] = spec_value
    isvc.setdefault("status", {}).setdefault("effective", {}).setdefault("overrides", {})[field] = entry
    return isvc


def rendered(isvc: dict) -> tuple[dict, dict | None]:
    children = {c["kind"]: c for c in build_children(resolve(isvc))}
    config_map = children.get("ConfigMap")
    values = json.loads(config_map["data"][names.LIVE_CONFIG_KEY]) if config_map else None
    return children["Deployment"], values


def test_a_live_override_changes_the_config_map_not_the_template(make_isvc):
    isvc = make_isvc(engine={"maxNumSeqs": 64, "maxNumBatchedTokens": 4096})
    plain, values = rendered(isvc)
    assert values == {}
    lowered = with_override(isvc, "maxNumSeqs", 30, 64)
    lowered = with_override(lowered, "maxNumBatchedTokens", 2048, 4096)
    deployment, values = rendered(lowered)
    assert values == {"max_num_seqs": 30, "max_num_batched_tokens": 2048}
    assert deployment == plain, "no hash of the ConfigMap's content in the Deployment"
    assert resolve(lowered).effective.engine["maxNumSeqs"] == 30  # what status.effective reports
    # Every pod mounts the ConfigMap where its flag points (optional: one may start before it exists).
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert (
        args[args.index(names.LIVE_CONFIG_FLAG) + 1] == f"{names.LIVE_CONFIG_MOUNT}/{names.LIVE_CONFIG_KEY}"
    )
    assert args[args.index("--max-num-seqs") + 1] == "64"
    (volume,) = [v for v in pod["volumes"] if v["name"] == names.VOLUME_LIVE_CONFIG]
    assert volume["configMap"] == {"name": "llama-live-config", "optional": True}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == names.VOLUME_LIVE_CONFIG]
    assert mount["mountPath"] == names.LIVE_CONFIG_MOUNT and mount["readOnly"] is True


def test_a_live_override_of_an_engine_derived_bound_leaves_the_flag_unset(make_isvc):
    isvc = make_isvc(engine={"maxNumSeqs": 64})
    plain, _ = rendered(isvc)
    deployment, values = rendered(with_override(isvc, "maxNumBatchedTokens", 3072, None))
    assert values == {"max_num_batched_tokens": 3072}
    assert deployment == plain
    assert "--max-num-batched-tokens" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    ("field", "value", "spec_value", "flag", "shown"),
    [
        ("gpuMemoryUtilization", 0.95, 0.9, "--gpu-memory-utilization", "0.95"),  # a restart lever
        ("maxNumSeqs", 96, 64, "--max-num-seqs", "96"),  # above the start-up value: the engine refuses live
    ],
)
def test_rollout_levers_stay_in_the_template(make_isvc, field, value, spec_value, flag, shown):
    isvc = make_isvc(engine={"maxNumSeqs": 64, "gpuMemoryUtilization": 0.9})
    plain, _ = rendered(isvc)
    changed = with_override(isvc, field, value, spec_value)
    deployment, values = rendered(changed)
    assert values == {}
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index(flag) + 1] == shown
    assert deployment["spec"]["template"] != plain["spec"]["template"]
    assert live.applied_by(resolve(changed).spec, field, value) == live.ROLLOUT


def test_vllm_has_no_live_levers(make_isvc):
    isvc = make_isvc({"spec.runtime": "vllm"}, engine={"maxNumSeqs": 64})
    assert not live.supports_live(resolve(isvc).spec)
    deployment, values = rendered(with_override(isvc, "maxNumSeqs", 30, 64))
    assert values is None, "no ConfigMap for vLLM"
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "30" and names.LIVE_CONFIG_FLAG not in args
    pod = deployment["spec"]["template"]["spec"]
    assert names.VOLUME_LIVE_CONFIG not in {v["name"] for v in pod["volumes"]}
    assert live.applied_by(resolve(isvc).spec, "maxNumSeqs", 30) == live.ROLLOUT


def test_the_user_edit_wins_over_a_live_override(make_isvc):
    isvc = with_override(make_isvc(engine={"maxNumSeqs": 64}), "maxNumSeqs", 30, 64)
    isvc["spec"]["engine"]["maxNumSeqs"] = 48
    deployment, values = rendered(isvc)
    assert values == {}
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "48"


def test_a_refused_live_change_reverts_in_one_status_patch(make_isvc, crd_schema):
    isvc = make_isvc(engine={"maxNumSeqs": 64})
    change = Change(1_000.0, "lowerMaxNumSeqs", "maxNumSeqs", 64, 30, "storm", 1, live.LIVE)
    isvc = with_override(isvc, "maxNumSeqs", 30, 64)
    isvc["status"]["remediations"] = [change.to_status()]
    assert schema_errors(isvc, crd_schema) == []
    update = revert_update(resolve(isvc), change, "pod-a: refused: HTTP 400", 1_010.0)
    revert, first = update.patch["remediations"]
    assert first == change.to_status()
    assert (revert["lever"], revert["field"], revert["from"], revert["to"], revert["appliedBy"]) == (
        "revert",
        "maxNumSeqs",
        30,
        64,
        "live",
    )
    assert revert["generation"] == 1 and "pod-a: refused: HTTP 400" in revert["reason"]
    assert update.patch["effective"] == {"overrides": {"maxNumSeqs": None}}  # back to the spec's value
    ((type_, reason, _),) = update.events
    assert (type_, reason) == ("Warning", EVENT_REVERTED)
    isvc["status"]["remediations"] = update.patch["remediations"]
    isvc["status"]["effective"]["overrides"] = {}
    assert schema_errors(isvc, crd_schema) == []
    assert rendered(isvc)[1] == {}
    assert Change.from_status(revert).applied_by == "live"


def test_a_live_change_is_recorded_as_live(make_isvc):
    spec = resolve(make_isvc(engine={"maxNumSeqs": 64})).spec
    assert live.applied_by(spec, "maxNumSeqs", 30) == live.LIVE
    assert live.applied_by(spec, "maxNumSeqs", 64) == live.LIVE  # back up to the start-up value
    assert live.applied_by(spec, "replicas", 3) == live.ROLLOUT


def test_the_values_in_force_and_what_counts_as_a_pod_that_missed_them(make_isvc):
    from kvpilot.operator.remediation.loop import _drifted

    isvc = make_isvc({"spec.engine.maxNumSeqs": 64, "spec.engine.maxNumBatchedTokens": 4096})
    settings = resolve(with_override(isvc, "maxNumSeqs", 30, 64))
    assert live.in_force(settings.spec, settings.effective) == {
        "max_num_seqs": 30,
        "max_num_batched_tokens": 4096,
    }
    assert live.live_values(settings.spec, settings.effective) == {"max_num_seqs": 30}
    # A live value must be reported exactly; a start-up value only not undercut (the engine may round
    # it up; only a live change lowers it).
    assert _drifted("64", 30, live=True) and _drifted("20", 30, live=True) and not _drifted("30", 30, True)
    assert _drifted("2048", 4096, live=False) and not _drifted("4352", 4096, live=False)
    assert not _drifted("None", 4096, live=False) and not _drifted(None, 30, live=True)
    # An engine-derived bound (unset, no override) is not compared at all; vLLM and liveLevers: false
    # have no values in force to correct.
    unset = resolve(make_isvc({"spec.engine.maxNumSeqs": 64}))
    assert live.in_force(unset.spec, unset.effective) == {"max_num_seqs": 64}
    for changes in ({"spec.runtime": "vllm"}, {"spec.remediation.liveLevers": False}):
        other = resolve(make_isvc({"spec.engine.maxNumSeqs": 64, **changes}))
        assert live.in_force(other.spec, other.effective) == {}
