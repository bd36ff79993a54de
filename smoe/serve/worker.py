"""The server's worker: one model, one thread running requests one at a time in arrival order.

Request handlers run on the event loop; generation runs on the worker thread. A request becomes a
`Job` on a FIFO queue; the worker posts the job's text and its outcome back to the event loop
through the job's asyncio queue. Setting `Job.cancelled` (its client went away) stops generation at
the next token, or skips the job if it has not started yet.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from smoe.hf.tokenizer import Detokenizer, chat_prompt, text_offsets
from smoe.runtime.generate import eos_ids, generate
from smoe.runtime.sampling import SamplingParams, TokenLogprob, chosen, sampling_defaults
from smoe.serve.tools.calls import ToolError
from smoe.serve.tools.support import ToolSupport

log = logging.getLogger("smoe.serve")


SHUTTING_DOWN = "the server is shutting down: send the request again once it is back"


class Overloaded(Exception):
    """More requests are waiting than the server accepts."""


@dataclass(frozen=True)
class Reply:
    """What a job is to produce: the sampler's settings, and how long it runs, where it stops and what
    it reports besides its text."""
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    prompt_logprobs: bool = False  # and those of the prompt's tokens (completions' echo)
    constraint: object = None  # a grammar the tokens must follow (a required tool call: smoe.serve.tools.grammar)
    special_text: bool = False  # the text keeps special tokens, where tool calls may be written


@dataclass
class Outcome:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish: str  # "eos" (end of text), "stop_sequence", "length" (max_tokens) or "cancelled"
    stop_sequence: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the generated tokens, when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.., when asked


# the jobs of the HTTP request being handled, for its access-log line (set by smoe.serve.app.AccessLog)
REQUEST_JOBS: contextvars.ContextVar[list | None] = contextvars.ContextVar("smoe_request_jobs", default=None)


class Job:
    def __init__(self, prompt: list[int], reply: Reply, loop: asyncio.AbstractEventLoop):
        self.prompt, self.reply, self.loop = prompt, reply, loop
        self.stats = None  # the GenerationStats, once it ran
        if (request_jobs := REQUEST_JOBS.get()) is not None:
            request_jobs.append(self)
        # ("text", str), ("logprobs" or "prompt_logprobs", [TokenLogprob]) ..., then ("done", Outcome), ("error", str)
        # (a server-side failure), ("refused", ToolError: the request's tools, found wrong while decoding) or
        # ("unavailable", str: the server began to shut down before the reply was whole)
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.queued = False  # holds a place in the worker's queue, not yet started
        self.leave_queue = None  # the worker's: frees that place

    def cancel(self) -> None:
        """Its client left, or its request failed: generation stops at the next token, and a job still queued
        frees its place at once (else a client that gave up waiting would keep another from being queued)."""
        self.cancelled.set()
        if self.leave_queue is not None:
            self.leave_queue(self)

    def post(self, kind: str, value) -> None:
        """Called from the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class TextStream:
    """Token ids in, text out: holds back text that could be the start of a stop sequence, and ends
    the text just before the first stop sequence."""

    def __init__(self, detokenizer: Detokenizer, stops: tuple[str, ...]):
        self.detokenizer, self.stops = detokenizer, [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.sent, self.stop_sequence = "", 0, None

    @property
    def tokens(self) -> list[int]:
        return self.detokenizer.tokens

    def push(self, token: int) -> str:
        """The new text that is safe to send."""
        searched = max(len(self.text) - self.hold, 0)  # the text before held no stop sequence
        self.detokenizer.push(token)
        self.text = text = self.detokenizer.text
        hit = min(((i, s) for s in self.stops if (i := text.find(s, searched)) >= 0), default=None)
        if hit:
            self.text, self.stop_sequence = text[:hit[0]], hit[1]
            return self._take(len(self.text))
        return self._take(len(text) - self.hold)

    def finish(self) -> str:
        """The text held back, once generation has ended."""
        if self.stop_sequence is None:
            self.detokenizer.rest()  # including a last character left incomplete
            self.text = self.detokenizer.text
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out


class Metrics:
    """Counters over the server's life, plus the running and the last finished request."""

    def __init__(self):
        self.started = time.time()
        self.completed = self.cancelled = self.failed = self.refused = 0
        self.prompt_tokens = self.generated_tokens = 0
        self.decoded_tokens, self.decode_seconds = 0, 0.0
        self.last: dict | None = None
        self.current: dict | None = None  # {"tokens", "since"} of the running request
        self.lock = threading.Lock()  # the worker counts what it ran, the event loop a job that left the queue

    def finished(self, stats, outcome: str) -> None:
        with self.lock:
            if outcome == "cancelled":
                self.cancelled += 1
            else:
                self.completed += 1
            if stats is None:
                return
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.generated_tokens
            if stats.decode_tok_s:
                self.decoded_tokens += stats.generated_tokens - 1
                self.decode_seconds += (stats.generated_tokens - 1) / stats.decode_tok_s
            self.last = stats.as_dict()

    def snapshot(self) -> dict:
        current = self.current
        running = None
        if current:
            elapsed = time.perf_counter() - current["since"]
            running = {"generated_tokens": current["tokens"], "tok_s": current["tokens"] / elapsed if elapsed else 0.0}
        return {
            "uptime_s": time.time() - self.started,
            "requests": {"completed": self.completed, "cancelled": self.cancelled, "failed": self.failed,
                         "refused": self.refused},
            "tokens": {"prompt": self.prompt_tokens, "generated": self.generated_tokens},
            "decode_tok_s": self.decoded_tokens / self.decode_seconds if self.decode_seconds else 0.0,
            "running": running,
            "last_request": self.last,
        }


class Worker:
    """Owns the model and the tokenizer; `submit` queues a job, the worker thread runs the queue."""

    def __init__(self, sm, tokenizer, model_id: str, max_queue: int = 64):
        self.sm, self.tokenizer, self.model_id, self.max_queue = sm, tokenizer, model_id, max_queue
        self.tokenizer_lock = threading.Lock()  # the event loop encodes while the worker decodes
        self.eos = eos_ids(sm.model)
        self.tools = ToolSupport(tokenizer, self.tokenizer_lock, self.eos)
        self.defaults = sampling_defaults(sm.vault.dir)  # what a request leaves out, as on the command line
        self.jobs: queue.Queue = queue.Queue()
        self.waiting = 0  # queued or running; changed by both threads, under waiting_lock
        self.waiting_lock = threading.Lock()
        self.metrics = Metrics()
        self.stopping = threading.Event()  # the server is shutting down: cancel everything
        self.thread = threading.Thread(target=self._work, name="smoe-generate", daemon=True)

    @property
    def context(self) -> int | None:
        return self.sm.max_positions

    @property
    def vocab_size(self) -> int:
        return self.sm.config.get_text_config().vocab_size

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        with self.tokenizer_lock:
            return list(chat_prompt(self.tokenizer, messages, tools))

    def encode_text(self, text: str) -> list[int]:
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    def prompt_text(self, tokens: list[int]) -> str:
        """A prompt's text as the model read it, special tokens included (completions' echo: the text its
        tokens and their offsets describe)."""
        with self.tokenizer_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def text_offsets(self, tokens: list[int], special: bool) -> list[int]:
        with self.tokenizer_lock:
            return text_offsets(self.tokenizer, tokens, special)

    def token_strings(self, tokens: list[int]) -> list[str]:
        """Each token's own vocabulary entry, for logprobs (special tokens included)."""
        with self.tokenizer_lock:
            return self.tokenizer.convert_ids_to_tokens(tokens)

    def sampling(self, **given) -> SamplingParams:
        """The sampler's settings of a request: the fields it gives (not None) over the model's defaults."""
        return chosen(self.defaults, **given)

    def submit(self, prompt: list[int], reply: Reply) -> Job:
        job = Job(prompt, reply, asyncio.get_running_loop())
        with self.waiting_lock:
            if self.waiting >= self.max_queue:
                raise Overloaded(f"{self.waiting} requests are already waiting (the limit is {self.max_queue})")
            self.waiting += 1
            job.queued, job.leave_queue = True, self.leave_queue
        self.jobs.put(job)
        return job

    def leave_queue(self, job: Job) -> None:
        with self.waiting_lock:
            if not job.queued:
                return
            job.queued = False
            self.waiting -= 1
        self.metrics.finished(None, "cancelled")

    def metrics_snapshot(self) -> dict:
        return {"model": self.model_id, **self.metrics.snapshot(), "queued_or_running": self.waiting,
                "cache": self.sm.cache_stats(), **self.sm.describe()}

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            with self.waiting_lock:
                started, job.queued = job.queued, False
            if not started:  # its client left while it waited: its place, and its count, went then
                continue
            try:
                self._run(job)
            finally:
                self.metrics.current = None
                with self.waiting_lock:
                    self.waiting -= 1

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set() or self.stopping.is_set():  # its client left while it waited, or the server stops
            self.metrics.finished(None, "cancelled")
            job.post("unavailable", SHUTTING_DOWN)
            return
        s = job.reply
        dropped = self.eos if s.special_text else ()  # with the special tokens but end of sequence
        stream = TextStream(Detokenizer(self.tokenizer, s.special_text, dropped, self.tokenizer_lock), s.stop)
        self.metrics.current = {"tokens": 0, "since": time.perf_counter()}

        logprobs, prompt_logprobs = [], []

        def on_logprob(entry: TokenLogprob) -> None:
            logprobs.append(entry)
            job.post("logprobs", [entry])

        def on_prompt_logprobs(entries: list[TokenLogprob]) -> None:
            prompt_logprobs.extend(entries)
            job.post("prompt_logprobs", entries)

        def on_token(token: int) -> bool:
            self.metrics.current["tokens"] += 1
            delta = stream.push(token)
            if delta:
                job.post("text", delta)
            return stream.stop_sequence is None and not job.cancelled.is_set() and not self.stopping.is_set()

        try:
            tokens, stats = generate(self.sm, job.prompt, s.max_tokens, on_token=on_token, params=s.params,
                                     logprobs=s.logprobs, on_logprob=on_logprob,
                                     on_prompt_logprobs=on_prompt_logprobs if s.prompt_logprobs else None,
                                     constraint=s.constraint)
        except ToolError as e:  # the request's tool schemas: the client gets a 400 naming the field
            log.warning("request refused: %s", e)
            self.metrics.refused += 1
            job.post("refused", e)
            return
        except Exception as e:  # a server-side failure (e.g. a corrupt vault): the client gets a 500
            log.exception("generation failed")
            self.metrics.failed += 1
            job.post("error", f"generation failed: {e}")
            return
        tail = stream.finish()
        if tail:
            job.post("text", tail)
        finish = self._finish_reason(stream, tokens, job)
        job.stats = stats
        self.metrics.finished(stats, finish)
        if finish == "cancelled" and not job.cancelled.is_set():  # cut short by the shutdown: not a whole reply
            job.post("unavailable", SHUTTING_DOWN)
            return
        job.post("done", Outcome(stream.text, len(job.prompt), len(tokens), finish, stream.stop_sequence, logprobs,
                                 prompt_logprobs))

    def _finish_reason(self, stream: TextStream, tokens: list[int], job: Job) -> str:
        if stream.stop_sequence is not None:
            return "stop_sequence"
        if tokens[-1] in self.eos:
            return "eos"
        cut = job.cancelled.is_set() or (self.stopping.is_set() and len(tokens) < job.reply.max_tokens)
        return "cancelled" if cut else "length"
