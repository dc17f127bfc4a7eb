"""The chart README's values table is generated from the ``# --`` comments of values.yaml.

Regenerate it after changing values.yaml::

    .venv/bin/python -m tests.operator.test_chart_values_table --write

The table covers every documented key except those of a top-level group the README documents in a
table of its own (a row naming ``group.key``), so such a section can keep its own wording.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import yaml

from tests.operator.conftest import CHART

VALUES = CHART / "values.yaml"
README = CHART / "README.md"
START = "<!-- values table: generated from values.yaml by tests/operator/test_chart_values_table.py -->"
END = "<!-- end of values table -->"
_KEY = re.compile(r"^(\s*)([A-Za-z][\w]*):(.*)$")


def documented_values(text: str) -> list[tuple[str, str]]:
    """(dotted key, comment) for each key with a ``# --`` block right above it, in file order.

    A documented key whose value is a mapping is one entry (its nested keys are its default).
    """
    lines = text.splitlines()
    out: list[tuple[str, str]] = []
    path: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    skip_below: int | None = None
    for index, line in enumerate(lines):
        match = _KEY.match(line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        if skip_below is not None and indent > skip_below:
            continue
        skip_below = None
        while path and path[-1][0] >= indent:
            path.pop()
        comment: list[str] = []
        above = index - 1
        while above >= 0 and lines[above].lstrip().startswith("#"):
            stripped = lines[above].strip()
            comment.insert(0, stripped[1:].strip())
            if stripped.startswith("# --"):
                break
            above -= 1
        dotted = ".".join([k for _, k in path] + [key])
        if comment and comment[0].startswith("--"):
            comment[0] = comment[0][2:].strip()
            out.append((dotted, " ".join(c for c in comment if c)))
            skip_below = indent
        else:
            path.append((indent, key))
    return out


def lookup(values: dict[str, Any], dotted: str) -> Any:
    node: Any = values
    for key in dotted.split("."):
        node = node[key]
    return node


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def groups_documented_elsewhere(readme: str) -> set[str]:
    """Top-level groups a README table outside the generated one names as `group.key`."""
    outside = readme
    if START in readme and END in readme:
        outside = readme[: readme.index(START)] + readme[readme.index(END) :]
    rows = [line for line in outside.splitlines() if line.startswith("| `")]
    return {m.group(1) for row in rows for m in re.finditer(r"`([A-Za-z]\w*)\.[A-Za-z][\w.]*`", row)}


def generate(values_text: str, readme: str) -> str:
    values = yaml.safe_load(values_text)
    skip = groups_documented_elsewhere(readme)
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for dotted, comment in documented_values(values_text):
        if dotted.split(".")[0] in skip:
            continue
        default = json.dumps(lookup(values, dotted), separators=(", ", ": "))
        rows.append(f"| `{dotted}` | `{_cell(default)}` | {_cell(comment)} |")
    return "\n".join([START, *rows, END])


def current_table(readme: str) -> str | None:
    if START not in readme or END not in readme:
        return None
    return readme[readme.index(START) : readme.index(END) + len(END)]


def test_readme_values_table_is_generated_from_values_yaml():
    readme = README.read_text()
    expected = generate(VALUES.read_text(), readme)
    assert current_table(readme) == expected, (
        "charts/kvpilot/README.md's values table is out of date: "
        "run .venv/bin/python -m tests.operator.test_chart_values_table --write"
    )


def test_every_documented_key_exists_and_every_key_is_covered():
    values_text = VALUES.read_text()
    values = yaml.safe_load(values_text)
    documented = dict(documented_values(values_text))
    for dotted in documented:
        lookup(values, dotted)  # raises KeyError for a key the parser misread

    def leaves(node: Any, prefix: str = "") -> set[str]:
        if isinstance(node, dict) and node and prefix not in documented:
            return set().union(*(leaves(v, f"{prefix}.{k}" if prefix else k) for k, v in node.items()))
        return {prefix}

    uncovered = {
        leaf for leaf in leaves(values) if not any(leaf == d or leaf.startswith(d + ".") for d in documented)
    }
    assert uncovered == set()


def test_parser_reads_nested_keys_and_multi_line_comments():
    text = (
        "# header\n\n"
        "a:\n"
        "  # -- First line\n"
        "  # second line.\n"
        "  b: 1\n"
        "  # -- A mapping documented as one value.\n"
        "  c:\n"
        "    d: 2\n"
        "# -- Top.\n"
        "e: x\n"
    )
    assert documented_values(text) == [
        ("a.b", "First line second line."),
        ("a.c", "A mapping documented as one value."),
        ("e", "Top."),
    ]
    table = generate(text, "")
    assert '| `a.c` | `{"d": 2}` | A mapping documented as one value. |' in table
    assert generate(text, "| `a.b` | elsewhere |\n").count("`a.") == 0


def main() -> int:
    """``--write``: rewrite the README's table (replacing the markers' content); else print it."""
    readme = README.read_text()
    table = generate(VALUES.read_text(), readme)
    if "--write" not in sys.argv[1:]:
        print(table)
        return 0
    existing = current_table(readme)
    if existing is None:
        print(f"{README}: add the markers {START!r} and {END!r} where the table goes", file=sys.stderr)
        return 1
    README.write_text(readme.replace(existing, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
