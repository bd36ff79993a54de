"""`smoe serve` over real sockets: the official openai and anthropic clients, raw HTTP and SSE, errors,
a fuzzer, fair queueing and cancellation. The server's text is checked against `generate` run on the
same vault in this process."""

import asyncio
import http.client
import json
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from smoe.hf.tokenizer import Detokenizer, chat_prompt, load_tokenizer
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY as GREEDY_PARAMS
from smoe.runtime.sampling import chosen, sampling_defaults
from smoe.serve.worker import Overloaded, Reply, TextStream, Worker

MAX_TOKENS_LIMIT = 256  # the server's --max-tokens
PROMPT = "The sea was"
GREEDY = {"temperature": 0}  # the anthropic client no longer has sampling arguments; the server still takes them
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(serve_vault, start_server):
    return start_server(serve_vault, "--max-tokens", str(MAX_TOKENS_LIMIT))


@pytest.fixture(scope="module")
def local(serve_vault):
    """The same vault run in this process: what the server must say."""
    sm = OpenedVault(serve_vault, dtype="float32")
    yield sm, load_tokenizer(serve_vault)
    sm.close()


def expected_text(local, prompt_ids, max_tokens, **sampling) -> tuple[str, list[int]]:
    """What the server answers with these sampling fields (greedy unless they say otherwise), the
    vault's defaults in every field they leave out."""
    sm, tok = local
    params = chosen(sampling_defaults(sm.vault.dir), **{"temperature": 0.0, "seed": 0} | sampling)
    tokens, _ = generate(sm, prompt_ids, max_tokens, params=params)
    return tok.decode(tokens, skip_special_tokens=True), tokens


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def call(server, method: str, path: str, body=None, headers=None) -> tuple[int, str, bytes]:
    """One raw HTTP request: (status, content type, body)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, r.getheader("content-type", ""), r.read()
    conn.close()
    return out


def sse_events(response) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event of a streaming http.client response."""
    events, name = [], None
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, line[6:]))
            name = None
    return events


# --- the pieces the server is made of -------------------------------------------------------------

def test_generate_stops_after_the_token_for_which_on_token_returns_false(local):
    sm, tok = local
    seen = []
    tokens, _ = generate(sm, tok(PROMPT)["input_ids"], 20, params=GREEDY_PARAMS,
                         on_token=lambda t: seen.append(t) or len(seen) < 3)
    assert tokens == seen and len(tokens) == 3


def test_text_stream_sends_exactly_the_text_before_the_first_stop_sequence(local):
    _, tok = local
    ids = tok("The sea was calm, and the ship sailed on, and on.", add_special_tokens=False)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    words = full.split()
    for stop in [words[1], f"{words[2]} {words[3]}", ", ", words[-1], "never in the text"]:
        stream, sent = TextStream(Detokenizer(tok), ("zzz", stop)), []
        for token in ids:
            sent.append(stream.push(token))
            if stream.stop_sequence:
                break
        sent.append(stream.finish())
        assert "".join(sent) == (full[:full.find(stop)] if stop in full else full), stop
        assert stream.stop_sequence == (stop if stop in full else None)


def test_engine_refuses_requests_beyond_its_queue_limit(local):
    sm, tok = local
    worker = Worker(sm, tok, "m", max_queue=2)  # worker not started: submitted jobs stay queued

    async def submit_three():
        reply = Reply(GREEDY_PARAMS, max_tokens=1)
        worker.submit([1, 2], reply)
        worker.submit([1, 2], reply)
        with pytest.raises(Overloaded, match="limit is 2"):
            worker.submit([1, 2], reply)

    asyncio.run(submit_three())
    assert worker.waiting == 2


# --- the OpenAI API -------------------------------------------------------------------------------

def test_server_binds_loopback_and_lists_its_model(server, oai):
    assert server.url.startswith("http://127.0.0.1:")
    assert server.health["status"] == "ok" and server.health["max_tokens"] == MAX_TOKENS_LIMIT
    assert [m.id for m in oai.models.list().data] == [server.health["model"]]
    assert oai.models.retrieve(server.health["model"]).id == server.health["model"]


