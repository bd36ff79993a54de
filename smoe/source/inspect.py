"""`smoe inspect`: what a model (or a vault) costs to stream, from headers and config alone."""

from __future__ import annotations

from pathlib import Path

from smoe.format import codec
from smoe.format.jsonfile import parse_json
from smoe.format.safetensors_io import read_entries
from smoe.format.vault import DATA_FILE, HEADER_SIZE, INDEX_FILE, Vault
from smoe.format.vault_index import align, blob_layout
from smoe.source.checkpoint import CONFIG_DTYPES, Checkpoint, open_checkpoint
from smoe.source.config_numbers import config_number
from smoe.source.layouts import ExpertMap
from smoe.source.matching import describe_config, map_experts

DEPTHS = {"bf16": None, "q4": 4, "q2": 2}
DEFAULT_DISK_GBPS = 7.4  # a PCIe 4 NVMe drive's sequential reads


def expert_bytes(shapes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """Bytes of one expert's blob at bf16 and at each SMOE depth (scales and padding included)."""
    out = {}
    for label, bits in DEPTHS.items():
        if bits is None:
            out[label] = sum(2 * o * i for o, i in shapes.values())
        else:
            out[label] = sum(sum(codec.encoded_nbytes(o * i, bits)) for o, i in shapes.values())
    return out


def blob_bytes(shapes: dict[str, tuple[int, int]], bits: int, alignment: int = 4096) -> int:
    """Bytes one expert takes in experts.bin at `bits`: its blob as the vault lays it out, aligned."""
    return align(blob_layout([codec.encoded_nbytes(o * i, bits) for o, i in shapes.values()], [])[2], alignment)


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
    ckpt = open_checkpoint(path)
    names = ckpt.names()
    if not names:  # a bare config: everything comes from its numbers
        report = experts_report(describe_config(ckpt.config, num_experts), disk_gbps)
        report |= {"source": "config", "routed_experts_found": None, "expert_share": None, "expert_share_from": None}
        return report | model_facts(ckpt.config, ckpt.dir) | sizes_report(report, None)
    expert_map = map_experts(ckpt.config, names, num_experts=num_experts)
    report = experts_report(expert_map, disk_gbps)
    report |= {"source": "weights" if ckpt.has_weights else "index", "routed_experts_found": len(expert_map.experts)}
    report["expert_share"], report["expert_share_from"] = expert_share(ckpt, expert_map)
    return report | model_facts(ckpt.config, ckpt.dir) | sizes_report(report, checkpoint_trunk(ckpt, expert_map, report))


def model_facts(config: dict, directory: Path) -> dict:
    """What `ollama show` gives besides the sizes: context length, vocabulary, chat template."""
    return {"context_length": config_number(config, "context_length"), "vocab_size": config_number(config, "vocab_size"),
            "chat_template": has_chat_template(directory)}


def has_chat_template(directory: Path) -> bool | None:
    """Whether the tokenizer files carry a chat template; None when there are no tokenizer files."""
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    tokenizer_config = directory / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        return None
    return bool(parse_json(tokenizer_config.read_bytes(), tokenizer_config).get("chat_template"))


def checkpoint_trunk(ckpt: Checkpoint, expert_map: ExpertMap, report: dict) -> dict:
    """Parameters and stored bytes of everything but the routed experts: from the headers, or (index only)
    the index's total less the experts' share, at the dtype the config declares."""
    trunk = [n for n in ckpt.names() if n not in expert_map.expert_names]
    if ckpt.has_weights:
        params = sum(_numel(ckpt.shape(n)) for n in trunk)
        return {"params": params, "stored_bytes": sum(ckpt.stored_nbytes(n) for n in trunk), "from": "headers"}
    total, share = ckpt.total_nbytes(), report["expert_share"]
    if not total or share is None:
        return {"params": None, "stored_bytes": None, "from": None}
    stored = round(total * (1 - share))
    per_param = _declared_bytes_per_param(ckpt.config)
    return {"params": round(stored / per_param) if per_param else None, "stored_bytes": stored,
            "from": f"estimate (index total_size less the experts, at {per_param or '?'} bytes per parameter)"}


def _declared_bytes_per_param(config: dict) -> int | None:
    for source in (config, config.get("text_config") or {}):
        declared = CONFIG_DTYPES.get(source.get("torch_dtype") or source.get("dtype"))
        if declared in ("bf16", "fp16"):
            return 2
        if declared == "fp32":
            return 4
    return None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def sizes_report(report: dict, trunk: dict | None) -> dict:
    """The trunk, and the vault's size at each depth: experts.bin (its header, then every routed expert's
    blob, aligned) plus the trunk as the vault keeps it (at source precision)."""
    shapes = {r: tuple(s) for r, s in report["expert_shapes"].items()}
    experts = report["moe_layers"] * report["experts_per_layer"]
    trunk = trunk or {"params": None, "stored_bytes": None, "from": None}
    sizes = {}
    for label, bits in DEPTHS.items():
        if bits is not None and shapes:
            experts_bytes = align(HEADER_SIZE, 4096) + experts * blob_bytes(shapes, bits)
            total = experts_bytes + trunk["stored_bytes"] if trunk["stored_bytes"] is not None else None
            sizes[label] = {"experts_bytes": experts_bytes, "total_bytes": total}
    return {"trunk": trunk, "vault_bytes": sizes}


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
        report |= model_facts(v.config, path) | sizes_report(report, vault_trunk(v))
        report["vault_bytes"]["vault"] = {"experts_bytes": (path / DATA_FILE).stat().st_size,
                                          "total_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}
    return report


def vault_trunk(v: Vault) -> dict:
    """The vault's trunk file: its parameters (from the header) and bytes."""
    if not v.trunk_path.is_file():
        return {"params": None, "stored_bytes": None, "from": None}
    entries = read_entries(v.trunk_path)
    return {"params": sum(_numel(e.shape) for e in entries.values()), "stored_bytes": v.trunk_path.stat().st_size,
            "from": "the vault's trunk file"}


def stored_depth(tensor_bits: dict[str, dict[int, int]], shapes: dict[str, tuple[int, int]]) -> str:
    """The vault's depth in words, weighing each role's tensor counts by that role's weights."""
    weights: dict[int, int] = {}
    for role, counts in tensor_bits.items():
        o, i = shapes[role]
        for b, n in counts.items():
            weights[b] = weights.get(b, 0) + n * o * i
    return codec.depth_name(weights)


def is_vault(path: Path) -> bool:
    return (path / DATA_FILE).exists() and (path / INDEX_FILE).exists()


def inspect_path(path: str | Path, disk_gbps: float = DEFAULT_DISK_GBPS, num_experts: int | None = None) -> dict:
    path = Path(path)
    if is_vault(path):
        return inspect_vault(path, disk_gbps)
    return inspect_checkpoint(path, disk_gbps, num_experts)


def at_disk_speed(report: dict, disk_gbps: float) -> dict:
    """The report with its streaming costs at another disk speed."""
    costs = streaming_costs(report["expert_bytes"], report["moe_layers"], report["experts_per_token"], disk_gbps)
    return report | {"disk_gbps": disk_gbps} | costs


def model_config(path: str | Path) -> dict:
    """config.json's dict of what inspect_path read."""
    path = Path(path)
    if is_vault(path):
        with Vault(path) as v:
            return v.config
    return open_checkpoint(path).config


def format_report(r: dict) -> str:
    lines = [
        f"family               {r['family']} (model_type {r['model_type']}, from {r['source']})",
        f"context length       {_known(r.get('context_length'))}",
        f"vocabulary           {_known(r.get('vocab_size'))}",
        f"chat template        {_yes_no(r.get('chat_template'))}",
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
    trunk = r.get("trunk") or {}
    if trunk.get("stored_bytes") is not None:
        params = f"{trunk['params']:,} params, " if trunk.get("params") is not None else ""
        lines.append(f"trunk                {params}{human_bytes(trunk['stored_bytes'])} stored ({trunk['from']})")
    if "stored_bits" in r:
        lines.append(f"depth                {r['depth']}")
        lines += stored_bits_table(r["stored_bits"])
    lines += vault_size_lines(r.get("vault_bytes") or {})
    if any(r["expert_bytes"].values()):
        lines.append(f"{'':21}{'per expert':>12}{'per token':>12}{'experts/s':>13}{'tok/s':>13}   "
                     f"(disk {r['disk_gbps']:.3g} GB/s, no cache)")
    for label, size in r["expert_bytes"].items():
        if not size:  # the config gives no expert sizes
            continue
        per_token = r["bytes_per_token_uncached"].get(label)
        tps = r["tokens_per_second_uncached"].get(label)
        lines.append(
            f"  {label:<19}{size / 1e6:>9.2f} MB{(per_token or 0) / 1e6:>9.1f} MB"
            f"{r['experts_per_second'][label]:>13,.0f}{tps or 0:>13,.1f}"
        )
    return "\n".join(lines)


def stored_bits_table(stored_bits: dict[str, dict[str, int]]) -> list[str]:
    """Expert tensors per role and depth, one row per role."""
    depths = sorted({b for counts in stored_bits.values() for b in counts}, key=int, reverse=True)
    lines = ["stored bits          " + "".join(f"{'Q' + b:>8}" for b in depths) + "   (expert tensors)"]
    for role, counts in stored_bits.items():
        lines.append(f"  {role:<19}" + "".join(f"{counts.get(b, 0):>8,}" for b in depths))
    return lines


def vault_size_lines(sizes: dict[str, dict]) -> list[str]:
    if not sizes:
        return []
    lines = [f"vault size           {'experts':>12}{'total':>12}"]
    for label, s in sizes.items():
        lines.append(f"  {label:<19}{human_bytes(s['experts_bytes']):>12}{human_bytes(s['total_bytes']):>12}")
    return lines


def human_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _known(value) -> str:
    return f"{value:,}" if value is not None else "not in the config"


def _yes_no(value: bool | None) -> str:
    return "unknown (no tokenizer files)" if value is None else ("yes" if value else "no")
