"""`smoe serve` at the edges of HTTP and of its input, over real sockets: content types, bodies over
the size limit, lone surrogates, methods, HEAD, union-typed fields; two servers on one vault, and a
vault directory replaced under a running server."""

import http.client
import json
import os
import select
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

BODY_MB = 0.05  # the --max-body-mb of `server`
LIMIT = int(BODY_MB * 2**20)
HI = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def vaults(tmp_path_factory) -> dict:
    """live: the vault `server` serves, a copy of a tiny Qwen3-MoE's at Q4; other: a tiny Mixtral's at Q2."""
    from smoe.testing.vaults import tiny_vault

    root = tmp_path_factory.mktemp("edges")
    live = root / "live"
    shutil.copytree(tiny_vault(root / "a", "qwen3_moe", bits=4, seed=3), live)
    return {"root": root, "live": live, "other": tiny_vault(root / "b", "mixtral", bits=2, seed=4)}


@pytest.fixture(scope="module")
def servers(vaults, start_server) -> list:
    """Two servers of the same vault, started side by side; the first is `server`."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda _: start_server(vaults["live"], "--max-body-mb", str(BODY_MB)), range(2)))


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers with lower-case names, body) of one request on its own connection."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


def api_message(path: str, headers: dict, body: bytes) -> str:
    """The message of a JSON error in the shape of the API at `path`."""
    assert headers["content-type"] == "application/json", headers
    error = json.loads(body)
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
    else:
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
    return error["error"]["message"]


CONTENT_TYPES = [
    ("application/json", 200),
    ("application/json; charset=utf-8", 200),
    (None, 200),
    ("application/x-www-form-urlencoded", 200),  # curl -d
    ("text/plain", 415),
    ("text/plain; charset=utf-8", 415),
    ("multipart/form-data; boundary=x", 415),
    ("application/xml", 415),
    ("application/octet-stream", 415),
]


@pytest.mark.parametrize("content_type, status", CONTENT_TYPES)
@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/v1/completions"])
def test_every_content_type_gets_json_or_415(server, path, content_type, status):
    body = json.dumps(HI if "messages" in path else {"prompt": "hi", "max_tokens": 1, "temperature": 0}).encode()
    got, headers, reply = request(server, "POST", path, body, {"Content-Type": content_type} if content_type else {})
    assert got == status, reply
    if status == 415:
        media = content_type.partition(";")[0]
        assert f"Content-Type {media} is not supported" in api_message(path, headers, reply)
    else:
        assert headers["content-type"] == "application/json" and json.loads(reply)


def answer_while_sending(server, head: bytes, piece: bytes, most: int) -> tuple[int, bytes]:
    """Sends `head`, then `piece` after `piece` until the server answers (or `most` bytes went):
    (body bytes sent, everything the server sent until it closed)."""
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(head)
        sent = 0
        while not select.select([sock], [], [], 0.05)[0]:
            assert sent < most, "no answer yet: the server is reading the whole body"
            sock.sendall(piece)
            sent += len(piece)
        reply, deadline = b"", time.monotonic() + 10
        while time.monotonic() < deadline and (chunk := sock.recv(65536)):
            reply += chunk
        return sent, reply


CHUNK = b"x" * 8192
OVERSIZED = [
    ("content-length", b"Content-Length: 1073741824\r\n", CHUNK, 0),  # the head says it all: not one body byte read
    ("chunked", b"Transfer-Encoding: chunked\r\n", b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK), LIMIT + 4 * len(CHUNK)),
]


@pytest.mark.parametrize("framing, header, piece, read_at_most", OVERSIZED, ids=[c[0] for c in OVERSIZED])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_an_oversized_body_is_413_before_it_is_read(server, path, framing, header, piece, read_at_most):
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode() + header + b"\r\n"
    sent, reply = answer_while_sending(server, head, piece, most=1 << 20)
    assert sent <= read_at_most + len(piece), f"{sent:,} bytes sent before the answer"
    status_line, _, rest = reply.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413 "), reply[:200]
    lines, _, body = rest.partition(b"\r\n\r\n")
    headers = dict(line.decode().lower().split(": ", 1) for line in lines.split(b"\r\n"))
    assert headers["connection"] == "close"  # and the server did close: recv() came back empty
    assert f"over the limit of {LIMIT:,} bytes" in api_message(path, headers, body)


def test_an_oversized_body_sent_whole_still_gets_its_413(server):
    """A client that sends all of its body before reading (http.client) reads the 413, not a reset."""
    status, headers, reply = request(server, "POST", "/v1/completions", b"x" * (4 << 20),
                                     {"Content-Type": "application/json"})
    assert status == 413 and headers["connection"] == "close"
    assert "over the limit" in api_message("/v1/completions", headers, reply)


SURROGATES = [
    ("/v1/completions", b'{"prompt": "sea \\ud83d", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["fine", "\\udc00"], "max_tokens": 1}', "prompt.1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": "\\uD83D"}', "stop"),
    ("/v1/messages", b'{"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", '
                     b'"text": "\\ude00"}]}]}', "messages.0.content.0.text"),
    ("/v1/messages", b'{"max_tokens": 1, "system": "\\ud83d", "messages": [{"role": "user", "content": "hi"}]}',
     "system"),
]


@pytest.mark.parametrize("path, body, field", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, field):
    status, headers, reply = request(server, "POST", path, body, {"Content-Type": "application/json"})
    assert status == 400, reply
    assert api_message(path, headers, reply).startswith(f"{field}: the text has a lone surrogate")
    # a surrogate pair is a character like any other
    pair = {"messages": [{"role": "user", "content": "sea \ud83d\ude00"}]}
    status, _, reply = request(server, "POST", "/v1/messages/count_tokens", json.dumps(pair).encode())
    assert status == 200, reply


WRONG_METHODS = [
    ("GET", "/v1/completions", "POST"),
    ("DELETE", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/messages", "POST"),
    ("POST", "/health", "GET, HEAD"),
    ("DELETE", "/v1/models", "GET, HEAD"),
    ("POST", "/", "GET, HEAD"),
]


@pytest.mark.parametrize("method, path, allow", WRONG_METHODS)
def test_405_names_the_allowed_methods(server, method, path, allow):
    status, headers, reply = request(server, method, path)
    assert status == 405 and headers["allow"] == allow
    api_message(path, headers, reply)


@pytest.mark.parametrize("path", ["/", "/health", "/metrics", "/v1/models", "/v1/models/{model}",
                                  "/v1/models/another-model", "/nowhere"])
def test_head_is_answered_wherever_get_is(server, path):
    path = path.format(model=server.health["model"])
    got, got_headers, _ = request(server, "GET", path)
    status, headers, body = request(server, "HEAD", path)
    assert status == got and headers["content-type"] == got_headers["content-type"] and body == b""


UNIONS = [
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop", "5"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", '[""]'),
    ("/v1/completions", {"prompt": 5}, "prompt", "5"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", '[1, "a"]'),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt", '{"text": "hi"}'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages.0.content", "7"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content",
     '[{"type": "text"}]'),
    ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": None}]}, "messages.0.content", "null"),
    ("/v1/messages/count_tokens", {"system": 5, **HI}, "system", "5"),
]


@pytest.mark.parametrize("path, body, field, got", UNIONS)
def test_a_union_field_error_names_the_field_and_what_it_accepts(server, path, body, field, got):
    status, headers, reply = request(server, "POST", path, json.dumps(body).encode())
    assert status == 400, reply
    message = api_message(path, headers, reply)
    assert message.startswith(f"{field}: expected a ") and message.endswith(f", got {got}"), message
    assert "\n" not in message
    if not path.startswith("/v1/messages"):
        assert json.loads(reply)["error"]["param"] == field


def greedy_text(server, prompt: str = "The sea was") -> str:
    status, _, reply = request(server, "POST", "/v1/completions",
                               json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode())
    assert status == 200, reply
    return json.loads(reply)["choices"][0]["text"]


def test_two_servers_on_one_vault_both_answer(servers):
    expected = greedy_text(servers[0])
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(greedy_text, servers * 3))
    assert texts == [expected] * 6
    servers[1].stop()


def test_a_vault_replaced_under_a_running_server_never_mixes_files(server, vaults):
    """The server holds the vault's files open from start-up: renaming another vault into its place,
    or deleting its directory, leaves it answering exactly as before, never with a mix of both."""
    root, live, other = vaults["root"], vaults["live"], vaults["other"]
    expected = greedy_text(server)
    index = (live / "index.json").read_bytes()
    texts = []
    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(greedy_text, server) for _ in range(6)]
        for _ in range(5):  # live <-> other by renames, while requests run and between them: live ends as other
            os.rename(live, root / "old")
            os.rename(other, live)
            os.rename(root / "old", other)
            texts.append(greedy_text(server))
        texts += [f.result() for f in answers]
    assert (live / "index.json").read_bytes() != index and (other / "index.json").read_bytes() == index
    shutil.rmtree(other)  # the directory the server opened is gone
    assert texts + [greedy_text(server)] == [expected] * 12
    assert server.get_json("/health")["status"] == "ok"
