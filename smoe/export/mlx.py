"""`smoe export VAULT --to mlx`: a model directory that mlx-lm loads, experts in MLX affine form.

MLX's affine quantisation stores w = scale·q + bias per group, q packed LSB-first into uint32. SMOE
is that with scale = s/h and bias = −s (h = 7.5 at Q4, 1.5 at Q2), the same codes. Each MoE layer's
experts become mlx-lm's fused `switch_mlp.{gate,up,down}_proj` ([E, out, in·bits/32] uint32, scales
and biases [E, out, in/group] in fp16), listed one by one with an explicit `mode` under
`quantization` in config.json. Where a row is not a multiple of 64 wide (SMOE groups then run
across rows) the group is 32 and each SMOE scale is written twice, which stays exact. The trunk
keeps the vault's precision and Hugging Face names, which mlx-lm's models read as they are. Which families,
where each model file keeps its experts and what it computes: smoe.export.mlx_families. Experts with
biases (gpt-oss) keep them as `bias` [E, out] beside the quantised weight, as mlx-lm's switch layers read them;
where the model file keeps one Linear per expert (DBRX) each expert is written alone, [out, …]. Ungated experts
(Nemotron-H's relu²) have the vault's up and down roles only, written under the row's names (SwitchMLP's fc1, fc2).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from smoe.export import mlx_families
from smoe.export.mlx_families import MlxFamily
from smoe.export.source import ExpertTensor, ExportSource, Planned, produce, require, scales_over
from smoe.format import codec
from smoe.format.dtypes import FLOATS, SAFETENSORS_NAMES
from smoe.format.safetensors_io import write_stream
from smoe.format.vault import COPIED_FILES
from smoe.source.description import describe_model

SHARD_BYTES = 5 * 2**30
SAFETENSORS_DTYPES = {t: SAFETENSORS_NAMES[t] for t in FLOATS.values()}
ROLES = ("gate", "up", "down")  # the order of a row's projections


def write_mlx(source: ExportSource, out: Path, progress: bool = False, shard_bytes: int = SHARD_BYTES) -> None:
    name, config = source.model_type, source.vault.config
    row = mlx_families.family(name)
    desc = describe_model(config)
    shapes = {key: source.trunk_shape(key) for key in source.trunk_names()}
    mlx_families.check(name, config, desc, source.meta["moe_layers"], shapes, source.expert_shape(source.roles[0])[0])
    require(row.expert_biases or not source.has_biases, f"{name}: experts with biases are not exported to MLX")
    out.mkdir(parents=True)
    quantization = {"group_size": codec.GROUP_SIZE, "bits": source.vault.bits, "mode": "affine"}
    plan = trunk_plan(source, row) + experts_plan(source, row, quantization)
    write_shards(out, plan, progress, shard_bytes)
    args = mlx_families.model_args(name, config, desc, source.meta["moe_layers"]) | {"quantization": quantization}
    (out / "config.json").write_text(json.dumps(args, indent=2))
    for copied in COPIED_FILES:
        if copied != "config.json" and (source.dir / copied).exists():
            shutil.copyfile(source.dir / copied, out / copied)


# --- tensors -------------------------------------------------------------------------------------


def trunk_plan(source: ExportSource, row: MlxFamily) -> list[Planned]:
    plan = []
    for key in source.trunk_names():
        if key.endswith("rotary_emb.inv_freq") or row.drops and re.search(row.drops, key):
            continue
        t_dtype = source.trunk_dtype(key)
        require(t_dtype in SAFETENSORS_DTYPES, f"trunk tensor {key}: {t_dtype} is not exported to MLX")
        name = renamed(key, row)
        shape = source.trunk_shape(key)
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=t_dtype).element_size()
        change, reshaped = mlx_families.edit(row, key) or (lambda t: t, lambda s: s)
        load = lambda key=key, change=change: change(source.trunk_tensor(key)).contiguous().view(torch.uint8).numpy()
        plan.append(Planned(name, SAFETENSORS_DTYPES[t_dtype], tuple(reshaped(shape)), nbytes, load))
    return plan


def renamed(key: str, row: MlxFamily) -> str:
    """A Hugging Face tensor or module name as the family's mlx-lm model file names it."""
    for pattern, repl in row.renames:
        key = re.sub(pattern, repl, key)
    return key


def group_width(inp: int) -> int | None:
    """MLX group size that holds SMOE's groups exactly: 64, or 32 (half groups) when rows cut groups."""
    return 64 if inp % 64 == 0 else 32 if inp % 32 == 0 else None


def experts_plan(source: ExportSource, row: MlxFamily, quantization: dict) -> list[Planned]:
    plan = []
    for layer in source.meta["moe_layers"]:
        for expert in range(source.num_experts) if row.per_expert else (None,):
            for role in source.roles:
                module = expert_module(row, layer, role, expert)
                plan += role_plan(source, layer, role, module, quantization, expert)
                if row.expert_biases:
                    plan.append(bias_plan(source, layer, role, module))
    return plan


