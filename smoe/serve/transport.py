"""Connections and the listening socket: uvicorn's HTTP/1.1 protocol guarded by deadlines on the
client's side and a cap on how many connections are open (GuardedH11), and errors answered before
uvicorn has a request, in the shape of the API the request was for."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import sys
from dataclasses import replace
from http import HTTPStatus
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from smoe.errors import SmoeError
from smoe.serve.api import Limits, error_body

DRAIN_BYTES = 16 << 20  # how much of an unread request body a closing connection still reads (and drops)
LINGER = 2.0  # seconds it may take to do so
HEAD_PREFIX = 4096  # bytes of a request's start kept to find its path for an error before uvicorn parses it
REFUSE_WAIT = 1.0  # seconds a connection over the limit may take to send its request line, to be told why
MAX_REFUSED = 32  # connections over the limit kept waiting for that at once; more are answered straight away
ACCEPT_BURST = 128  # connections asyncio accepts per loop pass (uvicorn's backlog), before any is admitted
FD_RESERVE = 64 + 2 * ACCEPT_BURST  # descriptors beyond the connection limit: the model's files, the
# listening socket, and connections accepted or evicted but not yet through connection_made / closed


def request_path(head: bytes) -> str:
    """The path of a request whose start is `head` ("POST /v1/messages HTTP/1.1..."), "" until its
    request line is complete."""
    line, complete, _ = head.partition(b"\n")
    parts = line.split()
    return urlsplit(parts[1].decode("latin-1")).path if complete and len(parts) == 3 else ""


def raw_error(path: str, status: int, message: str) -> bytes:
    """A whole HTTP response with a JSON error body, for answers given before uvicorn has a request."""
    body = json.dumps(error_body(path, status, message)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class Connections:
    """The open connections, oldest first, those refused and being answered, and the limits."""

    def __init__(self, limits: Limits):
        self.limits, self.open, self.refused = limits, {}, set()
        self.full = f"the server is at its limit of {limits.max_connections} connections"

    def admit(self, conn: GuardedH11) -> bool:
        """Whether `conn` may stay; at the limit it takes the place of the oldest connection that has
        no request in flight, so that idle or trickling clients cannot lock out the others."""
        if len(self.open) >= self.limits.max_connections:
            waiting = next((c for c in self.open if not c.in_request()), None)
            if waiting is None:
                return False
            waiting.expire(503, self.full)
            self.open.pop(waiting, None)
        self.open[conn] = None
        return True


class LingeringTransport:
    """The connection's transport as uvicorn sees it, with close() left to GuardedH11.linger."""

    def __init__(self, transport, protocol: GuardedH11):
        self.real, self.protocol = transport, protocol

    def close(self) -> None:
        self.protocol.linger()

    def is_closing(self) -> bool:
        return self.protocol.lingering or self.real.is_closing()

    def __getattr__(self, name):
        return getattr(self.real, name)


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 connection with deadlines on the client's side and a cap on their number.

    With no request in flight (a new connection, or kept alive after a response), the client must
    send a first byte within idle_timeout, and the rest of the request head within request_timeout
    of that byte; the body's deadline is read_body's. A connection that runs out of time is closed,
    with a 408 if part of a request had come. uvicorn alone times out only kept-alive connections.

    A socket closed while the client is still sending a body it did not read (after a 413 or 415) makes
    the kernel send a reset, which can destroy the answer before the client reads it; so such a close
    lingers: the answer is sent, our side shut, and what still comes is dropped (up to DRAIN_BYTES,
    for up to LINGER seconds) until the client closes."""

    def __init__(self, registry: Connections, **kwargs):
        super().__init__(**kwargs)
        self.registry, self.limits = registry, registry.limits  # uvicorn has self.connections
        self.timer: asyncio.TimerHandle | None = None
        self.head = b""  # the start of a request whose head has not all arrived
        self.refused = self.lingering = False
        self.drained = 0

    def in_request(self) -> bool:
        """Whether a request head has arrived and its answer is not yet sent."""
        return self.conn.our_state in (h11.SEND_RESPONSE, h11.SEND_BODY)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = LingeringTransport(transport, self)
        self.refused = not self.registry.admit(self)
        if not self.refused:
            self.arm(self.limits.idle_timeout, 408, "no request came")
        elif len(self.registry.refused) < MAX_REFUSED:  # to answer in the shape of its API
            self.registry.refused.add(self)
            self.arm(REFUSE_WAIT, 503, self.registry.full)
        else:
            self.expire(503, self.registry.full)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.registry.open.pop(self, None)
        self.registry.refused.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.drained += len(data)
            if self.drained > DRAIN_BYTES:
                self.transport.real.close()
            return
        if self.refused:  # answered once its request line is in
            self.head = (self.head + data)[:HEAD_PREFIX]
            if request_path(self.head) or len(self.head) == HEAD_PREFIX:
                self.expire(503, self.registry.full)
            return
        if not self.in_request():
            if not self.head:
                timeout = self.limits.request_timeout
                self.arm(timeout, 408, f"the request head did not arrive within {timeout:g} s")
            self.head = (self.head + data)[:HEAD_PREFIX]
        super().data_received(data)
        if self.in_request():
            self.disarm()
            self.head = b""

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.in_request() and not self.transport.is_closing():
            self.head = b""
            self.arm(self.limits.idle_timeout, 408, "no request came")

    def linger(self) -> None:
        """Closes the connection, lingering when an answer was sent before the request's body had all come."""
        real = self.transport.real
        if self.lingering or real.is_closing():
            return
        if self.conn.our_state is not h11.CLOSED or self.conn.their_state is not h11.SEND_BODY:
            real.close()
            return
        self.lingering = True
        real.write_eof()  # after the answer: the client reads it, then sees the end
        self.flow.resume_reading()
        self.disarm()
        self.timer = self.loop.call_later(LINGER, real.close)

    def send_400_response(self, msg: str) -> None:  # h11 could not parse the request
        self.disarm()
        self.transport.write(raw_error(request_path(self.head), 400, f"invalid HTTP request: {msg}"))
        self.transport.close()

    def arm(self, seconds: float, status: int, message: str) -> None:
        self.disarm()
        self.timer = self.loop.call_later(seconds, self.expire, status, message)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def expire(self, status: int, message: str) -> None:
        """Closes the connection, first answering a client that has begun a request (or is refused)."""
        self.disarm()
        if self.transport.is_closing():
            return
        if self.head or self.refused:
            self.transport.write(raw_error(request_path(self.head), status, message))
        self.transport.close()


