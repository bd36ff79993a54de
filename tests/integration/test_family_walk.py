"""The walk over every MoE family of the pinned transformers (smoe.testing.coverage) against
docs/FAMILIES.md, the table it wrote: a family that ran must still run on the same decoder, and a family
transformers adds fails here until the table lists it (`python -m smoe.testing.coverage`)."""

import re
from pathlib import Path

from smoe.testing import coverage

TABLE = Path(__file__).resolve().parents[2] / "docs" / "FAMILIES.md"
ROW = re.compile(r"^\| `(?P<model_type>[^`]+)` \| (?P<result>[^|]+) \| (?P<decoder>[^|]*) \|", re.M)


def test_every_moe_family_of_transformers_runs_as_the_table_says():
    listed = {m["model_type"]: (m["result"].strip(), m["decoder"].strip()) for m in ROW.finditer(TABLE.read_text())}
    rows = coverage.walk()
    assert sorted(r.model_type for r in rows) == sorted(listed), "families not in docs/FAMILIES.md, or gone"
    for r in rows:
        result, decoder = listed[r.model_type]
        if result == "runs":
            assert r.passed and r.decoder == decoder, f"{r.model_type}: {r.stage} {r.error}"
