"""Prompts as token ids: the vault's tokenizer, and chat turns through its chat template."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

from tokenizers.decoders import DecodeStream

from smoe.errors import SmoeError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a tokenizer
ROLE_LABELS = {"user": "User", "system": "System", "tool": "Tool"}


def load_tokenizer(path, purpose: str = ""):
    """The tokenizer saved with a model or vault; `purpose` ("for calibration") completes the error message."""
    from transformers import AutoTokenizer

    for_what = purpose and " " + purpose
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise SmoeError(f"{path}: no tokenizer{for_what} (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:  # transformers' reasons run over several lines: keep one
        raise SmoeError(f"{path}: no usable tokenizer{for_what} ({' '.join(str(e).split())[:300]})") from None


def check_text(text: str, what: str) -> str:
    """Text from the command line or a terminal. Python keeps bytes that are not UTF-8 as lone
    surrogates, which tokenizers refuse with a traceback: say which byte instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else ord(text[e.start])
        raise SmoeError(f"{what} is not valid UTF-8 (byte {byte:#04x} at character {e.start})") from None
    return text


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def chat_prompt(tok, history, tools: list[dict] | None = None) -> list[int]:
    """The tokenizer's chat template when it has one; plain "User:/Assistant:" turns otherwise.

    history: [{"role": "system" | "user" | "assistant" | "tool", "content": str, ...}, ...]; tools (in
    OpenAI's shape) go to the template, which alone knows how its model is told of them."""
    if has_chat_template(tok):
        return tok.apply_chat_template(history, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    text = "".join(f"{ROLE_LABELS.get(m['role'], 'Assistant')}: {m['content']}\n" for m in history)
    return tok(text + "Assistant:", add_special_tokens=True)["input_ids"]


def chat_text(tok, history, tools: list[dict] | None = None, generation_prompt: bool = False) -> str:
    """The text the chat template makes of `history` (empty without a template): how it writes tools and calls."""
    if not has_chat_template(tok):
        return ""
    return tok.apply_chat_template(history, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False)


def text_offsets(tok, tokens: list[int], special: bool) -> list[int]:
    """Where each token's text starts in the text of `tokens` (special tokens kept or skipped, as `special`
    says); a token that ends inside a character, where that character starts. One pass of the detokenizer's
    pieces, the text a reply streams; decoding every prefix instead costs the square of the length (seconds at
    4,000 tokens), which only a tokenizer whose decode cleans up spaces (no incremental decoder) still pays."""
    text = Detokenizer(tok, special)
    if text.stream is None:
        prefixes = tok.batch_decode([tokens[:i] for i in range(len(tokens))], skip_special_tokens=not special)
        return [len(prefix) for prefix in prefixes]
    pieces = [text.push(token) for token in tokens]
    return list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0))[: len(tokens)]


class Detokenizer:
    """The text of a growing sequence of token ids, a token at a time. Decoding the whole sequence at each
    token costs time in its length (3.4 ms a token at 16,000 tokens on a 2-core CPU, as long as a decode step),
    so where tokenizers' incremental decoder gives the whole decode (a tokenizer that cleans up spaces after
    decoding is the exception) each token costs only its own piece.

    `special`: keep special tokens in the text; `dropped`: ids left out of it (end of sequence)."""

    def __init__(self, tok, special: bool = False, dropped=(), lock=None):
        self.tok, self.special, self.dropped = tok, special, frozenset(dropped)
        self.lock = lock or contextlib.nullcontext()  # a tokenizer the caller shares with other threads
        self.tokens: list[int] = []
        self.text = ""  # every complete character so far
        with self.lock:
            incremental = decodes_as_its_backend(tok)
        self.stream = DecodeStream(skip_special_tokens=not special) if incremental else None

    def push(self, token: int) -> str:
        """The text `token` completes ("" while a character is still incomplete)."""
        if token in self.dropped:
            return ""
        self.tokens.append(token)
        with self.lock:
            if self.stream is not None:
                piece = self.stream.step(self.tok.backend_tokenizer, token) or ""
                self.text += piece
                return piece
            return self._whole(complete=True)

    def rest(self) -> str:
        """Once the sequence has ended: what its last tokens hold beyond `text` (a character left incomplete,
        as U+FFFD). One whole decode."""
        with self.lock:
            return self._whole(complete=False)

    def _whole(self, complete: bool) -> str:
        """`text` as the whole decode (a cleanup of spaces may rewrite its end, so the piece returned is what
        follows the old text's length); `complete`: unchanged while the decode ends inside a character."""
        whole = self.tok.decode(self.tokens, skip_special_tokens=not self.special)
        if complete and whole.endswith("\ufffd"):
            return ""
        piece, self.text = whole[len(self.text):], whole
        return piece


CLEANUP_PROBE = "Hello , world . it 's ok ! do n't ?"  # what transformers' cleanup of spaces would change


def decodes_as_its_backend(tok) -> bool:
    """Whether the tokenizer's decode is its tokenizers backend's, whose incremental decoder then gives the same
    text: not where transformers cleans up spaces after decoding (WordPiece tokenizers that ask for it)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return False
    ids = tok(CLEANUP_PROBE, add_special_tokens=False)["input_ids"]
    return tok.decode(ids) == backend.decode(ids, skip_special_tokens=False)
