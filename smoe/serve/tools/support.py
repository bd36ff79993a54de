"""A served model's tool support: its template's call format and the constraint of a request's
calls, both worked out from the tokenizer once and shared by every request."""

from __future__ import annotations

import threading

from smoe.hf.grammar import grammar_tokenizer
from smoe.hf.tokenizer import chat_text
from smoe.serve.tools.calls import ToolError, chosen_tools
from smoe.serve.tools.formats import CallFormat
from smoe.serve.tools.grammar import GrammarConstraint, literal_of
from smoe.serve.tools.messages import ToolUse
from smoe.serve.tools.replies import ToolTurn
from smoe.serve.tools.template import call_format

UNFOUND = object()


class ToolSupport:
    def __init__(self, tokenizer, lock: threading.Lock, eos_ids: set[int]):
        self.tokenizer, self.lock, self.eos_ids = tokenizer, lock, eos_ids
        self._format, self._grammar_tokenizer = UNFOUND, None

    def render(self, history: list[dict], tools: list[dict], generation_prompt: bool) -> str:
        with self.lock:
            return chat_text(self.tokenizer, history, tools, generation_prompt)

    def call_format(self) -> CallFormat | None:
        if self._format is UNFOUND:
            self._format = call_format(self.render)
        return self._format

    def turn(self, use: ToolUse) -> ToolTurn:
        """How a request's reply is decoded and read."""
        fmt = self.format_for(use)
        return ToolTurn(use, fmt, self.constraint(use, fmt))

    def format_for(self, use: ToolUse) -> CallFormat | None:
        """The call format a request that reads calls needs; a 400 naming `tools` when the template has none."""
        if not use.active():
            return None
        fmt = self.call_format()
        if fmt is None:
            raise ToolError("tools", "this model's chat template has no tool support (it writes no tool calls "
                                     "in a syntax smoe reads)")
        return fmt

    def constraint(self, use: ToolUse, fmt: CallFormat | None) -> GrammarConstraint | None:
        """A call of the chosen tools, when tool_choice requires one."""
        if fmt is None or not use.choice.constrains():
            return None
        if self._grammar_tokenizer is None:
            with self.lock:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, sorted(self.eos_ids))
        grammar = fmt.grammar(chosen_tools(list(use.tools), use.choice), use.choice.parallel,
                              literal_of(self._grammar_tokenizer))
        return GrammarConstraint(self._grammar_tokenizer, grammar)