def fit_fd_limit(max_connections: int) -> int:
    """The number of connections the descriptor limit allows, after raising its soft value toward
    max_connections + FD_RESERVE; without this, accept() fails with EMFILE and stops for a second."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):  # e.g. macOS refuses values over its OPEN_MAX
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max_connections if soft == resource.RLIM_INFINITY else max(1, min(max_connections, soft - FD_RESERVE))


def listen(host: str, port: int) -> socket.socket:
    """A bound socket, so that a busy port is a one-line error before the model loads."""
    if not 0 <= port <= 65535:
        raise SmoeError(f"--port {port} is not a TCP port (0-65535; 0 picks a free one)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections made while the model loads wait in the backlog
    except OSError as e:
        raise SmoeError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def warn_if_exposed(sock: socket.socket, api_key: str | None) -> None:
    if api_key is None and not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
        print(f"smoe: warning: {url_of(sock)} is reachable from other machines and has no authentication "
              "(--api-key KEY sets one)", file=sys.stderr)


def fit_connections(limits: Limits) -> Limits:
    allowed = fit_fd_limit(limits.max_connections)
    if allowed < limits.max_connections:
        print(f"smoe: warning: the file descriptor limit (ulimit -n) allows {allowed} connections, "
              f"not --max-connections {limits.max_connections}", file=sys.stderr)
    return replace(limits, max_connections=allowed)
