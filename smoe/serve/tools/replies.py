"""A reply with calls in each API's shape: OpenAI's `tool_calls` (arguments as a JSON string) and
finish_reason "tool_calls", Anthropic's `tool_use` blocks and stop_reason "tool_use"."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from smoe.serve.tools.calls import Call, Parsed, reply_of
from smoe.serve.tools.formats import CallFormat
from smoe.serve.tools.messages import ToolUse
from smoe.serve.tools.stream import CallHolder


@dataclass(frozen=True)
class ToolTurn:
    """What a request's reply is read with: its tools and choice, the template's call format, and
    the grammar decoding follows (None: free text)."""
    use: ToolUse
    fmt: CallFormat | None
    constraint: object = None

    def shaped(self, reply):
        """A job's smoe.serve.worker.Reply, constrained to the grammar and keeping call markers in its text."""
        return replace(reply, constraint=self.constraint, special_text=self.reads_calls())

    def reads_calls(self) -> bool:
        return self.fmt is not None and self.use.active()

    def holder(self) -> CallHolder | None:
        """For a streamed reply: what holds back text that may open a call (None: text only)."""
        return CallHolder(self.fmt.start) if self.reads_calls() else None

    def reply(self, text: str) -> Parsed:
        """The reply as text and calls; text only unless the request reads calls."""
        if not self.reads_calls():
            return Parsed(text)
        return reply_of(text, self.fmt.parse(text), list(self.use.tools))


def openai_call(call: Call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}
    return out if index is None else {"index": index, **out}


def openai_message(reply: Parsed) -> dict:
    if not reply.calls:
        return {"role": "assistant", "content": reply.content, "refusal": None}
    return {"role": "assistant", "content": reply.content or None, "refusal": None,
            "tool_calls": [openai_call(c) for c in reply.calls]}


def openai_finish(reply: Parsed, finish: str) -> str:
    return "tool_calls" if reply.calls else finish


def anthropic_id(call: Call) -> str:
    return call.id if call.id.startswith("toolu_") else "toolu_" + call.id.removeprefix("call_")


def anthropic_blocks(reply: Parsed) -> list[dict]:
    text = [{"type": "text", "text": reply.content}] if reply.content or not reply.calls else []
    return text + [{"type": "tool_use", "id": anthropic_id(c), "name": c.name, "input": c.arguments}
                   for c in reply.calls]


def anthropic_stop(reply: Parsed, stop: str) -> str:
    return "tool_use" if reply.calls else stop


def anthropic_tool_events(reply: Parsed, first_index: int) -> list[tuple[dict, str]]:
    """The (data, event name) of each tool_use block of a streamed reply: opened, its input as one
    JSON delta, closed."""
    events = []
    for index, block in enumerate(anthropic_blocks(reply)[1 if reply.content else 0:], first_index):
        if block["type"] != "tool_use":
            continue
        events += [({"type": "content_block_start", "index": index,
                     "content_block": {**block, "input": {}}}, "content_block_start"),
                   ({"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                    "content_block_delta"),
                   ({"type": "content_block_stop", "index": index}, "content_block_stop")]
    return events
