"""The Anthropic Messages API: /v1/messages, whole or as its event stream, and /v1/messages/count_tokens."""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from smoe.serve.api import (
    Limits,
    budget,
    encode_chat,
    error_body,
    event_stream,
    job_events,
    outcome_of,
    parse,
    read_body,
    refuse_images,
    sse,
    submit,
)
from smoe.serve.schemas import AnthropicPrompt, MessagesRequest
from smoe.serve.tools.calls import Parsed
from smoe.serve.tools.replies import ToolTurn, anthropic_blocks, anthropic_stop, anthropic_tool_events
from smoe.serve.worker import Outcome, Reply, Worker

ANTHROPIC_STOP = {"eos": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens", "cancelled": "end_turn"}


def anthropic_message(worker: Worker, msg_id: str, o: Outcome | None, prompt_tokens: int,
                      reply: Parsed | None = None) -> dict:
    """The message object (`reply`: its text and tool calls, by default its text); without an outcome,
    the empty one that opens a stream."""
    reply = reply or Parsed(o.text if o else "")
    return {"id": msg_id, "type": "message", "role": "assistant", "model": worker.model_id,
            "content": anthropic_blocks(reply) if o else [],
            "stop_reason": anthropic_stop(reply, ANTHROPIC_STOP[o.finish]) if o else None,
            "stop_sequence": o.stop_sequence if o else None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": o.completion_tokens if o else 0}}


async def anthropic_events(worker: Worker, job, request: Request, msg_id: str, prompt_tokens: int,
                           turn: ToolTurn | None = None):
    start = {"type": "message_start", "message": anthropic_message(worker, msg_id, None, prompt_tokens)}
    yield sse(start, "message_start")
    yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              "content_block_start")
    yield sse({"type": "ping"}, "ping")
    holder = turn.holder() if turn else None
    async for kind, value in job_events(job, request):
        if kind == "text":
            value = holder.push(value) if holder else value  # text that may open a call waits
            if value:
                yield text_delta(value)
        elif kind == "error":
            yield sse({"type": "error", "error": {"type": "api_error", "message": value}}, "error")
        elif kind == "refused":
            yield sse(error_body(request.url.path, 400, str(value), value.field), "error")
        elif kind == "unavailable":
            yield sse(error_body(request.url.path, 503, value), "error")
        elif kind == "done":
            reply = turn.reply(value.text) if holder else Parsed(value.text)
            if holder and not reply.calls and holder.unsent(reply.content):
                yield text_delta(holder.unsent(reply.content))
            yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            for data, event in anthropic_tool_events(reply, 1):
                yield sse(data, event)
            stop = anthropic_stop(reply, ANTHROPIC_STOP[value.finish])
            yield sse({"type": "message_delta",
                       "delta": {"stop_reason": stop, "stop_sequence": value.stop_sequence},
                       "usage": {"input_tokens": prompt_tokens, "output_tokens": value.completion_tokens}},
                      "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")


def text_delta(text: str) -> str:
    return sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
               "content_block_delta")


def anthropic_reply(worker: Worker, req: MessagesRequest, max_tokens: int) -> Reply:
    return Reply(worker.sampling(**req.sampling_fields()), max_tokens, tuple(req.stop_sequences or ()))


async def messages(request: Request, worker: Worker, limits: Limits) -> Response:
    req = parse(await read_body(request, limits), MessagesRequest)
    refuse_images(req.messages)
    use = req.tool_use()
    turn = await run_in_threadpool(worker.tools.turn, use)
    prompt = await encode_chat(worker, req.turns(), use.template_tools())
    max_tokens = budget(worker, limits, prompt, req.max_tokens, None)
    job = submit(worker, prompt, turn.shaped(anthropic_reply(worker, req, max_tokens)))
    msg_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return event_stream(anthropic_events(worker, job, request, msg_id, len(prompt), turn))
    o = await outcome_of(job, request)
    if o is None:
        return Response(status_code=499)
    return JSONResponse(anthropic_message(worker, msg_id, o, len(prompt), turn.reply(o.text)))


async def count_tokens(request: Request, worker: Worker, limits: Limits) -> dict:
    req = parse(await read_body(request, limits), AnthropicPrompt)
    refuse_images(req.messages)
    return {"input_tokens": len(await encode_chat(worker, req.turns(), req.tool_use().template_tools()))}
