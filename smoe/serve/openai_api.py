"""The OpenAI API's generating routes: /v1/chat/completions and /v1/completions, whole or streamed as
server-sent events in OpenAI's chunk shapes."""

from __future__ import annotations

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from smoe.serve.api import (
    ApiError,
    Limits,
    budget,
    check_token_ids,
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
from smoe.serve.logprobs import Pieces, chat_content, chat_logprobs, completion_logprobs
from smoe.serve.schemas import ChatCompletionRequest, CompletionRequest
from smoe.serve.tools.replies import ToolTurn, openai_call, openai_finish, openai_message
from smoe.serve.worker import Outcome, Reply, Worker

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
OPENAI_FINISH = {"eos": "stop", "stop_sequence": "stop", "length": "length", "cancelled": "stop"}


def openai_usage(o: Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens}


class OpenAIStream:
    """Server-sent events of chat or text completions, in OpenAI's chunk shapes: one job per choice,
    run one after another. With logprobs, each chunk carries those of the tokens generated since the
    previous chunk; streamed completions' text_offset counts each token's own text (exact unless a
    token splits a character)."""

    def __init__(self, worker: Worker, chat: bool, include_usage: bool, logprobs: bool = False,
                 turn: ToolTurn | None = None):
        self.chat, self.include_usage, self.model, self.logprobs = chat, include_usage, worker.model_id, logprobs
        self.turn = turn  # how a chat reply is read for tool calls
        self.worker, self.pieces = worker, Pieces(worker)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offset = 0  # characters of the current choice sent so far

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False, index: int = 0,
              logprobs: dict | None = None, calls: list[dict] | None = None) -> str:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            delta |= {"tool_calls": calls} if calls else {}
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
                job.cancel()

    async def choice_events(self, index: int, job, request: Request, echo: str | None):
        if self.chat:
            yield self.chunk("", role=True, index=index)
        if echo is not None and not self.logprobs:
            yield self.chunk(echo, index=index)
        pending, holder = [], self.turn.holder() if self.turn else None
        async for kind, value in job_events(job, request):
            if kind == "prompt_logprobs" and echo is not None:
                yield self.chunk(echo, index=index, logprobs=self.chunk_logprobs(value, first=job.prompt[0]))
            elif kind == "logprobs":
                pending += value
            elif kind == "text":
                value = holder.push(value) if holder else value  # text that may open a call waits
                if value:
                    yield self.chunk(value, index=index, logprobs=self.chunk_logprobs(pending))
                    pending = []
            elif kind == "error":
                yield sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
            elif kind == "refused":
                yield sse(error_body(request.url.path, 400, str(value), value.field))
            elif kind == "unavailable":
                yield sse(error_body(request.url.path, 503, value))
            elif kind == "done":
                finish = OPENAI_FINISH[value.finish]
                if holder:
                    reply = self.turn.reply(value.text)
                    if reply.calls:
                        yield self.chunk(None, index=index, calls=[openai_call(c, i) for i, c in enumerate(reply.calls)])
                    elif holder.unsent(reply.content):
                        yield self.chunk(holder.unsent(reply.content), index=index)
                    finish = openai_finish(reply, finish)
                yield self.chunk(None, finish, index=index, logprobs=self.chunk_logprobs(pending))
                yield value


def summed_usage(outcomes: list[Outcome]) -> dict:
    prompt, completion = sum(o.prompt_tokens for o in outcomes), sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def check_openai(req) -> None:
    """Refuses, naming the field, what smoe cannot do rather than silently doing something else."""
    if req.unsupported_format():
        raise ApiError(400, f"response_format: only {{\"type\": \"text\"}} is supported (no JSON mode or schemas), "
                       f"got {json.dumps(req.response_format)}", "response_format")
    for name, replacement in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, name, None) is not None:
            raise ApiError(400, f"{name}: deprecated by OpenAI and not supported; use {replacement}", name)
    if getattr(req, "best_of", None) not in (None, 1):
        raise ApiError(400, f"best_of: only 1 is supported (one sequence per prompt), got {req.best_of}", "best_of")
    if getattr(req, "suffix", None):
        raise ApiError(400, "suffix: fill-in-the-middle is not supported", "suffix")


