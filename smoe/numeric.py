"""One rule per numeric input — type, range, finiteness — shared by the CLI and the server.

Each `Range` checks a value, parses a command-line string (an argparse `type`) and builds the
pydantic field of a request body, so `--temperature 3` and `{"temperature": 3}` are refused by the
same bounds with the same words. Ranges of API fields are the ones OpenAI and Anthropic document.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pydantic import Field


@dataclass(frozen=True)
class Range:
    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself excluded
    note: str = ""

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            return f"{what} in {left}{fmt(self.low)}, {fmt(self.high)}]"
        if self.low is not None:
            return f"{what} {'>' if self.low_open else '≥'} {fmt(self.low)}"
        return what

    def problem(self, value) -> str | None:
        """Why `value` is not allowed, or None."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.kind is int and isinstance(value, float)):
            return f"expected {self.describe()}, got {value!r}"
        if not math.isfinite(value):
            return f"expected {self.describe()}, got {value!r}"
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if below or (self.high is not None and value > self.high):
            return f"expected {self.describe()}, got {fmt(value)}"
        return None

    def parse(self, text: str):
        """argparse `type`: the value, or an ArgumentTypeError saying what is allowed."""
        try:
            value = int(text) if self.kind is int else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    def field(self, default, **kwargs):
        """The pydantic field of a request body with these bounds (NaN and infinities refused)."""
        bounds = {}
        if self.low is not None:
            bounds["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            bounds["le"] = self.high
        if self.kind is float:
            bounds["allow_inf_nan"] = False
        return Field(default, **bounds, **kwargs)


def fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


INT64 = 2**63 - 1

# API fields (OpenAI, Anthropic) and the CLI options that mean the same
TEMPERATURE = Range(float, 0, 2, note="0 = greedy")
ANTHROPIC_TEMPERATURE = Range(float, 0, 1)
TOP_P = Range(float, 0, 1, note="0 keeps only the most likely token")
TOP_K = Range(int, 0, note="0 = off")
MIN_P = Range(float, 0, 1, note="0 = off")
REPETITION_PENALTY = Range(float, 0, low_open=True, note="1 = off")
PENALTY = Range(float, -2, 2, note="frequency and presence penalties; 0 = off")
TOP_LOGPROBS = Range(int, 0, 20)
MAX_TOKENS = Range(int, 1)
SEED = Range(int, -INT64 - 1, INT64)

# CLI options
THREADS = Range(int, 1, 4096)
NON_NEGATIVE_REAL = Range(float, 0, 1 << 30)
POSITIVE_REAL = Range(float, 0, 1 << 30, low_open=True)
COUNT = Range(int, 1)
NON_NEGATIVE = Range(int, 0)
EVAL_TOKENS = Range(int, 2)  # one prediction needs two tokens
PORT = Range(int, 0, 65535)
BODY_MB = Range(float, 0, 1024, low_open=True)
BITS_PER_WEIGHT = Range(float, 2.25, 4.25)
BANDWIDTH_GBPS = Range(float, 0, 1e6, low_open=True)
