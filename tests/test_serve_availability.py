"""`smoe serve` stays available: idle, trickling and surplus connections are closed after bounded,
configured times, cannot lock out a client that sends its request, and every answer the server gives
them is JSON in the shape of the API called. Real sockets on loopback, timeouts of a second or two."""

import http.client
import json
import resource
import select
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager

import pytest

IDLE_TIMEOUT = 1.5  # the --idle-timeout and --request-timeout of `server`
REQUEST_TIMEOUT = 2.0
CAP = 40  # the --max-connections of `capped`
SLACK = 1.0  # seconds a deadline may be late on a loaded machine


@pytest.fixture(scope="module")
def server(serve_vault, start_server):
    return start_server(serve_vault, "--idle-timeout", str(IDLE_TIMEOUT), "--request-timeout", str(REQUEST_TIMEOUT))


@pytest.fixture(scope="module")
def capped(serve_vault, start_server):
    """Long timeouts, so that only the connection limit can close a connection during a test."""
    return start_server(serve_vault, "--max-connections", str(CAP), "--idle-timeout", "60", "--request-timeout", "60")


@pytest.fixture(scope="module")
def patient(serve_vault, start_server):
    """Long timeouts and the default connection limit: a flood stays open however slowly it is opened."""
    return start_server(serve_vault, "--idle-timeout", "60", "--request-timeout", "60")


def connect(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


@contextmanager
def connections(server, n: int):
    """`n` open connections that send nothing, all closed on leaving, whatever happens."""
    with ExitStack() as stack:
        yield [stack.enter_context(connect(server)) for _ in range(n)]


def seconds_until_closed(sock: socket.socket, limit: float) -> float | None:
    """How long until the server closes `sock` (reading and dropping what it sends), or None."""
    start = time.monotonic()
    while (left := limit - (time.monotonic() - start)) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - start
            except ConnectionResetError:
                return time.monotonic() - start
    return None


def lifetimes(socks: list[socket.socket], since: float, limit: float) -> list[float | None]:
    """For each socket, the seconds from `since` until the server closed it, or None."""
    ends = {}
    for i, s in enumerate(socks):
        left = limit - (time.monotonic() - since)
        took = seconds_until_closed(s, max(left, 0.01))
        ends[i] = None if took is None else time.monotonic() - since
    return [ends[i] for i in range(len(socks))]


def is_open(sock: socket.socket) -> bool:
    return seconds_until_closed(sock, 0.01) is None


def parse_response(data: bytes) -> tuple[int, dict, bytes] | None:
    """(status, headers, body) once `data` holds a whole response (all of the server's have a Content-Length)."""
    head, found, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    if not (found and data.startswith(b"HTTP/1.1 ")) or len(body) < int(headers.get("content-length", 1 << 62)):
        return None
    return int(lines[0].split()[1]), headers, body


def read_response(sock: socket.socket, limit: float = 10) -> tuple[int, dict, bytes]:
    """The one response the server sends on `sock`, read until complete or closed."""
    data, deadline = b"", time.monotonic() + limit
    while parse_response(data) is None and select.select([sock], [], [], max(0, deadline - time.monotonic()))[0]:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            break
        data += chunk
    response = parse_response(data)
    assert response, f"no whole HTTP response: {data[:200]!r}"
    return response


def send_raw(server, data: bytes) -> tuple[int, dict, bytes]:
    with connect(server) as sock:
        sock.sendall(data)
        return read_response(sock)


def trickle(sock: socket.socket, data: bytes, gap: float, limit: float) -> float:
    """Sends `data` a byte every `gap` seconds until the server answers or `limit` passes; the time taken."""
    start = time.monotonic()
    for byte in data:
        if select.select([sock], [], [], 0)[0] or time.monotonic() - start > limit:
            break
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(gap)
    return time.monotonic() - start


def assert_error_shape(path: str, status: int, headers: dict, body: bytes, want: int) -> dict:
    assert status == want, body
    assert headers.get("content-type", "").startswith("application/json"), headers
    error = json.loads(body)
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
    else:
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
    return error


def get_health(server, timeout: float = 10) -> tuple[int, float]:
    start = time.monotonic()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status, time.monotonic() - start


def complete(server, timeout: float = 60) -> int:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "The sea", "max_tokens": 2}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def head(path: str, length: int | None = None) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}\r\n".encode()


# --- idle and slow connections --------------------------------------------------------------------

