"""Every environment switch smoe reads is in smoe.switches and in the README's table, and nothing else
of smoe reads SMOE_* variables behind the table's back."""

import re
from pathlib import Path

from smoe.switches import SWITCHES

ROOT = Path(__file__).resolve().parents[1]


def readme_rows() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Environment switches"):]
    return {m[0]: (m[1], m[2]) for m in re.findall(r"^\| `(SMOE_\w+)` \| ([^|]+) \| ([^|]+) \|$", table, re.M)}


def test_the_readme_table_lists_exactly_the_switches_with_their_defaults():
    rows = readme_rows()
    assert set(rows) == {s.name for s in SWITCHES}
    for s in SWITCHES:
        assert rows[s.name] == (s.default or "unset", s.effect)


def test_no_module_reads_an_smoe_variable_outside_the_switches_table():
    names = {s.name for s in SWITCHES}
    for path in (ROOT / "smoe").rglob("*.py"):
        for name in re.findall(r"\b(SMOE_[A-Z_]+)\b", path.read_text()):
            assert name in names, f"{path.relative_to(ROOT)} names {name}, which smoe.switches does not list"
