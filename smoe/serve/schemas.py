"""Request bodies the server accepts, as pydantic models (strict: a string is not a number).

Fields of the OpenAI and Anthropic APIs that smoe cannot honour with one sequence per request
(n > 1, images, a response_format other than text) are refused with a 400 that names them; fields
that only tune delivery are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from smoe import numeric

MAX_STOPS = 16
MAX_PROMPTS = 32  # prompts of one /v1/completions request, run one after another
Stop = Annotated[str, Field(min_length=1)]
# What each union-typed field accepts, for its one-line error: pydantic reports a union once per member,
# under names of its own ("stop.constrained-str: Input should be a valid string")
ACCEPTS = {
    "stop": f"a non-empty string or a list of up to {MAX_STOPS} of them",
    "prompt": f"a string, a list of token ids, or a list of up to {MAX_PROMPTS} of either",
    "content": 'a string or a list of content parts ({"type": "text", "text": ...})',
    "system": 'a string or a list of text parts ({"type": "text", "text": ...})',
}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    """Parsed only to be refused by name (the models served read text only)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["image", "image_url", "input_image"]


Content = str | list[TextPart | ImagePart]


def text_of(content: Content | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content if isinstance(part, TextPart))


def image_at(messages) -> str | None:
    """The location ("messages.0.content.1") of the first image in `messages`, or None."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if isinstance(part, ImagePart):
                return f"messages.{i}.content.{j}"
    return None


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(Strict):
    model: str | None = None
    max_tokens: int | None = numeric.MAX_TOKENS.field(None)
    max_completion_tokens: int | None = numeric.MAX_TOKENS.field(None)
    temperature: float = numeric.TEMPERATURE.field(1.0)
    top_p: float = numeric.TOP_P.field(1.0)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    top_k: int = numeric.TOP_K.field(0)
    min_p: float = numeric.MIN_P.field(0.0)
    repetition_penalty: float = numeric.REPETITION_PENALTY.field(1.0)
    frequency_penalty: float = numeric.PENALTY.field(0.0)
    presence_penalty: float = numeric.PENALTY.field(0.0)
    seed: int | None = numeric.SEED.field(None)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None  # only {"type": "text"}; checked by the handler to say why

    def unsupported_format(self) -> bool:
        return self.response_format is not None and self.response_format != {"type": "text"}

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Content | None = None

    def as_turn(self) -> dict:
        return {"role": "system" if self.role == "developer" else self.role, "content": text_of(self.content)}


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = numeric.TOP_LOGPROBS.field(None)


class CompletionRequest(OpenAIRequest):
    # text, token ids, or a batch of either: one choice per prompt
    prompt: (str | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: int | None = numeric.TOP_LOGPROBS.field(None)  # the legacy API allows 0..5
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: Content


class AnthropicPrompt(Strict):
    """What /v1/messages/count_tokens reads; the messages request adds generation settings."""
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None

    def turns(self) -> list[dict]:
        system = [{"role": "system", "content": text_of(self.system)}] if self.system else []
        return system + [{"role": m.role, "content": text_of(m.content)} for m in self.messages]


class MessagesRequest(AnthropicPrompt):
    max_tokens: int = numeric.MAX_TOKENS.field(...)
    temperature: float = numeric.ANTHROPIC_TEMPERATURE.field(1.0)
    top_p: float = numeric.TOP_P.field(1.0)
    top_k: int | None = numeric.TOP_K.field(None)
    stop_sequences: list[Stop] | None = Field(None, max_length=MAX_STOPS)
    stream: bool = False


def first_error(error: ValidationError, data: dict) -> tuple[str, str]:
    """(location, message) of the first problem in a request body `data`; a union-typed field is named
    with what it accepts and what it got."""
    loc = error.errors()[0]["loc"]
    for i, key in enumerate(loc[:-1]):
        if key in ACCEPTS and isinstance(loc[i + 1], str):  # loc[i + 1] names one of the union's members
            return dotted(loc[:i + 1]), f"expected {ACCEPTS[key]}, got {shown(value_at(data, loc[:i + 1]))}"
    return dotted(loc), error.errors()[0]["msg"]


def dotted(loc) -> str:
    return ".".join(map(str, loc))


def value_at(data, loc):
    for key in loc:
        data = data[key]
    return data


def shown(value, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"
