"""Which call syntax a chat template writes, found by rendering one call through it and reading it
back with each known format: no template text is matched, so a template is judged by what it does.

`render(history, tools, generation_prompt) -> str` is the template (smoe.hf.tokenizer.chat_text).
"""

from __future__ import annotations

import os

from smoe.serve.tools.calls import Call, Tool
from smoe.serve.tools.formats import FORMATS, CallFormat

PROBE = Tool("smoe_probe_tool", "Looks up a number.",
             {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
PROBE_CALL = Call(PROBE.name, {"n": 7})
QUESTION = {"role": "user", "content": "Look up seven."}
# nine alphanumerics: the one id shape every template accepts (Mistral's insist on it)
PROBE_ID = "a1b2c3d4e"


def template_call(call: Call, call_id: str) -> dict:
    """A call in the turn shape chat templates read (transformers' convention: arguments as an object)."""
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def assistant_part(render, history: list[dict], reply: dict, tools: list[dict]) -> str:
    """The text the template writes for `reply` after `history`: the whole conversation less what it
    shares with the prompt of the reply (a template may open a reply it renders differently from
    the generation prompt, with a thinking tag for one)."""
    prompt = render(history, tools, True)
    full = render(history + [reply], tools, False)
    return full[len(os.path.commonprefix([prompt, full])):]


def call_format(render) -> CallFormat | None:
    """The format whose parser reads the template's own call back, or None (a template without tool
    support drops the call, or raises on it; or a syntax none of FORMATS reads)."""
    try:
        reply = {"role": "assistant", "content": "", "tool_calls": [template_call(PROBE_CALL, PROBE_ID)]}
        text = assistant_part(render, [QUESTION], reply, [PROBE.as_template_tool()])
    except Exception:  # a template that raises on tools or on calls (jinja's TemplateError and others) has no support
        return None
    for fmt in FORMATS:
        parsed = fmt.parse(text)
        if parsed is not None and list(parsed.calls) == [PROBE_CALL]:
            return fmt
    return None
