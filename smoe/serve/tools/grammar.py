"""Grammars of tool calls and their token masks (llguidance), which the sampler applies.

A call format writes its syntax as a Lark grammar whose arguments are `%json{schema}`: llguidance
compiles it against the model's tokenizer and, token by token, gives the set of tokens that keep
the output inside the grammar; when the grammar is complete it allows only end-of-sequence.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np
import torch

from smoe.serve.tools.calls import Tool, ToolError

# one call's JSON as chat templates print it: json.dumps' separators, no free whitespace (which a
# small model could emit forever)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_error(schema: dict) -> str | None:
    """Why `schema` cannot constrain decoding (not a JSON schema llguidance compiles), or None."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (TypeError, ValueError) as e:
        return str(e).splitlines()[0]
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    return problem.splitlines()[0] if problem else None


def json_rule(schema: dict) -> str:
    """A Lark item that matches one JSON value of `schema` written in JSON_STYLE."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def closed(schema: dict) -> dict:
    """A tool's parameters with no properties beyond those declared, unless the schema says otherwise:
    decoding that may add keys at will can wander until it runs out of tokens."""
    return schema if "additionalProperties" in schema or "properties" not in schema else \
        {**schema, "additionalProperties": False}


def call_object(tools: list[Tool], name_key: str = "name", arguments_key: str = "arguments") -> dict:
    """The schema of {"name": <one of the tools>, "arguments": <its arguments>}; each tool's arguments are a
    reference into tool_defs(tools), which the schema's root must hold under "$defs"."""
    return {"anyOf": [{"type": "object", "properties": {name_key: {"const": t.name},
                                                        arguments_key: {"$ref": tool_pointer(i)}},
                       "required": [name_key, arguments_key], "additionalProperties": False}
                      for i, t in enumerate(tools)]}


def tool_defs(tools: list[Tool]) -> dict:
    """Each tool's (closed) parameters under its own name, for the "$defs" of a schema that nests them: a tool's
    own references ("#" for itself, "#/$defs/City") are rebased to where it now sits."""
    return {tool_pointer(i).rsplit("/", 1)[1]: rebased(closed(t.parameters), tool_pointer(i)) for i, t in enumerate(tools)}


def tool_pointer(index: int) -> str:
    return f"#/$defs/tool{index}"


# keywords whose values are data, not schemas: a "$ref" key inside them is not a reference
DATA_KEYWORDS = {"const", "enum", "default", "examples"}


def rebased(schema, base: str):
    """`schema` with each of its local references ("#" + JSON pointer) rewritten as if it were read from `base`."""
    if isinstance(schema, list):
        return [rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = rebased(value, base)
    return out


def standalone(schema: dict, root: dict) -> dict:
    """A part of schema `root` (one argument's) made readable on its own: where it refers into `root`, `root`
    comes along under "$defs" and the references are rebased onto it."""
    if not has_references(schema):
        return schema
    base = "#/$defs/root"
    return {"allOf": [rebased(schema, base)], "$defs": {"root": rebased(root, base)}}


def has_references(schema) -> bool:
    if isinstance(schema, list):
        return any(has_references(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    return any((key == "$ref" and isinstance(value, str)) or (key not in DATA_KEYWORDS and has_references(value))
               for key, value in schema.items())


def repeated(rule: str, parallel: bool, separator: str = '""') -> str:
    """Lark for one `rule`, or one or more separated by the Lark item `separator` when calls may be parallel."""
    return f"{rule} ({separator} {rule})*" if parallel else rule


def lark_literal(text: str) -> str:
    return json.dumps(text)


def literal_of(tokenizer: llguidance.LLTokenizer):
    """Lark for a fixed piece of text with this tokenizer: a marker that is one added token of the
    vocabulary (<tool_call> in Qwen's) is that token, which llguidance keeps apart from text."""
    def literal(text: str) -> str:
        tokens = tokenizer.tokenize_str(text)
        if len(tokens) == 1 and tokenizer.is_special_token(tokens[0]):
            return f"<[{tokens[0]}]>"
        return lark_literal(text)
    return literal


class GrammarConstraint:
    """The tokens a grammar allows next (Sequence.constraint): built per request, advanced per token."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, lark: str):
        self.matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(lark))
        if self.matcher.is_error():
            raise ToolError("tools", f"the grammar of these tools' calls does not compile "
                                     f"({self.matcher.get_error().splitlines()[0]})")

    def allowed(self, width: int) -> torch.Tensor:
        """bool [width]; tokens past the tokenizer's vocabulary (padding rows of the output layer) are never allowed."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = torch.zeros(width, dtype=torch.bool)
        n = min(width, bits.size)
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        return out

    def advance(self, token: int) -> None:
        """Take `token`; a grammar that fails here (llguidance finds out lazily) is the request's: a required
        property that refers to its own object has no finite value, and a schema can be too complex to parse."""
        if not self.matcher.consume_token(token):
            problem = self.matcher.get_error().splitlines()[0].removeprefix("parser error: ")
            raise ToolError("tools", f"decoding the call stopped inside these tools' grammar ({problem}): a schema "
                                     f"that no finite value satisfies, or one too complex to parse")

    def done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()
