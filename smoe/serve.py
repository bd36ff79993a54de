"""`smoe serve`: an OpenAI- and Anthropic-compatible HTTP API and a web chat page for one vault.

FastAPI routes on uvicorn. Handlers validate and tokenize on the event loop, then hand the request
to the engine (smoe/serve_engine.py), which generates one request at a time in arrival order.
Every client mistake is answered with a 4xx JSON error in the shape of the API it called:
`{"error": {"message", "type", "param", "code"}}` for OpenAI routes, `{"type": "error", "error":
{"type", "message"}}` for /v1/messages.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from smoe.errors import SmoeError
from smoe.serve_engine import Engine, Outcome, Overloaded, Sampling
from smoe.serve_schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_TYPES = {500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {404: "not_found_error", 413: "request_too_large", 500: "api_error", 503: "overloaded_error"}
OPENAI_FINISH = {"eos": "stop", "stop_sequence": "stop", "length": "length", "cancelled": "stop"}
ANTHROPIC_STOP = {"eos": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "cancelled": "end_turn"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DRAIN_BYTES = 16 << 20  # how far past the body limit a request is still read (and dropped)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # per request, on top of the model's context length
    max_queue: int = 64  # requests waiting or running


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.close = status, message, param, close


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message}}
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": None}}


def error_response(request: Request, status: int, message: str, param: str | None = None,
                   close: bool = False) -> JSONResponse:
    headers = {"Connection": "close"} if close else None
    return JSONResponse(error_body(request.url.path, status, message, param), status_code=status, headers=headers)


# --- request bodies -------------------------------------------------------------------------------

async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 when it exceeds `limit`.

    A body somewhat over the limit is read to its end and dropped, so that the client, still
    sending, gets the 413 instead of a connection reset; past DRAIN_BYTES more, the connection is
    closed at once."""
    too_large = f"request body is over the limit of {limit:,} bytes"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + DRAIN_BYTES:
        raise ApiError(413, f"request body of {int(declared):,} bytes is over the limit of {limit:,}", close=True)
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + DRAIN_BYTES:
            raise ApiError(413, too_large, close=True)
        if size <= limit:
            body += chunk
    if size > limit:
        raise ApiError(413, too_large)
    return bytes(body)


def reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse(body: bytes, schema):
    try:
        data = json.loads(body, parse_constant=reject_constant)
    except RecursionError:
        raise ApiError(400, "body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(map(str, first["loc"]))
        raise ApiError(400, f"{loc}: {first['msg']}" if loc else first["msg"], param=loc or None) from None


# --- prompts and limits ---------------------------------------------------------------------------

async def encode_chat(engine: Engine, turns: list[dict]) -> list[int]:
    try:
        return await run_in_threadpool(engine.encode_chat, turns)
    except Exception as e:  # the chat template rejects the conversation (e.g. roles out of order)
        raise ApiError(400, f"messages do not fit the model's chat template: {e}", "messages") from None


def check_token_ids(engine: Engine, ids: list[int]) -> list[int]:
    vocab = engine.sm.config.get_text_config().vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
    return ids


def budget(engine: Engine, limits: Limits, prompt: list[int], requested: int | None, default: int | None) -> int:
    """max_tokens for this request: as asked (or the default), within the server's limit and the context."""
    context = engine.context
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    if context and len(prompt) >= context:
        raise ApiError(400, f"the prompt of {len(prompt)} tokens is over the model's context of {context} tokens")
    room = context - len(prompt) if context else limits.max_tokens
    if requested is None:
        return min(default or limits.max_tokens, limits.max_tokens, room)
    if requested > limits.max_tokens:
        raise ApiError(400, f"max_tokens: {requested} is over this server's limit of {limits.max_tokens}", "max_tokens")
    if requested > room:
        raise ApiError(400, f"the prompt of {len(prompt)} tokens + max_tokens {requested} exceeds the model's context "
                       f"of {context} tokens", "max_tokens")
    return requested


def seed_of(seed: int | None) -> int:
    return secrets.randbits(63) if seed is None else seed % 2**64  # torch takes seeds in [0, 2**64)


def submit(engine: Engine, prompt: list[int], sampling: Sampling):
    try:
        return engine.submit(prompt, sampling)
    except Overloaded as e:
        raise ApiError(503, f"server busy: {e}") from None


# --- running a job --------------------------------------------------------------------------------

async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def job_events(job, request: Request):
    """The job's events until "done" or "error"; stops early, cancelling the job, if the client leaves."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        while True:
            get = asyncio.ensure_future(job.events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return
            kind, value = get.result()
            yield kind, value
            if kind != "text":
                return
    finally:  # also runs when the response task is cancelled because the client disconnected
        gone.cancel()
        job.cancelled.set()


async def outcome_of(job, request: Request) -> Outcome | None:
    """The finished job, or None when the client left first."""
    async for kind, value in job_events(job, request):
        if kind == "error":
            raise ApiError(500, value)
        if kind == "done":
            return value
    return None


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def openai_usage(o: Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens}


# --- the OpenAI API -------------------------------------------------------------------------------

class OpenAIStream:
    """Server-sent events of one chat or text completion, in OpenAI's chunk shapes."""

    def __init__(self, engine: Engine, chat: bool, include_usage: bool):
        self.chat, self.include_usage, self.model = chat, include_usage, engine.model_id
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> str:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": [choice]})

    async def events(self, job, request: Request):
        if self.chat:
            yield self.chunk("", role=True)
        async for kind, value in job_events(job, request):
            if kind == "text":
                yield self.chunk(value)
            elif kind == "error":
                yield sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
            else:
                yield self.chunk(None, OPENAI_FINISH[value.finish])
                if self.include_usage:
                    yield sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": [],
                               "usage": openai_usage(value)})
        yield sse("[DONE]")


