"""A tool-call loop over a real socket with the official openai and anthropic clients: `smoe serve`
on a tiny random model whose tokenizer carries Qwen3's chat template. tool_choice required holds
decoding to a call with schema-valid arguments (even a random model makes one), the tool's result
goes back, and the reply is text; streamed and not. Bad tool fields are 400s naming the field."""

import json
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from smoe.testing.chat_models import chat_vault

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast of a city.",
                                                  "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"city": {"enum": CITIES}},
                                                                 "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


def valid_weather(arguments: dict) -> bool:
    return set(arguments) == {"city", "days"} and arguments["city"] in CITIES and 1 <= arguments["days"] <= 7


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_server):
    vault = chat_vault(tmp_path_factory.mktemp("tools"), (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
    return start_server(vault, "--max-tokens", "64")


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def openai_stream_call(oai, **kwargs):
    """(content, tool_calls as {index: {"id", "name", "arguments"}}, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_required_call_then_result_then_text_answer(oai, stream):
    ask = dict(model="m", messages=QUESTION, tools=OPENAI_TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_tokens=48, **GREEDY)
    if stream:
        _, calls, finish = openai_stream_call(oai, **ask)
        call = calls[0]
    else:
        r = oai.chat.completions.create(**ask)
        finish, (tool_call,) = r.choices[0].finish_reason, r.choices[0].message.tool_calls
        call = {"id": tool_call.id, "name": tool_call.function.name, "arguments": tool_call.function.arguments}
    assert finish == "tool_calls"
    assert call["name"] in ("get_weather", "get_time")
    arguments = json.loads(call["arguments"])
    assert valid_weather(arguments) if call["name"] == "get_weather" else arguments["city"] in CITIES
    history = QUESTION + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call["id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C."}]
    answer = dict(model="m", messages=history, tools=OPENAI_TOOLS, tool_choice="none", max_tokens=16, **GREEDY)
    if stream:
        content, calls, finish = openai_stream_call(oai, **answer)
    else:
        r = oai.chat.completions.create(**answer)
        content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert content and not calls and finish in ("stop", "length")


def test_openai_named_choice_calls_that_tool(oai):
    r = oai.chat.completions.create(model="m", messages=QUESTION, tools=OPENAI_TOOLS, max_tokens=48,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    parallel_tool_calls=False, **GREEDY)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and valid_weather(json.loads(call.function.arguments))


def test_openai_auto_reply_that_is_no_call_is_text_with_stop_or_length(oai):
    r = oai.chat.completions.create(model="m", messages=QUESTION, tools=OPENAI_TOOLS, max_tokens=12, **GREEDY)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_any_gives_tool_use_then_result_then_text(claude, stream):
    ask = dict(model="m", max_tokens=48, messages=QUESTION, tools=ANTHROPIC_TOOLS,
               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
               extra_body=GREEDY)
    if stream:
        with claude.messages.stream(**ask) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and valid_weather(use.input)
    history = QUESTION + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}]}]
    answer = dict(model="m", max_tokens=16, messages=history, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"},
                  extra_body=GREEDY)
    if stream:
        with claude.messages.stream(**answer) as s:
            reply = s.get_final_message()
    else:
        reply = claude.messages.create(**answer)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text


def test_anthropic_any_choice_is_required(claude):
    message = claude.messages.create(model="m", max_tokens=48, messages=QUESTION, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert message.stop_reason == "tool_use" and any(b.type == "tool_use" for b in message.content)


@pytest.mark.parametrize("change, field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": {"a": {"type": "nope"}}}}}]},
     "tools.0.function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, "tool_choice"),
    ({"messages": QUESTION + [{"role": "tool", "tool_call_id": "call_none", "content": "x"}]}, "messages.1.tool_call_id"),
])
def test_openai_bad_tool_fields_are_a_400_naming_the_field(oai, change, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**{"model": "m", "messages": QUESTION, "tools": OPENAI_TOOLS, "max_tokens": 4,
                                       **change})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_anthropic_result_for_an_unknown_call_is_a_400_naming_it(claude):
    history = QUESTION + [{"role": "assistant", "content": "Let me see."},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=4, messages=history, tools=ANTHROPIC_TOOLS)
    assert "messages.2.content.0.tool_use_id" in e.value.message


def test_tools_on_a_template_without_tool_support_are_a_400_naming_tools(tmp_path, start_server):
    vault = chat_vault(tmp_path, (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text())
    client = openai.OpenAI(base_url=start_server(vault).url + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION, tools=OPENAI_TOOLS, max_tokens=4)
    assert e.value.body["param"] == "tools" and "no tool support" in e.value.body["message"]


RECURSIVE = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 3}, "child": {"$ref": "#"}},
             "required": ["label"]}
PYDANTIC_STYLE = {"type": "object", "$defs": {"City": {"type": "string", "enum": CITIES}},
                  "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}


# sampled, not greedy: greedy, this random model nests the tree until max_tokens (as it may with other seeds, or keep
# adding parallel calls: seed 0 ends within 64 tokens)
@pytest.mark.parametrize("schema", [RECURSIVE, PYDANTIC_STYLE], ids=["recursive", "defs"])
def test_a_required_call_follows_a_schema_with_references(oai, schema):
    r = oai.chat.completions.create(model="m", messages=QUESTION, tool_choice="required", max_tokens=64,
                                    temperature=1.0, seed=0,
                                    tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}])
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schema)


ENDLESS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}]


def test_a_schema_no_finite_value_satisfies_is_a_400_naming_tools_whole_and_streamed(oai, server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=QUESTION, tools=ENDLESS, tool_choice="required", max_tokens=16)
    assert e.value.body["param"] == "tools" and "\n" not in e.value.body["message"]
    with pytest.raises(openai.APIError) as e:  # the stream began with a 200: the error is its last event
        openai_stream_call(oai, model="m", messages=QUESTION, tools=ENDLESS, tool_choice="required", max_tokens=16)
    assert "tools:" in e.value.message
    r = oai.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)  # and the server goes on
    assert r.choices[0].finish_reason in ("length", "stop")
