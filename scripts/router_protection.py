"""Whether protecting what feeds the routers pays (QUALITY.md, "Better bits where they matter"): at the same bits,
the first half of the MoE layers at Q4 and the rest at Q2 (the early layers' error reaches every later router)
against the reverse, GPTQ with the default statistics, KL and routing flips as scripts/routing_flips.py measures
them.

  python scripts/router_protection.py OUT [--models a,b,c] [--eval-tokens 16384] [--calib-tokens 65536]

OUT is routing_flips.py's folder: its statistics (stats-*-base-*.pt) are reused, results cached in results.json.
"""

from __future__ import annotations

import torch
from routing_flips import cached, flip_rates, studies, study_arguments, summary

from smoe.quality.evaluate import compare


def evaluate_plan(study, depths: dict[int, int]) -> dict:
    """KL etc. and routing flips with each MoE layer's experts at depths[layer] (gptq, the default statistics)."""
    qm = study.qm
    qm.encoder, qm.stats = "gptq", study.routed_stats()
    qm.set_plan({(layer, unit): depths[layer] for layer, unit in qm.units()})
    reference = iter(study.reference)
    with torch.no_grad():
        result = compare(study.logits, lambda _: next(reference), study.ids, progress=False)
    qm.set_plan({unit: None for unit in qm.units()})
    result["flips"] = flip_rates(study.reference_routes, study.take_routes())
    return result


def main(argv=None) -> None:
    args = study_arguments(__doc__.split("\n\n")[0]).parse_args(argv)
    _, measure = cached(args.out)
    lines = ["| model | MoE layers at Q4 | KL | top-1 agreement | top-k set flips, mean | top-1 flips, mean |",
             "|---|---|---|---|---|---|"]
    for tag, name, study in studies(args):
        for side in ("front", "back"):
            def run(side=side):
                moe = sorted(study().qm.expert_map.moe_layers)
                half = len(moe) // 2
                q4 = moe[:half] if side == "front" else moe[len(moe) - half:]
                return evaluate_plan(study(), {layer: 4 if layer in q4 else 2 for layer in moe}) | {"q4": q4}
            r = measure(f"{tag}|protect|{side}", run)
            s, t, _, _ = summary(r["flips"])
            lines.append(f"| {name} | {side}: {r['q4']} | {r['kl']:.5f} | {r['top1']:.4f} | {s:.4f} | {t:.4f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
