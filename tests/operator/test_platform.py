"""The operator's own configuration: the default engine image (``spec.image`` only overrides) and the
optional allowlists of image registries and service accounts (``SpecValid=False`` outside them)."""

from __future__ import annotations

import argparse
import copy

import pytest
import yaml

from kvpilot.cli import main
from kvpilot.operator.api.platform import DEFAULT_ENGINE_IMAGE, Platform, image_registry
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.cli import platform_from
from kvpilot.operator.render.builders import build_deployment
from tests.operator.test_policy import ISVC


def without_image() -> dict:
    obj = copy.deepcopy(ISVC)
    del obj["spec"]["image"]
    return obj


def engine_image(settings) -> str:
    return build_deployment(settings)["spec"]["template"]["spec"]["containers"][0]["image"]


def test_an_unset_image_is_the_operators_default_and_spec_image_overrides():
    assert resolve(without_image()).is_valid
    assert engine_image(resolve(without_image())) == DEFAULT_ENGINE_IMAGE
    assert DEFAULT_ENGINE_IMAGE == "ghcr.io/kvpilot/engine:0.1.0"  # the image built for this version
    platform = Platform(default_image="registry.corp/llm/engine:7")
    assert engine_image(resolve(without_image(), platform)) == "registry.corp/llm/engine:7"
    assert engine_image(resolve(copy.deepcopy(ISVC), platform)) == "engine:1"
    assert "spec.image must name" in resolve({**ISVC, "spec": {**ISVC["spec"], "image": ""}}).problems[0]


def test_render_and_replay_need_no_image(tmp_path, capsys):
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(without_image()))
    assert main(["render", "-f", str(path)]) == 0
    deployment = next(yaml.safe_load_all(capsys.readouterr().out))
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == DEFAULT_ENGINE_IMAGE
    assert main(["render", "-f", str(path), "--default-image", "mirror.local/engine:x"]) == 0
    deployment = next(yaml.safe_load_all(capsys.readouterr().out))
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "mirror.local/engine:x"
    samples = tmp_path / "samples.jsonl"
    samples.write_text('{"time": 1, "pod": "p", "metrics": null, "error": "no answer"}\n')
    assert main(["replay", "-f", str(path), "--metrics", str(samples)]) == 0
    assert "1 evaluation(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("image", "registry"),
    [
        ("engine:1", "docker.io"),
        ("kvpilot/engine:1", "docker.io"),
        ("ghcr.io/kvpilot/engine:1", "ghcr.io"),
        ("localhost:5000/engine", "localhost:5000"),
        ("localhost/engine", "localhost"),
        ("nvcr.io/nvidia/engine@sha256:abc", "nvcr.io"),
    ],
)
def test_image_registry(image, registry):
    assert image_registry(image) == registry


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"image": "ghcr.io/kvpilot/engine:1"}, None),
        ({}, None),  # the default image: from an allowed registry
        ({"image": "evil.example.com/miner:1"}, "registry evil.example.com is not allowed by the operator"),
        ({"image": "engine:1"}, "registry docker.io is not allowed"),
        ({"pod": {"serviceAccountName": "llm-engine"}}, None),
        (
            {"pod": {"serviceAccountName": "cluster-admin-sa"}},
            "serviceAccountName 'cluster-admin-sa' is not allowed",
        ),
    ],
)
def test_allowlists_make_the_spec_invalid_with_the_reason(spec, problem):
    platform = Platform(
        allowed_registries=("ghcr.io", "nvcr.io"), allowed_service_accounts=("default", "llm-engine")
    )
    obj = without_image()
    obj["spec"].update(spec)
    problems = resolve(obj, platform).problems
    if problem is None:
        assert problems == ()
    else:
        assert len(problems) == 1 and problem in problems[0]
    assert resolve(obj).problems == ()  # no allowlist: anything goes


def test_flags_win_over_the_charts_environment():
    env = {
        "KVPILOT_DEFAULT_IMAGE": "ghcr.io/kvpilot/engine:9",
        "KVPILOT_ALLOWED_REGISTRIES": "ghcr.io, nvcr.io",
        "KVPILOT_ALLOWED_SERVICE_ACCOUNTS": "",
    }
    from_env = platform_from(argparse.Namespace(), env)
    assert from_env == Platform("ghcr.io/kvpilot/engine:9", ("ghcr.io", "nvcr.io"), ())
    flags = argparse.Namespace(default_image="x/y:1", allowed_registries="x", allowed_service_accounts="a,b")
    assert platform_from(flags, env) == Platform("x/y:1", ("x",), ("a", "b"))
    assert platform_from(argparse.Namespace(), {}) == Platform()
