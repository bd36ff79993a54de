"""Ctrl-C anywhere in a command, its imports included, is one line and exit status 130."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


def guarded(startup, body) -> int:
    """body(startup())'s exit status; an interrupt that reaches here is "smoe: interrupted" and 130.

    Ctrl-C during startup (the parser, whose options import torch) is held until startup returns: a
    KeyboardInterrupt raised inside torch's import can abort the process (SIGABRT, a C++ terminate)."""
    with Interrupts() as interrupts:
        try:
            with interrupts.held():
                ready = startup()
            return body(ready)
        except KeyboardInterrupt:  # before a command's own handling
            print("smoe: interrupted", file=sys.stderr)
            return 130
        except BaseException as e:  # pydantic-core's import, cut short, panics with a BaseException of its own
            if not interrupts.seen or isinstance(e, SystemExit):
                raise
            print("smoe: interrupted", file=sys.stderr)  # a module the interrupt left half imported failed after it
            return 130


class Interrupts:
    """Ctrl-C raises KeyboardInterrupt, as by default, unless held, and is remembered: one that lands inside an
    import can leave the module half made, and what fails next is another error, which is still the interruption."""

    def __enter__(self):
        self.seen, self.holding, self.previous = False, False, None
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.previous = signal.signal(signal.SIGINT, self.interrupt)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    @contextlib.contextmanager
    def held(self):
        """Inside: Ctrl-C is only remembered; leaving, one that came is raised then."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.seen:
            raise KeyboardInterrupt

    def interrupt(self, signum, frame):
        self.seen = True
        if not self.holding:
            raise KeyboardInterrupt
