"""Sensitivity: what quantising one fused expert tensor costs the model, measured as KL divergence.

The unit is what one fused kernel serves and the expert_map decides: per MoE layer, "gate_up" (gate and up
of every expert, or up alone for experts without a gate) and "down". For each unit and depth the
source model (fp32, in memory) gets that unit's weights replaced by their decoded SMOE values, runs the
first SENSITIVITY_WINDOWS calibration windows, and KL(source ‖ quantised) averaged over positions is
recorded; then the source
weights go back. Results are written to sensitivity.json after each measurement, so an interrupted
run resumes where it stopped.

While the sweep encodes each unit it also records, per expert and depth, the encoder's output error weighted by
the calibration's second moment of that expert's inputs (trace(ΔW H ΔWᵀ), H = E[x xᵀ] over the tokens routed to
it) and each expert's routed token count: the cheap proxy by which finer plan units (smoe.quality.plan's expert
groups) share a measured tensor KL among the experts of the tensor, with no further model pass.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
from pathlib import Path

import torch

from smoe.convert import encoders
from smoe.convert.calibrate import CalibrationStats, load_source_model
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.jsonfile import read_json
from smoe.hf.experts import UNIT_PARAMETERS, expert_parameters
from smoe.progress import bar as progress_bar
from smoe.source.checkpoint import Checkpoint
from smoe.source.loading import load_bias, load_projection
from smoe.source.matching import map_experts

SENSITIVITY_WINDOWS = 8  # calibration windows (of 512 tokens) that each (tensor, depth) measurement runs
UNITS = ("gate_up", "down")
UNIT_ROLES = {"gate_up": ("gate", "up"), "down": ("down",)}


def key(layer: int, unit: str, bits: int) -> str:
    return f"{layer}.{unit}.{bits}"


class QuantisedModel:
    """The source model in fp32 whose fused expert tensors can be swapped for quantised ones and back. The model
    is loaded when first needed: a sweep whose trials run on a cluster's workers needs only its expert map here."""

    def __init__(self, model_dir, encoder: str = "grid", stats: CalibrationStats | None = None):
        encoders.check_encoder(encoder)
        if encoder in encoders.NEEDS_CALIBRATION and stats is None:
            raise SmoeError(f"the {encoder} encoder needs calibration statistics (--calib FILE)")
        self.encoder, self.stats = encoder, stats
        self.ckpt = Checkpoint(model_dir)
        self.expert_map = map_experts(self.ckpt.config, self.ckpt.names())
        # decoded [out, in] weights by (layer, expert, role, bits), filled as units are encoded, and the encoder's
        # weighted output error trace(ΔW H ΔWᵀ) of each (record_proxy)
        self.cache: dict[tuple[int, int, str, int], torch.Tensor] = {}
        self.errors: dict[tuple[int, int, str, int], float] = {}

    @functools.cached_property
    def loaded(self) -> tuple:
        """(the transformers model, its experts modules by layer, their source parameters by layer)."""
        with torch.inference_mode(False):  # first needed inside log_probs: normal tensors, as at any other load
            model, modules = load_source_model(self.ckpt.dir)
        missing = set(self.expert_map.moe_layers) - set(modules)
        if missing:
            raise SmoeError(f"the model has no experts module for MoE layers {sorted(missing)}")
        original = {layer: {n: p.data for n, p in m.named_parameters(recurse=False)} for layer, m in modules.items()}
        return model, modules, original

    @property
    def model(self):
        return self.loaded[0]

    @property
    def modules(self) -> dict:
        return self.loaded[1]

    @property
    def original(self) -> dict:
        return self.loaded[2]

    def units(self) -> list[tuple[int, str]]:
        return [(layer, unit) for layer in self.expert_map.moe_layers for unit in UNITS]

    def decoded(self, layer: int, unit: str, bits: int | list[int | None], module=None) -> dict[str, torch.Tensor]:
        """The parameters of `module` (default: the loaded model's experts module of `layer`) for `unit` with every
        expert (or each at its own depth of a list, None: the source's) encoded and decoded."""
        module = self.modules[layer] if module is None else module
        depths = bits if isinstance(bits, list) else [bits] * self.expert_map.num_experts
        experts, biases = [], []
        for e, depth in enumerate(depths):
            sources = self.expert_map.experts[(layer, e)]
            weights = {s.role: load_projection(self.ckpt, s).float() for s in sources}
            for role in UNIT_ROLES[unit]:
                if role in weights and depth is not None:
                    weights[role] = self.expert_weight(layer, e, role, depth, weights[role])
            experts.append(weights)
            biases.append({b.role: load_bias(self.ckpt, b).float() for b in self.expert_map.biases.get((layer, e), [])})
        params = expert_parameters(module, experts, biases)
        return {n: p for n, p in params.items() if n in UNIT_PARAMETERS[unit]}

    def expert_weight(self, layer: int, expert: int, role: str, bits: int, w: torch.Tensor) -> torch.Tensor:
        """One projection encoded at `bits` and decoded (cached), its weighted error recorded."""
        k = (layer, expert, role, bits)
        if k not in self.cache:
            moment = self.stats.second_moment(layer, expert, role) if self.stats is not None else None
            codes, scales = encoders.encode(w, bits, self.encoder, moment if self.encoder != "grid" else None,
                                            name=f"layer {layer} expert {expert} {role}")
            self.cache[k] = codec.decode(codes, scales, bits, tuple(w.shape))
            if moment is not None:
                delta = (self.cache[k] - w).double()
                self.errors[k] = float(((delta @ moment.double()) * delta).sum())
        return self.cache[k]

    def set(self, layer: int, unit: str, bits: int | list[int | None] | None) -> None:
        """Put `unit` of `layer` at `bits`: one depth, a depth per expert (None: that expert's source weights), or
        None (the source weights)."""
        params = self.decoded(layer, unit, bits) if bits is not None else \
            {n: p for n, p in self.original[layer].items() if n in UNIT_PARAMETERS[unit]}
        put_parameters(self.modules[layer], layer, params)

    def forget(self, layer: int) -> None:
        """Drop the decoded weights of `layer` (their weighted errors stay)."""
        for k in [k for k in self.cache if k[0] == layer]:
            del self.cache[k]

    def set_plan(self, bits: dict[tuple[int, str], int | None]) -> None:
        for (layer, unit), b in bits.items():
            self.set(layer, unit, b)

    @torch.inference_mode()
    def log_probs(self, window: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model(input_ids=window, use_cache=False).logits[0, :-1].double(), dim=-1)


