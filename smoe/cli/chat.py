"""`smoe chat`: a conversation with a vault in a terminal, behaving as llama.cpp's and ollama's chats do.

Lines are edited and recalled with readline when stdin is a terminal. Ctrl-C during a reply stops the
reply (what it said so far stays in the conversation); Ctrl-C or Ctrl-D at an empty prompt leaves.
When the conversation outgrows the context, its oldest exchanges are forgotten; the system prompt stays.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from smoe.errors import SmoeError
from smoe.hf.tokenizer import ROLE_LABELS, chat_prompt, check_text, has_chat_template

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation",
    "/system TEXT": "set the system prompt and forget the conversation (no TEXT: remove it)",
    "/quit": "leave (also Ctrl-D, or Ctrl-C at an empty prompt)",
}
HISTORY_LINES = 1000


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)  # user and assistant messages alternating, oldest first

    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns


@dataclass
class Chat:
    """What every reply needs: the model, its tokenizer, the options, the context and the sampler's settings."""
    sm: object
    tok: object
    args: object
    ctx: int | None
    params: object  # smoe.runtime.sampling.SamplingParams
    replies: int = 0  # so far: each reply draws from its own seed, params.seed + replies

    def next_params(self):
        """The settings of the next reply: a seed of its own (a whole conversation replays from one --seed)."""
        self.replies += 1
        return replace(self.params, seed=(self.params.seed + self.replies - 1) % 2**64)


def context_size(model_ctx: int | None, wanted: int | None) -> int | None:
    """The tokens a conversation may fill: --ctx when given (never more than the model was built for)."""
    if wanted is None:
        return model_ctx
    if model_ctx and wanted > model_ctx:
        raise SmoeError(f"--ctx {wanted} exceeds the model's context of {model_ctx} tokens")
    return wanted


def fit(tok, conv: Conversation, max_tokens: int, ctx: int | None) -> tuple[list[int], int, int]:
    """(prompt ids, reply budget, exchanges forgotten) for the conversation ending in a user line.

    The oldest exchanges go first until the prompt leaves room for a reply of max_tokens, or of half
    the context when max_tokens is more (else a long --max-tokens would forget everything at every
    turn); the reply may then use all the room left. A line that leaves no room is refused, not kept."""
    dropped = 0
    prompt = chat_prompt(tok, conv.messages())
    reserve = min(max_tokens, ctx // 2) if ctx else max_tokens
    while ctx and len(prompt) + reserve > ctx and len(conv.turns) > 1:
        del conv.turns[:2]
        dropped += 1
        prompt = chat_prompt(tok, conv.messages())
    room = ctx - len(prompt) if ctx else max_tokens
    if room < 1:
        conv.turns.pop()
        raise SmoeError(f"that line makes a prompt of {len(prompt)} tokens, leaving no room in the context of {ctx}")
    return prompt, min(max_tokens, room), dropped


class StopOnInterrupt:
    """SIGINT during a reply: the first asks generation to stop after the current token (the decode
    state stays whole); a second raises KeyboardInterrupt, for a prefill that takes too long."""

    def __enter__(self):
        self.hit = False
        self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame):
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def reply(chat: Chat, conv: Conversation) -> None:
    """Stream the answer to the conversation's last user line and append it to the conversation."""
    from smoe.runtime.generate import TextStreamer, generate

    args, tok = chat.args, chat.tok
    prompt, budget, dropped = fit(tok, conv, args.max_tokens, chat.ctx)
    if dropped:
        say(f"[context of {chat.ctx} tokens full: forgot the oldest {dropped} exchange{'s' * (dropped > 1)}]")
    streamer, stats = TextStreamer(tok, sys.stdout), None
    with StopOnInterrupt() as stop:
        try:
            _, stats = generate(chat.sm, prompt, budget, params=chat.next_params(),
                                on_token=lambda token: show(streamer, token, stop))
        except KeyboardInterrupt:  # a second Ctrl-C, in a long prefill or step: keep what was shown
            pass
        except SmoeError:
            conv.turns.pop()
            raise
        conv.turns.append({"role": "assistant", "content": tok.decode(streamer.tokens, skip_special_tokens=True)})
    print(flush=True)
    if stop.hit:
        say("[stopped]")
    if stats:
        say(stats.line())


