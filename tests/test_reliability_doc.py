"""docs/reliability.md stays true: every message in its table is made of text the code raises, and
every test it names exists."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
HOLE = "\x00"  # stands for an interpolated value in the code's strings


def _table_rows() -> list[list[str]]:
    text = DOC.read_text()
    table = text[text.index("## Bad inputs and their messages"):]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| bad input")]
    return [[c.strip() for c in re.split(r" \| ", row.strip("| "))] for row in rows]


def _code_strings() -> list[str]:
    """Every string and f-string in meshplan/, with each interpolation replaced by HOLE."""
    out = []
    for path in (ROOT / "meshplan").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def _fragments(message: str) -> list[str]:
    """The literal pieces of a documented message between its `{placeholders}`."""
    pieces = (f.strip() for f in re.split(r"\{[^{}]*\}", message))  # messages are joined from pieces at spaces
    return [f for f in pieces if len(f.strip(" ;:.,()'`")) >= 3]


def test_every_documented_message_is_raised_by_the_code():
    strings = _code_strings()
    rows = _table_rows()
    assert len(rows) >= 30, f"the table lost rows: {len(rows)}"
    for bad_input, raised, message, test in rows:
        assert message.startswith("`") and message.endswith("`"), f"{bad_input}: message must be code-quoted"
        message = message.strip("`").strip()
        for fragment in _fragments(message):
            assert any(fragment in s for s in strings), f"{bad_input}: {fragment!r} appears in no string of meshplan/"


def test_every_documented_test_exists():
    for bad_input, _, _, test in _table_rows():
        file, name = test.split("::")
        source = (ROOT / file).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{bad_input}: {test} does not exist"


def test_fragments_are_checked_for_real():
    strings = _code_strings()
    assert not any("their product must equal devices!" in s for s in strings)
    assert _fragments("mesh_shape {shape} has {n} devices") == ["mesh_shape", "has", "devices"]
