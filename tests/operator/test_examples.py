"""Examples validate against the CRD and the operator; invalid manifests fail with their message.

Each file in ``invalid/`` starts with ``# expect (schema|operator): MESSAGE``: ``schema`` means the
API server rejects it (MESSAGE is among the schema or CEL errors); ``operator`` means the schema
admits it and the operator's validation reports MESSAGE. Every one of them is also refused by
``kvpilot render`` (the operator's validation covers what no API server checked).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvpilot.operator.api.settings import resolve
from tests.operator.conftest import EXAMPLE
from tests.operator.crd_schema import schema_errors

INVALID = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))
EXPECT = re.compile(r"^# expect \((schema|operator)\): (.+)$")


EXAMPLES = sorted(EXAMPLE.parent.glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_valid_everywhere(crd_schema, path):
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert [d["kind"] for d in documents] == ["InferenceService"]
    for document in documents:
        assert schema_errors(document, crd_schema) == []
        assert list(resolve(document).problems) == []


def test_the_starting_example_is_among_them():
    assert EXAMPLE in EXAMPLES and len(EXAMPLES) >= 3


def test_there_are_invalid_examples_of_both_kinds():
    kinds = [EXPECT.match(p.read_text().splitlines()[0]).group(1) for p in INVALID]
    assert kinds.count("schema") >= 8 and kinds.count("operator") >= 5


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_example_fails_with_its_message(path, crd_schema):
    kind, message = EXPECT.match(path.read_text().splitlines()[0]).groups()
    manifest = yaml.safe_load(path.read_text())
    by_schema = schema_errors(manifest, crd_schema)
    by_operator = list(resolve(manifest).problems)
    if kind == "schema":
        assert any(message in error for error in by_schema), by_schema
    else:
        assert by_schema == [], "the schema should admit it; the operator's validation catches it"
        assert any(message in problem for problem in by_operator), by_operator
    assert by_operator, "kvpilot render must refuse every invalid manifest too"
