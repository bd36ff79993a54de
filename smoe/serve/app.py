"""The ASGI application: FastAPI routes on the worker (smoe/serve/worker.py), the web chat page, the
handlers that turn every failure into an error in the API's shape, and the access log.

Handlers validate and tokenize on the event loop, then hand the request to the worker, which
generates one request at a time in arrival order.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from smoe.serve.anthropic_api import count_tokens, messages
from smoe.serve.api import ApiError, Limits, error_response
from smoe.serve.auth import key_check
from smoe.serve.openai_api import chat_completions, completions
from smoe.serve.prometheus import exposition, prefers_text
from smoe.serve.tools.calls import ToolError
from smoe.serve.worker import REQUEST_JOBS, Worker

READ_METHODS = ["GET", "HEAD"]  # HEAD is answered wherever GET is (uvicorn leaves out the body)

log = logging.getLogger("smoe.serve")


class AccessLog:
    """One line per HTTP request, once its response has been sent (streams included): method, route,
    status, seconds, whether the client left before the response was complete, prompt and generated
    tokens, decode tok/s."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        jobs, status, start = [], [0], time.perf_counter()
        sent, left = [False], [False]  # the whole response went out; the client disconnected before that
        token = REQUEST_JOBS.set(jobs)

        async def receive_noting_disconnect():
            message = await receive()
            left[0] = left[0] or (message["type"] == "http.disconnect" and not sent[0])
            return message

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            sent[0] = sent[0] or (message["type"] == "http.response.body" and not message.get("more_body"))

        try:
            await self.app(scope, receive_noting_disconnect, send_noting_status)
        finally:
            REQUEST_JOBS.reset(token)
            log.info(access_line(scope, status[0], jobs, time.perf_counter() - start, left[0]))


def access_line(scope, status: int, jobs: list, seconds: float, cancelled: bool = False) -> str:
    line = f"{scope['method']} {logged_path(scope['path'])} {status or '-'} {seconds:.3f} s"
    if cancelled:
        line += ", cancelled: the client disconnected"
    stats = [j.stats for j in jobs if j.stats is not None]
    if stats:
        prompt, generated = sum(s.prompt_tokens for s in stats), sum(s.generated_tokens for s in stats)
        rate = stats[-1].decode_tok_s
        line += f", prompt {prompt} tokens, generated {generated} tokens" + (f", {rate:.1f} tok/s" if rate else "")
    return line


def logged_path(path: str, most: int = 200) -> str:
    """The path percent-encoded again, as sent (a %0A in it would otherwise start a line of the client's
    making in the log), and cut to `most` characters."""
    quoted = urllib.parse.quote(path, safe="/:@!$&'()*+,;=~")
    return quoted if len(quoted) <= most else quoted[:most] + f"... ({len(quoted)} characters)"


def chat_page() -> str:
    return (resources.files("smoe.serve") / "web" / "chat.html").read_text(encoding="utf-8")


def create_app(worker: Worker, limits: Limits = Limits(), api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    # no redirect from /v1/models/ to /v1/models: an unknown path is a JSON 404, as every other answer is JSON
    app = FastAPI(title="smoe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  redirect_slashes=False)
    page = chat_page()
    model_card = {"id": worker.model_id, "object": "model", "created": int(worker.metrics.started), "owned_by": "smoe"}
    v1 = [Depends(key_check(api_key))] if api_key is not None else []  # what every /v1 route depends on

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        # a 503 (a full queue, a shutdown) says when to try again: the SDKs' retries wait that long
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {"Retry-After": "1"} if e.status == 503 else None
        return error_response(request, e.status, e.message, e.param, e.close, headers)

    @app.exception_handler(ToolError)
    async def tool_error(request: Request, e: ToolError):  # a request's tools, tool_choice or tool messages
        return error_response(request, 400, str(e), e.field)

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
        return {"status": "ok", "model": worker.model_id, "context": worker.context, "max_tokens": limits.max_tokens,
                "sampling": worker.defaults.as_dict(),  # what a request that leaves a field out gets
                "api_key_required": api_key is not None}

    @app.api_route("/metrics", methods=READ_METHODS)
    async def metrics(request: Request):
        accept = request.headers.get("accept", "")
        if prefers_text(accept):
            body, content_type = exposition(worker.metrics_snapshot(), accept)
            return Response(body, media_type=content_type)
        return worker.metrics_snapshot()

    @app.api_route("/v1/models", methods=READ_METHODS, dependencies=v1)
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.api_route("/v1/models/{model_id:path}", methods=READ_METHODS, dependencies=v1)
    async def model(model_id: str):
        if model_id != worker.model_id:
            raise ApiError(404, f"model {model_id!r} is not served here (this server serves {worker.model_id!r})",
                           "model")
        return model_card

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_route(request: Request):
        return await chat_completions(request, worker, limits)

    @app.post("/v1/completions", dependencies=v1)
    async def completions_route(request: Request):
        return await completions(request, worker, limits)

    @app.post("/v1/messages", dependencies=v1)
    async def messages_route(request: Request):
        return await messages(request, worker, limits)

    @app.post("/v1/messages/count_tokens", dependencies=v1)
    async def count_tokens_route(request: Request):
        return await count_tokens(request, worker, limits)

    return app
