"""`smoe inspect`: what a model (or a vault) costs to stream, from headers and config alone."""

from __future__ import annotations

import json
from pathlib import Path

from smoe.format import codec
from smoe.format.vault import DATA_FILE, INDEX_FILE, Vault
from smoe.source.checkpoint import Checkpoint
from smoe.source.families import ExpertMap, describe_config, map_experts

DEPTHS = {"bf16": None, "q4": 4, "q2": 2}


def expert_bytes(shapes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Bytes of one expert's blob at bf16 and at each SMOE depth (scales and padding included)."""
    out = {}
    for label, bits in DEPTHS.items():
        if bits is None:
            out[label] = sum(2 * o * i for o, i in shapes.values())
        else:
            out[label] = sum(sum(codec.encoded_nbytes(o * i, bits)) for o, i in shapes.values())
    return out


def streaming_costs(sizes: dict[str, int], moe_layers: int, top_k: int | None, disk_gbps: float) -> dict:
    per_token = {k: v * moe_layers * top_k for k, v in sizes.items()} if top_k else {}
    return {
        "expert_bytes": sizes,
        "experts_per_second": {k: disk_gbps * 1e9 / v for k, v in sizes.items() if v},
        "bytes_per_token_uncached": per_token,
        "tokens_per_second_uncached": {k: disk_gbps * 1e9 / v for k, v in per_token.items() if v},
    }


def experts_report(expert_map: ExpertMap, disk_gbps: float) -> dict:
    shapes = expert_map.expert_shapes()
    return {
        "family": expert_map.family,
        "model_type": expert_map.model_type,
        "moe_layers": len(expert_map.moe_layers),
        "experts_per_layer": expert_map.num_experts,
        "experts_per_token": expert_map.top_k,
        "expert_shapes": {r: list(s) for r, s in shapes.items()},
        "params_per_expert": sum(o * i for o, i in shapes.values()),
        "disk_gbps": disk_gbps,
        **streaming_costs(expert_bytes(shapes), len(expert_map.moe_layers), expert_map.top_k, disk_gbps),
    }


def inspect_checkpoint(path: Path, disk_gbps: float, num_experts: int | None) -> dict:
    ckpt = Checkpoint(path)
    names = ckpt.names()
    if not names:  # a bare config: everything comes from its numbers
        report = experts_report(describe_config(ckpt.config, num_experts), disk_gbps)
        return report | {"source": "config", "routed_experts_found": None, "expert_share": None, "expert_share_from": None}
    expert_map = map_experts(ckpt.config, names, num_experts=num_experts)
    report = experts_report(expert_map, disk_gbps)
    report |= {"source": "weights" if ckpt.has_weights else "index", "routed_experts_found": len(expert_map.experts)}
    report["expert_share"], report["expert_share_from"] = expert_share(ckpt, expert_map)
    return report


def expert_share(ckpt: Checkpoint, expert_map: ExpertMap) -> tuple[float | None, str | None]:
    """Share of the checkpoint's bytes held by routed experts: from the safetensors headers, or
    (index only, unquantised source) estimated from the config's shapes and the index's total size."""
    total = ckpt.total_nbytes()
    sizes = [ckpt.stored_nbytes(n) for n in expert_map.expert_names]
    if not total:
        return None, None
    if all(s is not None for s in sizes):
        return sum(sizes) / total, "headers"
    quantised = any(k in ckpt.config for k in ("quantization_config", "quantization"))
    params = sum(o * i for o, i in expert_map.expert_shapes().values())
    if quantised or not params:
        return None, None
    return len(expert_map.experts) * params * 2 / total, "estimate (bf16, config shapes / index total_size)"


def inspect_vault(path: Path, disk_gbps: float) -> dict:
    with Vault(path) as v:
        meta = v.meta
        entries = list(v.entries.values())
        mean_blob = sum(e.size for e in entries) / max(len(entries), 1)
        shapes = {r: tuple(s) for r, s in meta["expert_shapes"].items()}
        report = {
            "family": meta["family"], "model_type": meta["model_type"], "vault": str(path),
            "moe_layers": len(meta["moe_layers"]), "experts_per_layer": meta["num_experts"],
            "experts_per_token": meta["top_k"], "expert_shapes": {r: list(s) for r, s in shapes.items()},
            "params_per_expert": sum(o * i for o, i in shapes.values()), "routed_experts_found": len(entries),
            "default_bits": v.bits, "depth": stored_depth(v.tensor_bits(), shapes),
            "stored_bits": {r: {str(b): n for b, n in c.items()} for r, c in v.tensor_bits().items()},
            "disk_gbps": disk_gbps, "source": "vault",
        }
        sizes = expert_bytes(shapes) | {"vault": round(mean_blob)}
        report |= streaming_costs(sizes, report["moe_layers"], meta["top_k"], disk_gbps)
    return report


def stored_depth(tensor_bits: dict[str, dict[int, int]], shapes: dict[str, tuple[int, int]]) -> str:
    """The vault's depth in words, weighing each role's tensor counts by that role's weights."""
    weights: dict[int, int] = {}
    for role, counts in tensor_bits.items():
        o, i = shapes[role]
        for b, n in counts.items():
            weights[b] = weights.get(b, 0) + n * o * i
    return codec.depth_name(weights)


def inspect_path(path: str | Path, disk_gbps: float = 7.4, num_experts: int | None = None) -> dict:
    path = Path(path)
    if (path / DATA_FILE).exists() and (path / INDEX_FILE).exists():
        return inspect_vault(path, disk_gbps)
    return inspect_checkpoint(path, disk_gbps, num_experts)


def format_report(r: dict) -> str:
    lines = [
        f"family               {r['family']} (model_type {r['model_type']}, from {r['source']})",
        f"MoE layers           {r['moe_layers']}",
        f"experts per layer    {r['experts_per_layer']}",
        f"experts per token    {r['experts_per_token']}",
        f"params per expert    {r['params_per_expert']:,}  "
        + " ".join(f"{role} {o}x{i}" for role, (o, i) in r["expert_shapes"].items()),
    ]
    if r.get("routed_experts_found") is not None:
        lines.append(f"routed experts found {r['routed_experts_found']:,}")
    if r.get("expert_share") is not None:
        lines.append(f"experts share        {100 * r['expert_share']:.1f}% of the checkpoint bytes ({r['expert_share_from']})")
    if "stored_bits" in r:
        lines.append(f"depth                {r['depth']}")
        lines.append("stored bits          " + json.dumps(r["stored_bits"]))
    lines.append(f"{'':21}{'per expert':>12}{'per token':>12}{'experts/s':>13}{'tok/s':>13}   "
                 f"(disk {r['disk_gbps']} GB/s, no cache)")
    for label, size in r["expert_bytes"].items():
        per_token = r["bytes_per_token_uncached"].get(label)
        tps = r["tokens_per_second_uncached"].get(label)
        lines.append(
            f"  {label:<19}{size / 1e6:>9.2f} MB{(per_token or 0) / 1e6:>9.1f} MB"
            f"{r['experts_per_second'][label]:>13,.0f}{tps or 0:>13,.1f}"
        )
    return "\n".join(lines)
