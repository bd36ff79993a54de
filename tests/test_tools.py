"""Tool calls without a server: each published template's own calls parse back to the same calls,
each format's grammar only lets decoding write calls its parser reads (with schema-valid arguments),
streamed text is held back only where a call may begin, and bad tool fields name the field."""

import os
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from smoe.hf.grammar import grammar_tokenizer
from smoe.hf.tokenizer import chat_text, load_tokenizer
from smoe.runtime.sampling import SamplingParams, Sequence, sample_batch
from smoe.serve.schemas import ChatCompletionRequest, MessagesRequest
from smoe.serve.tools.calls import Call, Parsed, Tool, ToolError
from smoe.serve.tools.formats import FORMATS
from smoe.serve.tools.grammar import GrammarConstraint, literal_of
from smoe.serve.tools.replies import ToolTurn
from smoe.serve.tools.stream import CallHolder
from smoe.serve.tools.template import call_format, template_call
from smoe.testing.chat_models import save_chat_tokenizer

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"
# each published template and the call syntax it writes
TEMPLATE_FORMATS = {
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v3.1",
    "moonshotai-Kimi-K2": "kimi_k2",
    "GLM-4.6": "glm4.5",
    "MiniMax-M2": "minimax_m2",
    "openai-gpt-oss-120b": "harmony",
}
# templates that write only an assistant turn's first call: there each call is a turn of its own
ONE_CALL_A_TURN = {"openai-gpt-oss-120b"}
WEATHER = Tool("get_weather", "The forecast of a city.", {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]})
NOTE = Tool("save_note", "Saves a note.", {"type": "object", "properties": {"text": {"type": "string", "maxLength": 12}},
                                           "required": ["text"]})
CALLS = [Call("get_weather", {"city": "Paris", "days": 3}), Call("save_note", {"text": "bring a coat"})]
QUESTION = [{"role": "user", "content": "Weather in Paris, and note it."}]


def template_tokenizer(name: str):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="</s>")
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def renderer(tok):
    return lambda history, tools, generation_prompt: chat_text(tok, history, tools, generation_prompt)


@pytest.mark.parametrize("name", TEMPLATE_FORMATS)
def test_calls_a_template_writes_parse_back_to_the_same_calls(name):
    render = renderer(template_tokenizer(name))
    fmt = call_format(render)
    assert fmt is not None and fmt.name == TEMPLATE_FORMATS[name]
    calls = [template_call(c, f"abcdefgh{i}") for i, c in enumerate(CALLS)]
    turns = [[c] for c in calls] if name in ONE_CALL_A_TURN else [calls]
    replies = [{"role": "assistant", "content": "", "tool_calls": t} for t in turns]
    tools = [WEATHER.as_template_tool(), NOTE.as_template_tool()]
    prompt, full = render(QUESTION, tools, True), render(QUESTION + replies, tools, False)
    text = full[len(os.path.commonprefix([prompt, full])):]  # as assistant_part, over every reply turn
    assert list(fmt.parse(text).calls) == CALLS


def test_a_harmony_reply_is_its_final_and_preamble_text_and_its_calls_never_its_reasoning():
    harmony = next(f for f in FORMATS if f.name == "harmony")
    reply = ("<|channel|>analysis<|message|>Paris, three days.<|end|>"
             "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris", "days": 3}<|call|>')
    parsed = harmony.parse(reply)
    assert parsed.content == "Checking the forecast." and parsed.calls == (CALLS[0],)
    assert harmony.parse(reply[:-len("<|call|>")]).calls == (CALLS[0],)  # the end of sequence may take <|call|>
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    assert harmony.parse(answer) == Parsed("Sunny.")
    holder = CallHolder(harmony.start)  # reasoning never streams as text
    assert holder.push(answer) == "" and holder.unsent(harmony.parse(answer).content) == "Sunny."
    assert harmony.parse(reply.replace('"days": 3}', '"days": ')) is None


