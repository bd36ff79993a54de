"""How well layer l+1's experts are predicted from layer l, on the shared trained models' real routing: layer
l+1's router (and its routing rule, correction bias included) applied to layer l's experts' input, against the
experts layer l+1 really chose. The guess is what a GPU decoder would need to copy layer l+1's misses while layer
l computes (the CPU decoder's SMOE_PREFETCH makes the same guess).

  python scripts/route_prediction.py [--tokens 4096] [--models a,b,c]

Per model: recall of the chosen experts in the guessed top-k, and in the guessed top-2k (guessing twice as many,
twice the bytes), over every token and every pair of consecutive MoE layers of the first --tokens tokens of
valid.txt.gz (windows of 512, the model in fp32 through transformers); chance is k / E and 2k / E.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import replace
from pathlib import Path

import torch

from smoe.convert.calibrate import load_source_model
from smoe.hf.tokenizer import load_tokenizer
from smoe.hf.trunk import model_trunk
from smoe.moe.routing import route
from smoe.runtime.weights import layer_weights
from smoe.source.description import describe_model
from smoe.source.text import token_stream, windows

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
MODELS = ("qwen3-moe-28m", "mixtral-28m-b", "deepseek-v3-30m")
VALID = SHARED / "corpus" / "valid.txt.gz"


def study(model_dir: Path, tokens: int) -> dict:
    model, modules = load_source_model(model_dir)
    d = describe_model(model.config.get_text_config().to_dict())
    layers = model_trunk(model)["layers"]
    weights = {i: layer_weights(layers[i], d, i) for i in modules}
    inputs, chosen = {}, {}

    def record(layer, module, args):  # (hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k])
        inputs.setdefault(layer, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        chosen.setdefault(layer, []).append(args[1].detach().reshape(-1, args[1].shape[-1]))

    for layer, module in modules.items():
        module.register_forward_pre_hook(functools.partial(record, layer))
    ids = token_stream(load_tokenizer(model_dir), VALID, tokens)
    with torch.inference_mode():
        for window in windows(ids):
            model(input_ids=window, use_cache=False)
    k, experts = d.routing.top_k, d.routing.num_experts
    wide = replace(d.routing, top_k=min(2 * k, experts))
    hits = {"k": 0, "2k": 0}
    total = 0
    moe = sorted(modules)
    for a, b in zip(moe, moe[1:]):
        if b != a + 1:
            continue
        h, actual = torch.cat(inputs[a]), torch.cat(chosen[b])
        w = weights[b]
        logits = h @ w.router.float().T + (w.router_bias.float() if w.router_bias is not None else 0)
        correction = w.correction.float() if w.correction is not None else None
        for name, rule in (("k", d.routing), ("2k", wide)):
            guess, _ = route(rule, logits, correction)
            hits[name] += int((actual[:, :, None] == guess[:, None, :]).any(-1).sum())
        total += actual.numel()
    return {"k": k, "experts": experts, "pairs": sum(1 for a, b in zip(moe, moe[1:]) if b == a + 1),
            "tokens": len(ids), "recall_k": hits["k"] / total, "recall_2k": hits["2k"] / total}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    for name in args.models.split(","):
        r = study(SHARED / "models" / name, args.tokens)
        print(f"{name}: {r['pairs']} pairs of consecutive MoE layers, {r['tokens']} tokens, top-{r['k']} of "
              f"{r['experts']}: recall in the guessed top-k {r['recall_k']:.3f} (chance {r['k'] / r['experts']:.3f}), "
              f"in the guessed top-2k {r['recall_2k']:.3f} (chance {min(1.0, 2 * r['k'] / r['experts']):.3f})",
              flush=True)


if __name__ == "__main__":
    main()