def openai_sampling(req, max_tokens: int) -> Sampling:
    return Sampling(max_tokens, req.temperature, req.top_p, seed_of(req.seed), req.stops())


async def chat_completions(request: Request, engine: Engine, limits: Limits) -> Response:
    req = parse(await read_body(request, limits.max_body_bytes), ChatCompletionRequest)
    prompt = await encode_chat(engine, [m.as_turn() for m in req.messages])
    job = submit(engine, prompt, openai_sampling(req, budget(engine, limits, prompt, req.requested_max_tokens(), None)))
    if req.stream:
        return event_stream(OpenAIStream(engine, True, req.include_usage()).events(job, request))
    o = await outcome_of(job, request)
    if o is None:
        return Response(status_code=499)  # nobody is there to read it
    return JSONResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": engine.model_id, "usage": openai_usage(o),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                     "finish_reason": OPENAI_FINISH[o.finish]}],
    })


async def completions(request: Request, engine: Engine, limits: Limits) -> Response:
    req = parse(await read_body(request, limits.max_body_bytes), CompletionRequest)
    source = req.text_or_ids()
    if isinstance(source, str):
        prompt = await run_in_threadpool(engine.encode_text, source)
    else:
        prompt = check_token_ids(engine, source)
    max_tokens = budget(engine, limits, prompt, req.requested_max_tokens(), DEFAULT_COMPLETION_TOKENS)
    job = submit(engine, prompt, openai_sampling(req, max_tokens))
    if req.stream:
        return event_stream(OpenAIStream(engine, False, req.include_usage()).events(job, request))
    o = await outcome_of(job, request)
    if o is None:
        return Response(status_code=499)
    return JSONResponse({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": engine.model_id, "usage": openai_usage(o),
        "choices": [{"index": 0, "text": o.text, "logprobs": None, "finish_reason": OPENAI_FINISH[o.finish]}],
    })


# --- the Anthropic API ----------------------------------------------------------------------------

