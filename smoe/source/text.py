"""Text files as token streams: the pinned reading that eval, calibration and sensitivity share.

The first N tokens of a file (gzip allowed) as one stream, without special tokens, cut into
non-overlapping windows of 512.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import torch

from smoe.errors import SmoeError

WINDOW = 512


def read_text(path: str | Path, max_chars: int) -> tuple[str, bool]:
    """Up to max_chars characters of a text file (gzip allowed); and whether the file had more. Bytes that
    are not UTF-8 are refused, not replaced: a binary file given by mistake would else be scored as text."""
    path = Path(path)
    if not path.is_file():
        raise SmoeError(f"{path}: no such data file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read(max_chars + 1)
    except UnicodeDecodeError:
        raise SmoeError(f"{path}: not UTF-8 text (eval, calibration and plans read text)") from None
    except (OSError, EOFError) as e:
        raise SmoeError(f"{path}: cannot read ({e})") from None
    return text[:max_chars], len(text) > max_chars


def token_stream(tokenizer, path, n_tokens: int) -> list[int]:
    """The first n_tokens tokens of the file, tokenised as one stream without special tokens."""
    chars = n_tokens * 8
    while True:
        text, more = read_text(path, chars)
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) > n_tokens or not more:  # one spare token: the cut never changes the ones we keep
            return ids[:n_tokens]
        chars *= 2


def windows(ids: list[int], size: int = WINDOW) -> list[torch.Tensor]:
    return [torch.tensor([ids[i : i + size]]) for i in range(0, len(ids), size) if len(ids[i : i + size]) > 1]
