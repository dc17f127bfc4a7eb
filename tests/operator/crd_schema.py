"""Validate objects against a CRD's openAPIV3Schema the way the API server does, without one.

jsonschema (Draft 4, whose boolean ``exclusiveMinimum`` matches OpenAPI v3.0) checks types, enums,
ranges and patterns; on top of it this module handles the Kubernetes extensions:

- structural defaulting (``default:`` applied to absent keys of present objects, before validation);
- strict field validation (unknown fields are rejected, as ``kubectl apply`` does by default),
  except under ``x-kubernetes-preserve-unknown-fields``;
- ``x-kubernetes-int-or-string`` (declared with ``anyOf`` in the CRD, which jsonschema understands);
- ``x-kubernetes-validations``: CEL rules evaluated with cel-python, ``self`` typed by the schema.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema


def apply_schema_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill ``default:`` values into ``value`` in place (and return it), like the API server."""
    if isinstance(value, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                apply_schema_defaults(value[key], prop)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                apply_schema_defaults(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_schema_defaults(item, schema["items"])
    return value


def _strict(schema: Any) -> Any:
    """A copy of ``schema`` that rejects unknown fields where the API server would."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _cel_value(value: Any, schema: dict[str, Any]) -> Any:
    """Python value -> CEL value, numbers typed as the schema says (number fields are doubles)."""
    if schema.get("type") == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return celpy.json_to_cel(float(value))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = (
            schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        )
        return celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): _cel_value(v, props.get(k, extra)) for k, v in value.items()}
        )
    if isinstance(value, list):
        return celpy.celtypes.ListType([_cel_value(v, schema.get("items") or {}) for v in value])
    return celpy.json_to_cel(value)


_CEL = celpy.Environment()


def cel_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Messages of every failing ``x-kubernetes-validations`` rule in ``value`` (depth first)."""
    errors: list[str] = []
    if isinstance(value, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(value[key], prop, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors += cel_errors(item, schema["items"], f"{path}[{index}]")
    for rule in schema.get("x-kubernetes-validations") or []:
        program = _CEL.program(_CEL.compile(rule["rule"]))
        result = program.evaluate({"self": _cel_value(value, schema)})
        if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            errors.append(f"{path or '<root>'}: {rule.get('message') or rule['rule']}")
    return errors


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Every reason the API server would reject ``obj`` (a full object) under ``schema``."""
    defaulted = apply_schema_defaults(copy.deepcopy(obj), schema)
    validator = jsonschema.Draft4Validator(_strict(schema))
    errors = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(defaulted), key=lambda e: list(e.absolute_path))
    ]
    if not errors:  # like the API server, CEL runs on objects that passed the schema
        errors += cel_errors(defaulted, schema)
    return errors


def prune_unknown(value: Any, schema: dict[str, Any]) -> Any:
    """Drop fields the schema does not declare, in place (and return ``value``), as the API server
    prunes a structural schema's unknown fields on writes without ``fieldValidation=Strict``."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None and not extra:
            for key in [k for k in value if k not in props]:
                del value[key]
        for key, item in value.items():
            sub = (props or {}).get(key, extra if isinstance(extra, dict) else None)
            if isinstance(sub, dict):
                prune_unknown(item, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            prune_unknown(item, schema["items"])
    return value


def admit(
    obj: dict[str, Any], schema: dict[str, Any], strict: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """What the API server stores for a write of ``obj`` and every reason it answers 422 instead.

    Returns ``(stored, errors)``: a pruned (unless ``strict``: unknown fields are then errors) and
    defaulted copy, and the ``field.path: message`` of each schema or CEL failure (empty: admitted).
    """
    stored = copy.deepcopy(obj)
    if not strict:
        prune_unknown(stored, schema)
    apply_schema_defaults(stored, schema)
    return stored, schema_errors(stored, schema)
