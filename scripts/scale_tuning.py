"""Whether tuning the group scales of GPTQ-encoded experts pays (QUALITY.md, "Tuning the scales after GPTQ").

  python scripts/scale_tuning.py MODEL BITS {end-to-end,layerwise} [--steps N] [--lr LR] [--train-tokens T]
         [--stats STATS.pt] [--eval-tokens 16384]

The experts of MODEL (a shared model's name or a directory) are encoded by the default calibrated encoder (gptq,
smoe.quality.sensitivity.QuantisedModel, statistics from STATS, else collected on 65,536 tokens of train.txt.gz)
and their codes kept; each group's fp16 scale gets a multiplier, exp(m) with m learnt by Adam from 0:

- end-to-end: m minimises KL(source ‖ quantised model) on --train-tokens tokens of train.txt.gz (windows of 512,
  one a step, in turn);
- layerwise: each MoE layer's m minimises the relative squared error of its experts module's output (the routed
  sum) against the source's, on the source's inputs and routing of those tokens (4,096 rows a step), the layers
  one after another (what a layer-by-layer encoder could do).

Before and after, KL(source ‖ quantised) and top-1 agreement on the first --eval-tokens tokens of valid.txt.gz,
as `smoe eval` scores a vault (smoe.quality.evaluate.compare), printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.func import functional_call

from smoe.convert import calibrate
from smoe.hf.experts import expert_parameters
from smoe.hf.tokenizer import load_tokenizer
from smoe.quality.evaluate import compare
from smoe.quality.sensitivity import QuantisedModel
from smoe.source.text import token_stream, windows

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
TRAIN, VALID = SHARED / "corpus" / "train.txt.gz", SHARED / "corpus" / "valid.txt.gz"
ROLES = ("gate", "up", "down")
GROUP = 64  # consecutive weights of the row-major matrix sharing a scale


class Tuned:
    """The encoded experts of one model with a learnable log-multiplier per group of each matrix."""

    def __init__(self, qm: QuantisedModel, bits: int):
        self.qm, self.experts = qm, qm.expert_map.num_experts
        qm.set_plan({unit: bits for unit in qm.units()})  # encodes every expert (QuantisedModel.cache)
        self.decoded = {(layer, e, role): qm.cache[(layer, e, role, bits)]
                        for layer in qm.expert_map.moe_layers for e in range(self.experts) for role in ROLES}
        self.log_scale = {k: torch.zeros(w.numel() // GROUP, requires_grad=True) for k, w in self.decoded.items()}
        qm.set_plan({unit: None for unit in qm.units()})  # the model holds the source again
        names = {id(m): n for n, m in qm.model.named_modules()}
        self.prefix = {layer: names[id(m)] for layer, m in qm.modules.items()}

    def weight(self, key, tuned: bool = True) -> torch.Tensor:
        w = self.decoded[key]
        if not tuned:
            return w
        return (w.reshape(-1, GROUP) * self.log_scale[key].exp()[:, None]).reshape(w.shape)

    def layer_parameters(self, layer: int, tuned: bool = True) -> dict[str, torch.Tensor]:
        decoded = [{role: self.weight((layer, e, role), tuned) for role in ROLES} for e in range(self.experts)]
        return expert_parameters(self.qm.modules[layer], decoded, [{} for _ in range(self.experts)])

    def parameters(self, tuned: bool = True) -> dict[str, torch.Tensor]:
        return {f"{self.prefix[layer]}.{name}": p for layer in self.qm.expert_map.moe_layers
                for name, p in self.layer_parameters(layer, tuned).items()}

    def logits(self, window: torch.Tensor, tuned: bool = True) -> torch.Tensor:
        return functional_call(self.qm.model, self.parameters(tuned), (window,), {"use_cache": False}).logits.float()


def end_to_end(t: Tuned, train: list[torch.Tensor], steps: int, lr: float) -> None:
    with torch.no_grad():
        reference = [torch.log_softmax(t.qm.model(input_ids=w, use_cache=False).logits.float()[0, :-1], -1)
                     for w in train]
    opt = torch.optim.Adam(list(t.log_scale.values()), lr=lr)
    for step in range(steps):
        i = step % len(train)
        lp = torch.log_softmax(t.logits(train[i])[0, :-1], -1)
        loss = (reference[i].exp() * (reference[i] - lp)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(json.dumps({"step": step, "train_kl": round(float(loss), 6)}), flush=True)


def layerwise(t: Tuned, train: list[torch.Tensor], steps: int, lr: float) -> None:
    inputs = {layer: [] for layer in t.qm.modules}
    hooks = [m.register_forward_pre_hook(lambda _, args, layer=layer: inputs[layer].append([a.detach() for a in args[:3]]))
             for layer, m in t.qm.modules.items()]
    with torch.no_grad():
        for w in train:
            t.qm.model(input_ids=w, use_cache=False)
    for h in hooks:
        h.remove()
    for layer, module in t.qm.modules.items():
        x, ids, weights = (torch.cat([c[j].reshape(-1, c[j].shape[-1]) for c in inputs[layer]]) for j in range(3))
        with torch.no_grad():
            target = module(x, ids, weights)

        def error(rows, tuned=True):
            out = functional_call(module, t.layer_parameters(layer, tuned), (x[rows], ids[rows], weights[rows]))
            return (out - target[rows]).pow(2).sum() / target[rows].pow(2).sum()

        keys = [(layer, e, role) for e in range(t.experts) for role in ROLES]
        opt = torch.optim.Adam([t.log_scale[k] for k in keys], lr=lr)
        with torch.no_grad():
            before = float(error(slice(None), tuned=False))
        for _ in range(steps):
            loss = error(torch.randint(0, x.shape[0], (4096,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            after = float(error(slice(None)))
        print(json.dumps({"layer": layer, "train_error_before": round(before, 6), "after": round(after, 6)}), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("bits", type=int)
    p.add_argument("mode", choices=("end-to-end", "layerwise"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--train-tokens", type=int, default=16384)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--stats", type=Path, help="calibration statistics saved by calibrate.CalibrationStats.save")
    args = p.parse_args(argv)
    model_dir = Path(args.model) if Path(args.model).is_dir() else SHARED / "models" / args.model
    stats = calibrate.CalibrationStats.load(args.stats) if args.stats else None
    stats = replace(stats, balance=0.0) if stats is not None else calibrate.collect(model_dir, TRAIN, progress=False)
    torch.manual_seed(0)
    start = time.perf_counter()
    t = Tuned(QuantisedModel(model_dir, "gptq", stats), args.bits)
    ids = token_stream(load_tokenizer(model_dir), VALID, args.eval_tokens)
    with torch.no_grad():
        reference = {tuple(w[0].tolist()): t.qm.model(input_ids=w, use_cache=False).logits.float() for w in windows(ids)}
        score = lambda tuned: compare(lambda w: t.logits(w, tuned), lambda w: reference[tuple(w[0].tolist())], ids,
                                      progress=False)
        print(json.dumps({"model": model_dir.name, "bits": args.bits, "gptq": score(False)}), flush=True)
    train = calibrate.calibration_windows(model_dir, TRAIN, args.train_tokens)
    (end_to_end if args.mode == "end-to-end" else layerwise)(t, train, args.steps, args.lr)
    with torch.no_grad():
        print(json.dumps({"model": model_dir.name, "bits": args.bits, "mode": args.mode, "steps": args.steps,
                          "lr": args.lr, "tuned": score(True), "seconds": round(time.perf_counter() - start)}),
              flush=True)


if __name__ == "__main__":
    main()
