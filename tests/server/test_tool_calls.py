"""Tool calling through the real server and the official client: ``tools`` through the chat template,
``tool_choice`` none / auto / required / named, streamed and not, and the 400s.

The model has random weights, so it never calls a tool by itself: ``auto`` is checked here on its
no-call path (the parsers and the streaming reader are checked on known call texts in
test_tool_parsers.py). ``required`` and a named function constrain the output with a grammar, so every
answer must be well-formed calls whose arguments validate against the tool's schema.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from kvpilot.engine.errors import ConfigError
from kvpilot.engine.server import protocol
from kvpilot.engine.server.cli import check_tool_flags, make_arg_parser
from kvpilot.engine.server.errors import APIError
from kvpilot.engine.server.tool_choice import resolve_tools
from kvpilot.engine.server.tool_parsers import parse_hermes

from .conftest import MODEL_NAME, ServerProcess, kvpilot_command

# A Hermes/Qwen-style template: the tools in a system turn, earlier calls as <tool_call> blocks (their
# arguments as dicts), tool results in <tool_response>.
TOOL_TEMPLATE = """{{ bos_token }}
{%- if tools %}<|im_start|>system
You can call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Reply with <tool_call>{"name": <name>, "arguments": <args>}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments|tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "enum": [6, 7, 8]},
                "label": {"type": "string", "enum": ["gym", "work"]},
            },
            "required": ["hour", "label"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Lima?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_server(server_model, tmp_path_factory):
    """A server with the tool template, --enable-auto-tool-choice and the hermes parser."""
    tmp = tmp_path_factory.mktemp("tool-server")
    template = tmp / "tool_template.jinja"
    template.write_text(TOOL_TEMPLATE)
    flags = ["--num-gpu-blocks-override", "256", "--max-model-len", "2048", "--seed", "0"]
    flags += ["--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = ServerProcess(server_model, tmp / "server.log", flags)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def check_arguments(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    schema = SCHEMAS[name]
    jsonschema.validate(args, schema)
    return args


def streamed_calls(stream) -> tuple[dict[int, list[tuple[str, str]]], dict[int, str], dict[int, str]]:
    """Per choice: the (name, arguments) of each call accumulated from the deltas (checking OpenAI's
    delta shape), the content, and the finish_reason."""
    calls: dict[int, list[list[str]]] = {}
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            content[ch.index] = content.get(ch.index, "") + (ch.delta.content or "")
            for piece in ch.delta.tool_calls or []:
                mine = calls.setdefault(ch.index, [])
                if piece.id is not None:
                    assert piece.index == len(mine) and piece.type == "function"
                    assert piece.id.startswith("chatcmpl-tool-") and piece.function.name
                    mine.append([piece.function.name, piece.function.arguments or ""])
                else:
                    assert piece.index == len(mine) - 1 and piece.function.name is None
                    mine[piece.index][1] += piece.function.arguments
            if ch.finish_reason is not None:
                assert ch.index not in finish
                finish[ch.index] = ch.finish_reason
    return {i: [tuple(c) for c in cs] for i, cs in calls.items()}, content, finish


# ---------------------------------------------------------------------------------------------- template
def test_tools_and_tool_turns_reach_the_template(tool_server, tokenizer):
    client = tool_server.client()
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 C, cloudy"},
    ]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0
    )
    # The reference render: transformers' own, with the call's arguments as a dict (what templates take).
    as_template_takes = [*USER, {**messages[1], "content": ""}, messages[2]]
    as_template_takes[1]["tool_calls"] = [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}
    ]
    text = tokenizer.apply_chat_template(
        as_template_takes,
        tools=TOOLS,
        chat_template=TOOL_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>' in text
    assert 'id="call-1">18 C' in text and "set_alarm" in text
    assert resp.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    # tool_choice "none" (as vLLM): tools still in the prompt, the output plain text.
    without_tools = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert without_tools.usage.prompt_tokens < resp.usage.prompt_tokens
    assert resp.choices[0].message.tool_calls is None


# ---------------------------------------------------------------------------------------------- auto
def test_auto_without_a_call_is_plain_content_streamed_or_not(tool_server):
    client = tool_server.client()
    kwargs = dict(model=MODEL_NAME, messages=USER, tools=TOOLS, max_tokens=40, temperature=0)
    resp = client.chat.completions.create(**kwargs)  # tool_choice defaults to "auto"
    message = resp.choices[0].message
    assert message.content and not message.tool_calls
    assert parse_hermes(message.content).tool_calls == []  # the check is real: no call in the text
    assert resp.choices[0].finish_reason in ("stop", "length")
    calls, content, finish = streamed_calls(
        client.chat.completions.create(**kwargs, tool_choice="auto", stream=True)
    )
    assert calls == {} and content == {0: message.content}
    assert finish == {0: resp.choices[0].finish_reason}


# ---------------------------------------------------------------------------------------------- constrained
def test_required_answers_are_calls_that_validate(tool_server):
    client = tool_server.client()
    kwargs = dict(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice="required", n=3, seed=7)
    # The array may hold any number of calls, with some white space between tokens: room for them.
    resp = client.chat.completions.create(**kwargs, max_tokens=1500)
    names = set()
    for ch in resp.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.tool_calls and not ch.message.content
        for call in ch.message.tool_calls:
            assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
            check_arguments(call.function.name, call.function.arguments)
            names.add(call.function.name)
    assert names <= set(SCHEMAS)
    # The same seed streamed: the accumulated deltas are the same calls.
    calls, content, finish = streamed_calls(
        client.chat.completions.create(**kwargs, max_tokens=1500, stream=True)
    )
    expected = {
        ch.index: [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
        for ch in resp.choices
    }
    assert calls == expected
    assert finish == {i: "tool_calls" for i in range(3)} and all(not c for c in content.values())


def test_named_function_answers_are_its_arguments(tool_server):
    client = tool_server.client()
    choice = {"type": "function", "function": {"name": "set_alarm"}}
    kwargs = dict(
        model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=choice, n=2, seed=5, max_tokens=100
    )
    resp = client.chat.completions.create(**kwargs)
    for ch in resp.choices:
        assert ch.finish_reason == "stop"  # OpenAI's and vLLM's for a named choice
        (call,) = ch.message.tool_calls
        assert call.function.name == "set_alarm"
        check_arguments("set_alarm", call.function.arguments)
    calls, _, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert calls == {
        ch.index: [("set_alarm", ch.message.tool_calls[0].function.arguments)] for ch in resp.choices
    }
    assert finish == {0: "stop", 1: "stop"}


# ---------------------------------------------------------------------------------------------- 400s
def _fn(name: str, **extra) -> dict:
    return {"type": "function", "function": {"name": name, **extra}}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [_fn("")]}, "tools[0].function.name"),
        ({"tools": [_fn("f", parameters="{}")]}, "tools[0].function.parameters"),
        ({"tools": [_fn("f"), _fn("f")]}, "tools[1].function.name"),
        ({"tools": [_fn("f")] * 129}, "tools"),
        ({"tools": "f"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [_fn("f")], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [_fn("f")], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        (
            {"tools": [_fn("f")], "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [_fn("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        pytest.param(
            {
                "tools": [_fn("f", parameters={"properties": {"a": {"type": "nonsense"}}})],
                "tool_choice": "required",
            },
            "tools",
        ),
        pytest.param(
            {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {"messages": [*USER, {"role": "tool", "content": "18 C"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]},
                ]
            },
            "messages",
        ),
    ],
)
def test_malformed_tools_and_choices_are_400(tool_server, fields, param):
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **fields}
    response = tool_server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    with pytest.raises(openai.BadRequestError):
        tool_server.client().chat.completions.create(**body)


def test_tool_choice_none_without_tools_is_plain_chat(tool_server):
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "tool_choice": "none"}
    response = httpx.post(f"{tool_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200 and "tool_calls" not in response.json()["choices"][0]["message"]


def _request(**fields) -> protocol.ChatCompletionRequest:
    return protocol.validate(protocol.ChatCompletionRequest, {"messages": USER, **fields})


def test_auto_needs_the_server_flags_as_vllm_says():
    with pytest.raises(APIError) as err:
        resolve_tools(_request(tools=TOOLS), enable_auto_tool_choice=False, tool_call_parser=None)
    assert err.value.status == 400 and err.value.param == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in str(err.value.message)
    plan = resolve_tools(_request(tools=TOOLS), enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    assert plan.mode == "auto" and plan.parser == "llama3_json" and plan.schema is None
    # As vLLM 0.32 (which loads its tool parser only with --enable-auto-tool-choice): required and
    # named choices need the flags too; "none" does not.
    for choice, what in [
        ("required", "tool_choice='required'"),
        (NAMED, 'tool_choice=function "get_weather"'),
    ]:
        with pytest.raises(APIError) as err:
            resolve_tools(_request(tools=TOOLS, tool_choice=choice), False, None)
        assert err.value.param == "tool_choice" and err.value.message.startswith(what)
    assert resolve_tools(_request(tools=TOOLS, tool_choice="none"), False, None).mode == "none"
    assert resolve_tools(_request(tools=TOOLS, tool_choice="required"), True, "hermes").mode == "required"


def test_constraint_schemas_are_vllms():
    plan = resolve_tools(_request(tools=TOOLS, tool_choice="required"), True, "hermes")
    assert plan.schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": SCHEMAS[name]},
                    "required": ["name", "parameters"],
                }
                for name in ("get_weather", "set_alarm")
            ],
        },
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert (
        resolve_tools(_request(tools=TOOLS, tool_choice=named), True, "hermes").schema
        == SCHEMAS["get_weather"]
    )
    # $defs move to the top, where the tools' references point; the request's tools are left as sent.
    ref_tool = _fn(
        "g", parameters={"$defs": {"U": {"enum": ["c"]}}, "properties": {"u": {"$ref": "#/$defs/U"}}}
    )
    schema = resolve_tools(_request(tools=[ref_tool], tool_choice="required"), True, "hermes").schema
    assert schema["$defs"] == {"U": {"enum": ["c"]}} and "$defs" in ref_tool["function"]["parameters"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


# ---------------------------------------------------------------------------------------------- flags
def test_tool_flags_parse_and_are_checked_together(tmp_path: Path):
    args = make_arg_parser().parse_args(
        ["/m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert args.enable_auto_tool_choice is True and args.tool_call_parser == "llama3_json"
    defaults = make_arg_parser().parse_args(["/m"])
    assert defaults.enable_auto_tool_choice is False and defaults.tool_call_parser is None
    check_tool_flags(False, "hermes")  # a parser alone is fine (as vLLM): auto stays off
    with pytest.raises(ConfigError, match="requires --tool-call-parser"):
        check_tool_flags(True, None)
    result = subprocess.run(
        [*kvpilot_command(), "serve", str(tmp_path), "--port", "0", "--enable-auto-tool-choice"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "--enable-auto-tool-choice requires --tool-call-parser" in errors[0]
    result = subprocess.run(
        [*kvpilot_command(), "serve", str(tmp_path), "--tool-call-parser", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "hermes" in result.stderr
