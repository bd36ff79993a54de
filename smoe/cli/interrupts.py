"""Ctrl-C anywhere in a command, its imports included, is one line and exit status 130."""

from __future__ import annotations

import signal
import sys
import threading


def guarded(body) -> int:
    """body()'s exit status; an interrupt that reaches here is "smoe: interrupted" and 130."""
    with Interrupts() as interrupts:
        try:
            return body()
        except KeyboardInterrupt:  # before a command's own handling (torch loads for the parser: a second or two)
            print("smoe: interrupted", file=sys.stderr)
            return 130
        except BaseException as e:  # pydantic-core's import, cut short, panics with a BaseException of its own
            if not interrupts.seen or isinstance(e, SystemExit):
                raise
            print("smoe: interrupted", file=sys.stderr)  # a module the interrupt left half imported failed after it
            return 130


class Interrupts:
    """Ctrl-C raises KeyboardInterrupt, as by default, and is remembered: one that lands inside an import can
    leave the module half made, and what fails next is another error, which is still the interruption."""

    def __enter__(self):
        self.seen, self.previous = False, None
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.previous = signal.signal(signal.SIGINT, self.interrupt)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def interrupt(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt
