"""Hermes' syntax, which Qwen2.5 and Qwen3 share: each call a JSON object in <tool_call> tags.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from smoe.serve.tools.calls import Parsed, Tool
from smoe.serve.tools.formats.base import CallFormat, call_of, joined, json_at, skip_space
from smoe.serve.tools.grammar import call_object, json_rule, lark_literal, repeated, tool_defs

OPEN, CLOSE, NL = "<tool_call>", "</tool_call>", "\n"


class Hermes(CallFormat):
    def parse(self, text: str) -> Parsed | None:
        content, calls, pos = [], [], 0
        while (begin := text.find(OPEN, pos)) >= 0:
            content.append(text[pos:begin])
            found = json_at(text, begin + len(OPEN))
            if found is None or (call := call_of(found[0])) is None:
                return None
            calls.append(call)
            pos = skip_space(text, found[1])
            if text.startswith(CLOSE, pos):
                pos += len(CLOSE)
            elif pos < len(text):  # an end of text may cut the closing tag, nothing else may follow
                return None
        content.append(text[pos:])
        return Parsed(joined(content), tuple(calls)) if calls else None

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        arguments = json_rule(call_object(tools) | {"$defs": tool_defs(tools)})
        call = f"{literal(OPEN)} {literal(NL)} {arguments} {literal(NL)} {literal(CLOSE)}"
        return f"start: {repeated('call', parallel, literal(NL))}\ncall: {call}\n"


HERMES = Hermes("hermes", OPEN)
