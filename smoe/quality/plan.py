"""Bit allocation: one depth per fused expert tensor, least summed KL under a size budget, solved exactly.

Each MoE layer is a group with one option per combination of depths for its two units (gate_up,
down); an option costs its honest size and is worth the sum of its units' measured KLs. The
multiple-choice knapsack is solved by dynamic programming over layers on the Pareto frontier of
(cost, KL): a partial allocation is dropped only when another one costs no more and loses no more KL,
so the result is optimal (no rounding of costs, no greedy step).

Finer units (`expert_groups` N > 1): each layer's experts are ranked by their routed calibration tokens and cut
into N groups of consecutive rank (N = the expert count: one unit per expert); a knapsack group is then (layer,
expert group) with one option per combination of depths of its two units, so gate_up and down of an expert
group may differ, and every expert's blob keeps per-tensor bits. A group's KL is its tensor's measured KL times
the group's share of the proxy (routed tokens × the encoder's weighted output error, summed over the group's
experts, smoe.quality.sensitivity.record_proxy): the shares of a tensor's groups add up to one, so an allocation
that gives every group of a tensor one depth predicts exactly what the fused unit does.

Sizes are honest: with `--budget BITS` a unit costs numel/64 groups × (64·bits + 16) bits, i.e. 4.25
or 2.25 bits per weight with the fp16 scales; with `--size GB` an option costs the exact bytes its
layer's blobs take in experts.bin, 64-byte sections and blob alignment included.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.jsonfile import read_json
from smoe.format.paths import check_outputs
from smoe.format.vault import DEFAULT_ALIGNMENT, align
from smoe.format.vault_index import blob_layout
from smoe.quality.sensitivity import UNIT_ROLES, UNITS, key, save_json

PLAN_FORMAT = "smoe-plan"


# --- the exact solver ----------------------------------------------------------------------------


def solve(groups: list[list[tuple[int, float]]], capacity: int) -> tuple[list[int], float, int]:
    """Multiple-choice knapsack: pick one (cost, value) option per group, total cost <= capacity, least
    total value. Returns (chosen option per group, value, cost); SmoeError when nothing fits."""
    import numpy as np

    cost, value = np.zeros(1, dtype=np.int64), np.zeros(1)  # the frontier: cost increasing, value strictly decreasing
    steps = []  # per group: (index into the previous frontier, option) of each state kept
    for options in groups:
        oc = np.array([c for c, _ in options], dtype=np.int64)
        ov = np.array([v for _, v in options], dtype=np.float64)
        c, v = (cost[:, None] + oc).ravel(), (value[:, None] + ov).ravel()
        prev, opt = np.divmod(np.arange(c.size), len(options))
        fits = c <= capacity
        c, v, prev, opt = c[fits], v[fits], prev[fits], opt[fits]
        if not c.size:
            raise SmoeError("no allocation fits the budget")
        order = np.lexsort((v, c))  # by cost, then value
        c, v, prev, opt = c[order], v[order], prev[order], opt[order]
        best_before = np.minimum.accumulate(np.concatenate(([np.inf], v[:-1])))
        keep = v < best_before  # beats every cheaper (or equally cheap, earlier) state
        cost, value = c[keep], v[keep]
        steps.append((prev[keep], opt[keep]))
    i, choices = len(cost) - 1, []
    total_cost, total_value = int(cost[i]), float(value[i])
    for prev, opt in reversed(steps):
        choices.append(int(opt[i]))
        i = int(prev[i])
    return choices[::-1], total_value, total_cost


# --- sizes ---------------------------------------------------------------------------------------


def blob_nbytes(shapes: dict[str, tuple[int, int]], bits: dict[str, int], bias_nbytes: dict[str, int] | None = None) -> int:
    """Bytes of one expert's blob as the vault lays it out (codes, scales, biases)."""
    tensors = [codec.encoded_nbytes(o * i, bits[role]) for role, (o, i) in shapes.items()]
    return blob_layout(tensors, list((bias_nbytes or {}).values()))[2]


