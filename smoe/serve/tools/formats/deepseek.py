"""DeepSeek-V3.1's syntax: calls between its tool-call markers, each a name and JSON arguments.

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from smoe.serve.tools.calls import Call, Parsed, Tool
from smoe.serve.tools.formats.base import CallFormat, arguments_of, json_at
from smoe.serve.tools.grammar import closed, json_rule, lark_literal, repeated

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class DeepSeek(CallFormat):
    def parse(self, text: str) -> Parsed | None:
        begin = text.find(CALLS_BEGIN)
        if begin < 0:
            return None
        calls, pos = [], begin + len(CALLS_BEGIN)
        while text.startswith(CALL_BEGIN, pos):
            sep = text.find(SEP, pos)
            found = json_at(text, sep + len(SEP)) if sep >= 0 else None
            arguments = arguments_of(found[0]) if found else None
            if arguments is None or not text.startswith(CALL_END, found[1]):
                return None
            calls.append(Call(text[pos + len(CALL_BEGIN):sep].strip(), arguments))
            pos = found[1] + len(CALL_END)
        if not calls or not (text.startswith(CALLS_END, pos) or not text[pos:].strip()):
            return None
        return Parsed(text[:begin].strip(), tuple(calls))

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        rules = [f"call{i}: {literal(CALL_BEGIN)} {lark_literal(t.name)} {literal(SEP)} {json_rule(closed(t.parameters))} "
                 f"{literal(CALL_END)}" for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call{i}" for i in range(len(tools)))
        return (f"start: {literal(CALLS_BEGIN)} {repeated('call', parallel)} {literal(CALLS_END)}\n"
                f"call: {alternatives}\n" + "\n".join(rules) + "\n")


DEEPSEEK = DeepSeek("deepseek_v3.1", CALLS_BEGIN)
