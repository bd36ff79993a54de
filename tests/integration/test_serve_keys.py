"""`smoe serve --api-key KEY` over a real socket, with the official clients: every /v1 route needs the
key, in the header each API sends it in; /, /health and /metrics stay open."""

import http.client
import json

import anthropic
import openai
import pytest

from smoe.cli.commands import main

KEY = "sk-test-0123456789"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(serve_vault, start_server):
    return start_server(serve_vault, "--api-key", KEY)


def call(server, method: str, path: str, headers: dict | None = None, body: dict | None = None):
    """(status, headers, body) of one raw HTTP request."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                 headers={"Content-Type": "application/json"} | (headers or {}))
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


def test_openai_client_with_the_key_is_served_and_with_a_wrong_key_is_refused(server):
    right = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = right.completions.create(model="any", prompt="The sea", max_tokens=2, extra_body=GREEDY)
    assert r.usage.completion_tokens >= 1
    assert [m.id for m in right.models.list().data] == [server.health["model"]]
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY + "x", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "invalid_request_error"


def test_anthropic_client_is_served_with_x_api_key_or_bearer_and_refused_with_a_wrong_key(server):
    ask = {"model": "any", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for client in (anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60),
                   anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=60)):
        assert client.messages.create(**ask).usage.output_tokens >= 1
    wrong = anthropic.Anthropic(base_url=server.url, api_key="not-" + KEY, max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(**ask)
    assert e.value.status_code == 401 and e.value.body == {
        "type": "error", "error": {"type": "authentication_error", "message": "the API key is not this server's"}}


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/v1/models/any"),
                                          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")])
def test_every_v1_route_without_a_key_is_a_401_in_its_apis_error_shape(server, method, path):
    status, headers, body = call(server, method, path, body={} if method == "POST" else None)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    error = json.loads(body)
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
        assert "x-api-key" in error["error"]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error" and "Bearer" in error["error"]["message"]


def test_x_api_key_is_not_a_key_on_openai_routes(server):
    status, _, _ = call(server, "GET", "/v1/models", headers={"x-api-key": KEY})
    assert status == 401


def test_health_metrics_and_the_web_page_stay_open_without_a_key(server):
    for path in ("/", "/health", "/metrics"):
        assert call(server, "GET", path)[0] == 200, path
    assert server.health["api_key_required"] is True


def test_an_empty_api_key_is_a_one_line_error_before_the_model_loads(serve_vault, capsys):
    assert main(["serve", str(serve_vault), "--port", "0", "--api-key", ""]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "smoe: error: --api-key must not be empty, nor begin or end with spaces"]
