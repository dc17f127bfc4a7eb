"""``kvpilot render`` and ``kvpilot operator`` through the top-level CLI, in-process and as a process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpilot.cli import main
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.render.builders import build_children
from tests.operator.conftest import EXAMPLE, K8S_VERSION, REPO

KVPILOT = Path(sys.executable).parent / "kvpilot"


def test_render_example_in_process(capsys):
    assert main(["render", "-f", str(EXAMPLE)]) == 0
    out, err = capsys.readouterr()
    documents = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in documents] == ["Deployment", "Service", "PodDisruptionBudget", "ConfigMap"]
    assert err == ""
    # The same builders the operator uses: identical output for the same object.
    isvc = yaml.safe_load(EXAMPLE.read_text())
    assert documents == build_children(resolve(isvc))
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSION, strict=True)  # raises ValidationError
        assert "ownerReferences" not in document["metadata"]  # a file has no uid to point at


def test_render_applies_status_overrides_and_namespace(tmp_path, capsys, make_isvc):
    isvc = make_isvc({"metadata.namespace": make_isvc.DELETE})
    isvc["status"] = {"effective": {"overrides": {"replicas": {"value": 4, "specValue": 2}}}}
    other = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm"}}
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all([other, isvc]))
    assert main(["render", "-f", str(path), "-n", "prod"]) == 0
    deployment = next(yaml.safe_load_all(capsys.readouterr().out))
    assert deployment["spec"]["replicas"] == 4 and deployment["metadata"]["namespace"] == "prod"
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "no InferenceService"),
        ((REPO / "tests/operator/invalid/cuda-without-gpus.yaml").read_text(), "gpusPerReplica is 0"),
        ("{not yaml: [", "cannot read"),
    ],
)
def test_render_refuses_with_a_message(tmp_path, capsys, content, message):
    path = tmp_path / "in.yaml"
    path.write_text(content)
    assert main(["render", "-f", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_render_as_a_process_from_stdin():
    result = subprocess.run(
        [str(KVPILOT), "render", "-f", "-"],
        input=EXAMPLE.read_text(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout)]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget", "ConfigMap"]


def test_operator_command_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["operator", "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--namespace", "--all-namespaces", "--resync-interval", "--liveness", "--peering"):
        assert flag in usage
    with pytest.raises(SystemExit) as exit_:
        main(["operator", "--namespace", "a", "--all-namespaces"])
    assert exit_.value.code == 2  # mutually exclusive
    with pytest.raises(SystemExit) as exit_:
        main(["operator"])
    assert exit_.value.code == 2  # a scope is required: no accidental cluster-wide operator
    assert main(["operator", "--namespace", "team-*"]) == 2
    assert "patterns are not supported" in capsys.readouterr().err


def test_operator_help_as_a_process():
    result = subprocess.run([str(KVPILOT), "operator", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--all-namespaces" in result.stdout
