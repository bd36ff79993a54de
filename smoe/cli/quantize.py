"""`smoe plan` and the plan side of `smoe quantize` (--plan, --budget): the command-line glue over
smoe.quality.plan, and the finished vault's KL measured by the runtime."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from smoe.errors import SmoeError
from smoe.quality.plan import (
    calibration_stats,
    format_plan,
    load_plan,
    plan_model,
    role_bits,
    stats_path,
    write_heatmap,
)


def plan_calibration(args, doc: dict, encoder: str) -> None:
    """`quantize --plan` without --calib: a calibrated encoder calibrates on the plan's own text (and,
    unless --calib-tokens says otherwise, as many tokens) when that file is still there unchanged;
    else the error says what to pass."""
    from smoe.convert.calibrate import file_hash
    from smoe.convert.encoders import NEEDS_CALIBRATION

    record = doc.get("calibration") or {}
    if args.calib is not None:
        args.calib_tokens = args.calib_tokens or record.get("tokens")  # the plan's count unless told otherwise
        return
    if encoder not in NEEDS_CALIBRATION:
        return
    path = record.get("file")
    if not path or not Path(path).is_file() or file_hash(path) != record.get("hash"):
        where = f"its calibration text {path} is gone or changed" if path else "it does not say what it was calibrated on"
        tokens = f" --calib-tokens {record['tokens']}" if record.get("tokens") else ""
        raise SmoeError(f"the plan's {encoder} encoder needs calibration text and {where}: pass --calib FILE{tokens} "
                        f"(the text `smoe plan` ran on), or --encoder grid to quantize without calibration")
    args.calib, args.calib_tokens = path, args.calib_tokens or record["tokens"]
    print(f"smoe: notice: calibrating the {encoder} encoder on the plan's text {path} ({args.calib_tokens} tokens)",
          file=sys.stderr)


def vault_kl(vault_dir, meter) -> float:
    """KL(source ‖ vault) of the finished vault, run by the streaming runtime on the meter's windows."""
    import torch

    from smoe.runtime.model import OpenedVault

    sm = OpenedVault(vault_dir, dtype="float32")
    try:
        total = count = 0.0
        for window, ref in zip(meter.windows, meter.reference):
            lp = torch.log_softmax(sm.logits(window)[0, :-1].double(), dim=-1)
            total += float((ref.exp() * (ref - lp)).sum())
            count += ref.shape[0]
    finally:
        sm.close()
    return total / count


def cmd_plan(args) -> int:
    from smoe.convert.encoders import DEFAULT

    if not args.calib:
        raise SmoeError("smoe plan needs calibration text: --calib FILE")
    doc, table, _, _ = plan_model(args.model, args.calib, args.output, args.budget, args.size, args.encoder or DEFAULT,
                                  args.sensitivity, args.calib_tokens, progress=not args.quiet and not args.json,
                                  cluster=args.ray, groups=args.expert_groups, layer_by_layer=args.layer_by_layer)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(format_plan(doc, table))
        print(f"wrote     {args.output}, {Path(args.output).with_suffix('.png')}, {doc['sensitivity']}")
    return 0


def quantize_inputs(args, progress: bool):
    """For `smoe quantize`: (depth per (layer, role) or None, encoder, calibration stats or None, planned)
    from --plan / --budget / --encoder; with --budget the plan is made here, beside the vault."""
    from smoe.convert.calibrate import DEFAULT_TOKENS
    from smoe.convert.encoders import NEEDS_CALIBRATION, default_encoder
    from smoe.source.checkpoint import open_checkpoint
    from smoe.source.matching import map_experts

    if args.plan and args.budget is not None:
        raise SmoeError("give --plan or --budget, not both")
    if args.expert_groups != 1 and args.budget is None:
        raise SmoeError("--expert-groups is for planning: give it with --budget (a plan from `smoe plan` carries its own)")
    encoder = args.encoder or default_encoder(args.calib)
    if args.budget is not None:
        if not args.calib:
            raise SmoeError("--budget needs calibration text: --calib FILE")
        out = Path(args.output)
        if out.exists() and not args.force:
            raise SmoeError(f"{out}: already exists (use --force to replace it)")
        doc, table, meter, stats = plan_model(args.model, args.calib, out.with_name(out.name + ".plan.json"),
                                              budget_bits=args.budget, encoder=encoder, tokens=args.calib_tokens,
                                              progress=progress, need_meter=True, cluster=args.ray,
                                              groups=args.expert_groups)
        if progress:
            print(format_plan(doc, table))
        stats = stats if encoder in NEEDS_CALIBRATION else None  # expert groups calibrate a grid plan too
        return role_bits(doc, meter.qm.expert_map), encoder, stats, (doc, table, meter)
    if args.plan:
        doc = load_plan(args.plan)
        ckpt = open_checkpoint(args.model)
        bits = role_bits(doc, map_experts(ckpt.config, ckpt.names(), num_experts=args.num_experts))  # before any calibration
        encoder = args.encoder or doc.get("encoder", default_encoder(args.calib))
        plan_calibration(args, doc, encoder)
        stats = None
        if encoder in NEEDS_CALIBRATION and stats_path(Path(args.plan)).is_file():  # the plan's own, when they fit
            stats = calibration_stats(args.model, args.calib, args.calib_tokens or DEFAULT_TOKENS,
                                      stats_path(Path(args.plan)), progress)
        return bits, encoder, stats, None
    return None, encoder, None, None


def cluster_encoder(args):
    """With --ray: write_experts' encoding on the cluster (smoe.quality.fanout), checked before any work."""
    if not args.ray:
        return None
    from smoe.quality.fanout import encoder_on

    return encoder_on(args.ray, args.model)


def after_quantize(args, planned) -> dict:
    """With --budget: the finished vault's KL on the calibration windows against the plan's prediction,
    and the heatmap redrawn with it."""
    if not planned:
        return {}
    doc, table, meter = planned
    measured = vault_kl(args.output, meter)
    out = Path(args.output)
    write_heatmap(doc, table, out.with_name(out.name + ".plan.png"), measured)
    return {"predicted_kl": doc["predicted_kl"], "measured_kl": measured,
            "predicted_experts_file_bytes": doc["experts_file_bytes"],
            "experts_file_bytes": (out / "experts.bin").stat().st_size,
            "plan": str(out.with_name(out.name + ".plan.json"))}


def print_measured(measured: dict) -> None:
    if measured:
        print(f"plan      {measured['plan']} (heatmap beside it)")
        print(f"KL        measured {measured['measured_kl']:.5f} on the sensitivities' calibration windows, "
              f"predicted {measured['predicted_kl']:.5f} (sum of per-tensor KLs)")
        print(f"size      experts.bin {measured['experts_file_bytes']:,} bytes, "
              f"predicted {measured['predicted_experts_file_bytes']:,}")
