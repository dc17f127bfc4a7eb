"""The ``vllm serve`` flags ``kvpilot serve`` accepts, checked against vLLM 0.32's own parser.

The table is the contract a script written for ``vllm serve`` relies on: each flag exists in vLLM's
parser with the same kind (takes a value, or is a switch) and, where the meaning is the same, the same
default; and kvpilot's parser takes it. vLLM's parser is built in its own interpreter (see
tests/operator/test_vllm_args.py for how it is found). vLLM flags kvpilot does not take are listed
as a warning in the test output, never dropped silently.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpilot.engine.server.cli import make_arg_parser
from tests.operator.test_vllm_args import vllm_python

DESCRIBE = Path(__file__).resolve().parents[1] / "vllm" / "describe_flags.py"


@dataclass(frozen=True)
class Flag:
    """One ``vllm serve`` flag kvpilot takes.

    ``same_default``: (kvpilot's parsed default, vLLM's default as ``repr``) when the meaning is
    the same; otherwise ``differs`` says why the defaults are not compared. ``sample`` is a value
    for a flag that takes one."""

    takes_value: bool
    same_default: tuple[Any, str] | None = None
    differs: str = ""
    sample: str = ""


TABLE: dict[str, Flag] = {
    "--model": Flag(True, differs="vLLM falls back to a hub model; kvpilot requires one", sample="/m"),
    # vLLM's None binds ("", port): every IPv4 interface, which kvpilot spells 0.0.0.0.
    "--host": Flag(True, same_default=("0.0.0.0", "None"), sample="127.0.0.1"),
    "--port": Flag(True, same_default=(8000, "8000"), sample="8001"),
    "--served-model-name": Flag(True, same_default=(None, "None"), sample="name"),
    "--api-key": Flag(True, same_default=(None, "None"), sample="key"),
    "--chat-template": Flag(True, same_default=(None, "None"), sample="{{ messages }}"),
    "--generation-config": Flag(True, same_default=("auto", "'auto'"), sample="vllm"),
    "--uvicorn-log-level": Flag(True, same_default=("info", "'info'"), sample="trace"),
    "--log-level": Flag(
        True, differs="vLLM's is suppressed unless given; kvpilot's is uvicorn's", sample="INFO"
    ),
    "--disable-uvicorn-access-log": Flag(False, same_default=(False, "False")),
    "--disable-log-stats": Flag(False, same_default=(False, "False")),
    "--tokenizer": Flag(True, same_default=(None, "None"), sample="/tok"),
    "--block-size": Flag(True, differs="vLLM picks it per platform at start-up; kvpilot: 16", sample="32"),
    "--gpu-memory-utilization": Flag(True, differs="kvpilot 0.9, vLLM 0.92 of the device", sample="0.8"),
    "--kv-cache-memory-bytes": Flag(True, same_default=(None, "None"), sample="1024"),
    "--num-gpu-blocks-override": Flag(True, same_default=(None, "None"), sample="64"),
    "--max-num-seqs": Flag(True, differs="vLLM resolves it by device at start-up; kvpilot: 256", sample="8"),
    "--max-num-batched-tokens": Flag(True, same_default=(None, "None"), sample="512"),
    "--max-model-len": Flag(True, same_default=(None, "None"), sample="256"),
    "--enable-chunked-prefill": Flag(False, differs="vLLM resolves None at start-up; kvpilot: on"),
    "--no-enable-chunked-prefill": Flag(False, differs="see --enable-chunked-prefill"),
    "--enable-prefix-caching": Flag(False, differs="vLLM resolves None at start-up; kvpilot: on"),
    "--no-enable-prefix-caching": Flag(False, differs="see --enable-prefix-caching"),
    "--tensor-parallel-size": Flag(True, same_default=(1, "1"), sample="2"),
    "--pipeline-parallel-size": Flag(True, same_default=(1, "1"), sample="2"),
    "--dtype": Flag(True, same_default=("auto", "'auto'"), sample="bfloat16"),
    "--kv-cache-dtype": Flag(True, same_default=("auto", "'auto'"), sample="float16"),
    "--attention-backend": Flag(True, differs="the backends are kvpilot's own", sample="torch"),
    "--seed": Flag(True, same_default=(0, "0"), sample="7"),
}
# Added with tool calling; in the table once kvpilot's parser has them.
_TOOL_FLAGS = {
    "--enable-auto-tool-choice": Flag(False, same_default=(False, "False")),
    "--tool-call-parser": Flag(True, same_default=(None, "None"), sample="hermes"),
}
_KVPILOT_OPTIONS = {o for a in make_arg_parser()._actions for o in a.option_strings}
TABLE.update({flag: row for flag, row in _TOOL_FLAGS.items() if flag in _KVPILOT_OPTIONS})


@pytest.fixture(scope="module")
def vllm_options(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = subprocess.run(
        [vllm_python(), str(DESCRIBE)],
        capture_output=True,
        text=True,
        cwd=tmp_path_factory.mktemp("vllm"),
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _kvpilot_action(flag: str):
    return next(a for a in make_arg_parser()._actions if flag in a.option_strings)


@pytest.mark.parametrize("flag", sorted(TABLE))
def test_flag_has_vllms_kind_and_default(flag: str, vllm_options: dict[str, dict[str, Any]]) -> None:
    row = TABLE[flag]
    assert flag in vllm_options, f"{flag} is not a vllm serve flag"
    theirs = vllm_options[flag]
    assert theirs["takes_value"] is row.takes_value, f"{flag}: vLLM's takes_value is {theirs['takes_value']}"
    ours = _kvpilot_action(flag)
    assert (ours.nargs != 0) is row.takes_value, f"{flag}: kvpilot's kind differs from vLLM's"
    if row.same_default is None:
        assert row.differs, f"{flag}: give the shared default or say why the defaults differ"
        return
    kvpilot_default, vllm_default = row.same_default
    assert theirs["default"] == vllm_default, f"{flag}: vLLM's default is now {theirs['default']}"
    assert ours.default == kvpilot_default, f"{flag}: kvpilot's default is now {ours.default!r}"


@pytest.mark.parametrize("flag", sorted(TABLE))
def test_kvpilot_parses_the_flag(flag: str) -> None:
    row = TABLE[flag]
    argv = ["/m", flag, row.sample] if row.takes_value else ["/m", flag]
    if flag == "--model":
        argv = [flag, row.sample]
    value = getattr(make_arg_parser().parse_args(argv), _kvpilot_action(flag).dest)
    if not row.takes_value:
        # A switch sets its own value whatever the default: --no-X off, any other on.
        assert value is (not flag.startswith("--no-"))
        return
    if isinstance(value, list):  # nargs="+" (--served-model-name)
        value = value[0]
    expected = row.sample.lower() if flag == "--log-level" else row.sample
    assert str(value) == expected


def test_vllm_flags_kvpilot_does_not_take_are_listed(vllm_options: dict[str, dict[str, Any]]) -> None:
    missing = sorted(set(vllm_options) - set(TABLE) - {"-h", "--help"})
    accepted_without_row = sorted(set(missing) & _KVPILOT_OPTIONS)
    # A vLLM flag kvpilot's parser takes must have a row: its kind and default are then checked.
    assert not accepted_without_row, (
        f"vllm serve flags kvpilot takes but the table lacks: {accepted_without_row}"
    )
    assert missing, "vLLM's parser described no options"
    warnings.warn(
        f"{len(missing)} vllm serve flags kvpilot serve does not accept: {' '.join(missing)}", stacklevel=1
    )


def test_model_is_taken_positionally_or_as_a_flag_and_must_agree() -> None:
    from kvpilot.engine.errors import ConfigError
    from kvpilot.engine.server.cli import engine_args_from

    parser = make_arg_parser()
    assert engine_args_from(parser.parse_args(["--model", "/m"])).model == "/m"
    assert engine_args_from(parser.parse_args(["/m", "--model", "/m"])).model == "/m"
    with pytest.raises(ConfigError, match="differ"):
        engine_args_from(parser.parse_args(["/m", "--model", "/other"]))
    with pytest.raises(ConfigError, match="no model given"):
        engine_args_from(parser.parse_args([]))


def test_api_key_order_is_flag_then_kvpilot_then_vllm_variable() -> None:
    from kvpilot.engine.errors import ConfigError
    from kvpilot.engine.server.startup_inputs import resolve_api_key

    assert resolve_api_key(None, None, "vllm\n") == "vllm"
    assert resolve_api_key(None, "kvpilot", "vllm") == "kvpilot"
    assert resolve_api_key("flag", "kvpilot", "vllm") == "flag"
    assert resolve_api_key(None, None, None) is None
    with pytest.raises(ConfigError, match=r"\$VLLM_API_KEY"):
        resolve_api_key(None, None, " ")
