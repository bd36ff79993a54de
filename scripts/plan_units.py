"""Plans of fused tensors against plans of expert groups, at the same budgets, on the shared trained models; and the
proxy that shares a tensor's measured KL among its expert groups checked against measured group KLs.

For each model: `smoe plan`'s own path (smoe.quality.plan.plan_model: calibration on 65,536 tokens of
train.txt.gz spread over the file, the sensitivity sweep on its 8 windows, gptq), then make_plan at each budget and
expert-group count from the same table. Each plan is scored on the evaluation text as `smoe eval` scores a vault
(smoe.quality.evaluate.compare: the first 16,384 tokens of valid.txt.gz, windows of 512, KL(source ‖ quantised)),
the experts encoded and decoded in memory (smoe.quality.sensitivity.QuantisedModel, each expert at its planned
depth). The proxy check: with the experts of a layer in `--check-groups` groups by routed tokens, each group of each
tensor alone at Q2 (everything else the source's), its KL on the sweep's 8 windows against the tensor's measured
KL × the group's proxy share.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/plan_units.py out/plan-units

Results are cached in OUT/results.json (a re-run prints at once); `--models`, `--budgets`, `--groups` narrow a run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from smoe.hf.tokenizer import load_tokenizer
from smoe.quality.evaluate import compare
from smoe.quality.plan import expert_groups, group_kls, make_plan, plan_model
from smoe.quality.sensitivity import UNITS, key, measure_experts
from smoe.source.text import token_stream, windows

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
MODELS = ("qwen3-moe-28m", "mixtral-28m-b", "deepseek-v3-30m")
TRAIN, VALID = SHARED / "corpus" / "train.txt.gz", SHARED / "corpus" / "valid.txt.gz"


class Study:
    """One model: its plan's table, the in-memory quantised model and the source's logits on the evaluation text."""

    def __init__(self, name: str, out: Path, eval_tokens: int):
        self.name, self.dir, self.out = name, SHARED / "models" / name, out / name
        self.out.mkdir(parents=True, exist_ok=True)
        plan = self.out / "plan-3.0-g1.json"
        start = time.perf_counter()
        _, self.table, self.meter, _ = plan_model(self.dir, TRAIN, plan, budget_bits=3.0, encoder="gptq",
                                                  sensitivity=self.out / "sensitivity.json", need_meter=True,
                                                  progress=False)
        print(f"{name}: sensitivity table and proxy in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        self.qm = self.meter.qm
        self.ids = token_stream(load_tokenizer(self.dir), VALID, eval_tokens)
        with torch.inference_mode():
            self.reference = [self.logits(w) for w in windows(self.ids)]

    def logits(self, window: torch.Tensor) -> torch.Tensor:
        return self.qm.model(input_ids=window, use_cache=False).logits.float()

    def evaluate(self, doc: dict) -> dict:
        """The plan's experts in the model, scored on the evaluation text, then the source weights back."""
        for layer in self.table["moe_layers"]:
            for u in UNITS:
                self.qm.set(layer, u, doc["tensors"][f"{layer}.{u}"])
        try:
            reference = iter(self.reference)
            return compare(self.logits, lambda _: next(reference), self.ids, progress=False)
        finally:
            for layer in self.table["moe_layers"]:
                for u in UNITS:
                    self.qm.set(layer, u, None)

    def check_proxy(self, groups: int) -> list[dict]:
        """Each group of each tensor alone at Q2: measured KL on the sweep's windows and the proxy's estimate."""
        rows = []
        for layer in self.table["moe_layers"]:
            members = expert_groups(self.table, layer, groups)
            for u in UNITS:
                predicted = group_kls(self.table, layer, u, 2, members)
                for g, experts in enumerate(members):
                    rows.append({"layer": layer, "unit": u, "group": g, "experts": experts,
                                 "tensor_kl": self.table["kl"][key(layer, u, 2)], "predicted": predicted[g],
                                 "measured": measure_experts(self.meter, layer, u, 2, experts),
                                 "kurtosis": mean_kurtosis(self.qm, layer, u, experts),
                                 "tokens": sum(self.table["routed_tokens"][str(layer)][e] for e in experts)})
        return rows


def measured_shares(table: dict, rows: list[dict], groups: int) -> dict:
    """The table with each tensor's Q2 KL shared among its groups as the proxy check measured them (instead of by
    the proxy): what expert groups could gain with a perfect proxy."""
    proxy = dict(table["proxy"])
    for layer in table["moe_layers"]:
        tokens = table["routed_tokens"][str(layer)]
        for u in UNITS:
            errors = [0.0] * table["num_experts"]
            for r in rows:
                if (r["layer"], r["unit"]) == (layer, u):
                    for e in r["experts"]:  # each expert's tokens × error adds up to the group's measured KL
                        errors[e] = r["measured"] / len(r["experts"]) / max(tokens[e], 1)
            proxy[key(layer, u, 2)] = errors
    return table | {"proxy": proxy, "routed_tokens": {k: [max(t, 1) for t in v] for k, v in table["routed_tokens"].items()}}


def mean_kurtosis(qm, layer: int, unit: str, experts: list[int]) -> float:
    """Mean over the group's experts and the unit's projections of the weights' kurtosis (a data-free predictor)."""
    from smoe.quality.sensitivity import UNIT_ROLES
    from smoe.source.loading import load_projection

    values = []
    for e in experts:
        for src in qm.expert_map.experts[(layer, e)]:
            if src.role in UNIT_ROLES[unit]:
                w = load_projection(qm.ckpt, src).double().flatten()
                z = (w - w.mean()) / w.std()
                values.append(float((z ** 4).mean()))
    return sum(values) / len(values)


def pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return sxy / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def ranks(x: list[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    for rank, i in enumerate(order):
        r[i] = float(rank)
    return r


def proxy_summary(rows: list[dict]) -> dict:
    """Correlations of measured group KL with the proxy's estimate and with cheaper predictors; how far the
    groups' KLs add up to their tensor's."""
    measured = [r["measured"] for r in rows]
    ratio = sorted(r["measured"] / r["predicted"] for r in rows if r["predicted"] > 0)
    within = lambda name: sorted_within(rows, name)
    tensors = {(r["layer"], r["unit"]): r["tensor_kl"] for r in rows}
    sums = {t: sum(r["measured"] for r in rows if (r["layer"], r["unit"]) == t) for t in tensors}
    return {
        "pearson_log": pearson([math.log(r["predicted"]) for r in rows], [math.log(m) for m in measured]),
        "spearman": pearson(ranks([r["predicted"] for r in rows]), ranks(measured)),
        "spearman_within_tensor": within("predicted"),
        "spearman_within_tensor_tokens": within("tokens"),
        "spearman_within_tensor_tokens_x_kurtosis": within("tokens_x_kurtosis"),
        "ratio_median": ratio[len(ratio) // 2], "ratio_min": ratio[0], "ratio_max": ratio[-1],
        "groups_sum_over_tensor_median": sorted(sums[t] / tensors[t] for t in tensors)[len(tensors) // 2],
    }


def sorted_within(rows: list[dict], name: str) -> float:
    """Mean over tensors of the rank correlation, among the tensor's groups, of `name` with the measured KL."""
    values = []
    for t in sorted({(r["layer"], r["unit"]) for r in rows}):
        group = [r for r in rows if (r["layer"], r["unit"]) == t]
        x = [r["tokens"] * r["kurtosis"] if name == "tokens_x_kurtosis" else r[name] for r in group]
        values.append(pearson(ranks(x), ranks([r["measured"] for r in group])))
    return sum(values) / len(values)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budgets", default="3.0,2.5")
    p.add_argument("--groups", default="1,4,8,all", help="expert groups per layer ('all': one per expert)")
    p.add_argument("--check-groups", type=int, default=4, help="groups per tensor in the proxy check (0: none)")
    p.add_argument("--eval-tokens", type=int, default=16384)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.out / "results.json"
    results = json.loads(cache.read_text()) if cache.exists() else {}

    def save():
        cache.write_text(json.dumps(results, indent=1))

    for name in args.models.split(","):
        study = None
        for budget in map(float, args.budgets.split(",")):
            for g in args.groups.split(","):
                tag = f"{name}|{budget}|{g}|{args.eval_tokens}"
                if tag not in results:
                    study = study or Study(name, args.out, args.eval_tokens)
                    groups = study.table["num_experts"] if g == "all" else int(g)
                    doc = make_plan(study.table, budget_bits=budget, groups=groups)
                    (study.out / f"plan-{budget}-g{g}.json").write_text(json.dumps(doc, indent=1))
                    start = time.perf_counter()
                    results[tag] = {"bits_per_weight": doc["bits_per_weight"], "predicted_kl": doc["predicted_kl"],
                                    "experts_file_bytes": doc["experts_file_bytes"]} | study.evaluate(doc)
                    results[tag]["eval_s"] = time.perf_counter() - start
                    save()
                r = results[tag]
                print(f"{name:<16} budget {budget:<4} groups {g:<4} bits {r['bits_per_weight']:.4f}  KL {r['kl']:.5f}  "
                      f"predicted {r['predicted_kl']:.5f}  ppl {r['ppl']:.3f}  top-1 {r['top1']:.4f}", flush=True)
        tag = f"{name}|proxy|{args.check_groups}"
        if args.check_groups and tag not in results:
            study = study or Study(name, args.out, args.eval_tokens)
            start = time.perf_counter()
            results[tag] = {"rows": study.check_proxy(args.check_groups), "seconds": time.perf_counter() - start}
            save()
        for budget in map(float, args.budgets.split(",")) if args.check_groups else ():
            measured = f"{name}|{budget}|measured-{args.check_groups}|{args.eval_tokens}"
            if measured not in results:
                study = study or Study(name, args.out, args.eval_tokens)
                doc = make_plan(measured_shares(study.table, results[tag]["rows"], args.check_groups), budget_bits=budget,
                                groups=args.check_groups)
                results[measured] = {"bits_per_weight": doc["bits_per_weight"], "predicted_kl": doc["predicted_kl"],
                                     "experts_file_bytes": doc["experts_file_bytes"]} | study.evaluate(doc)
                save()
            r = results[measured]
            print(f"{name:<16} budget {budget:<4} groups {args.check_groups} shared as measured  bits "
                  f"{r['bits_per_weight']:.4f}  KL {r['kl']:.5f}  predicted {r['predicted_kl']:.5f}  ppl {r['ppl']:.3f}  "
                  f"top-1 {r['top1']:.4f}", flush=True)
        if args.check_groups:
            summary = proxy_summary(results[tag]["rows"])
            print(f"{name:<16} proxy, {args.check_groups} groups: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