def unit_bits(units: dict[str, int], roles) -> dict[str, int]:
    return {r: units[unit] for unit in UNITS for r in UNIT_ROLES[unit] if r in roles}


def depth_of(bits: int | list[int], expert: int) -> int:
    """One expert's depth of a unit: a plan gives a unit one depth, or a list of one per expert."""
    return bits if isinstance(bits, int) else bits[expert]


# --- units finer than a fused tensor -------------------------------------------------------------


def check_groups(n: int, count: int) -> None:
    """--expert-groups n for layers of `count` experts: from 1 (whole tensors) to one group per expert."""
    if not 1 <= n <= count:
        raise SmoeError(f"--expert-groups {n}: between 1 (whole tensors) and the {count} experts of a layer")


def expert_groups(table: dict, layer: int, n: int) -> list[list[int]]:
    """The layer's experts ranked by routed calibration tokens (most first, ties by index) and cut into `n` groups of
    consecutive rank, sizes differing by at most one; n = 1: every expert together (the fused unit)."""
    count = table["num_experts"]
    check_groups(n, count)
    if n == 1:
        return [list(range(count))]
    if "routed_tokens" not in table or "proxy" not in table:
        raise SmoeError("the sensitivity table has no per-expert proxy for expert groups: measure it again with "
                        "calibration statistics (a table written before expert groups existed lacks it)")
    tokens = table["routed_tokens"][str(layer)]
    ranked = sorted(range(count), key=lambda e: (-tokens[e], e))
    size, extra = divmod(count, n)
    bounds = [g * size + min(g, extra) for g in range(n + 1)]
    return [sorted(ranked[a:b]) for a, b in zip(bounds, bounds[1:])]


def group_kls(table: dict, layer: int, unit: str, bits: int, groups: list[list[int]]) -> list[float]:
    """The tensor's measured KL at `bits` shared among the groups in proportion to their proxy: routed tokens ×
    weighted output error, summed over each group's experts (evenly where the proxy is zero throughout)."""
    try:
        tensor = table["kl"][key(layer, unit, bits)]
    except KeyError as e:
        raise SmoeError(f"the sensitivity table lacks {e.args[0]} (measure it first)") from None
    if len(groups) == 1:
        return [tensor]
    tokens, errors = table["routed_tokens"][str(layer)], table["proxy"][key(layer, unit, bits)]
    weights = [sum(tokens[e] * errors[e] for e in g) for g in groups]
    total = sum(weights)
    return [tensor * w / total if total > 0 else tensor / len(groups) for w in weights]


# --- planning ------------------------------------------------------------------------------------


def layer_options(table: dict, layer: int, depths: list[int]) -> list[dict[str, int]]:
    return [dict(zip(UNITS, combo)) for combo in itertools.product(depths, repeat=len(UNITS))]


