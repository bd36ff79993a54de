"""What every call format shares: reading a JSON value inside text, and a call from a JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass

from smoe.serve.tools.calls import Call, Parsed, Tool
from smoe.serve.tools.grammar import lark_literal

DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class CallFormat:
    """One family's call syntax. `start` opens the calls in a reply (streamed text is held back from
    there); `parse` gives the reply's text and calls, None when the calls in it do not parse; `grammar`
    is the Lark grammar of a reply of calls only (one, or several when `parallel`), its fixed text
    written by `literal` (smoe.serve.tools.grammar.literal_of)."""
    name: str
    start: str

    def parse(self, text: str) -> Parsed | None:
        raise NotImplementedError

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        raise NotImplementedError


def json_at(text: str, pos: int):
    """(value, end) of the JSON value at text[pos:] after whitespace, or None."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def arguments_of(value) -> dict | None:
    """A call's arguments, given as an object or as a string of JSON (as OpenAI sends them)."""
    if isinstance(value, str):
        found = json_at(value, 0)
        if found is None or value[found[1]:].strip():
            return None
        value = found[0]
    return value if isinstance(value, dict) else None


def call_of(obj, name_key: str = "name", arguments_key: str = "arguments") -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return None
    arguments = arguments_of(obj.get(arguments_key, {}))
    return None if arguments is None else Call(obj[name_key], arguments)


def joined(parts: list[str]) -> str:
    return "".join(parts).strip()