def test_text_completion_is_what_generate_produces_on_the_same_vault(oai, local):
    ids = local[1](PROMPT)["input_ids"]
    text, tokens = expected_text(local, ids, 24)
    r = oai.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(tokens))
    assert r.choices[0].finish_reason == ("length" if len(tokens) == 24 else "stop")
    by_ids = oai.completions.create(model="any", prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == text


def test_seeded_sampling_is_what_generate_samples_with_that_seed(oai, local):
    text, _ = expected_text(local, local[1](PROMPT)["input_ids"], 24, temperature=1.0, top_p=0.9, seed=7)
    r = oai.completions.create(model="any", prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    assert r.choices[0].text == text


def test_logit_bias_is_what_generate_samples_with_that_bias(oai, local):
    """+100 on one token makes it the greedy choice at every step; a ban (-100) on the unbiased text's tokens
    changes the text; both as generate computes them with the same bias."""
    ids = local[1](PROMPT)["input_ids"]
    plain, tokens = expected_text(local, ids, 8)
    forced = oai.completions.create(model="any", prompt=ids, max_tokens=8, temperature=0, logit_bias={"42": 100})
    assert forced.choices[0].text == expected_text(local, ids, 8, logit_bias=((42, 100.0),))[0]
    assert forced.choices[0].text == local[1].decode([42] * 8)
    ban = {str(t): -100 for t in set(tokens)}
    banned = oai.completions.create(model="any", prompt=ids, max_tokens=8, temperature=0, logit_bias=ban)
    bias = tuple(sorted((int(t), -100.0) for t in ban))
    assert banned.choices[0].text == expected_text(local, ids, 8, logit_bias=bias)[0] != plain


def test_chat_completion_uses_the_chat_prompt_and_streams_the_same_text(oai, local):
    prompt = chat_prompt(local[1], CHAT)
    text, tokens = expected_text(local, prompt, 32)
    whole = oai.chat.completions.create(model="any", messages=CHAT, max_tokens=32, temperature=0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), len(tokens))
    pieces, finish, usage = [], None, None
    for chunk in oai.chat.completions.create(model="any", messages=CHAT, max_tokens=32, temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces += [choice.delta.content] if choice.delta.content else []
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text and len(pieces) > 1
    assert finish == whole.choices[0].finish_reason and usage.completion_tokens == len(tokens)


def test_stop_sequence_ends_the_text_just_before_it(oai):
    full = oai.completions.create(model="any", prompt=PROMPT, max_tokens=48, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = oai.completions.create(model="any", prompt=PROMPT, max_tokens=48, temperature=0, stop=["never", stop])
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(model="any", prompt=PROMPT, max_tokens=48, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:full.find(stop)]


def test_raw_http_stream_is_server_sent_events_ending_in_done(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    body = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks) > 1


def test_raw_http_keeps_the_connection_alive_across_requests(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    for _ in range(2):
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["prompt_tokens"] > 0
    conn.request("GET", "/metrics")
    metrics = json.loads(conn.getresponse().read())
    assert {"hit_rate", "bytes_read"} <= metrics["cache"].keys() and metrics["decode_tok_s"] > 0


def test_metrics_are_json_by_default_and_prometheus_text_when_accept_asks(server):
    status, content_type, body = call(server, "GET", "/metrics", headers={"Accept": "*/*"})
    assert status == 200 and content_type == "application/json"
    snapshot = json.loads(body)
    status, content_type, body = call(server, "GET", "/metrics", headers={"Accept": "text/plain"})
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    by_outcome = {s.labels["outcome"]: s.value for s in families["smoe_requests"].samples}
    assert by_outcome["completed"] >= snapshot["requests"]["completed"]
    assert families["smoe_generated_tokens"].type == "counter"
    assert families["smoe_expert_cache_hits"].samples[0].value >= snapshot["cache"]["hits"]
    assert families["smoe_model_info"].samples[0].labels["model"] == snapshot["model"]


def test_metrics_speak_openmetrics_to_a_prometheus_scraper(server):
    accept = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.1"
    status, content_type, body = call(server, "GET", "/metrics", headers={"Accept": accept})
    assert status == 200 and content_type.startswith("application/openmetrics-text")
    assert body.decode().rstrip().endswith("# EOF")
    assert "smoe_queued_or_running" in {f.name for f in text_string_to_metric_families(body.decode())}


# --- the Anthropic API ----------------------------------------------------------------------------

def test_anthropic_messages_whole_and_streamed_match_generate(claude, local):
    prompt = chat_prompt(local[1], CHAT)
    text, tokens = expected_text(local, prompt, 24)
    args = dict(model="any", max_tokens=24, system=CHAT[0]["content"], messages=CHAT[1:], extra_body=GREEDY)
    msg = claude.messages.create(**args)
    assert msg.content[0].text == text and msg.role == "assistant"
    assert msg.stop_reason == ("max_tokens" if len(tokens) == 24 else "end_turn")
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (len(prompt), len(tokens))
    with claude.messages.stream(**args) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == msg.stop_reason and final.usage.output_tokens == len(tokens)


def test_anthropic_stream_sends_the_events_in_the_documented_order(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    body = {"max_tokens": 8, "temperature": 0, "stream": True, "messages": CHAT[1:]}
    conn.request("POST", "/v1/messages", body=json.dumps(body), headers={"Content-Type": "application/json"})
    names = [name for name, _ in sse_events(conn.getresponse())]
    deltas = names.count("content_block_delta")
    assert deltas > 0
    assert names == (["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])


def test_anthropic_stop_sequence_is_reported(claude):
    full = claude.messages.create(model="any", max_tokens=32, messages=CHAT[1:], extra_body=GREEDY).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    msg = claude.messages.create(model="any", max_tokens=32, messages=CHAT[1:], stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert msg.content[0].text == full[:full.find(stop)]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)


# --- errors ---------------------------------------------------------------------------------------

M = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", b"\xff\xfe\x00garbage", 400, "not valid JSON"),
    ("/v1/chat/completions", b"[" * 100_000, 400, "not valid JSON"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": M, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": M, "temperature": 7}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": M, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": M, "max_tokens": 10**6}, 400, "limit"),
    ("/v1/chat/completions", {"messages": M, "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": M, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": M, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": M, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": M, "stream_options": {"include_usage": True}}, 400, "only allowed when stream"),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {}}, 400, "only allowed when stream"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "token ids"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": ["a"] * 33}, 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "NaN"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/messages", {"messages": M}, 400, "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "content"),
    ("/v1/messages", {"max_tokens": 5, "messages": M, "temperature": 1.5}, 400, "temperature"),
    ("/v1/messages", {"max_tokens": 10**6, "messages": M}, 400, "limit"),
    ("/v1/messages", b"{", 400, "not valid JSON"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "user message needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, 400, "non-empty list"),
    ("/v1/chat/completions", {"messages": M, "functions": [{"name": "f"}]}, 400, "use tools"),
    ("/v1/chat/completions", {"messages": M, "function_call": "auto"}, 400, "use tool_choice"),
    ("/v1/chat/completions", {"messages": M, "tool_choice": "any"}, 400, '"none", "auto", "required"'),
    ("/v1/chat/completions", {"messages": M, "logit_bias": {"abc": 5}}, 400, "token ids"),
    ("/v1/chat/completions", {"messages": M, "logit_bias": {"5": 500}}, 400, "[-100, 100]"),
    ("/v1/chat/completions", {"messages": M, "logit_bias": "x"}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(10**9): 1}}, 400, "token ids"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "fill-in-the-middle"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": ""}]}, 400, "non-empty string"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": []}]}, 400, "non-empty list"),
    ("/v1/chat/completions/", {"messages": M}, 404, "Not Found"),
    ("/v1/nowhere", {}, 404, "Not Found"),
    ("/v1/models/some-other-model", None, 404, "not served"),
]


