"""What every API route shares: errors in the shape of the API called, request bodies read and
validated, the token budget, and a job run to its events.

Every error the server answers with, the client's mistakes and its own (overload, timeouts, the
connection limit), is JSON in the shape of the API called: `{"error": {"message", "type", "param",
"code"}}` for OpenAI routes, `{"type": "error", "error": {"type", "message"}}` for /v1/messages.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from smoe.serve.schemas import ACCEPTS, first_error, image_at
from smoe.serve.worker import Outcome, Overloaded, Reply, Worker

OPENAI_TYPES = {500: "server_error", 503: "server_error"}
ANTHROPIC_TYPES = {401: "authentication_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                   500: "api_error", 503: "overloaded_error"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
JSON_TYPES = ("application/json", "application/x-www-form-urlencoded")  # the latter is what `curl -d` declares


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
        loc, message = first_error(e, data, getattr(schema, "ACCEPTS", ACCEPTS))
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

async def encode_chat(worker: Worker, turns: list[dict], tools: list[dict] | None = None) -> list[int]:
    try:
        return await run_in_threadpool(worker.encode_chat, turns, tools)
    except Exception as e:  # the chat template rejects the conversation (e.g. roles out of order)
        raise ApiError(400, f"messages do not fit the model's chat template: {e}", "messages") from None


def check_token_ids(worker: Worker, ids: list[int]) -> list[int]:
    vocab = worker.vocab_size
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


def submit(worker: Worker, prompt: list[int], reply: Reply):
    try:
        return worker.submit(prompt, reply)
    except Overloaded as e:
        raise ApiError(503, f"server busy: {e}") from None


# --- running a job --------------------------------------------------------------------------------

async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def job_events(job, request: Request):
    """The job's events until "done", "error", "refused" or "unavailable"; stops early, cancelling the job, if
    the client leaves."""
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
            if kind in ("done", "error", "refused", "unavailable"):
                return
    finally:  # also runs when the response task is cancelled because the client disconnected
        gone.cancel()
        job.cancel()


async def outcome_of(job, request: Request) -> Outcome | None:
    """The finished job, or None when the client left first."""
    async for kind, value in job_events(job, request):
        if kind == "error":
            raise ApiError(500, value)
        if kind == "refused":
            raise ApiError(400, str(value), value.field)
        if kind == "unavailable":
            raise ApiError(503, value)
        if kind == "done":
            return value
    return None


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def refuse_images(messages) -> None:
    at = image_at(messages)
    if at:
        raise ApiError(400, f"{at}: images are not supported (the model served reads text only)", at)
