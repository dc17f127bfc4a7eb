"""The API's shapes of a request's output constraint and token biases, as the engine takes them:
``response_format`` and vLLM's ``structured_outputs`` become one ``StructuredOutputsParams`` (checked
against the grammar library, so a schema it refuses is a 400 naming the field), OpenAI's
``logit_bias`` keys become token ids. vLLM's ``guided_*`` fields, removed in its 0.12, are named with
their replacement."""

from __future__ import annotations

import re
from typing import Any

from kvpilot.engine.errors import InvalidRequestError, SamplingParamsError
from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.server.errors import bad_request, not_supported
from kvpilot.engine.structured_output import check_constraint

# The constraint fields vLLM removed in 0.12, and the structured_outputs key each became.
REMOVED_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_LOGIT_BIAS_KEY = re.compile(r"-?[0-9]+")
# structured_outputs keys: what each must be (the engine's StructuredOutputsParams fields), and
# vLLM's other keys, which this engine does not implement.
_STRUCTURED_KEYS = {
    "json": (dict, str),
    "regex": (str,),
    "choice": (list,),
    "grammar": (str,),
    "json_object": (bool,),
}
_STRUCTURED_UNSUPPORTED = {
    "structural_tag",
    "whitespace_pattern",
    "disable_any_whitespace",
    "disable_additional_properties",
    "disable_fallback",
}


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"<token id>": bias}`` with integer keys (ranges: ``SamplingParams``; the vocabulary
    bound: the input processor)."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _LOGIT_BIAS_KEY.fullmatch(key):
            raise bad_request(
                f"logit_bias keys must be token ids (integers), got {key!r}", param="logit_bias"
            )
        out[int(key)] = value
    return out


def structured_outputs(
    structured: dict[str, Any] | None, response_format: dict[str, Any] | None
) -> StructuredOutputsParams | None:
    """A request's output constraint, from its ``structured_outputs`` or (chat) ``response_format``
    field; None for plain text. A 400 naming the field for a malformed one, two at once, or a schema,
    regex or grammar the library cannot parse (with its message)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if structured is not None:
        found.append(("structured_outputs", _from_structured_outputs(structured)))
    if response_format is not None:
        so = _from_response_format(response_format)
        if so is not None:
            found.append(("response_format", so))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(
            "give one output constraint: response_format and structured_outputs are both set",
            param="structured_outputs",
        )
    field, so = found[0]
    try:
        check_constraint(so)
    except InvalidRequestError as exc:
        message = str(exc)
        if field == "response_format":
            message = message.replace(
                f"structured_outputs.{so.kind}", "response_format.json_schema.schema", 1
            )
        raise bad_request(message, param=field) from None
    return so


def _from_structured_outputs(obj: dict[str, Any]) -> StructuredOutputsParams:
    for key, value in obj.items():
        if key in _STRUCTURED_UNSUPPORTED:
            raise not_supported(f"structured_outputs.{key}", f"structured_outputs.{key}")
        if key not in _STRUCTURED_KEYS:
            raise bad_request(
                f"structured_outputs has an unknown key {key!r}; use one of {', '.join(_STRUCTURED_KEYS)}",
                param=f"structured_outputs.{key}",
            )
        if value is not None and not isinstance(value, _STRUCTURED_KEYS[key]):
            raise bad_request(
                f"structured_outputs.{key} must be {_STRUCTURED_HINTS[key]}",
                param=f"structured_outputs.{key}",
            )
    kwargs = {key: value for key, value in obj.items() if value is not None}
    try:
        return StructuredOutputsParams(**kwargs)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param="structured_outputs") from None


_STRUCTURED_HINTS = {
    "json": "a JSON schema (an object, or its JSON text)",
    "regex": "a string",
    "choice": "an array of strings",
    "grammar": "a string (an EBNF grammar)",
    "json_object": "a boolean",
}


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema`` with
    ``{"name", "schema", "strict"?, "description"?}``."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                'response_format.json_schema must be an object {"name": ..., "schema": {...}} when type is '
                "json_schema",
                param="response_format.json_schema",
            )
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(
                "response_format.json_schema.name must be a string", param="response_format.json_schema.name"
            )
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(
                "response_format.json_schema.strict must be a boolean",
                param="response_format.json_schema.strict",
            )
        try:
            return StructuredOutputsParams(json=schema)
        except SamplingParamsError as exc:
            raise bad_request(str(exc), param="response_format") from None
    if kind == "structural_tag":
        raise not_supported("response_format structural_tag", "response_format")
    raise bad_request(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format.type",
    )