def test_idle_connections_are_closed_after_the_idle_timeout(server):
    start = time.monotonic()
    with connections(server, 20) as socks:
        lived = lifetimes(socks, start, IDLE_TIMEOUT + 5)
    assert all(t is not None and IDLE_TIMEOUT - 0.5 < t < IDLE_TIMEOUT + SLACK for t in lived), lived


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        select.select([sock], [], [], 10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        lifetime = seconds_until_closed(sock, IDLE_TIMEOUT + 5)
    assert lifetime is not None and lifetime < IDLE_TIMEOUT + SLACK


def test_a_slow_request_head_is_cut_off_with_a_json_408(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\n")  # then the headers, too slowly
        took = trickle(sock, b"Host: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n",
                       gap=0.05, limit=REQUEST_TIMEOUT + 5)
        status, headers, body = read_response(sock)
    error = assert_error_shape("/v1/messages", status, headers, body, 408)
    assert error["error"]["type"] == "timeout_error"
    assert REQUEST_TIMEOUT - 0.5 < took < REQUEST_TIMEOUT + SLACK


def test_a_slow_request_body_is_cut_off_with_a_json_408(server):
    body = json.dumps({"messages": [{"role": "user", "content": "a" * 200}], "max_tokens": 2}).encode()
    with connect(server) as sock:
        sock.sendall(head("/v1/chat/completions", len(body)))
        took = trickle(sock, body, gap=0.05, limit=REQUEST_TIMEOUT + 5)
        status, headers, answer = read_response(sock)
    assert_error_shape("/v1/chat/completions", status, headers, answer, 408)
    assert REQUEST_TIMEOUT - 0.5 < took < REQUEST_TIMEOUT + SLACK


def test_a_flood_of_idle_connections_does_not_lock_out_a_real_client(patient):
    with connections(patient, 300) as socks:
        status, took = get_health(patient)
        still_open = sum(map(is_open, socks[:20]))
        completed = complete(patient)
    assert status == 200 and took < 5.0, (status, took)  # far below the 60 s an idle slot would take
    assert completed == 200
    assert still_open == 20  # answered while the flood was there, not after the idle timeout emptied it


# --- the connection limit -------------------------------------------------------------------------

def test_at_the_connection_limit_the_oldest_idle_connections_make_room(capped):
    with connections(capped, 300) as socks:
        status, took = get_health(capped)
        time.sleep(0.2)
        open_now = [is_open(s) for s in socks]
    assert status == 200 and took < 5.0, (status, took)  # far below the 60 s an idle slot would take
    assert sum(open_now) <= CAP and all(open_now[-(CAP // 2):]), sum(open_now)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_when_every_connection_is_busy_a_new_one_gets_a_json_503(capped, path):
    with connections(capped, CAP) as busy:
        for s in busy:
            s.sendall(head("/v1/completions", 100))  # a body that never comes keeps a request in flight
        time.sleep(0.3)
        status, headers, body = send_raw(capped, head(path, 2) + b"{}")
    error = assert_error_shape(path, status, headers, body, 503)
    assert "connections" in json.dumps(error)
    deadline = time.monotonic() + 10  # and once the busy clients leave, the server answers again
    while (answer := get_health(capped)[0]) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert answer == 200


def test_the_connection_limit_fits_the_file_descriptor_limit():
    """Under `ulimit -n 1000` the server allows 1000 less the descriptors it keeps for itself, and a
    limit already within it stays as given."""
    code = ("import resource; from smoe.serve.transport import FD_RESERVE, fit_fd_limit\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (1000, 1000))\n"
            "print(fit_fd_limit(4096), fit_fd_limit(100), 1000 - FD_RESERVE)")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1000:
        pytest.skip(f"the hard descriptor limit here is {hard}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    allowed, untouched, room = map(int, out.split())
    assert (allowed, untouched) == (room, 100) and room > 0


# --- error bodies ---------------------------------------------------------------------------------

ERRORS = [  # (path for the shape, raw request, status)
    ("/v1/nothing", b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    ("/v1/messages/x", b"GET /v1/messages/x HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    ("/v1/messages", b"GET /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    ("/v1/chat/completions", b"DELETE /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    ("/v1/messages", head("/v1/messages", 5) + b"{nope", 400),
    ("/v1/completions", head("/v1/completions", (1 << 20) + 1) + b" " * ((1 << 20) + 1), 413),
    ("/v1/messages", head("/v1/messages", (1 << 20) + 1) + b" " * ((1 << 20) + 1), 413),
    ("", b"NOT HTTP AT ALL\r\n\r\n", 400),
    ("/v1/messages", b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400),
]


@pytest.mark.parametrize("path, request_bytes, status", ERRORS,
                         ids=[f"{status}-{path or 'garbage'}-{i}" for i, (path, _, status) in enumerate(ERRORS)])
def test_every_error_body_is_json_in_the_shape_of_the_api(server, path, request_bytes, status):
    got, headers, body = send_raw(server, request_bytes)
    assert_error_shape(path, got, headers, body, status)
