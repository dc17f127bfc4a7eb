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
from kvpilot.operator.render.builders import build_children
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


def test_the_starting_example_renders_what_its_header_promises():
    """Two single-GPU replicas behind a Service and a PDB, the engine run with the spec's own values."""
    assert EXAMPLE in EXAMPLES and len(EXAMPLES) >= 3
    example = yaml.safe_load(EXAMPLE.read_text())
    children = {c["kind"]: c for c in build_children(resolve(example))}
    assert sorted(children) == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]
    assert children["ConfigMap"]["data"] == {"live-config.json": "{}\n"}  # no live change yet
    deployment = children["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = container["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == "/mnt/models/llama-3.1-8b-instruct"
    assert (flags["--served-model-name"], flags["--max-num-seqs"], flags["--max-model-len"]) == (
        "llama-3.1-8b",
        "256",
        "8192",
    )


def test_there_are_invalid_examples_of_both_kinds():
    kinds = [EXPECT.match(p.read_text().splitlines()[0]).group(1) for p in INVALID]
    assert kinds.count("schema") >= 8 and kinds.count("operator") >= 5


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_example_fails_with_its_message(path, crd_schema):
    kind, message = EXPECT.match(path.read_text().splitlines()[0]).groups()
    manifest = yaml.safe_load(path.read_text())
    by_schema = schema_errors(manifest, crd_schema)
    by_operator = list(resolve(manifest).problems)
    # Exactly one fault per manifest: with two, it would still be refused with the rule under test gone.
    assert len(by_operator) == 1, by_operator
    if kind == "schema":
        assert len(by_schema) == 1 and message in by_schema[0], by_schema
    else:
        assert by_schema == [], "the schema should admit it; the operator's validation catches it"
        assert message in by_operator[0], by_operator
    assert by_operator, "kvpilot render must refuse every invalid manifest too"