def put_parameters(module, layer: int, params: dict[str, torch.Tensor]) -> None:
    for name, value in params.items():
        if tuple(getattr(module, name).shape) != tuple(value.shape):
            raise SmoeError(f"layer {layer}: {name} is {tuple(getattr(module, name).shape)}, decoded "
                            f"{tuple(value.shape)}")
        getattr(module, name).data = value.to(getattr(module, name).dtype)


class KLMeter:
    """KL(source ‖ current model) over fixed windows; the source's log-probabilities computed once."""

    def __init__(self, qm: QuantisedModel, windows: list[torch.Tensor]):
        self.qm, self.windows = qm, windows
        self.reference = [qm.log_probs(w) for w in windows]

    def kl(self) -> float:
        total = count = 0.0
        for window, ref in zip(self.windows, self.reference):
            lp = self.qm.log_probs(window)
            total += float((ref.exp() * (ref - lp)).sum())
            count += ref.shape[0]
        return total / count


def fingerprint(model_dir, encoder: str, calib_hash: str, tokens: int) -> str:
    """What a sensitivity table depends on: the model's config and weights' headers, encoder, calibration."""
    from smoe.convert.sculpt import source_fingerprint

    ckpt = Checkpoint(model_dir)
    h = hashlib.sha256(f"{source_fingerprint(ckpt, 0, encoder, 0)}|{calib_hash}|{tokens}".encode())
    return h.hexdigest()[:16]


def load_table(path: Path, fp: str) -> dict:
    if not path.exists():
        return {"fingerprint": fp, "kl": {}}
    table = read_json(path)
    if table.get("fingerprint") != fp:
        raise SmoeError(f"{path}: measured for another model, encoder or calibration "
                        "(remove it or pass another --sensitivity path)")
    return table