def test_a_template_without_tool_support_has_no_call_format():
    assert call_format(renderer(template_tokenizer("google-gemma-2-2b-it"))) is None


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    ids = save_chat_tokenizer(out, "{{ messages }}")
    tok = load_tokenizer(out)
    return tok, grammar_tokenizer(tok, [ids["<|im_end|>"]]), ids["<|im_end|>"]


def constrained_text(byte_tokenizer, grammar: str, seed: int, temperature: float = 1.0) -> str:
    """Text sampled from random logits under `grammar` until end of sequence: whatever the model
    prefers, the constraint decides what can be written."""
    tok, lltok, eos = byte_tokenizer
    seq = Sequence(SamplingParams(temperature=temperature, seed=seed), constraint=GrammarConstraint(lltok, grammar))
    generator = torch.Generator().manual_seed(seed)
    while not seq.output or seq.output[-1] != eos:
        assert len(seq.output) < 400, "the grammar never ended"
        sample_batch(torch.randn(1, len(tok), generator=generator) * 5, [seq])
    return tok.decode(seq.output[:-1], skip_special_tokens=True)


def valid(call: Call) -> bool:
    if call.name == "get_weather":
        return set(call.arguments) == {"city", "days"} and call.arguments["city"] in ("Paris", "Oslo") \
            and 1 <= call.arguments["days"] <= 7
    return call.name == "save_note" and set(call.arguments) == {"text"} and len(call.arguments["text"]) <= 12


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_decoding_under_a_formats_grammar_writes_calls_it_parses_with_valid_arguments(byte_tokenizer, fmt):
    literal = literal_of(byte_tokenizer[1])
    for seed in range(3):
        text = constrained_text(byte_tokenizer, fmt.grammar([WEATHER, NOTE], parallel=False, literal=literal), seed)
        parsed = fmt.parse(text)
        assert parsed is not None and len(parsed.calls) == 1 and valid(parsed.calls[0]), text


