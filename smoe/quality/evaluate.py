"""`smoe eval`: perplexity, KL(ref||vault) and top-1 agreement on a fixed token stream.

Pinned protocol, so figures compare across tools and versions: the first N tokens of the file as one
stream (no BOS added), cut into non-overlapping windows of 512, each window scored on its own, fp32
logits; every position but a window's first is predicted.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from smoe.errors import SmoeError
from smoe.progress import bar
from smoe.source.text import windows


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
    from smoe.hf.model import load_pretrained

    if not (Path(model_dir) / "config.json").exists():
        raise SmoeError(f"{model_dir}: not a model directory (no config.json)")
    model = load_pretrained(model_dir, dtype)

    @torch.inference_mode()
    def logits(ids):
        return model(input_ids=ids, use_cache=False).logits.float()

    return logits
