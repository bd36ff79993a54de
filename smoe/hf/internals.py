"""The transformers APIs smoe relies on beyond the documented `from_pretrained`/`generate` surface.

transformers changes its loading internals between minor releases; each entry names one thing we use,
where, and why no public API does it. `tests/test_hf_internals.py` resolves every entry against the
installed release, so an upgrade that moves one fails by name instead of deep inside a load. Public
extension points are used wherever they exist: the experts registry (`ExpertsInterface.register`) and
the `experts_implementation` argument of `from_config`/`from_pretrained`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# Releases the whole test suite passed on: CI's pin (constraints.txt) and the GPU machine's release.
CHECKED_VERSIONS = ("5.17", "5.24.0")
SUPPORTED = ">=5.17"  # pyproject.toml's range


@dataclass(frozen=True)
class Internal:
    path: str  # module.attribute[.attribute...]
    used_by: str
    why: str


INTERNALS = (
    Internal("transformers.integrations.moe.ExpertsInterface.register", "smoe.hf.experts.register",
             "the experts registry: our implementation computes routed experts from the vault (public)"),
    Internal("transformers.conversion_mapping.get_model_conversion_mapping", "smoe.hf.model.read_trunk",
             "the checkpoint-key renamings from_pretrained applies, for a trunk loaded without from_pretrained"),
    Internal("transformers.core_model_loading.rename_source_key", "smoe.hf.model.read_trunk",
             "applies those renamings to one key"),
    Internal("transformers.core_model_loading.WeightRenaming", "smoe.hf.model.read_trunk",
             "tells renamings from weight converters"),
    Internal("transformers.core_model_loading.WeightConverter", "smoe.hf.model.read_trunk",
             "tells renamings from weight converters"),
    Internal("transformers.PreTrainedConfig._decode_special_floats", "smoe.hf.model.model_config",
             "config.json's {\"__float__\": \"Infinity\"} back to floats, as from_pretrained reads a file"),
    Internal("transformers.PreTrainedModel._from_config", "smoe.hf.model.build_model",
             "what the Auto classes call to build a declared architecture on the meta device"),
    Internal("transformers.PreTrainedModel.init_weights", "smoe.hf.model.rebuild_meta_buffers",
             "fills buffers computed at construction (rotary inv_freq) that were made on meta"),
    Internal("transformers.PreTrainedModel.tie_weights", "smoe.hf.model.load_trunk",
             "ties embeddings after an assign-load (missing_keys, recompute_mapping arguments)"),
    Internal("transformers.PreTrainedModel.get_parameter_or_buffer", "smoe.hf.model.check_trunk_reached",
             "finds the tensor the model holds under a state-dict name"),
)

# Attributes read on instances (not resolvable from the classes): `_is_hf_initialized` on tensors (the
# "loaded" marker init_weights honours), `_keys_to_ignore_on_load_unexpected` and
# `_keys_to_ignore_on_load_missing` on models, `all_tied_weights_keys` on models, the
# experts modules' `has_gate`/`has_bias`/`is_transposed`/`is_concatenated`/`_apply_gate`, and the class
# names `DbrxExperts` and `Llama4TextMoe` of the MoE blocks the registry does not reach
# (smoe.hf.experts.replace_unregistered_moe_blocks), and the KV cache's name in forward keywords and
# outputs (`cache`, `past_key_values` before 5.2x; smoe.hf.model.forward_with_cache). The tests of
# smoe.hf.model and the runtime exercise each against transformers.


# The decoder-layer layout of transformers' modules that smoe reads (smoe.hf.trunk, smoe.hf.experts,
# smoe.hf.model): attribute names no smoe object of its own has. Read only inside smoe.hf, so a release that
# renames one breaks one package (tests/test_hf_internals.py holds the rest of smoe to it).
MODULE_LAYOUT = ("self_attn", "embed_tokens", "rotary_emb", "input_layernorm", "post_attention_layernorm", "q_proj",
                 "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "q_a_layernorm", "kv_a_proj_with_mqa",
                 "kv_a_layernorm", "kv_b_proj", "qk_nope_head_dim", "e_score_correction_bias",
                 # the experts modules' fused parameters (smoe.hf.experts reads and writes them)
                 "gate_up_proj", "up_proj", "down_proj")


def resolve(path: str):
    """The object at `path`, importing its module; AttributeError/ImportError if it moved."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def missing() -> list[str]:
    """The entries of INTERNALS the installed transformers lacks."""
    gone = []
    for entry in INTERNALS:
        try:
            resolve(entry.path)
        except (ImportError, AttributeError):
            gone.append(entry.path)
    return gone
