"""`smoe serve`: an OpenAI- and Anthropic-compatible HTTP API and a web chat page for one vault.

FastAPI routes on uvicorn. Handlers validate and tokenize on the event loop, then hand the request
to the worker (smoe/serve/worker.py), which generates one request at a time in arrival order.
Every error the server answers with, the client's mistakes and its own (overload, timeouts, the
connection limit), is JSON in the shape of the API called: `{"error": {"message", "type", "param",
"code"}}` for OpenAI routes, `{"type": "error", "error": {"type", "message"}}` for /v1/messages.
GuardedH11 bounds how long a connection may sit idle or trickle a request in, and how many are open.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from http import HTTPStatus
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import h11
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from smoe.errors import SmoeError
from smoe.format.vault import DATA_FILE
from smoe.serve.logprobs import Pieces, chat_content, chat_logprobs, completion_logprobs
from smoe.serve.schemas import (
    AnthropicPrompt,
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    first_error,
    image_at,
)
from smoe.serve.worker import REQUEST_JOBS, Outcome, Overloaded, Sampling, Worker

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_TYPES = {500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 500: "api_error",
                   503: "overloaded_error"}
OPENAI_FINISH = {"eos": "stop", "stop_sequence": "stop", "length": "length", "cancelled": "stop"}
ANTHROPIC_STOP = {"eos": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "cancelled": "end_turn"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DRAIN_BYTES = 16 << 20  # how much of an unread request body a closing connection still reads (and drops)
LINGER = 2.0  # seconds it may take to do so
READ_METHODS = ["GET", "HEAD"]  # HEAD is answered wherever GET is (uvicorn leaves out the body)
JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")  # the latter is what `curl -d` declares
HEAD_PREFIX = 4096  # bytes of a request's start kept to find its path for an error before uvicorn parses it
REFUSE_WAIT = 1.0  # seconds a connection over the limit may take to send its request line, to be told why
MAX_REFUSED = 32  # connections over the limit kept waiting for that at once; more are answered straight away
ACCEPT_BURST = 128  # connections asyncio accepts per loop pass (uvicorn's backlog), before any is admitted
FD_RESERVE = 64 + 2 * ACCEPT_BURST  # descriptors beyond the connection limit: the model's files, the
# listening socket, and connections accepted or evicted but not yet through connection_made / closed


log = logging.getLogger("smoe.serve.server")
LOG_LEVELS = ("debug", "info", "warning", "error")


class AccessLog:
    """One line per HTTP request, once its response has been sent (streams included): method, route,
    status, prompt and generated tokens, decode tok/s, seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        jobs, status, start = [], [0], time.perf_counter()
        token = REQUEST_JOBS.set(jobs)

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            REQUEST_JOBS.reset(token)
            log.info(access_line(scope, status[0], jobs, time.perf_counter() - start))


def access_line(scope, status: int, jobs: list, seconds: float) -> str:
    line = f"{scope['method']} {scope['path']} {status or '-'} {seconds:.3f} s"
    stats = [j.stats for j in jobs if j.stats is not None]
    if stats:
        prompt, generated = sum(s.prompt_tokens for s in stats), sum(s.generated_tokens for s in stats)
        rate = stats[-1].decode_tok_s
        line += f", prompt {prompt} tokens, generated {generated} tokens" + (f", {rate:.1f} tok/s" if rate else "")
    return line


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # per request, on top of the model's context length
    max_queue: int = 64  # requests waiting or running
    idle_timeout: float = 5.0  # seconds a connection may stay silent with no request in flight
    request_timeout: float = 30.0  # seconds for a request's head to arrive, and again for its body
    max_connections: int = 1024
    log_level: str = "info"  # "info" prints one access-log line per request


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
                   close: bool = False, headers: dict | None = None) -> JSONResponse:
    headers = (headers or {}) | ({"Connection": "close"} if close else {})
    return JSONResponse(error_body(request.url.path, status, message, param), status_code=status, headers=headers)


# --- request bodies -------------------------------------------------------------------------------

