"""gpt-oss's harmony syntax: a reply is messages, each a header naming its channel (and, for a call,
its recipient) and a body; a call is a commentary message to functions.NAME whose body is JSON.

    <|channel|>analysis<|message|>The user wants Paris.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    (one line: broken here to fit)

The recipient may stand before the channel instead (`<|start|>assistant to=functions.get_weather
<|channel|>commentary json<|message|>`, as gpt-oss's chat template writes past calls). The final
channel's text is the reply's content and commentary without a recipient is a preamble shown to
the user; the analysis channel is reasoning, never content.
"""

from __future__ import annotations

import re

from smoe.serve.tools.calls import Call, Parsed, Tool
from smoe.serve.tools.formats.base import CallFormat, arguments_of, joined
from smoe.serve.tools.grammar import closed, json_rule, lark_literal

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
FUNCTIONS = "functions."
END = r"<\|(?:end|call|return)\|>"
# a message's body runs to its end marker, or to the end of the text (the end of sequence took it)
MESSAGE_PART = re.compile(rf"(?P<header>.*?)<\|message\|>(?P<body>(?:(?!{END}).)*)(?:{END})?", re.S)
RECIPIENT = re.compile(r"(?:^|\s)to=(?P<to>[^\s<]+)")
CHANNEL_NAME = re.compile(r"<\|channel\|>(?P<channel>\w+)")
SHOWN = ("final", "commentary")


class Harmony(CallFormat):
    def parse(self, text: str) -> Parsed | None:
        content, calls = [], []
        for part in text.split(START):
            if not part.strip():
                continue  # text before the first <|start|> may be none: the prompt opens the first message
            message = MESSAGE_PART.fullmatch(part)
            if message is None:
                return None
            recipient, channel = RECIPIENT.search(message["header"]), CHANNEL_NAME.search(message["header"])
            if recipient is not None and recipient["to"].startswith(FUNCTIONS):
                if (arguments := arguments_of(message["body"])) is None:
                    return None
                calls.append(Call(recipient["to"][len(FUNCTIONS):], arguments))
            elif recipient is None and channel is not None and channel["channel"] in SHOWN:
                content.append(message["body"])
        return Parsed(joined(content), tuple(calls))

    def grammar(self, tools: list[Tool], parallel: bool, literal=lark_literal) -> str:
        # <|call|> ends gpt-oss's turn (it is one of its end-of-sequence tokens): a reply holds one
        # call whatever `parallel` says, and the grammar stops before the marker, which the end of
        # sequence writes
        rules = [f"call{i}: {literal(CHANNEL)} {lark_literal(f'commentary to={FUNCTIONS}{t.name} ')} "
                 f"{literal(CONSTRAIN)} {lark_literal('json')} {literal(MESSAGE)} {json_rule(closed(t.parameters))}"
                 for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call{i}" for i in range(len(tools)))
        return "start: call\n" + f"call: {alternatives}\n" + "\n".join(rules) + "\n"


# every message's header may hold a call (its recipient stands in the header, before or after the
# channel) and nothing in a reply is outside a message: a streamed reply is held whole
HARMONY = Harmony("harmony", "")