def save_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def measure(qm: QuantisedModel, windows: list[torch.Tensor], path: str | Path, fp: str,
            depths: tuple[int, ...] = codec.DEPTHS, progress: bool = True, meter: KLMeter | None = None,
            cluster: str | None = None, proxy: bool = True, layer_by_layer: bool = False) -> dict:
    """Fill `path` (sensitivity.json) with KL per (layer, unit, depth); resumes what is there. `cluster`: run the
    trials on a Ray cluster's workers (smoe.quality.fanout; "local" starts one on this machine); `layer_by_layer`:
    run them all in one pass over the source's layers (measure_layer_by_layer). With calibration statistics and
    `proxy`, the per-expert proxy too (record_proxy; after a cluster's trials it encodes here)."""
    path = Path(path)
    table = load_table(path, fp)
    table.update(encoder=qm.encoder, moe_layers=qm.expert_map.moe_layers, units=list(UNITS), depths=list(depths),
                 numel=unit_sizes(qm.expert_map), model_type=qm.expert_map.model_type, num_experts=qm.expert_map.num_experts)
    todo = [(layer, unit, b) for layer, unit in qm.units() for b in depths if key(layer, unit, b) not in table["kl"]]
    bar = progress_bar(total=len(qm.units()) * len(depths), initial=len(qm.units()) * len(depths) - len(todo),
                       enabled=progress, desc="sensitivity", unit="tensor")

    def record(trial: tuple[int, str, int], value: float) -> None:  # saved as it comes: a stopped run resumes
        table["kl"][key(*trial)] = value
        save_json(path, table)
        bar.update(1)

    if todo and layer_by_layer:
        measure_layer_by_layer(qm, windows, todo, record, progress)
    elif todo and cluster is not None:
        from smoe.quality import fanout

        fanout.measure_on_cluster(cluster, meter_for, (str(qm.ckpt.dir), qm.encoder, qm.stats, windows), measure_one,
                                  todo, record)
    elif todo:
        meter = meter or KLMeter(qm, windows)
        for trial in todo:
            record(trial, measure_one(meter, *trial))
    bar.close()
    if proxy and qm.stats is not None:
        record_proxy(qm, table, depths)
    save_json(path, table)
    return table


def measure_layer_by_layer(qm: QuantisedModel, windows: list[torch.Tensor], todo: list[tuple[int, str, int]],
                           record, progress: bool = False) -> None:
    """The trials of `todo` in one pass over the source run one decoder layer at a time (smoe.hf.layerwise), for
    models bigger than memory: each trial's tensor is swapped in while its own layer runs over the windows, the
    layers after it run the source's, and its KL is scored at the end against the source's. Memory: one layer,
    its decoded tensors, and the windows' hidden states of the source and of every trial (on disk past 512 MiB),
    never the whole model; compute: a trial at layer l runs the layers from l on, where the whole-model meter runs
    every layer for it. The values are the whole-model meter's up to the order of floating-point sums (tested).
    The results are recorded when the pass ends."""
    from smoe.convert.calibrate import IMPLEMENTATION, experts_modules
    from smoe.hf.layerwise import LayerByLayer

    runner = LayerByLayer(qm.ckpt.dir, windows, IMPLEMENTATION)
    modules = experts_modules(runner.model)
    alter: dict[int, list] = {}
    for trial in todo:
        layer, unit, bits = trial
        alter.setdefault(layer, []).append((trial, functools.partial(swapped, qm, modules[layer], layer, unit, bits)))
    totals, count = dict.fromkeys(todo, 0.0), 0
    layers = progress_bar(total=len(runner.layers), enabled=progress, desc="sensitivity, layer by layer", unit="layer")
    with runner.variants(alter, lambda _: layers.update(1)) as (source, branches), runner.head():
        layers.close()
        for b, ids in enumerate(runner.batches):  # scored a window at a time, as the meter scores them
            h = source.get(b)
            reference = [runner.log_probs(h[r: r + 1], ids[r: r + 1])[0] for r in range(len(ids))]
            count += sum(ref.shape[0] for ref in reference)
            for trial, states in branches.items():
                h = states.get(b)
                for r, ref in enumerate(reference):
                    lp = runner.log_probs(h[r: r + 1], ids[r: r + 1])[0]
                    totals[trial] += float((ref.exp() * (ref - lp)).sum())
    for trial in todo:
        value = totals[trial] / count
        if not math.isfinite(value):
            raise SmoeError(f"layer {trial[0]} {trial[1]} at Q{trial[2]}: KL is not finite")
        record(trial, value)


