"""GLM-4.5/4.6's syntax: the tool's name, then each argument as a key and a value in tags.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
"""

from __future__ import annotations

import re

from smoe.serve.tools.calls import Call, Parsed, Tool
from smoe.serve.tools.formats.base import CallFormat, joined
from smoe.serve.tools.formats.xml_arguments import argument_rules, value_of, value_rule
from smoe.serve.tools.grammar import lark_literal, repeated

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(r"<tool_call>(?P<name>[^\s<]+)\s*(?P<arguments>(?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)"
                  r"</tool_call>", re.S)
ARGUMENT = re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S)


class Glm(CallFormat):
    def parse(self, text: str) -> Parsed | None:
        content, calls, pos = [], [], 0
        while (begin := text.find(OPEN, pos)) >= 0:
            match = CALL.match(text, begin)
            if match is None:
                return None
            content.append(text[pos:begin])
            arguments = {a["key"].strip(): value_of(a["value"]) for a in ARGUMENT.finditer(match["arguments"])}
            calls.append(Call(match["name"], arguments))
            pos = match.end()
        content.append(text[pos:])
        return Parsed(joined(content), tuple(calls)) if calls else None

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        def pair(key, schema):
            return (f'"<arg_key>" {lark_literal(key)} "</arg_key>\\n<arg_value>" {value_rule(schema, "<")} '
                    f'"</arg_value>\\n"')
        rules = [f'call{i}: {literal(OPEN)} {lark_literal(t.name)} "\\n" {argument_rules(t, pair)} {literal(CLOSE)}'
                 for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call{i}" for i in range(len(tools)))
        return f"start: {repeated('call', parallel, lark_literal(chr(10)))}\ncall: {alternatives}\n" + "\n".join(rules) + "\n"


GLM = Glm("glm4.5", OPEN)
