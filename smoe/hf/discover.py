"""A family from transformers itself, for a model_type smoe's table has no row for.

transformers (v5) computes the routed experts of most new families with one kind of module: an
`...Experts` module holding fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (or both
transposed), which the checkpoint conversion maps from the released per-expert tensors. Building the
model on the meta device (no memory, no weights) shows where that module sits in a decoder layer and
its sizes; the config keys holding those sizes are the ones whose values match. That is a row of
smoe.source.families, made at the moment it is needed, so that a family transformers adds runs here
without a row. The experts may take in a latent width a config key states instead of the hidden size
(Muse Spark's moe_hidden_size), and gate_up may hold rows for identity experts after the routed ones
(LongCat). Families whose experts are computed otherwise (other parameter names, several expert kinds
in one layer, experts of a size no config key states) get the reason instead: they stay refused, by
name, saying why.
"""

from __future__ import annotations

import functools
import json
import re

import torch

from smoe.source import families
from smoe.source.config_numbers import CONFIG_KEYS, lookup
from smoe.source.layouts import GATED, Layout, Stored, standard
from smoe.source.loading import take_part
from smoe.source.matching import LAYER_RE

_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.(?P<block>.*?)\.?experts$")


def discover_family(config: dict) -> families.Family | str | None:
    """The family of a config whose model_type transformers knows and smoe's table does not; else why
    its experts are not the kind smoe reads (one line), or None (a type or config transformers cannot
    build)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        return _discover(model_type, json.dumps(config, sort_keys=True))
    except Exception:  # noqa: BLE001 - a config transformers cannot build a model of: not one smoe can read
        return None


@functools.lru_cache(maxsize=64)
def _discover(model_type: str, config_json: str) -> families.Family | str | None:
    from transformers import CONFIG_MAPPING

    from smoe.hf.model import skeleton

    if model_type not in CONFIG_MAPPING:
        return None
    config = json.loads(config_json)
    hf_config = CONFIG_MAPPING[model_type].from_dict(config)
    model = skeleton(hf_config, torch.float32)  # on the meta device
    text = hf_config.get_text_config().to_dict()
    widths = _input_widths(text)
    modules = {name: _block_of(name, module, widths)
               for name, module in model.named_modules() if _routed(type(module).__name__)}
    refused = _refusal(model, modules)
    if refused:
        return refused
    block, transposed, inner, experts, identity, width = next(iter(modules.values()))
    inner_key = _key_holding(text, inner, ("moe", "expert"))
    identity_key = _key_holding(text, identity, ("zero", "identity"), named_only=True) if identity else None
    if inner_key is None or _key_holding(text, experts, ("expert",)) is None or (identity and not identity_key):
        return f"no config key states its experts' width ({inner}), count ({experts}) or identity experts ({identity})"
    released = released_layout(model, min(modules), transposed)
    if released is None:
        return "transformers' save-time conversion of its experts gives tensors smoe cannot tell gate, up and down in"
    # the release's own layout first; the others (per expert, transformers' fused, MLX) where they name
    # other tensors: a name means one thing
    taken = {how.template for how in released.roles.values()}
    layouts = (released, *(layout for layout in standard(block, fused_transpose=transposed)
                           if not taken & {how.template for how in layout.roles.values()}))
    hidden = lookup([text], CONFIG_KEYS["hidden_size"])
    return families.Family(model_type, (model_type,), layouts, intermediate_keys=(inner_key,),
                           identity_key=identity_key, latent_keys=() if width == hidden else (widths[width],))


def _refusal(model, modules: dict) -> str | None:
    """Why the routed experts modules found are not one fused kind at one place of every MoE layer."""
    if not modules:
        return "transformers builds no routed ...Experts module for it (its experts are computed otherwise)"
    odd = sorted({type(model.get_submodule(n)).__name__ for n, found in modules.items() if found is None})
    if odd:
        return (f"its {', '.join(odd)} modules are not fused experts (gate_up_proj [E, 2I, H], down_proj "
                f"[E, H, I]) inside decoder layers")
    blocks = sorted({found[0] for found in modules.values()})
    if len(blocks) > 1:
        return f"its layers hold routed experts in {len(blocks)} places ({', '.join(blocks)}); a vault holds one per layer"
    if len(set(modules.values())) > 1:
        return "its layers' experts differ in size; a vault holds experts of one size"
    return None


def _routed(class_name: str) -> bool:
    """An experts module of routed experts (shared experts, which every token runs, are trunk)."""
    return class_name.endswith("Experts") and "Shared" not in class_name


def _input_widths(text: dict) -> dict[int, str]:
    """width -> the config key stating it, of the widths routed experts may take in: the hidden size, or
    a latent one (Muse Spark projects the hidden state down to moe_hidden_size before its experts)."""
    keys = [k for k in CONFIG_KEYS["hidden_size"] if type(text.get(k)) is int][:1]  # its own key first
    keys += [k for k, v in text.items() if type(v) is int and k.endswith("_size") and ("hidden" in k or "latent" in k)]
    widths: dict[int, str] = {}
    for key in keys:
        widths.setdefault(text[key], key)
    return widths


def _block_of(name: str, module, widths: dict[int, str]):
    """(block path inside the decoder layer, transposed, expert width, experts, identity experts, input
    width) of a fused experts module taking one of `widths` in, or None for any other kind. Experts are
    the ones with a down projection; gate_up rows beyond them (LongCat) are identity experts', whose
    tokens pass through unchanged."""
    m = _LAYER.search(name)
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if m is None or not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in (gate_up, down)):
        return None
    experts, identity = down.shape[0], gate_up.shape[0] - down.shape[0]
    if identity < 0:
        return None
    if gate_up.shape[2] == down.shape[1] in widths:  # [E, 2I, H], [E, H, I]
        return m["block"], False, gate_up.shape[1] // 2, experts, identity, down.shape[1]
    if gate_up.shape[1] == down.shape[2] in widths:  # [E, H, 2I], [E, I, H]
        return m["block"], True, gate_up.shape[2] // 2, experts, identity, down.shape[2]
    return None


def _key_holding(config: dict, value: int, hints: tuple[str, ...], named_only: bool = False) -> str | None:
    """The config key whose value is `value`, preferring keys that name the routed experts (a shared
    expert's width may equal theirs); with `named_only`, only such a key (a count no other may stand in for)."""
    keys = [k for k, v in config.items() if type(v) is int and v == value and "shared" not in k]
    named = [k for k in keys if any(h in k for h in hints)]
    return (named or ([] if named_only else keys) or [None])[0]


# Small sizes for the index tensors: experts, hidden, expert width (all different, so that a
# transposed or split tensor cannot pass for another).
_E, _H, _I = 3, 5, 2


def released_layout(model, module: str, transposed: bool) -> Layout | None:
    """How the released checkpoint stores the experts of the fused module `module`: transformers' own
    save-time conversion (the reverse of what it applies on load: renames, per-expert splits, gate/up
    concatenation or interleaving) applied to tensors of distinct numbers, and each tensor it writes
    matched against what each expert's gate, up and down must be. None when a role is not found."""
    from transformers.core_model_loading import revert_weight_conversion

    gate_up = torch.arange(1, _E * 2 * _I * _H + 1, dtype=torch.float64).reshape(_E, 2 * _I, _H)
    down = torch.arange(1, _E * _H * _I + 1, dtype=torch.float64).reshape(_E, _H, _I) + gate_up.numel()
    wanted = {(e, role): m for e in range(_E) for role, m in
              (("gate", gate_up[e, :_I]), ("up", gate_up[e, _I:]), ("down", down[e]))}
    stored = {module + ".gate_up_proj": gate_up.transpose(1, 2) if transposed else gate_up,
              module + ".down_proj": down.transpose(1, 2) if transposed else down}
    experts = model.get_submodule(module)
    for name, tensor in stored.items():  # conversions that compare shapes with the model's see these
        setattr(experts, name.rsplit(".", 1)[1], torch.nn.Parameter(torch.empty_like(tensor, device="meta")))
    layer = LAYER_RE.match(module)
    roles: dict[str, Stored] = {}
    for name, tensor in revert_weight_conversion(model, stored).items():
        m = LAYER_RE.match(name)
        if m is None or m["layer"] != layer["layer"]:
            return None
        for role, how in _stored_roles(m["rest"], tensor, wanted).items():
            roles.setdefault(role, how)
    if set(roles) != set(GATED):
        return None
    what = "released " + ", ".join(sorted({how.template for how in roles.values()}))
    return Layout(what, roles)


def _stored_roles(rest: str, tensor: torch.Tensor, wanted: dict) -> dict[str, Stored]:
    """role -> how it is stored in this tensor (name `rest` relative to its decoder layer), for every
    role the tensor holds the same way for every expert it holds."""
    if tensor.dim() == 3:  # every expert, along dim 0
        return _common([_matches(rest, tensor[e], e, wanted) for e in range(_E)])
    experts = [e for e in range(_E) if f".{e}." in f".{rest}."]
    if tensor.dim() != 2 or len(experts) != 1:
        return {}
    e = experts[0]
    template = f".{rest}.".replace(f".{e}.", ".{e}.", 1)[1:-1]
    return _matches(template, tensor, e, wanted)


def _matches(template: str, matrix: torch.Tensor, e: int, wanted: dict) -> dict[str, Stored]:
    """role -> the Stored whose reading of `matrix` (smoe.source.loading's, transposed or not) is expert e's."""
    found = {}
    for transpose in (False, True):
        rows = matrix.t() if transpose else matrix
        for parts, interleaved in ((1, False), (2, False), (2, True)):
            if rows.shape[0] % parts:
                continue
            for part in range(parts):
                piece = take_part(rows, template, part, parts, interleaved)
                for role in GATED:
                    if piece.shape == wanted[e, role].shape and torch.equal(piece, wanted[e, role]):
                        found[role] = Stored(template, transpose, part, parts, interleaved)
    return found


def _common(per_expert: list[dict]) -> dict:
    return {role: how for role, how in per_expert[0].items() if all(d.get(role) == how for d in per_expert)}