@contextlib.contextmanager
def swapped(qm: QuantisedModel, module, layer: int, unit: str, bits: int, decoder_layer):
    """Within: `unit` of `layer`'s experts module (loaded, in `decoder_layer`) at `bits`; then its source weights
    again, and the decoded weights forgotten: no other trial asks for them (one unit at one depth each), and kept
    they would hold the layer's experts twice over in fp32 by its last trial."""
    original = {n: p.data for n, p in module.named_parameters(recurse=False) if n in UNIT_PARAMETERS[unit]}
    put_parameters(module, layer, qm.decoded(layer, unit, bits, module))
    try:
        yield
    finally:
        put_parameters(module, layer, original)
        qm.forget(layer)


def record_proxy(qm: QuantisedModel, table: dict, depths: tuple[int, ...] = codec.DEPTHS) -> None:
    """Put into the table each expert's routed calibration tokens per MoE layer ("routed_tokens") and the weighted
    output error of each expert's share of each unit at each depth ("proxy", key(layer, unit, bits) -> one value
    per expert); units the sweep encoded cost nothing more, others are encoded here."""
    counts = qm.stats.counts
    table["routed_tokens"] = {str(layer): [int(c) for c in counts[layer].tolist()] for layer in qm.expert_map.moe_layers}
    proxies = table.setdefault("proxy", {})
    for layer, unit in qm.units():
        for b in depths:
            if key(layer, unit, b) not in proxies:
                proxies[key(layer, unit, b)] = [expert_error(qm, layer, e, unit, b)
                                                for e in range(qm.expert_map.num_experts)]


def expert_error(qm: QuantisedModel, layer: int, expert: int, unit: str, bits: int) -> float:
    """trace(ΔW H ΔWᵀ) summed over the expert's projections in `unit` at `bits`."""
    total = 0.0
    for src in qm.expert_map.experts[(layer, expert)]:
        if src.role in UNIT_ROLES[unit]:
            k = (layer, expert, src.role, bits)
            if k not in qm.errors:
                qm.expert_weight(layer, expert, src.role, bits, load_projection(qm.ckpt, src).float())
            total += qm.errors[k]
    return total


def measure_experts(meter: KLMeter, layer: int, unit: str, bits: int, experts: list[int]) -> float:
    """KL with only `experts` of `unit` of `layer` at `bits`, everything else the source's (checks the proxy)."""
    depths = [bits if e in experts else None for e in range(meter.qm.expert_map.num_experts)]
    meter.qm.set(layer, unit, depths)
    try:
        return meter.kl()
    finally:
        meter.qm.set(layer, unit, None)


def meter_for(model_dir, encoder: str, stats: CalibrationStats | None, windows: list[torch.Tensor]) -> KLMeter:
    """A KL meter over the windows with its own copy of the source model (what each worker of a fanned-out sweep
    holds)."""
    return KLMeter(QuantisedModel(model_dir, encoder, stats), windows)


def measure_one(meter: KLMeter, layer: int, unit: str, bits: int) -> float:
    """One trial of the sweep: KL with `unit` of `layer` alone at `bits`, every other tensor at the source's."""
    meter.qm.set(layer, unit, bits)
    try:
        value = meter.kl()
    finally:
        meter.qm.set(layer, unit, None)
    if not math.isfinite(value):
        raise SmoeError(f"layer {layer} {unit} at Q{bits}: KL is not finite")
    return value


def unit_sizes(expert_map) -> dict[str, int]:
    """Weights per unit ("layer.unit" -> count over all experts of the layer)."""
    shapes = expert_map.expert_shapes()
    sizes = {}
    for layer in expert_map.moe_layers:
        for unit in UNITS:
            n = sum(shapes[r][0] * shapes[r][1] for r in UNIT_ROLES[unit] if r in shapes)
            sizes[f"{layer}.{unit}"] = n * expert_map.num_experts
    return sizes
