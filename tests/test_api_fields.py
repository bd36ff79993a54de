"""The server's request fields beyond the basics, over a real `smoe serve`: sampler fields applied as
`generate` applies them, logprobs equal to the model's log-softmax, echo, batched prompts, token
counting, and clear 400s for what smoe cannot do."""

import http.client
import json
import math

import anthropic
import openai
import pytest
import torch

from smoe.hf.tokenizer import chat_prompt, load_tokenizer
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY, SamplingParams

PROMPT = "The sea was"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]
TOLERANCE = 2e-3  # the server's fast decoder against teacher-forced logits, both float32


@pytest.fixture(scope="module")
def server(serve_vault, start_server):
    return start_server(serve_vault, "--max-tokens", "64")


@pytest.fixture(scope="module")
def local(serve_vault):
    sm = OpenedVault(serve_vault, dtype="float32")
    yield sm, load_tokenizer(serve_vault)
    sm.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body | {"stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    lines = [raw.decode().rstrip("\r\n") for raw in conn.getresponse()]
    conn.close()
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def pieces_spell_the_text(tok) -> bool:
    """Whether vocabulary entries concatenate to the decoded text (byte-level BPE, sentencepiece): then
    token texts and offsets are exact. A tokenizer with no decoder joins tokens with spaces on decode
    (the tiny test model's); its token texts are its vocabulary entries."""
    return tok.backend_tokenizer.decoder is not None


def teacher_forced_logprobs(local, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = 1.., and the log-softmax rows [T-1, V] they come from."""
    sm, _ = local
    logp = torch.log_softmax(sm.logits(torch.tensor([ids]))[0, :-1].double(), -1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], logp


# --- the sampler's fields ------------------------------------------------------------------------

SAMPLER_FIELDS = {"temperature": 0.9, "top_p": 0.95, "top_k": 7, "min_p": 0.02, "repetition_penalty": 1.3,
                  "frequency_penalty": 0.8, "presence_penalty": -0.4, "seed": 11}


def test_sampler_fields_give_the_text_generate_gives_with_the_same_params(server, local):
    sm, tok = local
    ids = tok(PROMPT)["input_ids"]
    tokens, _ = generate(sm, ids, 24, params=SamplingParams(**SAMPLER_FIELDS))
    status, r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24} | SAMPLER_FIELDS)
    assert status == 200 and r["choices"][0]["text"] == tok.decode(tokens, skip_special_tokens=True)


def test_a_repetition_penalty_changes_greedy_text(server):
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    plain = post(server, "/v1/completions", body)[1]["choices"][0]["text"]
    penalised = post(server, "/v1/completions", body | {"repetition_penalty": 5.0})[1]["choices"][0]["text"]
    assert plain != penalised


@pytest.mark.parametrize("field, value", [("top_k", -1), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5),
                                          ("repetition_penalty", 0), ("repetition_penalty", -1),
                                          ("frequency_penalty", 2.01), ("presence_penalty", -2.01),
                                          ("top_logprobs", 21), ("logprobs", -1)])
def test_new_fields_out_of_range_are_400s_naming_the_field(server, field, value):
    path, body = ("/v1/completions", {"prompt": PROMPT}) if field == "logprobs" else \
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True})
    status, r = post(server, path, body | {"max_tokens": 1, field: value})
    assert status == 400 and r["error"]["param"] == field, r


def test_anthropic_top_k_is_applied_and_bounded(server):
    body = {"max_tokens": 4, "messages": CHAT, "temperature": 1.0, "top_k": 1}
    greedy = post(server, "/v1/messages", body | {"temperature": 0})[1]["content"][0]["text"]
    assert post(server, "/v1/messages", body)[1]["content"][0]["text"] == greedy  # top_k 1 is greedy
    status, r = post(server, "/v1/messages", body | {"top_k": -1})
    assert status == 400 and "top_k" in r["error"]["message"]


# --- refusals that say why -----------------------------------------------------------------------

def test_response_format_other_than_text_is_a_400_naming_the_field(server):
    body = {"messages": CHAT, "max_tokens": 1}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        status, r = post(server, "/v1/chat/completions", body | {"response_format": fmt})
        assert status == 400 and r["error"]["param"] == "response_format" and "text" in r["error"]["message"]
    assert post(server, "/v1/chat/completions", body | {"response_format": {"type": "text"}})[0] == 200


def test_an_image_in_a_message_is_a_400_saying_images_are_not_supported(server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    content = [{"type": "text", "text": "What is this?"}, image]
    status, r = post(server, "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert status == 400 and r["type"] == "error"
    assert r["error"]["message"] == "messages.0.content.1: images are not supported (the model served reads text only)"
    chat_image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,xx"}}]
    status, r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": chat_image}]})
    assert status == 400 and "images are not supported" in r["error"]["message"]


# --- logprobs ------------------------------------------------------------------------------------

def test_chat_logprobs_are_the_models_log_softmax_of_each_token(server, local, oai):
    sm, tok = local
    r = oai.chat.completions.create(model="any", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                    top_logprobs=3)
    choice = r.choices[0]
    assert choice.message.refusal is None
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    prompt = list(chat_prompt(tok, CHAT))
    generated, _ = generate(sm, prompt, 8, params=GREEDY)  # the server's tokens
    reference, _ = teacher_forced_logprobs(local, prompt + generated)
    assert len(content) == len(generated)
    for entry, ref in zip(content, reference[len(prompt) - 1:].tolist()):
        assert math.isclose(entry.logprob, ref, abs_tol=TOLERANCE)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the top one
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    if pieces_spell_the_text(tok):
        assert b"".join(bytes(e.bytes) for e in content).decode().startswith(choice.message.content)
    else:
        assert [e.token for e in content] == [t or "" for t in tok.convert_ids_to_tokens(generated)]


def test_chat_without_logprobs_has_null_logprobs_and_a_null_refusal(server):
    status, r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
    assert status == 200 and r["choices"][0]["logprobs"] is None and r["choices"][0]["message"]["refusal"] is None
    status, r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_logprobs": 2})
    assert status == 400 and r["error"]["param"] == "top_logprobs"


def test_streamed_chat_carries_the_logprobs_of_every_token(server):
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "stream_options": {"include_usage": True}}
    chunks = stream_chunks(server, "/v1/chat/completions", body)
    content = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    plain = post(server, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"})[1]
    assert content == plain["choices"][0]["logprobs"]["content"]
    assert len(content) == chunks[-1]["usage"]["completion_tokens"]


def test_completion_echo_returns_the_prompt_and_its_logprobs_with_the_first_null(server, local):
    _, tok = local
    ids = tok(PROMPT)["input_ids"]
    status, r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                  "echo": True, "logprobs": 2})
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(ids) + r["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    generated, _ = generate(local[0], ids, 4, params=GREEDY)
    reference, _ = teacher_forced_logprobs(local, ids + generated)
    assert len(lp["token_logprobs"]) == len(reference) + 1
    for got, ref in zip(lp["token_logprobs"][1:], reference.tolist()):
        assert math.isclose(got, ref, abs_tol=TOLERANCE)
    offsets = lp["text_offset"] + [len(choice["text"])]
    if pieces_spell_the_text(tok):
        assert [choice["text"][a:b] for a, b in zip(offsets, offsets[1:])] == lp["tokens"]
    else:
        assert lp["tokens"] == [t or "" for t in tok.convert_ids_to_tokens(ids + generated)]
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])


def test_completion_logprobs_without_echo_cover_only_the_generated_tokens(server, local):
    status, r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0})
    lp = r["choices"][0]["logprobs"]
    assert status == 200 and len(lp["tokens"]) == r["usage"]["completion_tokens"] and lp["text_offset"][0] == 0
    assert all(top == {} for top in lp["top_logprobs"])
    if pieces_spell_the_text(local[1]):
        assert "".join(lp["tokens"]) == r["choices"][0]["text"]


# --- request shapes ------------------------------------------------------------------------------

def test_a_list_of_prompts_gets_one_choice_each_in_order_with_usage_summed(server, local):
    _, tok = local
    prompts = [PROMPT, "Once upon a time"]
    body = {"max_tokens": 6, "temperature": 0}
    singles = [post(server, "/v1/completions", body | {"prompt": p})[1] for p in prompts]
    for batch in (prompts, [tok(p)["input_ids"] for p in prompts]):
        status, r = post(server, "/v1/completions", body | {"prompt": batch})
        assert status == 200 and [c["index"] for c in r["choices"]] == [0, 1]
        assert [c["text"] for c in r["choices"]] == [s["choices"][0]["text"] for s in singles]
        assert r["usage"]["total_tokens"] == sum(s["usage"]["total_tokens"] for s in singles)
    chunks = stream_chunks(server, "/v1/completions", body | {"prompt": prompts})
    streamed = ["".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == i) for i in (0, 1)]
    assert streamed == [s["choices"][0]["text"] for s in singles]


def test_count_tokens_is_the_length_of_the_chat_prompt(server, local):
    _, tok = local
    system = "You are brief."
    expected = len(chat_prompt(tok, [{"role": "system", "content": system}] + CHAT))
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    assert claude.messages.count_tokens(model="any", system=system, messages=CHAT).input_tokens == expected
    status, r = post(server, "/v1/messages/count_tokens", {"messages": []})
    assert status == 400 and r["type"] == "error"


def test_a_harness_style_loglikelihood_request_gives_each_continuations_teacher_forced_sum(server, local):
    """The request lm-evaluation-harness's local-completions model sends for loglikelihood: token-id
    prompts of context + continuation, echo, one generated token (dropped by the [ctxlen:-1] slice)."""
    _, tok = local
    pairs = [("The sea was", " calm and"), ("Once upon a", " time")]
    contexts = [tok(c)["input_ids"] for c, _ in pairs]
    prompts = [ctx + tok(cont, add_special_tokens=False)["input_ids"] for ctx, (_, cont) in zip(contexts, pairs)]
    status, r = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "temperature": 0,
                                                  "logprobs": 1, "echo": True, "seed": 1234})
    assert status == 200
    for choice, ctx, ids in zip(r["choices"], contexts, prompts):
        got = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        reference, _ = teacher_forced_logprobs(local, ids)
        assert len(got) == len(ids) - len(ctx)
        assert math.isclose(sum(got), float(reference[len(ctx) - 1:].sum()), abs_tol=TOLERANCE * len(got))
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        greedy = all(math.isclose(lp, max(top.values())) for lp, top in zip(got, tops))
        argmax = teacher_forced_logprobs(local, ids)[1].argmax(-1)[len(ctx) - 1:].tolist()
        assert greedy == (argmax == ids[len(ctx):])


def test_a_streamed_echo_with_logprobs_sends_what_the_whole_response_holds(server, local):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1}
    whole = post(server, "/v1/completions", body)[1]["choices"][0]
    chunks = [ch for c in stream_chunks(server, "/v1/completions", body) for ch in c["choices"]]
    assert "".join(ch["text"] for ch in chunks) == whole["text"]
    logprobs = [ch["logprobs"] for ch in chunks if ch["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for lp in logprobs for x in lp[key]] == whole["logprobs"][key], key
    if pieces_spell_the_text(local[1]):  # else offsets of spaces the decoder inserts differ between the two
        assert [x for lp in logprobs for x in lp["text_offset"]] == whole["logprobs"]["text_offset"]


def test_optional_fields_sent_as_null_take_their_defaults(server, oai):
    """The SDKs send null for an argument given as None (`n=None`); OpenAI and Anthropic read it as left out."""
    chat = oai.chat.completions.create(model="any", messages=CHAT, max_tokens=2, n=None, stream=None, logprobs=None,
                                       parallel_tool_calls=None)
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None and chat.usage.completion_tokens == 2
    text = oai.completions.create(model="any", prompt=PROMPT, max_tokens=2, n=None, echo=None, logprobs=None,
                                  stream=None)
    assert len(text.choices) == 1 and text.choices[0].logprobs is None and text.usage.completion_tokens == 2
    status, r = post(server, "/v1/messages", {"messages": CHAT, "max_tokens": 2, "stream": None})
    assert status == 200 and r["type"] == "message"
    status, r = post(server, "/v1/chat/completions", {"messages": None})
    assert status == 400 and r["error"]["param"] == "messages", r


def test_an_echoed_prompt_keeps_its_special_tokens_so_text_tokens_and_offsets_agree(server, local):
    """The echo is the prompt as the model read it: a special token in it is in the text, where its offset
    says, as it is in `tokens`."""
    _, tok = local
    prompt = f"The sea{tok.eos_token} was"
    status, r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
                                                  "logprobs": 0})
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and choice["text"].startswith(prompt) and tok.eos_token in lp["tokens"]
    at = lp["tokens"].index(tok.eos_token)
    assert choice["text"][lp["text_offset"][at]:].startswith(tok.eos_token)
    chunks = stream_chunks(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                       "echo": True})
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]).startswith(prompt)