def assert_api_error(path: str, content_type: str, body: bytes, status: int, fragment: str = "") -> None:
    assert content_type == "application/json"
    error = json.loads(body)
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and isinstance(error["error"]["type"], str)
        message = error["error"]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error" and "param" in error["error"]
        message = error["error"]["message"]
    assert fragment in message, (status, message)


@pytest.mark.parametrize("path, body, status, fragment", BAD_REQUESTS)
def test_bad_requests_get_a_4xx_json_error_in_the_api_shape(server, path, body, status, fragment):
    method = "GET" if path.startswith("/v1/models") else "POST"
    got, content_type, reply = call(server, method, path, body)
    assert got == status
    assert_api_error(path, content_type, reply, status, fragment)


def test_wrong_method_gets_405_json(server):
    status, content_type, body = call(server, "GET", "/v1/messages")
    assert status == 405
    assert_api_error("/v1/messages", content_type, body, 405)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_prompt_over_the_context_gets_400(server, path):
    context = server.health["context"]
    content = "sea " * (context + 10)  # at least one token a word
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    status, content_type, reply = call(server, "POST", path, body)
    assert status == 400
    assert_api_error(path, content_type, reply, 400, "context")
    status, _, _ = call(server, "POST", "/v1/completions", {"prompt": [5] * context, "max_tokens": 1})
    assert status == 400


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_size_limit_gets_413(server, chunked):
    body = json.dumps({"prompt": "x" * (1 << 20), "max_tokens": 1}).encode()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    if chunked:  # no Content-Length: the server must count what arrives
        conn.request("POST", "/v1/completions", body=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
    else:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 413
    assert_api_error("/v1/completions", r.getheader("content-type"), r.read(), 413, "limit")


def test_official_clients_raise_their_bad_request_errors(oai, claude):
    with pytest.raises(openai.BadRequestError, match="limit of 256"):
        oai.chat.completions.create(model="any", messages=M, max_tokens=100_000)
    with pytest.raises(anthropic.BadRequestError, match="limit of 256"):
        claude.messages.create(model="any", messages=M, max_tokens=100_000)


def test_serve_refuses_a_busy_port_with_a_one_line_error(serve_vault):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "smoe.cli", "serve", str(serve_vault), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"smoe: error: cannot listen on 127.0.0.1 port {port}") and "Traceback" not in proc.stderr