def openai_reply(worker: Worker, req, max_tokens: int, logprobs: int | None = None, echo: bool = False) -> Reply:
    bias = logit_bias(req.logit_bias, worker.vocab_size)
    return Reply(worker.sampling(**req.sampling_fields(), logit_bias=bias), max_tokens, req.stops(), logprobs, echo)


def logit_bias(given: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias as the sampler takes it: each key a token id of the vocabulary, each bias in
    [-100, 100] (as OpenAI checks them); None when not given."""
    if not given:
        return None
    pairs = []
    for key, bias in given.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise ApiError(400, f"logit_bias: keys must be token ids in [0, {vocab}), got {json.dumps(key)}", "logit_bias")
        if not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias.{key}: a bias must be in [-100, 100], got {bias:g}", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


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
    use = req.tool_use()
    turn = await run_in_threadpool(worker.tools.turn, use)
    prompt = await encode_chat(worker, req.turns(), use.template_tools())
    max_tokens = budget(worker, limits, prompt, req.requested_max_tokens(), None)
    job = submit(worker, prompt, turn.shaped(openai_reply(worker, req, max_tokens, n_logprobs)))
    if req.stream:
        stream = OpenAIStream(worker, True, req.include_usage(), n_logprobs is not None, turn)
        return event_stream(stream.events([job], request))
    o = await outcome_of(job, request)
    if o is None:
        return Response(status_code=499)  # nobody is there to read it
    logprobs = chat_logprobs(Pieces(worker), o.logprobs) if n_logprobs is not None else None
    reply = turn.reply(o.text)
    return JSONResponse({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": worker.model_id, "usage": openai_usage(o),
        "choices": [{"index": 0, "message": openai_message(reply), "logprobs": logprobs,
                     "finish_reason": openai_finish(reply, OPENAI_FINISH[o.finish])}],
    })


async def completion_prompt(worker: Worker, source: str | list[int]) -> list[int]:
    if isinstance(source, str):
        return await run_in_threadpool(worker.encode_text, source)
    return check_token_ids(worker, source)


def submit_all(worker: Worker, prompts: list[list[int]], replies: list[Reply]) -> list:
    """One job per prompt, or none: a refusal midway cancels those already queued."""
    jobs = []
    try:
        for prompt, reply in zip(prompts, replies):
            jobs.append(submit(worker, prompt, reply))
    except ApiError:
        for job in jobs:
            job.cancel()
        raise
    return jobs


def completion_choice(worker: Worker, index: int, prompt: list[int], o: Outcome, req: CompletionRequest) -> dict:
    echo = worker.prompt_text(prompt) if req.echo else ""
    logprobs = None
    if req.logprobs is not None:  # offsets into the text returned: the echo, then the generated text after it
        offsets = worker.text_offsets(prompt, special=True) if req.echo else []
        offsets += [len(echo) + at for at in worker.text_offsets([e.token for e in o.logprobs], special=False)]
        entries = (o.prompt_logprobs if req.echo else []) + o.logprobs
        logprobs = completion_logprobs(Pieces(worker), entries, offsets, prompt[0] if req.echo else None)
    return {"index": index, "text": echo + o.text, "logprobs": logprobs, "finish_reason": OPENAI_FINISH[o.finish]}


async def completions(request: Request, worker: Worker, limits: Limits) -> Response:
    req = parse(await read_body(request, limits), CompletionRequest)
    check_openai(req)
    prompts = [await completion_prompt(worker, source) for source in req.prompts()]
    requested = req.requested_max_tokens()
    replies = [openai_reply(worker, req, budget(worker, limits, p, requested, DEFAULT_COMPLETION_TOKENS), req.logprobs,
                            req.echo) for p in prompts]
    jobs = submit_all(worker, prompts, replies)
    if req.stream:
        echoes = [worker.prompt_text(p) for p in prompts] if req.echo else None
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
            job.cancel()
    return JSONResponse({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": worker.model_id, "usage": summed_usage(outcomes),
        "choices": [completion_choice(worker, i, p, o, req) for i, (p, o) in enumerate(zip(prompts, outcomes))],
    })
