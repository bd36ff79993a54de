"""MiniMax-M2's syntax: invocations in one <minimax:tool_call> block, each argument a parameter tag.

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>
"""

from __future__ import annotations

import re

from smoe.serve.tools.calls import Call, Parsed, Tool
from smoe.serve.tools.formats.base import CallFormat
from smoe.serve.tools.formats.xml_arguments import argument_rules, value_of, value_rule
from smoe.serve.tools.grammar import lark_literal, repeated

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
BLOCK = re.compile(r"<minimax:tool_call>(?P<body>.*?)(?:</minimax:tool_call>|$)", re.S)
INVOKE = re.compile(r'\s*<invoke name="(?P<name>[^"]+)">(?P<parameters>.*?)</invoke>\s*', re.S)
PARAMETER = re.compile(r'<parameter name="(?P<key>[^"]+)">(?P<value>.*?)</parameter>', re.S)


class MiniMax(CallFormat):
    def parse(self, text: str) -> Parsed | None:
        block = BLOCK.search(text)
        if block is None:
            return None
        calls, pos, body = [], 0, block["body"]
        while (invoke := INVOKE.match(body, pos)) is not None:
            arguments = {p["key"]: value_of(p["value"].strip("\n")) for p in PARAMETER.finditer(invoke["parameters"])}
            calls.append(Call(invoke["name"], arguments))
            pos = invoke.end()
        if not calls or body[pos:].strip():
            return None
        return Parsed((text[:block.start()] + text[block.end():]).strip(), tuple(calls))

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        def pair(key, schema):
            return f'{lark_literal(f"<parameter name={chr(34)}{key}{chr(34)}>")} {value_rule(schema, "<")} "</parameter>\\n"'
        rules = [f'call{i}: {lark_literal(f"<invoke name={chr(34)}{t.name}{chr(34)}>")} "\\n" {argument_rules(t, pair)} '
                 f'"</invoke>\\n"' for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call{i}" for i in range(len(tools)))
        return (f'start: {literal(OPEN)} "\\n" {repeated("call", parallel)} {literal(CLOSE)}\n'
                f"call: {alternatives}\n" + "\n".join(rules) + "\n")


MINIMAX = MiniMax("minimax_m2", OPEN)