# schemas with references, as pydantic and openai.pydantic_function_tool write them: a definition under $defs, and a
# tool that refers to itself ("#")
CITY = Tool("pick_city", "", {"type": "object", "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
                              "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]})
TREE = Tool("tree", "", {"type": "object", "properties": {"label": {"type": "string", "maxLength": 3},
                                                          "child": {"$ref": "#"}}, "required": ["label"]})


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_calls_decoded_under_schemas_with_references_are_valid_against_those_schemas(byte_tokenizer, fmt):
    literal, tools = literal_of(byte_tokenizer[1]), {t.name: t for t in (CITY, TREE)}
    called = set()
    for seed in range(16):
        text = constrained_text(byte_tokenizer, fmt.grammar(list(tools.values()), parallel=False, literal=literal), seed)
        parsed = fmt.parse(text)
        assert parsed is not None and len(parsed.calls) == 1, text
        call = parsed.calls[0]
        jsonschema.validate(call.arguments, tools[call.name].parameters)
        called.add(call.name if "child" not in call.arguments else "tree, nested")
    assert {"pick_city", "tree, nested"} <= called, called  # the definition and the recursion were both decoded


def test_a_schema_that_no_finite_value_satisfies_ends_decoding_with_a_tool_error(byte_tokenizer):
    endless = Tool("endless", "", {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})
    grammar = FORMATS[0].grammar([endless], parallel=False, literal=literal_of(byte_tokenizer[1]))
    with pytest.raises(ToolError) as e:
        constrained_text(byte_tokenizer, grammar, seed=0)
    assert e.value.field == "tools" and "\n" not in str(e.value)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_named_choice_grammar_writes_only_that_tool(byte_tokenizer, temperature):
    literal = literal_of(byte_tokenizer[1])
    hermes = FORMATS[0]
    for seed in range(3):
        text = constrained_text(byte_tokenizer, hermes.grammar([NOTE], True, literal), seed, temperature)
        calls = hermes.parse(text).calls
        assert calls and all(c.name == "save_note" and valid(c) for c in calls)


def test_streamed_text_is_held_only_from_where_a_call_may_begin():
    holder = CallHolder("<tool_call>")
    assert holder.push("Let me look. <tool") == "Let me look. "
    assert holder.push("_call>\n{") == ""
    assert holder.held() == '<tool_call>\n{'
    plain = CallHolder("<tool_call>")
    assert plain.push("a < b") == "a < b" and plain.push(" <t") == " " and plain.push("ea>") == "<tea>"


def test_a_reply_that_does_not_parse_or_calls_an_unknown_tool_is_text():
    request = ChatCompletionRequest.model_validate({"messages": QUESTION, "tools": [WEATHER.as_template_tool()]})
    turn = ToolTurn(request.tool_use(), FORMATS[0])
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    unknown = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    for text in (broken, unknown, "Sunny."):
        reply = turn.reply(text)
        assert reply.content == text and not reply.calls
    called = turn.reply('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>')
    assert called.content == "Sure." and called.calls == (Call("get_weather", {"city": "Oslo", "days": 1}),)


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": "one"}}}}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER.as_template_tool(), WEATHER.as_template_tool()]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER.as_template_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_openai_tool_fields_name_the_field(body, field):
    with pytest.raises(ToolError) as e:
        ChatCompletionRequest.model_validate({"messages": QUESTION, **body}).tool_use()
    assert e.value.field == field


def test_an_openai_tool_result_must_answer_an_earlier_call():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    answered = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "Rain."}]
    turns = ChatCompletionRequest.model_validate({"messages": answered}).turns()
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert turns[2] == {"role": "tool", "content": "Rain.", "tool_call_id": "call_1", "name": "get_weather"}
    with pytest.raises(ToolError) as e:
        ChatCompletionRequest.model_validate({"messages": answered[:1] + answered[2:]}).turns()
    assert e.value.field == "messages.1.tool_call_id"
    bad_arguments = [{**call, "function": {"name": "get_weather", "arguments": "{city"}}]
    with pytest.raises(ToolError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "tool_calls": bad_arguments}]}).turns()
    assert e.value.field == "messages.0.tool_calls.0.function.arguments"


def test_anthropic_tool_blocks_become_template_turns_and_choices_map_to_modes():
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Rain."}]}
    body = {"max_tokens": 8, "messages": QUESTION + [{"role": "assistant", "content": [use]},
                                                     {"role": "user", "content": [result]}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER.parameters}]}
    req = MessagesRequest.model_validate(body)
    assert [t["role"] for t in req.turns()] == ["user", "assistant", "tool"]
    assert req.turns()[2]["content"] == "Rain." and req.turns()[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    modes = {"auto": "auto", "any": "required", "none": "none"}
    for given, mode in modes.items():
        assert MessagesRequest.model_validate({**body, "tool_choice": {"type": given}}).tool_use().choice.mode == mode
    named = MessagesRequest.model_validate({**body, "tool_choice": {"type": "tool", "name": "get_weather"}}).tool_use()
    assert named.choice.mode == "named" and named.choice.name == "get_weather"
    with pytest.raises(ToolError) as e:
        MessagesRequest.model_validate({**body, "tool_choice": {"type": "tool", "name": "nope"}}).tool_use()
    assert e.value.field == "tool_choice"
    with pytest.raises(ToolError) as e:
        MessagesRequest.model_validate({**body, "tools": [{"name": "f", "input_schema": {"type": "array"}}]}).tool_use()
    assert e.value.field == "tools.0.input_schema"
    with pytest.raises(ToolError) as e:
        MessagesRequest.model_validate({**body, "messages": QUESTION + [{"role": "user", "content": [result]}]}).turns()
    assert e.value.field == "messages.1.content.0.tool_use_id"
