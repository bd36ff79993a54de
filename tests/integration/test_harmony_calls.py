"""gpt-oss's harmony calls over a real socket with the official openai and anthropic clients: `smoe
serve` on a tiny random model whose tokenizer carries gpt-oss's chat template. The template's call
syntax is found by rendering, a required call holds decoding to a harmony call with schema-valid
arguments, and none of the reply's channel markup reaches the client as text, whole or streamed."""

import json
from pathlib import Path

import anthropic
import openai
import pytest

from smoe.testing.chat_models import chat_vault

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city.",
                                           "parameters": WEATHER}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# a harmony call is about a hundred bytes of header and JSON, and the tokenizer is byte-level
ASK = dict(model="m", messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
           max_tokens=160, temperature=0)


def valid_weather(arguments: dict) -> bool:
    return set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_server):
    vault = chat_vault(tmp_path_factory.mktemp("harmony"), (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text())
    return start_server(vault, "--max-tokens", "160")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_a_required_harmony_call_comes_back_as_a_tool_call_with_valid_arguments(oai):
    r = oai.chat.completions.create(**ASK)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert call.function.name == "get_weather" and valid_weather(json.loads(call.function.arguments))


def test_a_streamed_harmony_call_sends_no_channel_markup_as_text(oai):
    content, arguments, finish = "", "", None
    for chunk in oai.chat.completions.create(stream=True, **ASK):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        arguments += "".join(c.function.arguments or "" for c in choice.delta.tool_calls or ())
        finish = choice.finish_reason or finish
    assert content == "" and finish == "tool_calls" and valid_weather(json.loads(arguments))


def test_an_anthropic_streamed_harmony_call_is_one_tool_use_block_and_no_text(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    with claude.messages.stream(model="m", max_tokens=160, messages=QUESTION, extra_body={"temperature": 0},
                                tools=[{"name": "get_weather", "input_schema": WEATHER}],
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        message = s.get_final_message()
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and valid_weather(use.input)
    assert "".join(b.text for b in message.content if b.type == "text") == ""  # the stream's text block stays empty