def anthropic_message(engine: Engine, msg_id: str, o: Outcome | None, prompt_tokens: int) -> dict:
    """The message object; without an outcome, the empty one that opens a stream."""
    return {"id": msg_id, "type": "message", "role": "assistant", "model": engine.model_id,
            "content": [{"type": "text", "text": o.text}] if o else [],
            "stop_reason": ANTHROPIC_STOP[o.finish] if o else None, "stop_sequence": o.stop_sequence if o else None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": o.completion_tokens if o else 0}}


async def anthropic_events(engine: Engine, job, request: Request, msg_id: str, prompt_tokens: int):
    start = {"type": "message_start", "message": anthropic_message(engine, msg_id, None, prompt_tokens)}
    yield sse(start, "message_start")
    yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              "content_block_start")
    yield sse({"type": "ping"}, "ping")
    async for kind, value in job_events(job, request):
        if kind == "text":
            yield sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": value}},
                      "content_block_delta")
        elif kind == "error":
            yield sse({"type": "error", "error": {"type": "api_error", "message": value}}, "error")
        else:
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            yield sse({"type": "message_delta",
                       "delta": {"stop_reason": ANTHROPIC_STOP[value.finish], "stop_sequence": value.stop_sequence},
                       "usage": {"input_tokens": prompt_tokens, "output_tokens": value.completion_tokens}},
                      "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")


async def messages(request: Request, engine: Engine, limits: Limits) -> Response:
    req = parse(await read_body(request, limits.max_body_bytes), MessagesRequest)
    prompt = await encode_chat(engine, req.turns())
    max_tokens = budget(engine, limits, prompt, req.max_tokens, None)
    job = submit(engine, prompt, Sampling(max_tokens, req.temperature, req.top_p, seed_of(None),
                                          tuple(req.stop_sequences or ())))
    msg_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return event_stream(anthropic_events(engine, job, request, msg_id, len(prompt)))
    o = await outcome_of(job, request)
    if o is None:
        return Response(status_code=499)
    return JSONResponse(anthropic_message(engine, msg_id, o, len(prompt)))


# --- the application ------------------------------------------------------------------------------

def chat_page() -> str:
    return (resources.files("smoe") / "web" / "chat.html").read_text(encoding="utf-8")


def create_app(engine: Engine, limits: Limits = Limits()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="smoe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    page = chat_page()
    model_card = {"id": engine.model_id, "object": "model", "created": int(engine.metrics.started), "owned_by": "smoe"}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request, e.status, e.message, e.param, e.close)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes (404), wrong methods (405)
        return error_response(request, e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return error_response(request, 400, str(e.errors()[0].get("msg", "invalid request")))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, e: ClientDisconnect):  # while sending its body
        return Response(status_code=499)

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.model_id, "context": engine.context, "max_tokens": limits.max_tokens}

    @app.get("/metrics")
    async def metrics():
        return engine.metrics_snapshot()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.model_id:
            raise ApiError(404, f"model {model_id!r} is not served here (this server serves {engine.model_id!r})",
                           "model")
        return model_card

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request):
        return await chat_completions(request, engine, limits)

    @app.post("/v1/completions")
    async def completions_route(request: Request):
        return await completions(request, engine, limits)

    @app.post("/v1/messages")
    async def messages_route(request: Request):
        return await messages(request, engine, limits)

    return app


# --- running it -----------------------------------------------------------------------------------

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


def warn_if_exposed(sock: socket.socket) -> None:
    if not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
        print(f"smoe: warning: {url_of(sock)} is reachable from other machines and has no authentication",
              file=sys.stderr)


def run_server(open_model, load_tokenizer, vault, host: str, port: int, limits: Limits) -> int:
    import uvicorn

    if limits.max_tokens < 1 or limits.max_body_bytes < 1 or limits.max_queue < 1:
        raise SmoeError("--max-tokens, --max-body-mb and --max-queue must be positive")
    sock = listen(host, port)
    engine = Engine(open_model(), load_tokenizer(vault), Path(vault).resolve().name, limits.max_queue)
    config = uvicorn.Config(create_app(engine, limits), http="h11", ws="none", log_level="warning", access_log=False,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5, limit_concurrency=256,
                            server_header=False)
    warn_if_exposed(sock)
    print(f"smoe: serving {engine.model_id} at {url_of(sock)} (web chat at /, OpenAI API at /v1, "
          f"Anthropic API at /v1/messages)", flush=True)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.sm.close()
    return 0