def expert_module(row: MlxFamily, layer: int, role: str, expert: int | None = None) -> str:
    """Where mlx-lm's model keeps `role` of `layer`'s experts: the fused switch layer, or expert `expert`'s own."""
    experts = row.experts if expert is None else f"{row.experts}.{expert}"
    return renamed(f"model.layers.{layer}.{experts}.{dict(zip(ROLES, row.projections))[role]}", row)


def role_plan(source: ExportSource, layer: int, role: str, module: str, quantization: dict,
              expert: int | None = None) -> list[Planned]:
    """One projection of every expert of `layer` (of expert `expert` alone where given): weight, scales and
    biases of MLX's affine form."""
    (out, inp), width = source.expert_shape(role), group_width(source.expert_shape(role)[1])
    lead = (source.num_experts,) if expert is None else ()
    get = lambda: source.experts(layer, role) if expert is None else source.experts(layer, role)[expert:expert + 1]
    stack = np.stack if expert is None else (lambda arrays: arrays[0])
    count = int(np.prod(lead))
    if width is None:  # rows too narrow for any MLX group: written decoded (toy sizes only)
        load = lambda: stack([e.decoded() for e in get()])
        return [Planned(f"{module}.weight", "F32", (*lead, out, inp), count * out * inp * 4, load)]
    bits = source.role_bits(layer, role)  # a mixed-depth layer's Q2 codes fit 4-bit slots too
    quantization[module] = {"group_size": width, "bits": bits, "mode": "affine"}
    words, groups = (*lead, out, inp * bits // 32), (*lead, out, inp // width)
    return [
        Planned(f"{module}.weight", "U32", words, 4 * int(np.prod(words)),
                lambda: stack([pack_uint32(e, bits) for e in get()])),
        Planned(f"{module}.scales", "F16", groups, 2 * int(np.prod(groups)),
                lambda: stack([scale_bias(e, width)[0] for e in get()])),
        Planned(f"{module}.biases", "F16", groups, 2 * int(np.prod(groups)),
                lambda: stack([scale_bias(e, width)[1] for e in get()])),
    ]


def bias_plan(source: ExportSource, layer: int, role: str, module: str) -> Planned:
    """The experts' own biases [E, out] in fp32 (what mlx-lm's switch layers add after the product)."""
    shape = (source.num_experts, source.expert_shape(role)[0])
    load = lambda: torch.stack(source.expert_biases(layer, role)).float().numpy()
    return Planned(f"{module}.bias", "F32", shape, 4 * int(np.prod(shape)), load)


def pack_uint32(expert: ExpertTensor, bits: int) -> np.ndarray:
    """Codes [out, in] -> uint32 [out, in·bits/32], code k of a word in bits k·bits … (LSB first)."""
    out, inp = expert.shape
    per_word = 32 // bits
    q = expert.codes[: out * inp].astype(np.uint32).reshape(out, inp // per_word, per_word)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(q << shifts, axis=2)


def scale_bias(expert: ExpertTensor, width: int) -> tuple[np.ndarray, np.ndarray]:
    """fp16 (scale, bias) = (s/h, −s) per group of `width`, [out, in/width]."""
    out, inp = expert.shape
    s = scales_over(expert, width).astype(np.float64).reshape(out, inp // width)
    return (s / codec.half_range(expert.bits)).astype(np.float16), (-s).astype(np.float16)


# --- safetensors shards --------------------------------------------------------------------------


def shards(plan: list[Planned], limit: int = SHARD_BYTES) -> list[list[Planned]]:
    """Consecutive runs of tensors, each run at most `limit` bytes (a larger tensor sits alone)."""
    runs, size = [[]], 0
    for p in plan:
        if runs[-1] and size + p.nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += p.nbytes
    return runs


def write_shards(out: Path, plan: list[Planned], progress: bool, limit: int) -> None:
    runs = shards(plan, limit)
    names = ["model.safetensors"] if len(runs) == 1 else [
        f"model-{i + 1:05d}-of-{len(runs):05d}.safetensors" for i in range(len(runs))]
    data = produce(plan, progress)
    for name, run in zip(names, runs):
        write_safetensors(out / name, run, data)
    index = {"metadata": {"total_size": sum(p.nbytes for p in plan)},
             "weight_map": {p.name: name for name, run in zip(names, runs) for p in run}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_safetensors(path: Path, run: list[Planned], data) -> None:
    """Header from the plan, then each tensor's bytes as `data` yields them (one tensor in memory)."""

    def write_data(f) -> None:
        for _ in run:
            next(data)[1].tofile(f)

    write_stream(path, [(p.name, p.dtype, p.shape, p.nbytes) for p in run], {"format": "mlx"}, write_data)