def show(streamer, token: int, stop: StopOnInterrupt) -> bool:
    """Print the token; False (stop generating) once Ctrl-C was pressed."""
    streamer(token)
    return not stop.hit


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def command(line: str, conv: Conversation) -> bool:
    """Run a /command; False when it asks to leave."""
    name, _, rest = line.partition(" ")
    if name in ("/quit", "/exit"):
        return False
    if name in ("/help", "/?"):
        say("\n".join(f"  {usage:<13} {what}" for usage, what in COMMANDS.items()))
    elif name == "/reset":
        conv.turns.clear()
        say("[conversation forgotten]")
    elif name == "/system":
        conv.system, conv.turns = rest.strip() or None, []
        say("[system prompt set; conversation forgotten]" if conv.system else "[system prompt removed; conversation forgotten]")
    else:
        say(f"unknown command {name} (/help lists them)")
    return True


def read_line() -> str | None:
    """The next line, or None to leave (Ctrl-D; Ctrl-C at an empty prompt). Ctrl-C on a half-typed
    line discards that line, as in a shell."""
    while True:
        try:
            return input("> ")
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:
            print()
            if not typed_text():
                return None


def typed_text() -> str:
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline else ""


def history_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smoe" / "chat_history"


def start_line_editing() -> Path | None:
    """readline for input() when a person types (importing it is what switches it on); the history
    file of earlier sessions, if there is one. None when stdin is not a terminal."""
    if not sys.stdin.isatty():
        return None
    import readline

    readline.set_history_length(HISTORY_LINES)
    path = history_file()
    try:
        readline.read_history_file(path)
    except OSError:  # the first session, or an unreadable file: start with an empty history
        pass
    return path


def save_history(path: Path | None) -> None:
    if path is None:
        return
    import readline

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
        path.chmod(0o600)  # what was typed may be private, as a shell's history is
    except OSError:  # a read-only home costs the history, not the exit status
        pass


def run(sm, tok, args, params) -> int:
    chat = Chat(sm, tok, args, context_size(sm.max_positions, args.ctx), params)
    conv = Conversation(check_text(args.system, "--system") if args.system else None)
    history = start_line_editing()
    say("\n".join(banner(chat)))
    try:
        while (line := read_line()) is not None:
            if not talk(line.strip(), chat, conv):
                break
    finally:
        save_history(history)
    return 0


def banner(chat: Chat) -> list[str]:
    """What the chat says first: how to use it, how it samples, and how it shows the model a conversation."""
    from smoe.runtime.sampling import defaults_origin

    lines = ["smoe chat: /help for commands, Ctrl-C stops a reply, Ctrl-D leaves",
             f"sampling: {chat.params.line()} (defaults: {defaults_origin(chat.sm.vault.dir)})"]
    if not has_chat_template(chat.tok):
        lines.append(f"this model has no chat template: the conversation goes to it as plain text, "
                     f"'{ROLE_LABELS['user']}: ...' and 'Assistant: ...' lines, ending in 'Assistant:'")
    return lines


def talk(line: str, chat: Chat, conv: Conversation) -> bool:
    """Act on one typed line; False when it asks to leave."""
    if not line:
        return True
    try:
        check_text(line, "that line")
        if line.startswith("/"):
            return command(line, conv)
        conv.turns.append({"role": "user", "content": line})
        reply(chat, conv)
    except SmoeError as e:  # a bad line costs the line, not the conversation
        say(f"smoe: error: {e}")
    except KeyboardInterrupt:  # Ctrl-C just before or after a reply: a line left unanswered is dropped
        if conv.turns and conv.turns[-1]["role"] == "user":
            conv.turns.pop()
        print()
    return True
