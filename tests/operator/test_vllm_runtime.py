"""``spec.runtime: vllm``: what the operator renders and refuses, and how the local platform runs it.

The rendered args are checked against vLLM's own parser in ``test_vllm_args.py``; the closed loop
against a real vLLM server is ``test_vllm_loop.py``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pytest
import yaml

from kvpilot.cli import main
from kvpilot.operator.api.platform import DEFAULT_VLLM_IMAGE
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.cli import platform_from
from kvpilot.operator.local import process
from kvpilot.operator.render.builders import build_deployment
from tests.operator.conftest import BASE_ISVC

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "inferenceservice-vllm.yaml"


def vllm_isvc(**spec) -> dict:
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["spec"]["runtime"] = "vllm"
    isvc["spec"].update(spec)
    return isvc


def container_of(isvc: dict, platform=None) -> dict:
    settings = resolve(isvc, platform) if platform else resolve(isvc)
    assert settings.is_valid, settings.problems
    (container,) = build_deployment(settings)["spec"]["template"]["spec"]["containers"]
    return container


def test_the_vllm_example_renders_vllm_serve_with_its_key_and_cache() -> None:
    container = container_of(yaml.safe_load(EXAMPLE.read_text()))
    assert container["image"] == DEFAULT_VLLM_IMAGE  # unset spec.image: the runtime's default
    assert container["command"] == ["vllm", "serve"]
    args = container["args"]
    flag = {a: b for a, b in zip(args, args[1:], strict=False) if a.startswith("--")}
    assert flag["--model"] == "Qwen/Qwen2.5-7B-Instruct"  # an hf:// source is a repository id
    assert flag["--download-dir"] == "/var/cache/huggingface/hub"
    assert (flag["--gpu-memory-utilization"], flag["--max-num-seqs"], flag["--max-model-len"]) == (
        "0.85",
        "128",
        "16384",
    )
    env = {e["name"]: e for e in container["env"]}
    # The key reaches vLLM through its own variable, from the Secret, never in the args.
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "llm-api-key", "key": "api-key"}
    assert "KVPILOT_API_KEY" not in env and "--api-key" not in args
    assert env["HOME"]["value"] == "/tmp" and env["HF_HOME"]["value"] == "/var/cache/huggingface"
    assert container["securityContext"]["runAsUser"] == 1000  # vLLM's image would run as root
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


def test_the_kvpilot_runtime_is_the_default_and_renders_as_before() -> None:
    container = container_of(copy.deepcopy(BASE_ISVC))
    assert container["command"] == ["kvpilot", "serve"] and "runAsUser" not in container["securityContext"]
    assert resolve(copy.deepcopy(BASE_ISVC)).spec["runtime"] == "kvpilot"


def test_the_default_vllm_image_comes_from_the_operators_configuration() -> None:
    isvc = vllm_isvc()
    del isvc["spec"]["image"]
    flags = argparse.Namespace(default_vllm_image="mirror.corp/vllm/vllm-openai:v0.32.0")
    assert container_of(isvc, platform_from(flags, {}))["image"] == "mirror.corp/vllm/vllm-openai:v0.32.0"
    from_env = platform_from(argparse.Namespace(), {"KVPILOT_DEFAULT_VLLM_IMAGE": "vllm:7"})
    assert container_of(isvc, from_env)["image"] == "vllm:7"
    # spec.image still wins.
    isvc["spec"]["image"] = "registry.example.com/vllm:1"
    assert container_of(isvc, from_env)["image"] == "registry.example.com/vllm:1"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"engine": {"attentionBackend": "triton"}},
            "spec.engine.attentionBackend is not supported by runtime vllm",
        ),
        (
            {"engine": {"pipelineMicroBatches": 2}},
            "spec.engine.pipelineMicroBatches is not supported by runtime vllm",
        ),
        ({"extraArgs": ["--max-num-seqs=4"]}, "spec.extraArgs[0] --max-num-seqs is set by the operator"),
        ({"extraArgs": ["--download-dir=/x"]}, "spec.extraArgs[0] --download-dir is set by the operator"),
        ({"env": [{"name": "HOME", "value": "/root"}]}, "spec.env[0].name HOME is set by the operator"),
        (
            {"env": [{"name": "VLLM_API_KEY", "value": "k"}]},
            "spec.env[0].name VLLM_API_KEY is set by the operator",
        ),
    ],
)
def test_what_vllm_cannot_honour_is_refused_by_name(spec, message) -> None:
    problems = resolve(vllm_isvc(**spec)).problems
    assert len(problems) == 1 and message in problems[0], problems


def test_vllm_only_flags_pass_through_extra_args_and_home_stays_the_users_on_kvpilot() -> None:
    container = container_of(vllm_isvc(extraArgs=["--enforce-eager", "--max-logprobs=5"]))
    assert container["args"][-2:] == ["--enforce-eager", "--max-logprobs=5"]
    kvpilot = copy.deepcopy(BASE_ISVC)
    kvpilot["spec"]["env"] = [{"name": "HOME", "value": "/data"}]
    assert resolve(kvpilot).problems == ()


def test_render_prints_the_vllm_deployment(capsys) -> None:
    assert main(["render", "-f", str(EXAMPLE)]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["command"] == ["vllm", "serve"]


# --- the local platform -------------------------------------------------------------------------


def test_a_local_vllm_replica_runs_the_rendered_args_through_vllms_module(tmp_path) -> None:
    container = container_of(vllm_isvc(engine={"cpuMemoryBudgetBytes": 1 << 30, "gpuMemoryUtilization": 0.1}))
    args, notes = process.local_args(container, 8123, model_dir=str(tmp_path), gpu=False)
    flag = {a: b for a, b in zip(args, args[1:], strict=False) if a.startswith("--")}
    assert (flag["--model"], flag["--host"], flag["--port"]) == (str(tmp_path), "127.0.0.1", "8123")
    assert flag["--kv-cache-memory-bytes"] == str(int(0.1 * (1 << 30)))
    assert [a for a in args if a not in flag and a not in flag.values()] == []  # nothing else moved
    assert not any("reserves" in note for note in notes)
    command = process.replica_command(container, "/opt/vllm/bin/python")
    assert command == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert process.replica_command(container_of(copy.deepcopy(BASE_ISVC)), None) is None
    env, env_notes = process.local_env(container)
    assert "HOME" not in env and any("apiKeySecretRef" in n for n in env_notes) is False


def test_without_a_cpu_budget_a_local_vllm_replica_says_what_vllm_will_reserve() -> None:
    _, notes = process.local_args(container_of(vllm_isvc()), 8123, gpu=False)
    assert any("reserves gpuMemoryUtilization x this machine's memory" in note for note in notes)


def test_a_missing_vllm_is_one_clear_line(tmp_path, monkeypatch, capsys) -> None:
    with pytest.raises(process.RuntimeMissing, match="not an executable Python interpreter"):
        process.find_vllm_python(str(tmp_path / "nothing"), {})
    monkeypatch.setattr(process, "_vllm_importable", lambda: False)
    with pytest.raises(process.RuntimeMissing, match=r"vLLM is not installed .*pip install vllm"):
        process.find_vllm_python(None, {})
    assert process.find_vllm_python(None, {"KVPILOT_VLLM_PYTHON": sys.executable}) == sys.executable
    manifest = tmp_path / "isvc.yaml"
    isvc = vllm_isvc(model={"source": f"file://{tmp_path}"})
    manifest.write_text(yaml.safe_dump(isvc))
    monkeypatch.delenv("KVPILOT_VLLM_PYTHON", raising=False)
    assert main(["up", "--local", "-f", str(manifest)]) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "vLLM is not installed" in line and "--vllm-python" in line
