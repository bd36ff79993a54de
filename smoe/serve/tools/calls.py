"""Tools, calls and tool_choice as a request gives them, checked once so the rest can trust them."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from smoe.errors import SmoeError

CHOICES = ("none", "auto", "required", "named")


class ToolError(SmoeError):
    """A request's tool fields are wrong; `field` is the request field named in its 400."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the names OpenAI's and Anthropic's APIs accept


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_template_tool(self) -> dict:
        """The OpenAI shape that chat templates (and transformers' apply_chat_template) expect."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12), compare=False)

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Parsed:
    """A reply split into its text and its calls (none: the reply is text)."""
    content: str
    calls: tuple[Call, ...] = ()


@dataclass(frozen=True)
class Choice:
    """none: never call; auto: the model decides; required: at least one call; named: a call of `name`."""
    mode: str = "auto"
    name: str | None = None
    parallel: bool = True  # more than one call in a reply

    def constrains(self) -> bool:
        return self.mode in ("required", "named")


def check_tools(tools: list[Tool], where: str, schema_error, name_key: str = "name",
                schema_key: str = "parameters") -> list[Tool]:
    """`tools` with unique names of the characters OpenAI and Anthropic allow and parameter schemas that
    `schema_error(schema)` (None when it compiles) accepts; `where` is the request field ("tools"), and a tool's
    fields are named `name_key` and `schema_key` in the request (OpenAI's "function.name", Anthropic's "name")."""
    seen = set()
    for i, tool in enumerate(tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise ToolError(f"{where}.{i}.{name_key}", f"a tool's name is 1 to 64 letters, digits, '_' or '-', "
                                                        f"got {json.dumps(tool.name)}")
        if tool.name in seen:
            raise ToolError(f"{where}.{i}.{name_key}", f"two tools are named {tool.name!r}")
        seen.add(tool.name)
        if tool.parameters.get("type", "object") != "object":
            raise ToolError(f"{where}.{i}.{schema_key}",
                            "a tool's arguments are a JSON object: its schema's type must be \"object\"")
        if (problem := schema_error(tool.parameters)) is not None:
            raise ToolError(f"{where}.{i}.{schema_key}", f"not a usable JSON schema ({problem})")
    return tools


def check_choice(choice: Choice, tools: list[Tool], where: str) -> Choice:
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        known = ", ".join(t.name for t in tools) or "none"
        raise ToolError(where, f"names the tool {choice.name!r}, which is not among the request's tools ({known})")
    if choice.constrains() and not tools:
        raise ToolError(where, f"{choice.mode} needs at least one tool in `tools`")
    return choice


def chosen_tools(tools: list[Tool], choice: Choice) -> list[Tool]:
    """The tools a constrained reply may call."""
    return [t for t in tools if t.name == choice.name] if choice.mode == "named" else tools


def reply_of(text: str, parsed: Parsed | None, tools: list[Tool]) -> Parsed:
    """The reply `text` as calls when it parsed into calls of the request's tools; as text otherwise
    (a reply that does not parse, or calls a tool the request does not have). A reply parsed into
    text alone keeps that text: harmony's is its final channel, without the reasoning around it."""
    names = {t.name for t in tools}
    if parsed is None or any(c.name not in names for c in parsed.calls):
        return Parsed(text)
    return parsed
