"""Log-probabilities in the shapes of OpenAI's APIs: chat's `logprobs.content[]` and legacy completions'
{tokens, token_logprobs, top_logprobs, text_offset}.

The numbers are the model's log-softmax over its raw logits (smoe/runtime/sampling.py says why). A token's
text and bytes come from its vocabulary entry: byte-level BPE entries (GPT-2, Qwen, Llama 3) map back
to their exact bytes, so a token holding half of a UTF-8 character shows those bytes.
"""

from __future__ import annotations

import functools

from smoe.runtime.sampling import TokenLogprob


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(piece: str) -> bytes:
    table = byte_decoder()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece's byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()  # sentencepiece marks a space with U+2581


class Pieces:
    """Text and bytes of token ids, through the worker's tokenizer."""

    def __init__(self, worker):
        self.worker = worker

    def __call__(self, tokens: list[int]) -> list[tuple[str, bytes]]:
        out = []
        for piece in self.worker.token_strings(tokens):
            raw = token_bytes(piece or "")
            out.append((raw.decode("utf-8", errors="replace"), raw))
        return out


def chat_content(pieces: Pieces, entries: list[TokenLogprob]) -> list[dict]:
    """`choices[].logprobs.content` of a chat completion (or of one streamed chunk)."""
    out = []
    for e in entries:
        alternatives = pieces([t for t, _ in e.top])
        (text, raw), = pieces([e.token])
        out.append({"token": text, "logprob": e.logprob, "bytes": list(raw),
                    "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(b)}
                                     for (a, b), (_, lp) in zip(alternatives, e.top)]})
    return out


def chat_logprobs(pieces: Pieces, entries: list[TokenLogprob]) -> dict:
    return {"content": chat_content(pieces, entries), "refusal": None}


def completion_logprobs(pieces: Pieces, entries: list[TokenLogprob], offsets: list[int],
                        first: int | None = None) -> dict:
    """Legacy completions' logprobs of `entries`, at character `offsets` of the returned text; an
    echoed prompt's `first` token, predicted from nothing, comes first with null logprobs."""
    tokens = ([first] if first is not None else []) + [e.token for e in entries]
    texts = [text for text, _ in pieces(tokens)]
    top = [None] if first is not None else []
    top += [top_dict(pieces, e) for e in entries]
    lps = ([None] if first is not None else []) + [e.logprob for e in entries]
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def top_dict(pieces: Pieces, entry: TokenLogprob) -> dict[str, float]:
    """{text: logprob} of the alternatives; of two with the same text, the more likely one stays."""
    out = {}
    for (text, _), (_, lp) in zip(pieces([t for t, _ in entry.top]), entry.top):
        out.setdefault(text, lp)
    return out
