"""`smoe serve` writes one access-log line per request; --log-level warning silences them."""

import http.client
import json
import time


def post(server, path: str, body: dict) -> int:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def log_lines(server, fragment: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in server.stderr().splitlines() if fragment in line]
        if lines:
            return lines
        time.sleep(0.1)
    return []


def test_each_request_gets_one_access_line_with_route_status_and_tokens(serve_vault, start_server):
    server = start_server(serve_vault)
    assert post(server, "/v1/completions", {"prompt": "The sea", "max_tokens": 3, "temperature": 0}) == 200
    lines = log_lines(server, "POST /v1/completions 200")
    assert len(lines) == 1 and "generated 3 tokens" in lines[0] and "tok/s" in lines[0], server.stderr()
    assert post(server, "/v1/completions", {"prompt": "x", "temperature": 9}) == 400
    assert len(log_lines(server, "POST /v1/completions 400")) == 1
    server.get_json("/health")
    assert log_lines(server, "GET /health 200")


def test_log_level_warning_keeps_access_lines_out(serve_vault, start_server):
    server = start_server(serve_vault, "--log-level", "warning")
    assert post(server, "/v1/completions", {"prompt": "The sea", "max_tokens": 2}) == 200
    time.sleep(0.5)
    assert "POST /v1/completions" not in server.stderr()


def test_a_path_with_a_newline_or_of_any_length_stays_one_short_log_line(serve_vault, start_server):
    """The access line shows the path percent-encoded, as sent, and cut short: a %0A in it cannot start
    a line of the client's making, and a 100 kB path does not fill the log."""
    server = start_server(serve_vault)
    for path in ("/x%0Asmoe:%20POST%20/v1/completions%20200%20FORGED", "/" + "a" * 20_000):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("GET", path)
        assert conn.getresponse().status == 404
        conn.close()
    lines = log_lines(server, "GET /x%0Asmoe:%20POST%20/v1/completions%20200%20FORGED 404")
    long = log_lines(server, "GET /aaa")
    assert len(lines) == 1 and not [line for line in server.stderr().splitlines() if line.startswith("smoe: POST")]
    assert len(long) == 1 and len(long[0]) < 400 and "(20001 characters)" in long[0]