async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, or a 415 when its Content-Type is not JSON, a 413 when it exceeds the limit, or a 408
    when it takes over request_timeout to arrive."""
    check_content_type(request)
    try:
        with anyio.fail_after(limits.request_timeout):
            return await read_body_within(request, limits.max_body_bytes)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.request_timeout:g} s",
                       close=True) from None


def check_content_type(request: Request) -> None:
    """Bodies are read as JSON when they say so, say nothing, or carry curl's default form type; any
    other type is refused before the body is read."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media and media not in JSON_TYPES and not media.endswith("+json"):
        raise ApiError(415, f"Content-Type {media} is not supported: the body must be JSON (application/json)",
                       close=True)


async def read_body_within(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit`: from its Content-Length, before any
    of it is read, or once the bytes counted (a chunked body) pass it. The connection is then closed
    (GuardedH11.linger lets the client read the answer)."""
    over = f"over the limit of {limit:,} bytes (--max-body-mb)"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {int(declared):,} bytes is {over}", close=True)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body is {over}", close=True)
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
    at = lone_surrogate_at(data) if b"\\u" in body else None  # only a \u escape can write one
    if at is not None:
        raise ApiError(400, f"{at}: the text has a lone surrogate (a \\ud800-\\udfff escape without its pair), "
                       "which is not a character", param=at)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        loc, message = first_error(e, data)
        raise ApiError(400, f"{loc}: {message}" if loc else message, param=loc or None) from None


def lone_surrogate_at(data) -> str | None:
    """The location ("messages.0.content") of the first string in `data` that holds a lone surrogate,
    which no encoding can write (the tokenizer fails on it), or None."""
    stack = [("", data)]
    while stack:
        at, value = stack.pop()
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return at
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((f"{at}.{key}" if at else str(key), item) for key, item in reversed(list(items)))
    return None


# --- prompts and limits ---------------------------------------------------------------------------

async def encode_chat(worker: Worker, turns: list[dict]) -> list[int]:
    try:
        return await run_in_threadpool(worker.encode_chat, turns)
    except Exception as e:  # the chat template rejects the conversation (e.g. roles out of order)
        raise ApiError(400, f"messages do not fit the model's chat template: {e}", "messages") from None


def check_token_ids(worker: Worker, ids: list[int]) -> list[int]:
    vocab = worker.sm.config.get_text_config().vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
    return ids


def budget(worker: Worker, limits: Limits, prompt: list[int], requested: int | None, default: int | None) -> int:
    """max_tokens for this request: as asked (or the default), within the server's limit and the context."""
    context = worker.context
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


def submit(worker: Worker, prompt: list[int], sampling: Sampling):
    try:
        return worker.submit(prompt, sampling)
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
            if kind in ("done", "error"):
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
    """Server-sent events of chat or text completions, in OpenAI's chunk shapes: one job per choice,
    run one after another. With logprobs, each chunk carries those of the tokens generated since the
    previous chunk; streamed completions' text_offset counts each token's own text (exact unless a
    token splits a character)."""

    def __init__(self, worker: Worker, chat: bool, include_usage: bool, logprobs: bool = False):
        self.chat, self.include_usage, self.model, self.logprobs = chat, include_usage, worker.model_id, logprobs
        self.worker, self.pieces = worker, Pieces(worker)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offset = 0  # characters of the current choice sent so far

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False, index: int = 0,
              logprobs: dict | None = None) -> str:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        self.offset += len(text or "")
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": [choice]})

    def chunk_logprobs(self, entries: list, first: int | None = None) -> dict | None:
        if not self.logprobs or not (entries or first is not None):
            return None
        if self.chat:
            return {"content": chat_content(self.pieces, entries), "refusal": None}
        offsets, at = [], self.offset
        for text, _ in self.pieces(([first] if first is not None else []) + [e.token for e in entries]):
            offsets.append(at)
            at += len(text)
        return completion_logprobs(self.pieces, entries, offsets, first)

    async def events(self, jobs: list, request: Request, echoes: list[str | None] | None = None):
        """`echoes[i]`: choice i's prompt text to send first (completions' echo), or None."""
        try:
            usage = []
            for index, job in enumerate(jobs):
                self.offset = 0
                async for piece in self.choice_events(index, job, request, (echoes or [None] * len(jobs))[index]):
                    if isinstance(piece, Outcome):
                        usage.append(piece)
                    else:
                        yield piece
                if len(usage) <= index:  # the client left or the job failed
                    break
            if self.include_usage and len(usage) == len(jobs):
                yield sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                           "created": self.created, "model": self.model, "choices": [], "usage": summed_usage(usage)})
            yield sse("[DONE]")
        finally:
            for job in jobs:
                job.cancelled.set()

    async def choice_events(self, index: int, job, request: Request, echo: str | None):
        if self.chat:
            yield self.chunk("", role=True, index=index)
        if echo is not None and not self.logprobs:
            yield self.chunk(echo, index=index)
        pending = []
        async for kind, value in job_events(job, request):
            if kind == "prompt_logprobs" and echo is not None:
                yield self.chunk(echo, index=index, logprobs=self.chunk_logprobs(value, first=job.prompt[0]))
            elif kind == "logprobs":
                pending += value
            elif kind == "text":
                yield self.chunk(value, index=index, logprobs=self.chunk_logprobs(pending))
                pending = []
            elif kind == "error":
                yield sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
            elif kind == "done":
                yield self.chunk(None, OPENAI_FINISH[value.finish], index=index, logprobs=self.chunk_logprobs(pending))
                yield value


def summed_usage(outcomes: list[Outcome]) -> dict:
    prompt, completion = sum(o.prompt_tokens for o in outcomes), sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def check_openai(req) -> None:
    """Refuses, naming the field, what smoe cannot do rather than silently doing something else."""
    if req.unsupported_format():
        raise ApiError(400, f"response_format: only {{\"type\": \"text\"}} is supported (no JSON mode or schemas), "
                       f"got {json.dumps(req.response_format)}", "response_format")


def refuse_images(messages) -> None:
    at = image_at(messages)
    if at:
        raise ApiError(400, f"{at}: images are not supported (the model served reads text only)", at)


def openai_sampling(req, max_tokens: int, logprobs: int | None = None, echo: bool = False) -> Sampling:
    return Sampling(max_tokens, req.temperature, req.top_p, seed_of(req.seed), req.stops(), req.top_k, req.min_p,
                    req.repetition_penalty, req.frequency_penalty, req.presence_penalty, logprobs, echo)


def chat_top_logprobs(req: ChatCompletionRequest) -> int | None:
    """How many alternatives to report per token, or None for no logprobs."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def chat_completions(request: Request, worker: Worker, limits: Limits) -> Response:
    req = parse(await read_body(request, limits), ChatCompletionRequest)
    check_openai(req)
    refuse_images(req.messages)
    n_logprobs = chat_top_logprobs(req)
    prompt = await encode_chat(worker, [m.as_turn() for m in req.messages])
    max_tokens = budget(worker, limits, prompt, req.requested_max_tokens(), None)
    job = submit(worker, prompt, openai_sampling(req, max_tokens, n_logprobs))
    if req.stream:
        stream = OpenAIStream(worker, True, req.include_usage(), n_logprobs is not None)
        return event_stream(stream.events([job], request))
    o = await outcome_of(job, request)
    if o is None:
        return Response(status_code=499)  # nobody is there to read it
    logprobs = chat_logprobs(Pieces(worker), o.logprobs) if n_logprobs is not None else None
    return JSONResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": worker.model_id, "usage": openai_usage(o),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text, "refusal": None},
                     "logprobs": logprobs, "finish_reason": OPENAI_FINISH[o.finish]}],
    })


async def completion_prompt(worker: Worker, source: str | list[int]) -> list[int]:
    if isinstance(source, str):
        return await run_in_threadpool(worker.encode_text, source)
    return check_token_ids(worker, source)


def submit_all(worker: Worker, prompts: list[list[int]], samplings: list[Sampling]) -> list:
    """One job per prompt, or none: a refusal midway cancels those already queued."""
    jobs = []
    try:
        for prompt, sampling in zip(prompts, samplings):
            jobs.append(submit(worker, prompt, sampling))
    except ApiError:
        for job in jobs:
            job.cancelled.set()
        raise
    return jobs


def completion_choice(worker: Worker, index: int, prompt: list[int], o: Outcome, req: CompletionRequest) -> dict:
    echo = worker.decode(prompt) if req.echo else ""
    logprobs = None
    if req.logprobs is not None:
        shown = (prompt if req.echo else []) + [e.token for e in o.logprobs]
        offsets = [len(text) for text in worker.decode_prefixes(shown)[:-1]]
        entries = (o.prompt_logprobs if req.echo else []) + o.logprobs
        logprobs = completion_logprobs(Pieces(worker), entries, offsets, prompt[0] if req.echo else None)
    return {"index": index, "text": echo + o.text, "logprobs": logprobs, "finish_reason": OPENAI_FINISH[o.finish]}


async def completions(request: Request, worker: Worker, limits: Limits) -> Response:
    req = parse(await read_body(request, limits), CompletionRequest)
    check_openai(req)
    prompts = [await completion_prompt(worker, source) for source in req.prompts()]
    requested = req.requested_max_tokens()
    samplings = [openai_sampling(req, budget(worker, limits, p, requested, DEFAULT_COMPLETION_TOKENS), req.logprobs,
                                 req.echo) for p in prompts]
    jobs = submit_all(worker, prompts, samplings)
    if req.stream:
        echoes = [worker.decode(p) for p in prompts] if req.echo else None
        stream = OpenAIStream(worker, False, req.include_usage(), req.logprobs is not None)
        return event_stream(stream.events(jobs, request, echoes))
    outcomes = []
    try:
        for job in jobs:
            outcomes.append(await outcome_of(job, request))
            if outcomes[-1] is None:  # the client left
                return Response(status_code=499)
    finally:
        for job in jobs:
            job.cancelled.set()
    return JSONResponse({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": worker.model_id, "usage": summed_usage(outcomes),
        "choices": [completion_choice(worker, i, p, o, req) for i, (p, o) in enumerate(zip(prompts, outcomes))],
    })


# --- the Anthropic API ----------------------------------------------------------------------------

def anthropic_message(worker: Worker, msg_id: str, o: Outcome | None, prompt_tokens: int) -> dict:
    """The message object; without an outcome, the empty one that opens a stream."""
    return {"id": msg_id, "type": "message", "role": "assistant", "model": worker.model_id,
            "content": [{"type": "text", "text": o.text}] if o else [],
            "stop_reason": ANTHROPIC_STOP[o.finish] if o else None, "stop_sequence": o.stop_sequence if o else None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": o.completion_tokens if o else 0}}


async def anthropic_events(worker: Worker, job, request: Request, msg_id: str, prompt_tokens: int):
    start = {"type": "message_start", "message": anthropic_message(worker, msg_id, None, prompt_tokens)}
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
        elif kind == "done":
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            yield sse({"type": "message_delta",
                       "delta": {"stop_reason": ANTHROPIC_STOP[value.finish], "stop_sequence": value.stop_sequence},
                       "usage": {"input_tokens": prompt_tokens, "output_tokens": value.completion_tokens}},
                      "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")


async def messages(request: Request, worker: Worker, limits: Limits) -> Response:
    req = parse(await read_body(request, limits), MessagesRequest)
    refuse_images(req.messages)
    prompt = await encode_chat(worker, req.turns())
    max_tokens = budget(worker, limits, prompt, req.max_tokens, None)
    job = submit(worker, prompt, Sampling(max_tokens, req.temperature, req.top_p, seed_of(None),
                                          tuple(req.stop_sequences or ()), top_k=req.top_k or 0))
    msg_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return event_stream(anthropic_events(worker, job, request, msg_id, len(prompt)))
    o = await outcome_of(job, request)
    if o is None:
        return Response(status_code=499)
    return JSONResponse(anthropic_message(worker, msg_id, o, len(prompt)))


async def count_tokens(request: Request, worker: Worker, limits: Limits) -> dict:
    req = parse(await read_body(request, limits), AnthropicPrompt)
    refuse_images(req.messages)
    return {"input_tokens": len(await encode_chat(worker, req.turns()))}


# --- the application ------------------------------------------------------------------------------

def chat_page() -> str:
    return (resources.files("smoe.serve") / "web" / "chat.html").read_text(encoding="utf-8")


def create_app(worker: Worker, limits: Limits = Limits()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="smoe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    page = chat_page()
    model_card = {"id": worker.model_id, "object": "model", "created": int(worker.metrics.started), "owned_by": "smoe"}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request, e.status, e.message, e.param, e.close)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes (404), wrong methods (405, with Allow)
        headers = dict(e.headers or {})
        if "Allow" in headers:
            headers["Allow"] = ", ".join(sorted(headers["Allow"].split(", ")))
        return error_response(request, e.status_code, str(e.detail), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return error_response(request, 400, str(e.errors()[0].get("msg", "invalid request")))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):  # a bug: uvicorn still logs the traceback
        return error_response(request, 500, f"internal server error: {type(e).__name__}")

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, e: ClientDisconnect):  # while sending its body
        return Response(status_code=499)

    @app.api_route("/", response_class=HTMLResponse, methods=READ_METHODS)
    async def index():
        return HTMLResponse(page)

    @app.api_route("/health", methods=READ_METHODS)
    async def health():
        return {"status": "ok", "model": worker.model_id, "context": worker.context, "max_tokens": limits.max_tokens}

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics():
        return worker.metrics_snapshot()

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.api_route("/v1/models/{model_id:path}", methods=READ_METHODS)
    async def model(model_id: str):
        if model_id != worker.model_id:
            raise ApiError(404, f"model {model_id!r} is not served here (this server serves {worker.model_id!r})",
                           "model")
        return model_card

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request):
        return await chat_completions(request, worker, limits)

    @app.post("/v1/completions")
    async def completions_route(request: Request):
        return await completions(request, worker, limits)

    @app.post("/v1/messages")
    async def messages_route(request: Request):
        return await messages(request, worker, limits)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request):
        return await count_tokens(request, worker, limits)

    return app


# --- connections ----------------------------------------------------------------------------------

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


def fit_connections(limits: Limits) -> Limits:
    allowed = fit_fd_limit(limits.max_connections)
    if allowed < limits.max_connections:
        print(f"smoe: warning: the file descriptor limit (ulimit -n) allows {allowed} connections, "
              f"not --max-connections {limits.max_connections}", file=sys.stderr)
    return replace(limits, max_connections=allowed)


def run_server(open_model, load_tokenizer, vault, host: str, port: int, limits: Limits) -> int:
    import uvicorn

    if min(limits.max_tokens, limits.max_body_bytes, limits.max_queue, limits.max_connections) < 1 \
            or min(limits.idle_timeout, limits.request_timeout) <= 0:
        raise SmoeError("--max-tokens, --max-body-mb, --max-queue, --max-connections, --idle-timeout and "
                        "--request-timeout must be positive")
    limits = fit_connections(limits)
    sock = listen(host, port)
    worker = Worker(open_model(), load_tokenizer(vault), Path(vault).resolve().name, limits.max_queue)
    check_still_there(worker.sm)
    # no limit_concurrency: uvicorn's counts idle connections and answers in plain text; GuardedH11 caps them
    protocol = functools.partial(GuardedH11, Connections(limits))
    logging.basicConfig(level=limits.log_level.upper(), format="smoe: %(message)s", stream=sys.stderr)
    # uvicorn's own access log is off: AccessLog's line also says what the request generated
    config = uvicorn.Config(AccessLog(create_app(worker, limits)), http=protocol, ws="none",
                            log_level=max(limits.log_level, "warning", key=LOG_LEVELS.index),
                            access_log=False, timeout_keep_alive=limits.idle_timeout, timeout_graceful_shutdown=5,
                            server_header=False, backlog=ACCEPT_BURST)
    warn_if_exposed(sock)
    print(f"smoe: serving {worker.model_id} at {url_of(sock)} (web chat at /, OpenAI API at /v1, "
          f"Anthropic API at /v1/messages)", flush=True)
    previous, stopped = signal.signal(signal.SIGTERM, terminated), False
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except Terminated:
        stopped = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.sm.close()
    if stopped:
        print("smoe: stopped (SIGTERM); the vault is closed", file=sys.stderr, flush=True)
    return 0


def check_still_there(sm) -> None:
    """The files are opened one by one at start-up and then held open, so what is served stays the vault
    opened whatever becomes of its directory; a directory replaced while they were opened could have
    mixed two vaults' files, so that start is refused."""
    try:
        same = os.path.samestat(os.fstat(sm.vault.fd), os.stat(sm.vault.dir / DATA_FILE))
    except OSError:
        same = False
    if not same:
        sm.close()
        raise SmoeError(f"{sm.vault.dir} was replaced while the server was opening it: start it again")


class Terminated(Exception):
    """SIGTERM (a service manager stopping the server): after uvicorn's graceful shutdown it re-raises
    the signal, which would end the process before the vault is closed; this handler turns it into
    an exception that unwinds through the `finally` that closes it."""


def terminated(signum, frame):
    raise Terminated
