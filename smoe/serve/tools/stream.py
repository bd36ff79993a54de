"""Streamed text while the reply may hold calls: text before a call goes out as it comes; from the
first character that could open a call, text is held until the reply ends and is parsed, and goes
out as calls or, when it does not parse, as text."""

from __future__ import annotations


class CallHolder:
    def __init__(self, start: str):
        self.start = start
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> str:
        """The part of the text so far that can no longer begin a call."""
        self.text += delta
        safe = self.safe_end()
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def held(self) -> str:
        """The text not sent yet, once the reply has ended."""
        return self.text[self.sent:]

    def unsent(self, content: str) -> str:
        """What is left to send, once the reply has ended, of a reply read as text alone (`content`):
        the held text; or, when none was sent, all of `content`, which a format that splits a reply
        itself (harmony's final channel, without its reasoning) makes other than the raw text."""
        return self.held() if self.sent else content

    def safe_end(self) -> int:
        found = self.text.find(self.start, self.sent)
        if found >= 0:
            return found
        for keep in range(min(len(self.start) - 1, len(self.text) - self.sent), 0, -1):  # a tail that may grow into start
            if self.start.startswith(self.text[-keep:]):
                return len(self.text) - keep
        return len(self.text)
