"""Matching checkpoint names to routed experts, and counting them against the config.

A tensor name is split into <prefix><layers|blocks>.<L>.<rest>; <rest> with its expert number replaced by
"{e}" is looked up in the family's layouts (one dict lookup per name), so shared experts, dense MLPs,
routers and vision towers simply never match. map_experts then counts: every MoE layer x every expert x
every role, or a SmoeError. describe_config gives the geometry a bare config promises, without names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from smoe.errors import SmoeError
from smoe.source.config_checks import check_resolved, ranges
from smoe.source.config_numbers import CONFIG_KEYS, as_int, config_moe_layers, latent_keys, lookup, num_layers, resolve
from smoe.source.families import FAMILIES, Family, supported_families
from smoe.source.layouts import BiasSource, ExpertMap, ProjectionSource, Stored

LAYER_RE = re.compile(r"^(?P<prefix>(?:.*?\.)?)(?:layers|blocks)\.(?P<layer>\d+)\.(?P<rest>.+)$")
_NUMBER_RE = re.compile(r"(?<=\.)\d+(?=\.)")
_MTP_RE = re.compile(r"(^|\.)mtp\.$")


@dataclass(frozen=True)
class _Entry:
    """What a layer-relative name template means in one family."""

    layout: int  # index into the family's layouts
    role: str
    stored: Stored
    bias: bool


def _templates(family: Family) -> dict[str, list[_Entry]]:
    table: dict[str, list[_Entry]] = {}
    for i, layout in enumerate(family.layouts):
        for bias, stored_map in ((False, layout.roles), (True, layout.biases)):
            for role, stored in stored_map.items():
                table.setdefault(stored.template, []).append(_Entry(i, role, stored, bias))
    return table


@dataclass(frozen=True)
class _Name:
    """A tensor name split at its decoder layer, its expert number (if any) replaced by {e}."""

    name: str
    prefix: str
    layer: int
    template: str
    expert: int | None
    layer_base: str  # the name up to and including "layers.<L>."


def _parse(names: list[str]) -> list[_Name]:
    parsed = []
    for name in names:
        m = LAYER_RE.match(name)
        if not m:
            continue
        rest = "." + m["rest"] + "."
        numbers = _NUMBER_RE.findall(rest)
        if len(numbers) > 1:
            continue
        template = _NUMBER_RE.sub("{e}", rest, count=1)[1:-1]
        expert = int(numbers[0]) if numbers else None
        parsed.append(_Name(name, m["prefix"], int(m["layer"]), template, expert, name[: m.start("rest")]))
    return parsed


@dataclass
class _Hit:
    name: str
    prefix: str
    layer: int
    expert: int | None  # None: the tensor holds every expert
    entry: _Entry


def _match(family: Family, parsed: list[_Name], present: set[str]) -> list[_Hit]:
    table = _templates(family)
    layouts = family.layouts
    hits = []
    for p in parsed:
        for entry in table.get(p.template, ()):
            marker = layouts[entry.layout].marker
            if marker and p.layer_base + marker not in present:
                continue
            hits.append(_Hit(p.name, p.prefix, p.layer, p.expert, entry))
    return hits


def _infer_family(names: list[str], parsed: list[_Name]) -> Family:
    """No config: the family whose layouts match the names (families sharing a naming agree)."""
    present = set(names)
    found = {f.name: frozenset(h.name for h in _match(f, parsed, present)) for f in FAMILIES}
    matches = [f for f in FAMILIES if found[f.name]]
    if not matches:
        raise SmoeError("no config.json model_type, and no routed-expert tensors recognised in the tensor names "
                        f"(supported families: {', '.join(supported_families())})")
    if len({found[f.name] for f in matches}) > 1:
        raise SmoeError(f"no config.json model_type, and the tensor names fit several families differently "
                        f"({', '.join(f.name for f in matches)}): add a config.json")
    hinted = [f for f in matches if f.hint and any(f.hint in n for n in names)]
    return (hinted or matches)[0]


# ----- planning ----------------------------------------------------------------------------------


def map_experts(config: dict, names: list[str], num_experts: int | None = None) -> ExpertMap:
    """Find every routed expert's projections; count them against the config (see module docstring).

    num_experts: the number of routed experts, overriding the config (needed where experts are
    fused and the config does not say).
    """
    names = sorted(names)
    family, model_type, configs = resolve(config or {})
    parsed = _parse(names)
    if family is None:
        family = _infer_family(names, parsed)
        model_type = family.name
    check_resolved(config or {}, configs, family.name, num_experts, "config.json")
    hits = _match(family, parsed, set(names))
    if not hits:
        raise SmoeError(f"{model_type}: no routed-expert tensors found; expected "
                        f"{'; or '.join(layout.what for layout in family.layouts)}")
    hits, mtp_names = _decoder_hits(hits)
    e_count = _expert_count(model_type, configs, hits, num_experts, family)
    hits, identity_names = _without_identity_experts(hits, e_count, as_int(lookup(configs, (family.identity_key,)))
                                                     if family.identity_key else 0)
    moe_layers = _expected_layers(configs, num_layers(configs), hits, family)

    experts, biases, found = _collect(hits, e_count)
    _check_counts(model_type, moe_layers, e_count, family.roles, experts, found)
    _check_biases(model_type, biases, experts)
    keys = [(layer, e) for layer in moe_layers for e in range(e_count)]

    expert_names = {h.name for h in hits} | mtp_names | identity_names
    owners = {_owner(n) for n in expert_names}
    # parts a format leaves beside a projection (input scales, ...) belong to the expert, not the trunk
    expert_names |= {n for n in names if _owner(n) in owners}

    hidden = as_int(lookup(configs, CONFIG_KEYS["hidden_size"]))
    top_k = as_int(lookup(configs, CONFIG_KEYS["top_k"]))
    return ExpertMap(
        family=family.name,
        model_type=str(model_type),
        moe_layers=moe_layers,
        num_experts=e_count,
        top_k=top_k,
        roles=family.roles,
        experts={k: [experts[k][r] for r in family.roles] for k in keys},
        biases={k: [biases[k][r] for r in family.roles if r in biases[k]] for k in keys if k in biases},
        expert_names=expert_names,
        hidden_size=hidden,
        expert_intermediate_size=as_int(lookup(configs, family.intermediate_keys)),
        expert_input_size=as_int(lookup(configs, latent_keys(family))) or hidden,
    )


def describe_config(config: dict, num_experts: int | None = None) -> ExpertMap:
    """The MoE geometry a config promises, without tensor names (`smoe inspect` of a bare config):
    a plan with no expert sources."""
    family, model_type, configs = resolve(config or {})
    if family is None:
        raise SmoeError("config has no model_type: cannot tell the model family")
    check_resolved(config or {}, configs, family.name, num_experts, "config.json")  # before tables of its counts
    count = num_experts if num_experts is not None else as_int(lookup(configs, CONFIG_KEYS["num_experts"]))
    n_layers = num_layers(configs)
    if not count or n_layers is None:
        raise SmoeError(f"{model_type}: the config does not give the number of experts and layers "
                        f"(pass --num-experts, or inspect a directory with the weight index)")
    hidden = as_int(lookup(configs, CONFIG_KEYS["hidden_size"]))
    return ExpertMap(
        family=family.name, model_type=str(model_type), moe_layers=config_moe_layers(configs, n_layers),
        num_experts=count, top_k=as_int(lookup(configs, CONFIG_KEYS["top_k"])), roles=family.roles,
        experts={}, biases={}, expert_names=set(), hidden_size=hidden,
        expert_intermediate_size=as_int(lookup(configs, family.intermediate_keys)),
        expert_input_size=as_int(lookup(configs, latent_keys(family))) or hidden,
    )


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _decoder_hits(hits: list[_Hit]) -> tuple[list[_Hit], set[str]]:
    """The decoder's experts, and the names of experts in separate multi-token-prediction modules.

    Expert-shaped names under another prefix (a vision or audio tower) are not the decoder's: they
    stay in the trunk.  Experts under an mtp.* prefix (qwen3-next, qwen3.5) belong to a module that
    inference does not run: they are neither counted nor kept in the trunk.
    """
    counts: dict[str, int] = {}
    for h in hits:
        if not _MTP_RE.search(h.prefix):
            counts[h.prefix] = counts.get(h.prefix, 0) + 1
    if not counts:
        raise SmoeError("routed experts found only in multi-token-prediction layers")
    decoder = max(counts, key=counts.get)
    mtp = {h.name for h in hits if _MTP_RE.search(h.prefix)}
    return [h for h in hits if h.prefix == decoder], mtp


def _without_identity_experts(hits: list[_Hit], e_count: int, identity: int | None) -> tuple[list[_Hit], set[str]]:
    """The hits of the routed experts, and the names of tensors kept for identity experts (LongCat's "zero"
    experts, numbered after the routed ones): an identity expert passes its token through, so what a
    checkpoint holds for one (transformers saves the rows its fused gate_up allots them, never read) is
    neither an expert nor trunk."""
    dead = {h.name for h in hits if h.expert is not None and e_count <= h.expert < e_count + (identity or 0)}
    return [h for h in hits if h.name not in dead], dead


def _expert_count(model_type: str, configs: list[dict], hits: list[_Hit], num_experts: int | None,
                  family: Family) -> int:
    count = num_experts if num_experts is not None else as_int(lookup(configs, CONFIG_KEYS["num_experts"]))
    if count is not None:
        if int(count) <= 0:
            raise SmoeError(f"{model_type}: {count} routed experts: not a mixture-of-experts model")
        return int(count)
    if any(h.expert is None for h in hits):
        raise SmoeError(f"{model_type}: experts are fused ({family.layouts[hits[0].entry.layout].what}) and "
                        f"the config does not say how many there are: pass the number of routed experts "
                        f"(--num-experts)")
    return max(h.expert for h in hits) + 1


def _expected_layers(configs: list[dict], n_layers: int | None, hits: list[_Hit], family: Family) -> list[int]:
    """The MoE layers the config promises, plus the MTP layers present; without a layer count: as found.

    DeepSeek-style checkpoints store their multi-token-prediction layers as decoder layers numbered
    after the last one (model.layers.61 of 61), routed experts and all: they count where present.
    """
    seen = sorted({h.layer for h in hits})
    if n_layers is None or any(layout.marker for layout in family.layouts):
        return seen  # no layer count, or MoE blocks told apart only by names (moondream)
    mtp_count = int(lookup(configs, CONFIG_KEYS["mtp_layers"]) or 0)
    extra = [layer for layer in seen if n_layers <= layer < n_layers + mtp_count]
    return config_moe_layers(configs, n_layers) + extra


def _collect(hits: list[_Hit], e_count: int):
    """(layer, expert) -> role -> source, for projections and biases; plus the (layer, expert) seen."""
    experts: dict[tuple[int, int], dict[str, ProjectionSource]] = {}
    biases: dict[tuple[int, int], dict[str, BiasSource]] = {}
    found: set[tuple[int, int]] = set()
    for h in hits:
        s, role = h.entry.stored, h.entry.role
        # a per-expert tensor is the expert's own; a fused or stacked one is indexed by expert
        for e in [h.expert] if h.expert is not None else range(e_count):
            index = None if h.expert is not None else e
            if h.entry.bias:
                src, target = BiasSource(role, h.name, index, s.part, s.parts, s.interleaved), biases
            else:
                src = ProjectionSource(role, h.name, index, s.transpose, s.part, s.parts, s.interleaved,
                                       e_count if s.stacked else 0)
                target = experts
                found.add((h.layer, e))
            sources = target.setdefault((h.layer, e), {})
            if sources.get(role, src) != src:
                raise SmoeError(f"layer {h.layer} expert {e} {role}: found in two tensors, "
                                f"{sources[role].name} and {h.name}")
            sources[role] = src
    return experts, biases, found


def _check_counts(model_type: str, moe_layers: list[int], e_count: int, roles: tuple[str, ...],
                  experts: dict, found: set) -> None:
    """Exactly moe_layers x e_count experts, each with every role, or a SmoeError saying what is off."""
    expected = {(layer, e) for layer in moe_layers for e in range(e_count)}
    missing = [f"layer {layer} expert {e} {role}" for layer, e in sorted(expected) for role in roles
               if role not in experts.get((layer, e), {})]
    unexpected = sorted(found - expected)
    if not missing and not unexpected:
        return
    promise = f"{len(moe_layers)} MoE layers x {e_count} experts"
    parts = []
    if missing:
        parts.append(f"{len(missing)} expert projections missing (first: {', '.join(missing[:5])})")
    if unexpected:
        extra_layers = sorted({layer for layer, _ in unexpected} - set(moe_layers))
        what = f"layers {ranges(extra_layers)} that should have none" if extra_layers else (
            f"expert ids up to {max(e for _, e in unexpected)}")
        parts.append(f"{len(unexpected)} experts beyond that ({what})")
    raise SmoeError(f"{model_type}: expected {promise}, but the checkpoint has {'; '.join(parts)}")


def _check_biases(model_type: str, biases: dict, experts: dict) -> None:
    """Expert biases are all-or-nothing per role: a partial set means a damaged checkpoint."""
    for role in sorted({r for sources in biases.values() for r in sources}):
        lacking = [key for key in sorted(experts) if role not in biases.get(key, {})]
        if lacking:
            layer, e = lacking[0]
            raise SmoeError(f"{model_type}: {len(lacking)} experts lack their {role} bias "
                            f"(first: layer {layer} expert {e})")
