"""Prompts as token ids: the vault's tokenizer, and chat turns through its chat template."""

from __future__ import annotations

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
    says); a token that ends inside a character, where that character starts. One pass of tokenizers'
    incremental decoder; decoding every prefix instead costs the square of the length (seconds at 4,000
    tokens), which only a tokenizer whose whole decode differs from its increments (one that cleans up
    spaces after decoding) still pays."""
    whole = tok.decode(tokens, skip_special_tokens=not special)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        stream = DecodeStream(skip_special_tokens=not special)
        pieces = [stream.step(backend, token) or "" for token in tokens]
        if "".join(pieces) == whole:
            return list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0))[: len(tokens)]
    prefixes = tok.batch_decode([tokens[:i] for i in range(len(tokens))], skip_special_tokens=not special)
    return [len(text) for text in prefixes]
