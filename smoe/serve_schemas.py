"""Request bodies the server accepts, as pydantic models (strict: a string is not a number).

Fields of the OpenAI and Anthropic APIs that smoe cannot honour with one sequence per request
(n > 1, tools, images) fail validation; fields that only tune delivery are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from smoe import numeric

MAX_STOPS = 16
Stop = Annotated[str, Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(Strict):
    type: Literal["text"]
    text: str


def text_of(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIRequest(Strict):
    model: str | None = None
    max_tokens: int | None = numeric.MAX_TOKENS.field(None)
    max_completion_tokens: int | None = numeric.MAX_TOKENS.field(None)
    temperature: float = numeric.TEMPERATURE.field(1.0)
    top_p: float = numeric.TOP_P.field(1.0)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = numeric.SEED.field(None)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_turn(self) -> dict:
        return {"role": "system" if self.role == "developer" else self.role, "content": text_of(self.content)}


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(OpenAIRequest):
    # text, a batch of exactly one text, or token ids
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]

    def text_or_ids(self) -> str | list[int]:
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextPart]


class MessagesRequest(Strict):
    model: str | None = None
    max_tokens: int = numeric.MAX_TOKENS.field(...)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    temperature: float = numeric.ANTHROPIC_TEMPERATURE.field(1.0)
    top_p: float = numeric.TOP_P.field(1.0)
    top_k: int | None = Field(None, ge=1, description="accepted and ignored: sampling is nucleus-only")
    stop_sequences: list[Stop] | None = Field(None, max_length=MAX_STOPS)
    stream: bool = False

    def turns(self) -> list[dict]:
        system = [{"role": "system", "content": text_of(self.system)}] if self.system else []
        return system + [{"role": m.role, "content": text_of(m.content)} for m in self.messages]
