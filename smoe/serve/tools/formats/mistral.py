"""Mistral's syntax (Mistral-Nemo, Mistral-Small): one JSON list of calls after [TOOL_CALLS].

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
"""

from __future__ import annotations

import secrets
import string

from smoe.serve.tools.calls import Call, Parsed, Tool
from smoe.serve.tools.formats.base import CallFormat, call_of, json_at
from smoe.serve.tools.grammar import call_object, json_rule, lark_literal, tool_defs

OPEN = "[TOOL_CALLS]"
ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_id() -> str:
    """Mistral's templates accept only ids of nine letters and digits."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


class Mistral(CallFormat):
    def parse(self, text: str) -> Parsed | None:
        begin = text.find(OPEN)
        found = json_at(text, begin + len(OPEN)) if begin >= 0 else None
        if found is None or not isinstance(found[0], list) or not found[0]:
            return None
        calls = [call_of(obj) for obj in found[0]]
        if None in calls:
            return None
        ids = [obj.get("id") if isinstance(obj.get("id"), str) else mistral_id() for obj in found[0]]
        content = text[:begin] + text[found[1]:]
        return Parsed(content.strip(), tuple(Call(c.name, c.arguments, i) for c, i in zip(calls, ids)))

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        calls = {"type": "array", "items": call_object(tools), "minItems": 1, **({} if parallel else {"maxItems": 1}),
                 "$defs": tool_defs(tools)}
        return f"start: {literal(OPEN)} {json_rule(calls)}\n"


MISTRAL = Mistral("mistral", OPEN)