def tensor_groups(table: dict, layer: int, unit: str) -> int:
    """SMOE groups of one expert's share of a unit, each projection padded to whole groups."""
    shapes = table.get("expert_shapes")
    if shapes:
        return sum(codec.num_groups(o * i) for r, (o, i) in shapes.items() if r in UNIT_ROLES[unit])
    return codec.num_groups(table["numel"][f"{layer}.{unit}"] // table["num_experts"])


def bits_cost(table: dict, layer: int, units: dict[str, int], experts: int | None = None) -> int:
    """Storage bits of a layer's units at the given depths, for `experts` of its experts (default all):
    groups × (64·bits + 16)."""
    count = table["num_experts"] if experts is None else experts
    return count * sum(tensor_groups(table, layer, u) * (codec.GROUP_SIZE * b + 16) for u, b in units.items())


def bytes_cost(table: dict, layer: int, units: dict[str, int], alignment: int, experts: int | None = None) -> int:
    """Bytes in experts.bin of `experts` of the layer's blobs (default all) with their units at the given depths."""
    shapes = {r: tuple(s) for r, s in table["expert_shapes"].items()}
    blob = blob_nbytes(shapes, unit_bits(units, shapes), table.get("bias_nbytes"))
    return (table["num_experts"] if experts is None else experts) * align(blob, alignment)


def per_expert(table: dict, units: dict[str, int | list[int]]) -> dict[tuple, int]:
    """Experts per combination of depths (one per unit, in UNITS order) of a layer's chosen units."""
    counts: dict[tuple, int] = {}
    for e in range(table["num_experts"]):
        combo = tuple(depth_of(units[u], e) for u in UNITS)
        counts[combo] = counts.get(combo, 0) + 1
    return counts


def experts_file_bytes(table: dict, chosen: dict[int, dict[str, int | list[int]]],
                       alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Exact size of experts.bin: the header block plus every layer's aligned blobs."""
    return alignment + sum(bytes_cost(table, layer, dict(zip(UNITS, combo)), alignment, n)
                           for layer, units in chosen.items() for combo, n in per_expert(table, units).items())


def storage_bits(table: dict, chosen: dict[int, dict[str, int | list[int]]]) -> int:
    return sum(bits_cost(table, layer, dict(zip(UNITS, combo)), n)
               for layer, units in chosen.items() for combo, n in per_expert(table, units).items())


def total_weights(table: dict) -> int:
    return sum(table["numel"].values())


def make_plan(table: dict, budget_bits: float | None = None, size_gb: float | None = None,
              alignment: int = DEFAULT_ALIGNMENT, groups: int = 1) -> dict:
    """The least-KL depth per (layer, unit, expert group) within the budget; exactly one of budget_bits / size_gb;
    `groups`: expert groups per layer (1: the fused tensors)."""
    if (budget_bits is None) == (size_gb is None):
        raise SmoeError("give exactly one of --budget BITS and --size GB")
    check_budget(table, budget_bits, size_gb, alignment)
    depths = sorted(table["depths"])
    layers = table["moe_layers"]
    members = {layer: expert_groups(table, layer, groups) for layer in layers}
    options = layer_options(table, layers[0], depths)
    kls = {(layer, u, b): group_kls(table, layer, u, b, members[layer]) for layer in layers for u in UNITS for b in depths}
    if budget_bits is not None:
        cost = lambda layer, units, n: bits_cost(table, layer, units, n)
        capacity = math.floor(budget_bits * total_weights(table) + 1e-9)
    else:
        cost = lambda layer, units, n: bytes_cost(table, layer, units, alignment, n)
        capacity = math.floor(size_gb * 1e9) - alignment
    units = [(layer, g) for layer in layers for g in range(len(members[layer]))]
    choices, predicted, _ = solve([[(cost(layer, o, len(members[layer][g])), sum(kls[(layer, u, b)][g] for u, b in o.items()))
                                    for o in options] for layer, g in units], capacity)
    depth = {(layer, u): [0] * table["num_experts"] for layer in layers for u in UNITS}
    for (layer, g), i in zip(units, choices):
        for u, b in options[i].items():
            for e in members[layer][g]:
                depth[(layer, u)][e] = b
    chosen = {layer: {u: collapse(depth[(layer, u)]) for u in UNITS} for layer in layers}
    doc = plan_document(table, chosen, predicted, budget_bits, size_gb, alignment)
    if groups > 1:
        doc["expert_groups"] = {"count": groups, "members": {str(layer): members[layer] for layer in layers}}
    return doc


def collapse(depths: list[int]) -> int | list[int]:
    """One depth where every expert has it, else the list."""
    return depths[0] if len(set(depths)) == 1 else depths


def check_budget(table: dict, budget_bits: float | None, size_gb: float | None, alignment: int) -> None:
    """A budget below the all-shallowest or above the all-deepest allocation is a mistake, not a plan."""
    depths = sorted(table["depths"])
    if budget_bits is not None:
        low, high = codec.bits_per_weight(depths[0]), codec.bits_per_weight(depths[-1])
        if not low - 1e-9 <= budget_bits <= high + 1e-9:
            raise SmoeError(f"--budget {budget_bits:g} bits/weight is outside the depths' range: {low} (all SMOE-Q{depths[0]}) "
                            f"to {high} (all SMOE-Q{depths[-1]}), scales included")
        return
    every = lambda b: {layer: {u: b for u in UNITS} for layer in table["moe_layers"]}
    low = experts_file_bytes(table, every(depths[0]), alignment) / 1e9
    high = experts_file_bytes(table, every(depths[-1]), alignment) / 1e9
    if not low - 1e-12 <= size_gb <= high + 1e-12:
        raise SmoeError(f"--size {size_gb:g} GB is outside the depths' range for experts.bin: {low:.6g} GB "
                        f"(all SMOE-Q{depths[0]}) to {high:.6g} GB (all SMOE-Q{depths[-1]})")


def plan_document(table, chosen, predicted, budget_bits, size_gb, alignment) -> dict:
    weights = total_weights(table)
    stored = storage_bits(table, chosen)
    return {
        "format": PLAN_FORMAT, "version": 1,
        "model_type": table["model_type"], "moe_layers": table["moe_layers"], "num_experts": table["num_experts"],
        "expert_shapes": table["expert_shapes"], "encoder": table["encoder"],
        "budget": {"bits_per_weight": budget_bits} if budget_bits is not None else {"gb": size_gb},
        "tensors": {f"{layer}.{u}": b for layer, units in chosen.items() for u, b in units.items()},
        "predicted_kl": predicted,
        "bits_per_weight": stored / weights,
        "expert_weights": weights,
        "predicted_bytes": stored // 8,
        "experts_file_bytes": experts_file_bytes(table, chosen, alignment),
    }


def load_plan(source: str | Path | dict) -> dict:
    if isinstance(source, dict):
        return source
    path = Path(source)
    if not path.is_file():
        raise SmoeError(f"{path}: no such plan file")
    doc = read_json(path)
    if doc.get("format") != PLAN_FORMAT or not isinstance(doc.get("tensors"), dict):
        raise SmoeError(f"{path}: not an smoe plan (written by `smoe plan`)")
    return doc


def role_bits(doc: dict, expert_map) -> dict[tuple[int, str], int]:
    """A plan document checked against the model: (layer, role) -> bits, or a tuple of one per expert where the
    plan's units are expert groups; gate and up always equal."""
    shapes = {r: list(s) for r, s in expert_map.expert_shapes().items()}
    if doc.get("moe_layers") != expert_map.moe_layers or doc.get("num_experts") != expert_map.num_experts or \
            (doc.get("expert_shapes") and doc["expert_shapes"] != shapes):
        raise SmoeError(f"the plan does not match the model: it is for {doc.get('model_type')} with MoE layers "
                        f"{doc.get('moe_layers')}, {doc.get('num_experts')} experts, shapes {doc.get('expert_shapes')}; "
                        f"the model has {expert_map.moe_layers}, {expert_map.num_experts}, {shapes}")
    want = {f"{layer}.{u}" for layer in expert_map.moe_layers for u in UNITS}
    if set(doc["tensors"]) != want:
        odd = sorted(set(doc["tensors"]) ^ want)
        raise SmoeError(f"the plan does not match the model: tensors {odd[:4]} are missing or unknown")
    bits = {}
    for name, b in doc["tensors"].items():
        per = [b] if isinstance(b, int) else b
        if not isinstance(per, list) or (len(per) != 1 and len(per) != expert_map.num_experts) or \
                any(x not in codec.DEPTHS or isinstance(x, bool) for x in per):
            raise SmoeError(f"the plan gives {name} {b} bits; SMOE supports {codec.DEPTHS}, one for the tensor or "
                            f"one per expert ({expert_map.num_experts})")
        layer, unit = name.split(".")
        for role in UNIT_ROLES[unit]:
            if role in expert_map.roles:
                bits[(int(layer), role)] = b if isinstance(b, int) else tuple(b)
    return bits


def table_for_model(table: dict, expert_map, bias_nbytes: dict[str, int] | None = None) -> dict:
    """The sensitivity table with the model facts sizes need."""
    return table | {"expert_shapes": {r: list(s) for r, s in expert_map.expert_shapes().items()},
                    "bias_nbytes": bias_nbytes or {}}


# --- output --------------------------------------------------------------------------------------


def format_plan(doc: dict, table: dict) -> str:
    lines = [f"{'layer':>5}  {'unit':<8}{'weights':>12}  {'KL@Q2':>10}  {'KL@Q4':>10}  depth"]
    for name, b in doc["tensors"].items():
        layer, unit = name.split(".")
        kl = {d: table["kl"].get(key(int(layer), unit, d)) for d in table["depths"]}
        lines.append(f"{layer:>5}  {unit:<8}{table['numel'][name]:>12,}  {fmt(kl.get(2))}  {fmt(kl.get(4))}  {depth_label(b)}")
    budget = doc["budget"]
    asked = f"{budget['bits_per_weight']:g} bits/weight" if "bits_per_weight" in budget else f"{budget['gb']:g} GB"
    shared = ", shared among expert groups by the proxy" if "expert_groups" in doc else ""
    lines += [
        f"budget    {asked}",
        f"predicted KL {doc['predicted_kl']:.5f} (sum of per-tensor KLs{shared})",
        f"size      {doc['bits_per_weight']:.4f} bits/weight incl. scales: {doc['predicted_bytes'] / 1e6:,.3f} MB of codes "
        f"and scales; experts.bin {doc['experts_file_bytes'] / 1e6:,.3f} MB with alignment",
    ]
    return "\n".join(lines)


def depth_label(bits: int | list[int]) -> str:
    """"Q4", or for a tensor whose experts differ the experts at each depth: "Q4 ×9, Q2 ×23"."""
    if isinstance(bits, int):
        return f"Q{bits}"
    return ", ".join(f"Q{b} ×{bits.count(b)}" for b in sorted(set(bits), reverse=True))


def fmt(x) -> str:
    return f"{x:10.5f}" if x is not None else f"{'-':>10}"


def write_heatmap(doc: dict, table: dict, path: str | Path, measured_kl: float | None = None) -> Path:
    """PNG: layers × units, colour = KL at the shallowest depth, each cell labelled with the chosen depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers, low = table["moe_layers"], min(table["depths"])
    grid = np.array([[table["kl"][key(layer, u, low)] for u in UNITS] for layer in layers])
    fig, ax = plt.subplots(figsize=(4.5, 1.2 + 0.35 * len(layers)))
    image = ax.imshow(grid, aspect="auto", cmap="magma_r", norm=matplotlib.colors.LogNorm())
    for r, layer in enumerate(layers):
        for c, u in enumerate(UNITS):
            ax.text(c, r, depth_label(doc["tensors"][f"{layer}.{u}"]).replace(", ", "\n"), ha="center", va="center",
                    color="white" if grid[r, c] > np.sqrt(grid.max() * grid.min()) else "black", fontsize=8)
    ax.set_xticks(range(len(UNITS)), UNITS)
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_ylabel("MoE layer")
    fig.colorbar(image, ax=ax, label=f"KL with this tensor alone at Q{low}")
    title = f"{doc['bits_per_weight']:.3f} bits/weight, predicted KL {doc['predicted_kl']:.4f}"
    if measured_kl is not None:
        title += f"\nmeasured KL {measured_kl:.4f} (vault, same windows)"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def plan_outputs(plan: Path, sensitivity: Path) -> list[Path]:
    """Every file `plan_model` writes: the plan, its heatmap, the sensitivity table, the calibration statistics,
    and their temporaries."""
    from smoe.convert.calibrate import checksum_path

    heatmap = plan.with_suffix(".png")
    stats = stats_path(plan)
    return [plan, heatmap, sensitivity, stats, checksum_path(stats),
            *(p.with_name(p.name + ".tmp") for p in (plan, sensitivity, stats)), heatmap.with_name(heatmap.stem + ".tmp.png")]


def check_replaceable(plan: Path, sensitivity: Path) -> None:
    """Before any work: the plan and its table are files that are absent or a plan's own (a plan run again
    replaces its plan and resumes its table), never a directory or another file, which would be lost. The
    heatmap beside the plan is replaced only with that plan: an image there without it is someone else's."""
    for path, kind in ((plan, "smoe-plan"), (sensitivity, None)):
        if path.is_dir():
            raise SmoeError(f"{path}: is a directory (a plan is a file: give -o DIR/plan.json)")
        if kind and path.exists() and not is_document(path, kind):
            raise SmoeError(f"{path}: exists and is not a smoe plan; not replaced (remove it or choose another -o)")
    heatmap = plan.with_suffix(".png")
    if os.path.lexists(heatmap) and (not heatmap.is_file() or heatmap.is_symlink() or not plan.exists()):
        raise SmoeError(f"{heatmap}: exists and is not the heatmap of a smoe plan at {plan}; not replaced (remove it "
                        f"or choose another -o)")


def is_document(path: Path, kind: str) -> bool:
    try:
        return json.loads(path.read_bytes()).get("format") == kind
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        return False


def stats_path(plan: Path) -> Path:
    """Where a plan keeps the calibration statistics it measured with, for `quantize --plan` to reuse."""
    return plan.with_name(plan.stem + ".calibration.pt")


def calibration_stats(model_dir, calib, tokens: int, path: Path, progress: bool = True, collected: bool = False):
    """The expert inputs' second moments on the calibration text: those kept at `path` when they were collected
    from this model, text and token count, else collected now (and kept there when `collected`)."""
    from smoe.convert import calibrate
    from smoe.quality.sensitivity import fingerprint

    source = fingerprint(model_dir, "calibration", calibrate.file_hash(calib), tokens)
    stats = calibrate.CalibrationStats.load(path, source) if path.is_file() else None
    if stats is not None:
        print(f"smoe: notice: reusing the calibration statistics in {path}", file=sys.stderr)
        return stats
    stats = calibrate.collect(model_dir, calib, tokens, progress=progress)
    if collected:
        stats.save(path, source)
    return stats


def write_plan(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    save_json(path, doc)
    return path


# --- end to end ----------------------------------------------------------------------------------


def plan_model(model_dir, calib, out: str | Path, budget_bits: float | None = None, size_gb: float | None = None,
               encoder: str = "grid", sensitivity: str | Path | None = None, tokens: int | None = None,
               alignment: int = DEFAULT_ALIGNMENT, progress: bool = True, need_meter: bool = False,
               cluster: str | None = None, groups: int = 1, layer_by_layer: bool = False):
    """Calibrate, measure (or resume) the sensitivity table, solve, write plan.json and its heatmap.
    Returns (plan document, table, KL meter, calibration stats); the meter is None when the table was complete
    already or its trials ran on a cluster, and `need_meter` is false; the statistics when the table was complete.
    `cluster`: the trials on a Ray cluster (sensitivity.measure). `groups`: expert groups per layer (make_plan);
    above 1 they need the calibration statistics whatever the encoder (routed tokens and weighted errors).
    `layer_by_layer`: the trials in one pass over the source run one layer at a time, and a calibrated encoder's
    statistics streamed a layer at a time (neither holds the whole model: models bigger than memory); the
    statistics are then not kept beside the plan, and expert groups, which need all of them, are refused."""
    from smoe.convert import calibrate, encoders
    from smoe.hf.gguf import check_calibratable
    from smoe.quality.sensitivity import (
        SENSITIVITY_WINDOWS,
        KLMeter,
        QuantisedModel,
        fingerprint,
        load_table,
        measure,
        unit_sizes,
    )
    from smoe.source.checkpoint import Checkpoint
    from smoe.source.matching import map_experts

    if (budget_bits is None) == (size_gb is None):
        raise SmoeError("give exactly one of --budget BITS and --size GB")
    check_calibratable(model_dir)
    encoders.check_encoder(encoder)
    if layer_by_layer and (cluster is not None or need_meter or groups > 1):
        what = "--ray" if cluster is not None else "--expert-groups" if groups > 1 else "a budget to quantize with"
        raise SmoeError(f"the layer-by-layer sweep runs on this machine and holds no whole model or calibration: "
                        f"{what} needs them (plan with `smoe plan --layer-by-layer`, then `smoe quantize --plan`)")
    if cluster is not None:
        from smoe.quality import fanout

        fanout.check_cluster(cluster)
    check_outputs([out], [])  # an empty path first: the names beside it are made from its own
    out = Path(out)
    sensitivity = Path(sensitivity) if sensitivity else out.with_name(out.stem + ".sensitivity.json")
    check_outputs(plan_outputs(out, sensitivity), [model_dir, calib])
    if not out.parent.is_dir():
        raise SmoeError(f"{out.parent}: no such directory for the plan")
    check_replaceable(out, sensitivity)
    ckpt = Checkpoint(model_dir)
    moe = map_experts(ckpt.config, ckpt.names())
    skeleton = {"depths": list(codec.DEPTHS), "moe_layers": moe.moe_layers, "num_experts": moe.num_experts,
                "numel": unit_sizes(moe), "expert_shapes": {r: list(s) for r, s in moe.expert_shapes().items()}}
    check_budget(skeleton, budget_bits, size_gb, alignment)  # before any work
    check_groups(groups, moe.num_experts)
    tokens = tokens or calibrate.DEFAULT_TOKENS
    windows = calibrate.calibration_windows(model_dir, calib, tokens)[:SENSITIVITY_WINDOWS]
    fp = fingerprint(model_dir, encoder, calibrate.file_hash(calib), tokens) + f"-{len(windows)}"
    table = load_table(sensitivity, fp)
    wanted = {key(layer, u, b) for layer in moe.moe_layers for u in UNITS for b in codec.DEPTHS}
    stats = meter = None
    no_proxy = groups > 1 and ("routed_tokens" not in table or wanted - set(table.get("proxy", {})))
    if wanted - set(table["kl"]) or need_meter or no_proxy:  # a complete table needs no model run
        if layer_by_layer and encoder in encoders.NEEDS_CALIBRATION:
            stats = calibrate.StreamedStats(model_dir, calib, tokens, progress=progress)
        elif encoder in encoders.NEEDS_CALIBRATION or groups > 1:
            stats = calibration_stats(model_dir, calib, tokens, stats_path(out), progress, collected=True)
        qm = QuantisedModel(model_dir, encoder, stats)
        # the source model runs here only for the trials run here, or for the caller's meter
        whole = (cluster is None and not layer_by_layer and wanted - set(table["kl"])) or need_meter
        meter = KLMeter(qm, windows) if whole else None
        table = measure(qm, windows, sensitivity, fp, progress=progress, meter=meter, cluster=cluster,
                        proxy=not layer_by_layer and (groups > 1 or cluster is None), layer_by_layer=layer_by_layer)
        stats = None if layer_by_layer else stats
    table = table_for_model(table, moe, bias_sizes(ckpt, moe))
    doc = make_plan(table, budget_bits, size_gb, alignment, groups) | {"sensitivity": str(sensitivity),
                                                                        "calibration": calibration_record(calib, tokens)}
    write_plan(doc, out)
    write_heatmap(doc, table, out.with_suffix(".png"))
    return doc, table, meter, stats


def calibration_record(calib, tokens: int) -> dict:
    """What `quantize --plan` needs to calibrate a calibrated encoder as the plan did: the text and its size
    (the statistics themselves are kept beside the plan, stats_path)."""
    from smoe.convert.calibrate import file_hash

    return {"file": str(Path(calib).resolve()), "hash": file_hash(calib), "tokens": tokens}


def bias_sizes(ckpt, moe) -> dict[str, int]:
    """Bytes of one expert's biases per role (gpt-oss), from the checkpoint's headers."""
    from smoe.convert.sculpt import nbytes_of

    sizes = {}
    for b in moe.biases.get(next(iter(moe.experts)), []):
        n = nbytes_of(ckpt, b.name)
        sizes[b.role] = n // (moe.num_experts if b.expert_index is not None else 1) // b.parts
    return sizes
