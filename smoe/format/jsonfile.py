"""JSON as smoe reads it: one parser for every JSON file, which refuses a key given twice in one object
(Python's json keeps the last value and other readers may keep the first: the file means two things)."""

from __future__ import annotations

import json
from pathlib import Path

from smoe.errors import SmoeError


class DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _unique(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


def loads(raw: bytes | str):
    """json.loads, refusing duplicate keys (DuplicateKey, a ValueError)."""
    return json.loads(raw, object_pairs_hook=_unique)


def parse_json(raw: bytes | str, path: Path | str):
    """The JSON value of `raw`, read from `path`; a SmoeError naming the file when it is not valid
    JSON or an object gives one key twice."""
    try:
        return loads(raw)
    except DuplicateKey as e:
        raise SmoeError(f"{path}: the key {e.key!r} appears twice in one object (which value is meant?)") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SmoeError(f"{path}: not valid JSON ({str(e)[:80]})") from None


def read_json(path: Path | str) -> dict:
    """A JSON file holding one object."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise SmoeError(f"{path}: cannot read it ({e.strerror})") from None
    data = parse_json(raw, path)
    if not isinstance(data, dict):
        raise SmoeError(f"{path}: expected a JSON object")
    return data
