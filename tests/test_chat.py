"""`smoe chat` as a person meets it: a real pseudo-terminal, keys typed as bytes, the screen read back."""

import fcntl
import io
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from smoe.cli.chat import Conversation, context_size, fit
from smoe.errors import SmoeError

CTRL_C, CTRL_D, LEFT, UP = b"\x03", b"\x04", b"\x1b[D", b"\x1b[A"
STATS = re.compile(rb"\[(\d+) prompt tokens.*?\((\d+) tokens\)")


@pytest.fixture(scope="module")
def vault(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE at Q4, its context widened so that a reply can outlast a keypress."""
    from smoe.testing.vaults import tiny_model_dir, vault_of

    return vault_of(tiny_model_dir(tmp_path_factory.mktemp("chat"), "qwen3_moe", seed=1, max_position_embeddings=32768))


def take_terminal():
    """In the child: a session of its own whose controlling terminal is the pty on stdin, so that
    Ctrl-C typed there becomes SIGINT, as in a real terminal. A shell runs a background job with
    SIGINT ignored, and children inherit that: the chat gets the default disposition a terminal gives."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """`smoe chat VAULT ARGS` on a pseudo-terminal: `type` sends keys, `expect` waits for the screen."""

    def __init__(self, vault: Path, cache: Path, *args: str):
        master, slave = os.openpty()
        env = os.environ | {"LC_ALL": "C.UTF-8", "TERM": "dumb", "XDG_CACHE_HOME": str(cache), "INPUTRC": "/dev/null"}
        # greedy: a reply runs as long as on every run (a sampled one may meet the end of text early)
        cmd = [sys.executable, "-m", "smoe.cli", "chat", str(vault), "--dtype", "float32", "--temperature", "0", *args]
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True, preexec_fn=take_terminal)
        os.close(slave)
        self.master, self.screen, self.seen = master, b"", 0

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def interrupt_prompt(self) -> None:
        """Ctrl-C at the prompt. CPython's readline notices a signal only while it waits in select():
        one that lands between drawing the prompt and that wait is seen at the next key. A person is
        never that fast; a test is, so it lets the chat settle first."""
        time.sleep(0.5)
        self.type(CTRL_C)

    def expect(self, marker: bytes | re.Pattern, timeout: float = 30) -> bytes:
        """Everything shown from the last match up to and including `marker`."""
        deadline = time.monotonic() + timeout
        while True:
            found = (re.compile(re.escape(marker)) if isinstance(marker, bytes) else marker).search(self.screen, self.seen)
            if found:
                shown, self.seen = self.screen[self.seen:found.end()], found.end()
                return shown
            if not self.read(deadline - time.monotonic()):
                raise AssertionError(f"waited for {marker!r}; the screen ends:\n{self.screen[-2000:].decode(errors='replace')}")

    def read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], max(timeout, 0))
        try:
            data = os.read(self.master, 65536) if ready else b""
        except OSError:  # EIO: the chat has exited and the pty is closed
            data = b""
        self.screen += data
        return bool(data)

    def ask(self, line: bytes) -> bytes:
        """Type a line and wait for its reply to end (its statistics line) and the next prompt."""
        self.type(line + b"\r")
        shown = self.expect(STATS)
        self.expect(b"> ")
        return shown

    def wait(self, timeout: float = 30) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self.read(0.1)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal(vault, tmp_path):
    opened = []

    def start(*args: str) -> Terminal:
        term = Terminal(vault, tmp_path / "cache", *args)
        opened.append(term)
        term.expect(b"> ", timeout=120)
        return term

    yield start
    for term in opened:
        term.close()


@pytest.fixture(scope="module")
def session(vault, tmp_path_factory):
    """One chat kept open across the tests of commands and editing (each leaves it at a prompt)."""
    term = Terminal(vault, tmp_path_factory.mktemp("cache"), "--max-tokens", "8")
    term.expect(b"> ", timeout=120)
    yield term
    term.close()


def test_a_typed_line_gets_a_reply_and_a_new_prompt(session):
    shown = session.ask(b"hello there")
    assert STATS.search(shown) and session.proc.poll() is None


def test_an_empty_line_prompts_again_instead_of_quitting(session):
    session.type(b"\r")
    session.expect(b"> ")
    session.type(b"   \r")
    session.expect(b"> ")
    assert session.proc.poll() is None
    assert STATS.search(session.ask(b"still there?"))


def test_help_lists_every_command(session):
    session.type(b"/help\r")
    shown = session.expect(b"> ")
    for name in (b"/help", b"/reset", b"/system", b"/quit"):
        assert name in shown


def test_an_unknown_command_gets_a_one_line_hint(session):
    session.type(b"/frobnicate\r")
    assert b"unknown command /frobnicate (/help lists them)" in session.expect(b"> ")


def test_arrow_keys_edit_the_line_instead_of_typing_escapes(session):
    session.type(b"/elp" + LEFT * 3 + b"h\r")  # "/elp", back to after "/", insert "h": "/help"
    shown = session.expect(b"> ")
    assert b"/reset" in shown and b"unknown command" not in shown


def test_up_arrow_recalls_the_previous_line(session):
    session.type(b"/reset\r")
    session.expect(b"conversation forgotten]")
    session.expect(b"> ")
    session.type(UP + b"\r")
    assert b"conversation forgotten]" in session.expect(b"> ")


def test_reset_forgets_the_conversation(session):
    first = int(STATS.search(session.ask(b"what is a vault")).group(1))
    longer = int(STATS.search(session.ask(b"what is a vault")).group(1))
    session.type(b"/reset\r")
    session.expect(b"> ")
    again = int(STATS.search(session.ask(b"what is a vault")).group(1))
    assert longer > first and again == first


def test_system_sets_the_prompt_and_forgets_the_conversation(session):
    session.type(b"/reset\r")
    session.expect(b"> ")
    bare = int(STATS.search(session.ask(b"hi")).group(1))
    session.type(b"/system you are a terse assistant\r")
    assert b"system prompt set" in session.expect(b"> ")
    with_system = int(STATS.search(session.ask(b"hi")).group(1))
    assert with_system > bare  # the system prompt is in, the earlier exchange is gone
    session.type(b"/system\r")
    session.expect(b"> ")
    assert int(STATS.search(session.ask(b"hi")).group(1)) == bare


def test_a_line_that_is_not_utf8_costs_the_line_not_the_session(vault, monkeypatch, capsys):
    # piped, as Python reads it: in a terminal readline itself drops a byte that starts no character
    status, _, err = piped_chat(vault, monkeypatch, capsys, b"caf\xe9\nhello\n", "--max-tokens", "4")
    assert status == 0 and "smoe: error: that line is not valid UTF-8 (byte 0xe9 at character 3)\n" in err
    assert STATS.search(err.encode())


def piped_chat(vault, monkeypatch, capsys, typed: bytes, *args: str) -> tuple[int, str, str]:
    """`smoe chat` in this process with `typed` as its (non-terminal) stdin: (status, stdout, stderr)."""
    from smoe.cli.commands import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(typed), encoding="utf-8", errors="surrogateescape"))
    status = main(["chat", str(vault), "--dtype", "float32", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_sampling_options_reach_the_replies(vault, monkeypatch, capsys):
    greedy = ("--max-tokens", "24", "--temperature", "0")
    plain = piped_chat(vault, monkeypatch, capsys, b"hello\n", *greedy)
    penalised = piped_chat(vault, monkeypatch, capsys, b"hello\n", *greedy, "--repeat-penalty", "2")
    assert plain[0] == penalised[0] == 0 and plain[1] != penalised[1]


def test_ctrl_c_on_a_half_typed_line_discards_only_the_line(session):
    session.type(b"/frobnicate")
    session.expect(b"/frobnicate")  # echoed: readline holds the keys
    session.interrupt_prompt()
    session.expect(b"> ")
    session.type(b"/help\r")
    shown = session.expect(b"> ")
    assert b"/reset" in shown and b"unknown command" not in shown and session.proc.poll() is None


def test_quit_leaves_with_status_0(session):
    session.type(b"/quit\r")
    assert session.wait() == 0


def interrupt_reply(term: Terminal, line: bytes) -> re.Match:
    """Ask `line`, press Ctrl-C once the reply streams, and return its statistics once stopped."""
    term.type(line + b"\r")
    term.expect(line + b"\r\n")
    term.expect(re.compile(rb"\w+ \w+ \w+"))
    term.type(CTRL_C)
    term.expect(b"[stopped]", timeout=30)
    stats = STATS.search(term.expect(STATS))
    term.expect(b"> ")
    return stats


def test_ctrl_c_mid_reply_stops_it_and_keeps_the_session(terminal):
    term = terminal("--max-tokens", "30000")
    first = interrupt_reply(term, b"tell me a long story")
    second = interrupt_reply(term, b"and then?")
    assert int(first.group(2)) < 30000 and int(second.group(2)) < 30000 and term.proc.poll() is None
    # the stopped reply stays in the conversation: the next prompt holds it
    assert int(second.group(1)) > int(first.group(1)) + int(first.group(2)) // 2


def test_ctrl_d_at_an_empty_prompt_leaves_with_status_0_and_keeps_the_history(terminal, tmp_path):
    term = terminal("--max-tokens", "4")
    term.type(b"/help\r")
    term.expect(b"> ")
    term.type(CTRL_D)
    assert term.wait() == 0
    history = tmp_path / "cache" / "smoe" / "chat_history"
    assert "/help" in history.read_text() and history.stat().st_mode & 0o777 == 0o600


def test_ctrl_c_at_an_empty_prompt_leaves_with_status_0(terminal):
    term = terminal("--max-tokens", "4")
    term.interrupt_prompt()
    assert term.wait() == 0 and b"interrupted" not in term.screen


def test_a_full_context_forgets_the_oldest_exchanges_with_a_notice(terminal):
    term = terminal("--ctx", "64", "--max-tokens", "8", "--system", "be brief")
    prompts = [int(STATS.search(term.ask(b"one more question about the weather")).group(1)) for _ in range(5)]
    assert b"[context of 64 tokens full: forgot the oldest" in term.screen
    assert b"error" not in term.screen and max(prompts) + 8 <= 64 and term.proc.poll() is None


class Words:
    """A tokenizer of one token per word and no chat template: prompt lengths are easy to count."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text.split())))}


def exchange(n: int) -> list[dict]:
    return [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": f"answer {n}"}]


def test_fit_drops_the_oldest_exchanges_first_and_keeps_the_system_prompt():
    conv = Conversation("be brief", exchange(1) + exchange(2) + [{"role": "user", "content": "question 3"}])
    prompt, budget, dropped = fit(Words(), conv, max_tokens=4, ctx=17)
    assert dropped == 1 and budget == 4 and len(prompt) + budget <= 17
    assert conv.system == "be brief" and [m["content"] for m in conv.turns] == ["question 2", "answer 2", "question 3"]


def test_fit_shortens_the_reply_when_only_the_new_line_is_left():
    conv = Conversation(None, exchange(1) + [{"role": "user", "content": "a b c d e f"}])
    prompt, budget, dropped = fit(Words(), conv, max_tokens=100, ctx=12)
    assert dropped == 1 and budget == 12 - len(prompt) and len(conv.turns) == 1


def test_fit_keeps_half_the_context_of_history_when_max_tokens_is_larger_than_the_context():
    conv = Conversation(None, exchange(1) + exchange(2) + [{"role": "user", "content": "question 3"}])
    prompt, budget, dropped = fit(Words(), conv, max_tokens=1000, ctx=20)
    assert dropped == 1 and len(prompt) == 10 and budget == 10  # prompt 10 + reserve 10 fits in 20; 16 + 10 did not


def test_fit_refuses_a_line_longer_than_the_context_and_forgets_it():
    conv = Conversation(None, [{"role": "user", "content": "word " * 20}])
    with pytest.raises(SmoeError, match="no room in the context of 10"):
        fit(Words(), conv, max_tokens=4, ctx=10)
    assert conv.turns == []


def test_ctx_larger_than_the_model_is_refused_and_smaller_is_kept():
    assert context_size(128, 64) == 64 and context_size(128, None) == 128 and context_size(None, 64) == 64
    with pytest.raises(SmoeError, match="--ctx 256 exceeds the model's context of 128 tokens"):
        context_size(128, 256)


def test_ctx_larger_than_the_model_is_a_one_line_error(vault, capsys):
    from smoe.cli.commands import main

    assert main(["chat", str(vault), "--ctx", "40000"]) == 2
    assert capsys.readouterr().err == "smoe: error: --ctx 40000 exceeds the model's context of 32768 tokens\n"


@pytest.mark.parametrize("bad", ["0", "-5", "1.5", "lots"])
def test_ctx_outside_its_range_is_refused_by_the_parser(vault, bad, capsys):
    from smoe.cli.commands import main

    with pytest.raises(SystemExit) as exit_:
        main(["chat", str(vault), "--ctx", bad])
    assert exit_.value.code == 2 and "--ctx: expected an integer ≥ 1" in capsys.readouterr().err
