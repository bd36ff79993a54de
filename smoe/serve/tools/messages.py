"""Request messages as the chat template's turns, tool calls and their results included, and the
request's tool fields as one `ToolUse`. OpenAI sends calls on assistant messages and results as
`tool` messages; Anthropic sends `tool_use` blocks in assistant turns and `tool_result` blocks in
user turns. Templates read transformers' shape: assistant turns with `tool_calls` (arguments as
objects), then one {"role": "tool"} turn per result."""

from __future__ import annotations

from dataclasses import dataclass

from smoe.serve.tools.calls import Call, Choice, Tool, ToolError, check_choice, check_tools
from smoe.serve.tools.formats.base import arguments_of
from smoe.serve.tools.grammar import schema_error
from smoe.serve.tools.template import template_call


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and tool_choice, checked."""
    tools: tuple[Tool, ...] = ()
    choice: Choice = Choice("none")

    def template_tools(self) -> list[dict]:
        """The tools shown to the model: none when it may not call them."""
        return [t.as_template_tool() for t in self.tools] if self.active() else []

    def active(self) -> bool:
        """Whether replies are read for calls."""
        return bool(self.tools) and self.choice.mode != "none"


def text_of_parts(content) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content if getattr(p, "type", "") == "text")


class CallLedger:
    """The calls made so far in a conversation, by id, so that each result names a call that was made."""

    def __init__(self):
        self.names: dict[str, str] = {}

    def made(self, call_id: str, name: str) -> None:
        self.names[call_id] = name

    def answered(self, call_id: str, where: str) -> str:
        if call_id not in self.names:
            made = ", ".join(self.names) or "none"
            raise ToolError(where, f"no earlier assistant tool call has id {call_id!r} (calls made: {made})")
        return self.names[call_id]


# --- OpenAI ----------------------------------------------------------------------------------------

def openai_turns(messages) -> list[dict]:
    ledger, turns = CallLedger(), []
    for i, m in enumerate(messages):
        if m.role == "tool":
            if not m.tool_call_id:
                raise ToolError(f"messages.{i}.tool_call_id", "a tool message names the call it answers")
            name = ledger.answered(m.tool_call_id, f"messages.{i}.tool_call_id")
            turns.append({"role": "tool", "content": text_of_parts(m.content), "tool_call_id": m.tool_call_id,
                          "name": name})
        elif m.role == "assistant" and m.tool_calls:
            turns.append({"role": "assistant", "content": text_of_parts(m.content),
                          "tool_calls": [openai_call(ledger, c, f"messages.{i}.tool_calls.{j}")
                                         for j, c in enumerate(m.tool_calls)]})
        else:
            turns.append(m.as_turn())
    return turns


def openai_call(ledger: CallLedger, ref, where: str) -> dict:
    arguments = arguments_of(ref.function.arguments)
    if arguments is None:
        raise ToolError(f"{where}.function.arguments", "must be a JSON object written as a string")
    ledger.made(ref.id, ref.function.name)
    return template_call(Call(ref.function.name, arguments), ref.id)


def openai_tool_use(req) -> ToolUse:
    tools = check_tools([Tool(t.function.name, t.function.description or "", t.function.parameters or empty_object())
                         for t in req.tools or ()], "tools", schema_error, "function.name", "function.parameters")
    choice = req.tool_choice
    if choice is None:
        mode, name = ("auto" if tools else "none"), None
    elif isinstance(choice, str):
        mode, name = choice, None
    else:
        mode, name = "named", choice.function.name
    return ToolUse(tuple(tools), check_choice(Choice(mode, name, req.parallel_tool_calls), tools, "tool_choice"))


def empty_object() -> dict:
    return {"type": "object", "properties": {}}


# --- Anthropic -------------------------------------------------------------------------------------

ANTHROPIC_MODES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


def anthropic_turns(system, messages) -> list[dict]:
    ledger = CallLedger()
    turns = [{"role": "system", "content": text_of_parts(system)}] if system else []
    for i, m in enumerate(messages):
        turns += anthropic_message_turns(ledger, m, i)
    return turns


def anthropic_message_turns(ledger: CallLedger, m, i: int) -> list[dict]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    blocks = list(enumerate(m.content))
    results = [(j, b) for j, b in blocks if b.type == "tool_result"]
    uses = [(j, b) for j, b in blocks if b.type == "tool_use"]
    turns = [{"role": "tool", "content": text_of_parts(b.content), "tool_call_id": b.tool_use_id,
              "name": ledger.answered(b.tool_use_id, f"messages.{i}.content.{j}.tool_use_id")} for j, b in results]
    text = text_of_parts(m.content)
    if uses:
        if m.role != "assistant":
            raise ToolError(f"messages.{i}.content.{uses[0][0]}", "tool_use blocks belong to assistant messages")
        for _, b in uses:
            ledger.made(b.id, b.name)
        turns.append({"role": "assistant", "content": text,
                      "tool_calls": [template_call(Call(b.name, b.input), b.id) for _, b in uses]})
    elif text or not results:
        turns.append({"role": m.role, "content": text})
    return turns


def anthropic_tool_use(req) -> ToolUse:
    tools = check_tools([Tool(t.name, t.description or "", t.input_schema) for t in req.tools or ()], "tools",
                        schema_error, schema_key="input_schema")
    choice = req.tool_choice
    if choice is None:
        return ToolUse(tuple(tools), Choice("auto" if tools else "none"))
    if choice.type == "tool" and not choice.name:
        raise ToolError("tool_choice.name", "tool_choice of type \"tool\" names the tool")
    picked = Choice(ANTHROPIC_MODES[choice.type], choice.name if choice.type == "tool" else None,
                    not choice.disable_parallel_tool_use)
    return ToolUse(tuple(tools), check_choice(picked, tools, "tool_choice"))