# --- queueing and cancellation --------------------------------------------------------------------

def raw_request(server, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


def open_stream(server, prompt: str, max_tokens: int) -> tuple[socket.socket, bytes]:
    """A streaming completion whose response headers have arrived (so it is queued on the server), and
    what came after the headers."""
    sock = socket.create_connection((server.host, server.port), timeout=120)
    sock.sendall(raw_request(server, "/v1/completions",
                             {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 200")
    return sock, head.split(b"\r\n\r\n", 1)[1]


def test_requests_run_one_at_a_time_in_arrival_order(server):
    socks, buffers = zip(*[open_stream(server, f"{PROMPT} {word}", 12) for word in ("calm", "rough", "grey")])
    buffers, order, open_ = list(buffers), [], set(range(3))
    while open_:
        ready, _, _ = select.select([socks[i] for i in open_], [], [], 60)
        assert ready
        for i in sorted(open_):  # drain in arrival order, so bytes sent earlier are read earlier
            if socks[i] in ready:
                data = socks[i].recv(65536)
                if not data:
                    open_.discard(i)
                buffers[i] += data
                texts = re.findall(rb'"text": "((?:[^"\\]|\\.)+)"', buffers[i])
                order += [i] * (len(texts) - order.count(i))
    for s in socks:
        s.close()
    assert set(order) == {0, 1, 2}
    firsts = [order.index(i) for i in range(3)]
    assert firsts == sorted(firsts)
    # generation is sequential, but each reply is written by its own task: on a busy machine a reply's last
    # chunks may leave after the next reply's first ones (seen: after most of them), so the order read here is
    # each reply in one run but for such a tail. Runs of one reply, not positions: three replies of 12 tokens
    # generated together would switch between replies about every chunk (30 or more changes), sequential
    # ones 2 times, plus 2 for each late tail.
    changes = sum(a != b for a, b in zip(order, order[1:]))
    assert changes <= 6, order


@pytest.fixture(scope="module")
def long_prompt_and_budget(oai, server) -> tuple[str, int]:
    """A prompt whose greedy continuation runs to the token limit (no end of text), and that limit."""
    for prompt in (PROMPT, "Once upon a time", "It was a dark and stormy night"):
        budget = min(MAX_TOKENS_LIMIT, server.health["context"] - 16)
        r = oai.completions.create(model="any", prompt=prompt, max_tokens=budget, temperature=0)
        if r.choices[0].finish_reason == "length":
            return prompt, budget
    pytest.fail("every prompt reached the end of text before the token limit")


def test_client_leaving_mid_stream_cancels_its_generation(server, long_prompt_and_budget):
    prompt, budget = long_prompt_and_budget
    before = server.wait_idle()["requests"]["cancelled"]
    logged_before = logged_cancellations(server)
    sock, received = open_stream(server, prompt, budget)
    while b'"text": "' not in received:
        received += sock.recv(65536)
    sock.close()
    metrics = server.wait_idle()
    assert metrics["requests"]["cancelled"] == before + 1
    assert metrics["last_request"]["generated_tokens"] < budget
    assert_logged_cancelled(server, "POST /v1/completions 200", before=logged_before)


def assert_logged_cancelled(server, fragment: str, before: int) -> None:
    """The access-log line of the request just cancelled (lines after the first `before` of them) says so."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in server.stderr().splitlines() if "cancelled" in line][before:]
        if lines:
            assert len(lines) == 1 and fragment in lines[0] and "the client disconnected" in lines[0], lines
            return
        time.sleep(0.05)
    pytest.fail(f"no access-log line says the request was cancelled:\n{server.stderr()}")


def logged_cancellations(server) -> int:
    return sum("cancelled" in line for line in server.stderr().splitlines())


def test_client_leaving_a_whole_response_request_cancels_it(server, long_prompt_and_budget):
    prompt, budget = long_prompt_and_budget
    before = server.wait_idle()["requests"]["cancelled"]
    logged_before = logged_cancellations(server)
    sock = socket.create_connection((server.host, server.port), timeout=60)
    sock.sendall(raw_request(server, "/v1/completions", {"prompt": prompt, "max_tokens": budget, "temperature": 0}))
    while not server.get_json("/metrics")["running"]:
        time.sleep(0.005)
    sock.close()
    metrics = server.wait_idle()
    assert metrics["requests"]["cancelled"] == before + 1
    assert metrics["last_request"]["generated_tokens"] < budget
    assert_logged_cancelled(server, "POST /v1/completions 499", before=logged_before)


def test_a_request_whose_client_leaves_while_queued_never_runs(server, long_prompt_and_budget):
    prompt, budget = long_prompt_and_budget
    before = server.wait_idle()
    running, _ = open_stream(server, prompt, budget)
    while not server.get_json("/metrics")["running"]:
        time.sleep(0.005)
    queued, _ = open_stream(server, prompt, budget)
    queued.close()
    running.close()
    after = server.wait_idle()
    assert after["requests"]["cancelled"] == before["requests"]["cancelled"] + 2
    # only the first one read its prompt
    assert after["tokens"]["prompt"] - before["tokens"]["prompt"] == after["last_request"]["prompt_tokens"] > 0


def test_a_queued_request_whose_client_leaves_frees_its_place_in_the_queue_at_once(
        serve_vault, start_server, long_prompt_and_budget):
    """With --max-queue 2, one request running and one that waited and left: a new request is queued, not
    refused as if the queue were full, while the first still runs."""
    prompt, budget = long_prompt_and_budget
    server = start_server(serve_vault, "--max-queue", "2")
    running, _ = open_stream(server, prompt, budget)
    while not server.get_json("/metrics")["running"]:
        time.sleep(0.005)
    left, _ = open_stream(server, prompt, budget)
    left.close()
    deadline = time.monotonic() + 30
    while server.get_json("/metrics")["queued_or_running"] > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    metrics = server.get_json("/metrics")
    assert metrics["queued_or_running"] == 1 and metrics["running"], metrics
    assert metrics["requests"]["cancelled"] == 1
    third, _ = open_stream(server, prompt, budget)  # its response head says 200: queued, not a 503
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": 4}))
    full = conn.getresponse()
    assert full.status == 503 and "2 requests are already waiting" in json.loads(full.read())["error"]["message"]
    assert full.getheader("Retry-After") == "1"  # when the SDKs' retries try again
    conn.close()
    for sock in (third, running):
        sock.close()
    assert server.wait_idle()["requests"]["cancelled"] == 3


def read_all(sock: socket.socket, received: bytes = b"") -> bytes:
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_shutdown_answers_the_requests_in_flight_and_queued_with_503s_in_their_apis_shape(
        serve_vault, start_server, long_prompt_and_budget):
    """SIGTERM stops generation at the next token: a whole-response request, a stream and a queued request
    each get the server's 503 in their API's shape within the graceful period, not a cut connection or a
    plain-text 500, and the server still ends cleanly."""
    prompt, budget = long_prompt_and_budget
    server = start_server(serve_vault)
    whole = socket.create_connection((server.host, server.port), timeout=120)
    whole.sendall(raw_request(server, "/v1/completions", {"prompt": prompt, "max_tokens": budget, "temperature": 0}))
    while not server.get_json("/metrics")["running"]:
        time.sleep(0.005)
    stream, received = open_stream(server, prompt, budget)
    queued = socket.create_connection((server.host, server.port), timeout=120)
    queued.sendall(raw_request(server, "/v1/messages", {"messages": [{"role": "user", "content": prompt}],
                                                        "max_tokens": budget}))
    while server.get_json("/metrics")["queued_or_running"] < 3:
        time.sleep(0.005)
    server.proc.send_signal(signal.SIGTERM)
    head, body = read_all(whole).split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503") and "shutting down" in json.loads(body)["error"]["message"], head + body
    events = read_all(stream, received).decode()
    error = '{"error": {"message": "the server is shutting down'
    assert error in events and events.index(error) < events.index("data: [DONE]"), events[-500:]
    head, body = read_all(queued).split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["type"] == "overloaded_error", head + body
    assert server.proc.wait(timeout=30) == 0
    assert "Traceback" not in server.stderr()


# --- robustness -----------------------------------------------------------------------------------

def http_bytes(path: str, body: bytes, extra: str = "", method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


WRONG_VALUES = ["x", 1, -1, 2.5, None, True, [], {}, [1, "a"], {"a": 1}, 10**30, "0" * 5000]


def fuzz_case(rng: random.Random) -> tuple[bytes, bool]:
    """(bytes to send, read the reply?) — malformed, oversized or cut short."""
    valid = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/messages"])
    body = json.dumps(valid).encode()
    kind = rng.randrange(10)
    if kind == 0:  # not HTTP at all
        return rng.randbytes(rng.randint(1, 400)) + b"\r\n\r\n", True
    if kind == 1:  # JSON cut short or with flipped bytes
        cut = bytearray(body[:rng.randrange(len(body))])
        for _ in range(rng.randint(0, 3)):
            if cut:
                cut[rng.randrange(len(cut))] = rng.randrange(256)
        return http_bytes(path, bytes(cut)), True
    if kind == 2:  # a field of the wrong type or out of range
        bad = dict(valid, **{rng.choice(["messages", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                                         "prompt", "system", "n"]): rng.choice(WRONG_VALUES)})
        return http_bytes(path, json.dumps(bad).encode()), True
    if kind == 3:  # declares a huge body, sends a little, hangs up
        return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n").encode() + body, rng.random() < 0.5
    if kind == 4:  # a request cut at a random byte, connection closed
        whole = http_bytes(path, body)
        return whole[:rng.randrange(len(whole))], False
    if kind == 5:  # a whole valid request, connection closed without reading
        return http_bytes(path, body), False
    if kind == 6:  # oversized headers
        return http_bytes(path, body, f"X-Pad: {'a' * rng.randint(20_000, 100_000)}\r\n"), True
    if kind == 7:  # deeply nested or huge JSON values
        nested = b"[" * rng.randint(1000, 200_000)
        return http_bytes(path, rng.choice([nested, b'{"messages": ' + nested])), True
    if kind == 8:  # odd methods, paths and lengths
        return rng.choice([http_bytes("/v1/../../etc/passwd", b"", method="GET"),
                           http_bytes(path, body, method="PUT"), http_bytes("/%00%ff", b"", method="GET"),
                           f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n".encode(),
                           f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n".encode(),
                           f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".encode()]), True
    return http_bytes(path, body[:-1] + b', "extra": ' + json.dumps(rng.choice(WRONG_VALUES)).encode() + b"}"), True


def send_case(server, case: tuple[bytes, bool]) -> int | None:
    """The reply's status code, or None when nothing was read."""
    data, read = case
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the server answered early and closed (e.g. 413 before the body arrived)
            pass
        if not read:
            return None
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    status = re.match(rb"HTTP/1\.1 (\d{3})", reply)
    return int(status.group(1)) if status else None


def test_a_thousand_malformed_oversized_and_cut_requests_leave_the_server_correct(server, oai):
    before = oai.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    rng = random.Random(0)
    cases = [fuzz_case(rng) for _ in range(1200)]
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda c: send_case(server, c), cases))
    answered = [s for s in statuses if s is not None]
    assert len(answered) > 700, f"only {len(answered)} replies"
    assert all(s < 500 for s in answered), sorted(set(answered))
    assert time.monotonic() - start < 240
    assert server.proc.poll() is None
    assert server.wait_idle()["queued_or_running"] == 0
    after = oai.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    assert after == before
    assert "Traceback" not in server.stderr()


def test_sigterm_stops_the_server_cleanly_and_closes_the_vault(serve_vault, start_server):
    server = start_server(serve_vault)
    assert server.get_json("/health")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    log = server.stderr()
    assert "smoe: stopped (SIGTERM); the vault is closed" in log and "Traceback" not in log
