"""Structured outputs and logit_bias through the OpenAI API (the official client, a live server, random
weights): 100 seeded samples per constraint always parse and validate; malformed constraints and
biases are 400s naming their field; a bias of +100 forces its token and leaves the logprobs alone."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from .conftest import MODEL_NAME
from .test_errors import assert_error

NUM_SAMPLES = 100

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "editor", "viewer"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REPO = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "owner": {
            "type": "object",
            "properties": {"login": {"type": "string", "maxLength": 8}, "admin": {"type": "boolean"}},
            "required": ["login", "admin"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "owner", "tags"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"
COLORS = ["red", "green", "dark blue", "blue"]
MESSAGES = [{"role": "user", "content": "Answer in the requested format."}]


def _chat(server, n: int = NUM_SAMPLES, max_tokens: int = 128, **fields):
    return server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=n, temperature=1.0, seed=1000, max_tokens=max_tokens, **fields
    )


def _complete(server, n: int = NUM_SAMPLES, max_tokens: int = 128, **fields):
    return server.client().completions.create(
        model=MODEL_NAME, prompt="Output:", n=n, temperature=1.0, seed=2000, max_tokens=max_tokens, **fields
    )


def _texts(resp, chat: bool) -> list[str]:
    assert len(resp.choices) == NUM_SAMPLES
    for c in resp.choices:
        assert c.finish_reason == "stop", (c.finish_reason, c)
    return [c.message.content if chat else c.text for c in resp.choices]


def _check_json(texts: list[str], schema: dict) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > NUM_SAMPLES // 2, "distinct seeds give distinct samples"


def test_response_format_json_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = _texts(_chat(server, response_format=fmt), chat=True)
    _check_json(texts, PERSON)
    assert all(list(json.loads(t)) == ["name", "age", "role"] for t in texts), "in the schema's order"


def test_structured_outputs_nested_schema_on_completions(server):
    resp = _complete(server, extra_body={"structured_outputs": {"json": REPO}})
    _check_json(_texts(resp, chat=False), REPO)


def test_response_format_json_object(server, tokenizer):
    # Random weights rarely close a free-form string: a bias towards quotes and braces ends the objects
    # in a few dozen tokens (the grammar, not the bias, keeps them valid).
    bias = {str(tokenizer.convert_tokens_to_ids(t)): 8 for t in ['"', "}", '",']}
    resp = _chat(server, response_format={"type": "json_object"}, logit_bias=bias)
    texts = _texts(resp, chat=True)
    for text in texts:
        assert isinstance(json.loads(text), dict), text
    assert len(set(texts)) > 10


def test_structured_outputs_regex(server):
    texts = _texts(
        _complete(server, max_tokens=40, extra_body={"structured_outputs": {"regex": EMAIL}}), False
    )
    assert all(re.fullmatch(EMAIL, t) for t in texts), [t for t in texts if not re.fullmatch(EMAIL, t)]
    assert len(set(texts)) > NUM_SAMPLES // 2


def test_structured_outputs_choice_on_chat(server):
    resp = _chat(server, max_tokens=16, extra_body={"structured_outputs": {"choice": COLORS}})
    texts = _texts(resp, chat=True)
    assert set(texts) <= set(COLORS)
    assert len(set(texts)) >= 3


def test_streaming_json_schema(server):
    stream = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=1.0,
        seed=5,
        max_tokens=128,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


# ------------------------------------------------------------------------------------------ errors
def _chat_body(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, **fields}


def _completion_body(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "x", "max_tokens": 8, **fields}


@pytest.mark.parametrize(
    "fields, param, match",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "response_format",
            "response_format.json_schema.schema is not a valid JSON schema: .*frob",
        ),
        (
            {"structured_outputs": {"json": {"type": "object", "properties": 3}}},
            "structured_outputs",
            "structured_outputs.json is not a valid JSON schema: .*properties",
        ),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "not a valid regular expression"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", "nothing"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "must be a string"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown key"),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "one output constraint",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "JSON schema object",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "must be"),
        ({"guided_json": PERSON}, "guided_json", "structured_outputs"),
        ({"guided_regex": "a+"}, "guided_regex", "structured_outputs"),
        ({"guided_choice": ["a"]}, "guided_choice", "structured_outputs"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "structured_outputs"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias", r"\[-100, 100\]"),
        ({"logit_bias": {"5": -101}}, "logit_bias", r"\[-100, 100\]"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-3": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "vocabulary"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ],
)
def test_bad_constraints_and_biases_are_400_naming_the_field(server, fields, param, match):
    error = assert_error(server.post("/v1/chat/completions", json=_chat_body(**fields)), 400, param=param)
    assert re.search(match, error["message"]), error


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"logit_bias": {"1": 1000}}, "logit_bias"),
    ],
)
def test_completions_errors_name_the_field(server, fields, param):
    assert_error(server.post("/v1/completions", json=_completion_body(**fields)), 400, param=param)


# ------------------------------------------------------------------------------------------ logit_bias
def test_logit_bias_forces_a_token_and_keeps_the_logprobs(server, tokenizer):
    client = server.client()
    common = {"model": MODEL_NAME, "prompt": "def main():", "temperature": 0.0, "logprobs": 5}
    plain = client.completions.create(max_tokens=1, **common).choices[0].logprobs
    top = plain.top_logprobs[0]
    # The 5th most likely first token (not the greedy one) is forced by a +100 bias.
    target_text = min(top, key=top.get)
    assert target_text != plain.tokens[0]
    target = next(t for t in range(len(tokenizer)) if tokenizer.decode([t]) == target_text)
    biased = client.completions.create(
        max_tokens=3, logit_bias={str(target): 100}, extra_body={"ignore_eos": True}, **common
    ).choices[0]
    assert biased.text == tokenizer.decode([target] * 3)
    assert biased.logprobs.tokens[0] == target_text
    assert biased.logprobs.token_logprobs[0] == pytest.approx(top[target_text], abs=1e-5)
    assert biased.logprobs.top_logprobs[0] == pytest.approx(top, abs=1e-5)
    # -100 on the greedy token moves the greedy choice.
    greedy_id = next(t for t in range(len(tokenizer)) if tokenizer.decode([t]) == plain.tokens[0])
    banned = client.completions.create(max_tokens=1, logit_bias={str(greedy_id): -100}, **common)
    assert banned.choices[0].logprobs.tokens[0] != plain.tokens[0]


def test_logit_bias_on_chat(server, tokenizer):
    (target,) = tokenizer.encode("self", add_special_tokens=False)
    resp = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=1.0,
        seed=3,
        max_tokens=4,
        logit_bias={str(target): 100},
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].message.content == tokenizer.decode([target] * 4) == "self" * 4


def test_client_side_errors_surface_as_bad_request(server):
    with pytest.raises(openai.BadRequestError) as err:
        _complete(server, n=1, extra_body={"structured_outputs": {"regex": "("}})
    assert err.value.response.json()["error"]["param"] == "structured_outputs"
