"""Request bodies the server accepts, as pydantic models (strict: a string is not a number).

Fields of the OpenAI and Anthropic APIs that smoe cannot honour with one sequence per request
(n > 1, images, a response_format other than text) are refused with a 400 that names them; fields
that only tune delivery are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from smoe import numeric
from smoe.serve.tools.messages import ToolUse, anthropic_tool_use, anthropic_turns, openai_tool_use, openai_turns

MAX_STOPS = 16
MAX_PROMPTS = 32  # prompts of one /v1/completions request, run one after another
Stop = Annotated[str, Field(min_length=1)]
# What each union-typed field accepts, for its one-line error: pydantic reports a union once per member,
# under names of its own ("stop.constrained-str: Input should be a valid string")
ACCEPTS = {
    "stop": f"a non-empty string or a list of up to {MAX_STOPS} of them",
    "prompt": f"a string, a list of token ids, or a list of up to {MAX_PROMPTS} of either",
    "content": 'a string or a non-empty list of content parts ({"type": "text", "text": ...})',
    "system": 'a string or a list of text parts ({"type": "text", "text": ...})',
}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def null_is_the_default(cls, data):
        """An optional field sent as null has its default, as OpenAI and Anthropic read it: their SDKs send
        null for an argument given as None (`n=None`, `logprobs=None`)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    """Parsed only to be refused by name (the models served read text only)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["image", "image_url", "input_image"]


Content = str | Annotated[list[TextPart | ImagePart], Field(min_length=1)]


# --- tools (checked further, and turned into the template's turns, by smoe.serve.tools.messages) ---

class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallRef(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AnthropicTool(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ToolUsePart(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultPart(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextPart] = ""
    is_error: bool = False


AnthropicContent = (Annotated[str, Field(min_length=1)]
                    | Annotated[list[TextPart | ImagePart | ToolUsePart | ToolResultPart], Field(min_length=1)])


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
    # sampling fields: None (left out) takes the model's default (smoe.runtime.sampling.model_defaults)
    temperature: float | None = numeric.TEMPERATURE.field(None)
    top_p: float | None = numeric.TOP_P.field(None)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    top_k: int | None = numeric.TOP_K.field(None)
    min_p: float | None = numeric.MIN_P.field(None)
    repetition_penalty: float | None = numeric.REPETITION_PENALTY.field(None)
    frequency_penalty: float | None = numeric.PENALTY.field(None)
    presence_penalty: float | None = numeric.PENALTY.field(None)
    seed: int | None = numeric.SEED.field(None)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None  # only {"type": "text"}; checked by the handler to say why
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias; checked by the handler

    @model_validator(mode="after")
    def stream_options_only_with_stream(self):
        """As OpenAI's API: options of a stream that will not be sent are refused, not ignored."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_fields(self) -> dict:
        """The sampler's settings as asked, None for each left to the model's default."""
        return {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                       "frequency_penalty", "presence_penalty", "seed")}

    def unsupported_format(self) -> bool:
        return self.response_format is not None and self.response_format != {"type": "text"}

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    tool_calls: list[ToolCallRef] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    @model_validator(mode="after")
    def content_given(self):
        """Only an assistant's turn may leave out its content (its tool calls are the turn)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_turn(self) -> dict:
        return {"role": "system" if self.role == "developer" else self.role, "content": text_of(self.content)}


class ChatCompletionRequest(OpenAIRequest):
    ACCEPTS: ClassVar[dict] = ACCEPTS | {
        "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'}
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # the deprecated forms of tools and tool_choice: refused by the handler, which names their replacements
    functions: list | None = None
    function_call: str | dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = numeric.TOP_LOGPROBS.field(None)

    def turns(self) -> list[dict]:
        return openai_turns(self.messages)

    def tool_use(self) -> ToolUse:
        return openai_tool_use(self)


class CompletionRequest(OpenAIRequest):
    # text, token ids, or a batch of either: one choice per prompt
    prompt: (str | Annotated[list[int], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: int | None = numeric.TOP_LOGPROBS.field(None)  # the legacy API allows 0..5
    echo: bool = False
    best_of: int | None = numeric.COUNT.field(None)  # 1 only (one sequence per prompt); the handler says why
    suffix: str | None = None  # none: no fill-in-the-middle; checked by the handler

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"]
    content: AnthropicContent


class AnthropicPrompt(Strict):
    """What /v1/messages/count_tokens reads; the messages request adds generation settings."""
    ACCEPTS: ClassVar[dict] = ACCEPTS | {
        "content": 'a non-empty string or a non-empty list of content blocks ({"type": "text", "text": ...})'}
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    def turns(self) -> list[dict]:
        return anthropic_turns(self.system, self.messages)

    def tool_use(self) -> ToolUse:
        return anthropic_tool_use(self)


class MessagesRequest(AnthropicPrompt):
    max_tokens: int = numeric.MAX_TOKENS.field(...)
    # None (left out) takes the model's default, as on the OpenAI routes
    temperature: float | None = numeric.ANTHROPIC_TEMPERATURE.field(None)
    top_p: float | None = numeric.TOP_P.field(None)
    top_k: int | None = numeric.TOP_K.field(None)
    stop_sequences: list[Stop] | None = Field(None, max_length=MAX_STOPS)
    stream: bool = False

    def sampling_fields(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def first_error(error: ValidationError, data: dict, accepts: dict = ACCEPTS) -> tuple[str, str]:
    """(location, message) of the first problem in a request body `data`; a union-typed field of `accepts` (the
    schema's ACCEPTS) is named with what it accepts and what it got."""
    loc = error.errors()[0]["loc"]
    for i, key in enumerate(loc[:-1]):
        if key in accepts and isinstance(loc[i + 1], str):  # loc[i + 1] names one of the union's members
            return dotted(loc[:i + 1]), f"expected {accepts[key]}, got {shown(value_at(data, loc[:i + 1]))}"
    return dotted(loc), error.errors()[0]["msg"].removeprefix("Value error, ")  # a validator's own message


def dotted(loc) -> str:
    return ".".join(map(str, loc))


def value_at(data, loc):
    for key in loc:
        data = data[key]
    return data


def shown(value, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"
