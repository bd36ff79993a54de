"""A family from transformers itself, for a model_type smoe's table has no row for.

transformers (v5) computes the routed experts of most new families with one kind of module: an
`...Experts` module holding fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (or both
transposed), which the checkpoint conversion maps from the released per-expert tensors. Building the
model on the meta device (no memory, no weights) shows where that module sits in a decoder layer and
its sizes; the config keys holding those sizes are the ones whose values match. That is a row of
smoe.source.families, made at the moment it is needed, so that a family transformers adds runs here
without a row. Families whose experts are computed otherwise (other parameter names, several expert
kinds in one layer, experts of a size no config key states) get None: they stay refused, by name.
"""

from __future__ import annotations

import functools
import json
import re

import torch

from smoe.source import families

_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.(?P<block>.*?)\.?experts$")


def discover_family(config: dict) -> families.Family | None:
    """The family of a config whose model_type transformers knows and smoe's table does not, or None."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        return _discover(model_type, json.dumps(config, sort_keys=True))
    except Exception:  # noqa: BLE001 - a config transformers cannot build a model of: not one smoe can read
        return None


@functools.lru_cache(maxsize=64)
def _discover(model_type: str, config_json: str) -> families.Family | None:
    from transformers import CONFIG_MAPPING

    from smoe.hf.model import causal_lm_class

    if model_type not in CONFIG_MAPPING:
        return None
    config = json.loads(config_json)
    hf_config = CONFIG_MAPPING[model_type].from_dict(config)
    with torch.device("meta"):
        model = causal_lm_class(hf_config)._from_config(hf_config)
    found = {_block_of(name, module, hf_config.get_text_config().hidden_size)
             for name, module in model.named_modules() if type(module).__name__.endswith("Experts")}
    if len(found) != 1 or None in found:
        return None
    block, transposed, inner, experts = found.pop()
    text = hf_config.get_text_config().to_dict()
    inner_key = _key_holding(text, inner, ("moe", "expert"))
    if inner_key is None or _key_holding(text, experts, ("expert",)) is None:
        return None
    return families.Family(model_type, (model_type,), families.standard(block, fused_transpose=transposed),
                           intermediate_keys=(inner_key,))


def _block_of(name: str, module, hidden: int):
    """(block path inside the decoder layer, transposed, expert width, experts) of a fused experts
    module, or None for any other kind."""
    m = _LAYER.search(name)
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if m is None or not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in (gate_up, down)):
        return None
    experts = gate_up.shape[0]
    if gate_up.shape[2] == hidden and down.shape[1] == hidden:  # [E, 2I, H], [E, H, I]
        return m["block"], False, gate_up.shape[1] // 2, experts
    if gate_up.shape[1] == hidden and down.shape[2] == hidden:  # [E, H, 2I], [E, I, H]
        return m["block"], True, gate_up.shape[2] // 2, experts
    return None


def _key_holding(config: dict, value: int, hints: tuple[str, ...]) -> str | None:
    """The config key whose value is `value`, preferring keys that name the routed experts (a shared
    expert's width may equal theirs)."""
    keys = [k for k, v in config.items() if type(v) is int and v == value and "shared" not in k]
    named = [k for k in keys if any(h in k for h in hints)]
    return (named or keys or [None])[0]
