"""Kimi-K2's syntax: a section of calls, each with an id "functions.NAME:INDEX" and JSON arguments.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
    (one line: broken here to fit)
"""

from __future__ import annotations

import re

from smoe.serve.tools.calls import Call, Parsed, Tool
from smoe.serve.tools.formats.base import CallFormat, arguments_of, json_at
from smoe.serve.tools.grammar import closed, json_rule, lark_literal

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
CALL_ID = re.compile(r"\s*(?:functions\.)?(?P<name>[^:\s]+):(?P<index>\d+)\s*")


class Kimi(CallFormat):
    def parse(self, text: str) -> Parsed | None:
        begin = text.find(SECTION_BEGIN)
        if begin < 0:
            return None
        calls, pos = [], begin + len(SECTION_BEGIN)
        while text.startswith(CALL_BEGIN, pos):
            marker = text.find(ARGUMENTS, pos)
            call_id = CALL_ID.fullmatch(text, pos + len(CALL_BEGIN), marker) if marker >= 0 else None
            found = json_at(text, marker + len(ARGUMENTS)) if call_id else None
            arguments = arguments_of(found[0]) if found else None
            if arguments is None or not text.startswith(CALL_END, found[1]):
                return None
            calls.append(Call(call_id["name"], arguments, f"functions.{call_id['name']}:{call_id['index']}"))
            pos = found[1] + len(CALL_END)
        if not calls or not (text.startswith(SECTION_END, pos) or not text[pos:].strip()):
            return None
        return Parsed(text[:begin].strip(), tuple(calls))

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        # the index counts the reply's calls; a grammar cannot count, so one call only
        rules = [f"call{i}: {literal(CALL_BEGIN)} {lark_literal('functions.' + t.name + ':0')} {literal(ARGUMENTS)} "
                 f"{json_rule(closed(t.parameters))} {literal(CALL_END)}" for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call{i}" for i in range(len(tools)))
        return (f"start: {literal(SECTION_BEGIN)} call {literal(SECTION_END)}\n"
                f"call: {alternatives}\n" + "\n".join(rules) + "\n")


KIMI = Kimi("kimi_k2", SECTION_BEGIN)
