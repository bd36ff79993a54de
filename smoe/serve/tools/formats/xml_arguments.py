"""What the formats that write each argument in its own tags (GLM-4.x, MiniMax-M2) share: a value
is written raw when it is a string and as JSON otherwise, and read back the same way."""

from __future__ import annotations

import json

from smoe.serve.tools.calls import Tool
from smoe.serve.tools.grammar import closed, json_rule, lark_literal, standalone


def value_of(raw: str):
    """A written argument: JSON when it reads as JSON (2, true, [1]), the raw text otherwise (a string)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def value_rule(schema: dict, stop: str) -> str:
    """Lark for one written value of `schema`: strings raw (never containing `stop`'s first character), others as JSON."""
    if schema.get("type") == "string" and "enum" in schema:
        return "(" + " | ".join(lark_literal(v) for v in schema["enum"]) + ")"
    if schema.get("type") == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return f"/[^{stop[0]}]{{{low},{high}}}/"
    return json_rule(schema)


def argument_rules(tool: Tool, pair) -> str:
    """Lark for a tool's arguments in the order declared, required ones always and others optionally;
    `pair(key, value_rule)` writes one argument."""
    properties = tool.parameters.get("properties", {})
    required = set(tool.parameters.get("required", ()))
    items = []
    for key, schema in properties.items():
        item = pair(key, standalone(schema, closed(tool.parameters)))
        items.append(item if key in required else f"({item})?")
    return " ".join(items) or '""'
