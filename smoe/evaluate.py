"""`smoe eval`: perplexity, KL(ref||vault) and top-1 agreement on a fixed token stream.

Pinned protocol, so figures compare across tools and versions: the first N tokens of the file as one
stream (no BOS added), cut into non-overlapping windows of 512, each window scored on its own, fp32
logits; every position but a window's first is predicted.
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import torch
from smoe.progress import bar

from smoe.errors import SmoeError

WINDOW = 512


def read_text(path: str | Path, max_chars: int) -> tuple[str, bool]:
    """Up to max_chars characters of a text file (gzip allowed); and whether the file had more."""
    path = Path(path)
    if not path.is_file():
        raise SmoeError(f"{path}: no such data file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            text = f.read(max_chars + 1)
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


def compare(logits_fn, ref_logits_fn, ids: list[int], progress: bool = True) -> dict:
    """Aggregate NLL of both models, KL(ref||model) and top-1 agreement over every predicted position."""
    nll = ref_nll = kl = agree = 0.0
    count = 0
    for window in bar(windows(ids), progress, desc="eval", unit="window"):
        lp = torch.log_softmax(logits_fn(window)[0, :-1].double(), dim=-1)
        ref_lp = torch.log_softmax(ref_logits_fn(window)[0, :-1].double(), dim=-1)
        target = window[0, 1:]
        nll -= float(lp.gather(1, target[:, None]).sum())
        ref_nll -= float(ref_lp.gather(1, target[:, None]).sum())
        kl += float((ref_lp.exp() * (ref_lp - lp)).sum())
        agree += float((lp.argmax(-1) == ref_lp.argmax(-1)).sum())
        count += target.numel()
    if not count:
        raise SmoeError("the data file gave fewer than 2 tokens: nothing to evaluate")
    return {"ppl": math.exp(nll / count), "ref_ppl": math.exp(ref_nll / count), "kl": kl / count,
            "top1": agree / count, "tokens": len(ids), "predictions": count}


def load_reference(model_dir, dtype=torch.float32):
    from transformers import AutoConfig

    from smoe.runtime import causal_lm_class

    if not (Path(model_dir) / "config.json").exists():
        raise SmoeError(f"{model_dir}: not a model directory (no config.json)")
    model_class = causal_lm_class(AutoConfig.from_pretrained(model_dir))
    model = model_class.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.inference_mode()
    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits.float()

    return logits
