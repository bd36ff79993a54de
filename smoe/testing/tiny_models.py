"""Tiny random Hugging Face MoE models, one per family, for tests.

Each model is a few hundred kB: hidden size 64, 2-4 decoder layers (MoE layers and, where the
family has them, dense layers), 4-6 routed experts of width 24, vocabulary 128.  Families are named
by their text model's model_type ("gemma4_text"); the family name ("gemma4") is accepted too.
`save_tiny_model` writes one with `save_pretrained` (safetensors), its routed experts laid out the
way the family's released checkpoints store them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from smoe.errors import SmoeError

# Shared by every family: small enough to build and save in well under a second.
_BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}

_DEEPSEEK_ATTENTION = {  # MLA with small ranks
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "head_dim": 8,  # MLA ropes only qk_rope_head_dim; a larger head_dim breaks the forward pass
    "num_key_value_heads": 4,  # MLA: one key/value head per query head
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
}

# family -> config overrides on top of _BASE.  Layer counts are chosen so that dense layers (where
# the family has them) sit beside MoE layers, which the matcher must tell apart.
TINY_CONFIGS: dict[str, dict] = {
    "qwen2_moe": {
        "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96,
        "moe_intermediate_size": 24, "shared_expert_intermediate_size": 48, "mlp_only_layers": [0],
    },
    "qwen3_moe": {
        "num_hidden_layers": 4, "num_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 96,
        "moe_intermediate_size": 24, "decoder_sparse_step": 2,
    },
    "qwen3_next": {
        # at least one full-attention layer, or the model cannot be built
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96,
        "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    },
    "qwen3_5_moe_text": {
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    },
    "olmoe": {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24},
    "deepseek_v2": {
        "num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "intermediate_size": 96, "moe_intermediate_size": 24,
        "topk_method": "greedy", **_DEEPSEEK_ATTENTION,
    },
    "deepseek_v3": {
        "num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "intermediate_size": 96, "moe_intermediate_size": 24,
        **_DEEPSEEK_ATTENTION,
    },
    "mistral4": {
        "num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 0, "intermediate_size": 96, "moe_intermediate_size": 24,
        # its default YaRN rope does not fit heads this small
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                            "original_max_position_embeddings": 128}, **_DEEPSEEK_ATTENTION,
    },
    "glm4_moe": {
        "num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "intermediate_size": 96, "moe_intermediate_size": 24,
        "n_group": 1, "topk_group": 1,
    },
    "mixtral": {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24},
    "minimax": {
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "block_size": 16,
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
    },
    "minimax_m2": {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24},
    "phimoe": {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24},
    "jamba": {
        # layer 0 mamba + dense MLP, layer 1 attention + MoE (expert layers: i % period == offset)
        "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
        "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2, "attn_layer_offset": 1,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8, "use_mamba_kernels": False,
    },
    "gpt_oss": {
        "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
    },
    "llama4_text": {
        # MoE every second layer: layers 1 and 3; layers 0 and 2 have a dense feed_forward
        "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size": 24,
        "intermediate_size_mlp": 96, "interleave_moe_layer_step": 2, "attention_chunk_size": 32,
    },
    "granitemoe": {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24},
    "granitemoeshared": {
        "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
        "shared_intermediate_size": 48,
    },
    "granitemoehybrid": {
        "num_hidden_layers": 2, "layer_types": ["mamba", "attention"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 24, "shared_intermediate_size": 48,
        "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 16,
    },
    "gemma4_text": {
        "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
        "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "intermediate_size": 96,
        "moe_intermediate_size": 24, "hidden_size_per_layer_input": 0, "num_global_key_value_heads": 2,
        "global_head_dim": 16,
    },
    "nemotron_h": {
        # mamba, MoE, attention, MoE.  The shared expert defaults to a very large width: set it.
        "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "intermediate_size": 96,
        "moe_intermediate_size": 24, "moe_shared_expert_intermediate_size": 48,
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1, "chunk_size": 16,
        "use_mamba_kernels": False,
    },
    "ernie4_5_moe": {
        "num_hidden_layers": 3, "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1,
        "intermediate_size": 96, "moe_intermediate_size": 24, "moe_layer_start_index": 1,
    },
    "hunyuan_v1_moe": {
        "num_hidden_layers": 2, "num_experts": 4, "moe_topk": 2, "intermediate_size": 24,
    },
    "dots1": {
        "num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "intermediate_size": 96, "moe_intermediate_size": 24,
    },
    "lfm2_moe": {
        "num_hidden_layers": 3, "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 96, "moe_intermediate_size": 24,
        "layer_types": ["conv", "full_attention", "conv"],
    },
    "exaone_moe": {
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "num_shared_experts": 1, "intermediate_size": 96, "moe_intermediate_size": 24, "n_group": 1,
        "topk_group": 1,
    },
    "afmoe": {
        "num_hidden_layers": 3, "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "num_shared_experts": 1, "intermediate_size": 96, "moe_intermediate_size": 24,
        "global_attn_every_n_layers": 2, "sliding_window": 16,
    },
    "dbrx": {
        # DBRX names its sizes differently; rope_theta and clip_qkv must be given
        "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128, "vocab_size": 128,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 24},
    },
}

# How the family's released checkpoints store routed experts where transformers saves them otherwise:
# gemma4 releases per-expert tensors (transformers saves them fused), the official qwen3.5-MoE
# release is fused (transformers saves it per expert).
RELEASED_LAYOUT = {"gemma4_text": "per_expert", "qwen3_5_moe_text": "fused"}

# Text-only CausalLM classes that AutoModelForCausalLM does not map.
_CAUSAL_LM = {"mistral4": "Mistral4ForCausalLM"}


# Sizes a family's default config is shrunk to, where it has the key (tiny_default_config).
_SHRUNK = {
    **_BASE, "intermediate_size": 96, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 24, "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "top_k_experts": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    # low-rank latent attention (MLA) and its indexer
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "qk_head_dim": 24, "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2,
    # other attention kinds' widths
    "swa_head_dim": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "linear_head_dim": 16,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "unpadded_vocab_size": 128,
    # other names of a dense MLP's or an expert's width
    "ffn_hidden_size": 96, "intermediate_size_mlp": 96, "shared_experts_intermediate_size": 32,
    "router_hidden_size": 32, "zero_expert_num": 2, "num_experts_per_token": 2, "linear_num_heads": 4,
    "num_expert_group": 1,
    # the latent width experts work in (Muse Spark), unlike every other width so that no shape passes for it
    "moe_latent_size": 40, "moe_hidden_size": 40,
}


def tiny_default_config(model_type: str):
    """transformers' default config of `model_type` shrunk to a tiny model: the sizes above where it has
    those keys, one decoder layer of each kind its per-layer lists hold (at least two layers), each
    per-layer list cut to match. A multimodal config's text model is shrunk so, its vision and audio
    towers to one small layer (TOWER_SIZES)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    values = cls().to_dict()
    towers = {k for k, v in values.items() if isinstance(v, dict) and k != "text_config" and "model_type" in v}
    text_width = (values.get("text_config") or values).get("hidden_size")
    for key in towers:
        values[key] = _shrink_tower(values[key], {text_width: _BASE["hidden_size"]})
    if isinstance(values.get("text_config"), dict):
        values["text_config"] = _shrink_text(_released(model_type, values["text_config"]))
        values |= {k: v for k, v in BRIDGE_SIZES.items() if values.get(k) is not None}
    else:
        values = _shrink_text(_released(model_type, values))
    return cls(**{k: v for k, v in values.items() if k not in ("transformers_version", "model_type")})


def _shrink_text(values: dict) -> dict:
    values = dict(values)
    depth = values.get("num_hidden_layers")
    keep = _kept_layers(values, depth)
    for key, value in list(values.items()):
        if key in INDEX_LISTS and isinstance(value, list):  # layer indices, not per-layer values
            values[key] = [keep.index(i) for i in value if i in keep]
        elif key in SOURCE_LISTS and isinstance(value, list) and len(value) == depth:
            values[key] = [keep.index(value[i]) for i in keep]
        elif isinstance(value, list) and depth and len(value) == depth:
            values[key] = [value[i] for i in keep]
    unshrunk, overrides = values, values.get("per_layer_config")
    if isinstance(overrides, dict):  # {"07": {size overrides}}: kept layers, renumbered
        overrides = {str(keep.index(int(k))): v for k, v in overrides.items() if int(k) in keep}
        values["per_layer_config"] = {k: _shrunk(v) for k, v in overrides.items()}
    values = _shrunk(values)
    for k, override in (overrides or {}).items():  # a layer whose own MLA sizes sum to head_dim (dots3's SWA)
        if _mla_sums_to_head_dim(unshrunk | override):
            values["head_dim"] = _mla_head_dim(values | values["per_layer_config"][k])
    if depth:
        values["num_hidden_layers"] = len(keep)
    return values


# Values a family's releases set where its default config leaves them unset (a dict, or one made from the
# text config's defaults): ones transformers' own model needs (DeepSeek-OCR-2's default names no MLP kind
# per layer nor a top-k; Qwen4-Exp's default layers are indexed attention without an indexer's sizes;
# Step-3.7 builds a sliding-window mask whatever layer_types says), or a computation the default switches
# off that the walk must see (Step-3.7's clamped SwiGLU, its bound small enough to bite here).
_QSA_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                "indexer_compress_ratio": 4}  # 2 blocks of 4 tokens kept: a 12-token prompt has 3
RELEASE_VALUES = {
    "deepseek_ocr2": lambda text: {"num_experts_per_tok": 6,
                                   "mlp_layer_types": ["dense"] + ["sparse"] * (text["num_hidden_layers"] - 1)},
    "step3p7": lambda text: {"sliding_window": 16, "swiglu_limits": [0.1] * text["num_hidden_layers"]},
    "qwen4_exp": _QSA_INDEXER,
    "qwen4_exp_text": _QSA_INDEXER,
}


def _released(model_type: str, text: dict) -> dict:
    """The text config's default values with what the family's releases set over them (RELEASE_VALUES)."""
    values = RELEASE_VALUES.get(model_type, {})
    return text | (values(text) if callable(values) else values)


INDEX_LISTS = ("mlp_only_layers", "moe_layers")  # lists of layer indices
SOURCE_LISTS = ("kv_source_layers",)  # per layer, the index of the layer whose keys and values it reads


def _kept_layers(values: dict, depth: int | None) -> list[int]:
    """The first two layers and the first layer of each kind the per-layer lists (and per-layer
    overrides) hold, with every layer a kept one reads its keys and values from."""
    keep = {0, 1} if depth and depth > 1 else {0}
    overrides = values.get("per_layer_config") if isinstance(values.get("per_layer_config"), dict) else {}
    kinds = [v for k, v in values.items() if isinstance(v, list) and depth and len(v) == depth
             and k not in INDEX_LISTS + SOURCE_LISTS]
    if overrides and depth:
        kinds.append([sorted(overrides.get(f"{i:02d}", overrides.get(str(i), {}))) for i in range(depth)])
    for kind in kinds:  # the first layer of each kind
        keep |= {kind.index(v) for v in kind}
    for key in SOURCE_LISTS:
        if isinstance(values.get(key), list) and len(values[key]) == depth:
            keep |= {values[key][i] for i in keep}
    return sorted(keep)


def _shrunk(values: dict) -> dict:
    """The sizes of _SHRUNK where the config has the key (None: derived from others; 0: a part the
    family leaves out, such as GLM-5's rotary-free latent attention), keeping the relations its
    validators check: MLA's key/value heads and head_dim, a top-k no larger than the default, the
    multimodal rotary sections summing to half the rotary width."""
    old = dict(values)
    values = values | {k: v for k, v in _SHRUNK.items() if values.get(k) not in (None, 0)}
    values |= {k: [v] * len(old[k]) for k, v in _SHRUNK.items() if isinstance(old.get(k), list)
               and all(isinstance(x, int) for x in old[k])}  # per modality (ERNIE-VL: text, vision)
    for key in CONFIG_TOP_K:
        if isinstance(old.get(key), int):
            values[key] = min(old[key], values[key])
    if old.get("num_key_value_heads") == old.get("num_attention_heads") and old.get("num_key_value_heads"):
        values["num_key_value_heads"] = values["num_attention_heads"]  # MLA requires as many as queries
    if values.get("kv_lora_rank") is not None and old.get("head_dim") is not None:
        values["head_dim"] = _mla_head_dim(values) if _mla_sums_to_head_dim(old) else values["qk_rope_head_dim"]
    return _mrope_fitted(values)


def _mla_sums_to_head_dim(values: dict) -> bool:
    """Whether MLA's head_dim is its query/key width (no-rope + rope parts), not the rope part alone."""
    return values.get("kv_lora_rank") is not None and values.get("head_dim") == (
        (values.get("qk_nope_head_dim") or 0) + (values.get("qk_rope_head_dim") or 0))


def _mla_head_dim(values: dict) -> int:
    return values["qk_nope_head_dim"] + values["qk_rope_head_dim"]


CONFIG_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k_experts", "num_experts_per_token")


# sections a family's rotary module takes when its config gives none (modeling_glm4v_moe.py)
MROPE_DEFAULT = {"glm4v_moe_text": [8, 12, 12], "ernie4_5_vl_moe_text": [22, 22, 20]}


def _mrope_fitted(values: dict) -> dict:
    """Multimodal rotary sections (time, height, width) rescaled to half the tiny rotary width, the rest of
    the rounding on a section no other equals (ERNIE-VL interleaves its equal height and width ones)."""
    rope = dict(values.get("rope_parameters") or {})
    sections = rope.get("mrope_section", MROPE_DEFAULT.get(values.get("model_type")))
    if not isinstance(sections, list) or not sections:
        return values
    width = values.get("qk_rope_head_dim") or int((values.get("head_dim") or 16) * rope.get(
        "partial_rotary_factor", values.get("partial_rotary_factor", 1.0)))
    half, total = width // 2, sum(sections)
    fitted = [max(1, s * half // total) for s in sections]
    fitted[next((i for i, s in enumerate(sections) if sections.count(s) == 1), 0)] += half - sum(fitted)
    return values | {"rope_parameters": rope | {"mrope_section": fitted}}


# A vision or audio tower's sizes, where it has the key: one small layer feeding the text model's width.
TOWER_SIZES = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "depth": 1, "n_layers": 1,
    "encoder_layers": 1, "num_attention_heads": 2, "num_heads": 2, "num_key_value_heads": 2,
    "encoder_attention_heads": 2, "head_dim": 16, "d_model": 32, "encoder_ffn_dim": 64,
    "out_hidden_size": _BASE["hidden_size"], "text_hidden_size": _BASE["hidden_size"],
    "output_dim": _BASE["hidden_size"], "projection_hidden_dim": 64, "projection_intermediate_size": 64,
    "mlp_dim": 64, "downsample_hidden_size": 16, "output_channels": 16, "image_size": 64,
}


# A multimodal config's own sizes, of what carries a tower's output into the text model.
BRIDGE_SIZES = {"out_hidden_size": _BASE["hidden_size"], "projector_hidden_size": 64, "projection_dim": 64}


def _shrink_tower(values: dict, widths: dict) -> dict:
    """A tower at TOWER_SIZES, its per-layer lists and overrides cut to its one layer, its own sub-towers
    likewise. Other sizes equal to the tower's width or the text model's (`widths`: old -> new) follow
    them, keeping what validators check (dots3's adapter_in_dim is the tower's width, adapter_out_dim the
    text model's)."""
    depth = next((values[k] for k in ("num_hidden_layers", "depth", "n_layers", "encoder_layers")
                  if isinstance(values.get(k), int)), None)
    widths = widths | ({values["hidden_size"]: TOWER_SIZES["hidden_size"]} if values.get("hidden_size") else {})
    values = {k: _shrink_tower(v, widths) if isinstance(v, dict) and ("hidden_size" in v or "model_type" in v)
              else v[:1] if isinstance(v, list) and depth and len(v) == depth
              else widths[v] if type(v) is int and v in widths else v for k, v in values.items()}
    if isinstance(values.get("per_layer_config"), dict):  # {"25": {overrides}} (dots3's vision experts)
        values["per_layer_config"] = {k: v for k, v in values["per_layer_config"].items() if int(k) == 0}
    return values | {k: v for k, v in TOWER_SIZES.items() if values.get(k) is not None}


def tiny_families() -> list[str]:
    return sorted(TINY_CONFIGS)


# family names (smoe.source.families) whose tiny model is their text-only model_type
_TEXT_MODEL = {"gemma4": "gemma4_text", "llama4": "llama4_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def tiny_config(family: str, **architecture):
    """The tiny config of `family`, with `architecture` values over its own (they may change shapes)."""
    from transformers import AutoConfig

    family = _TEXT_MODEL.get(family, family)
    if family not in TINY_CONFIGS:
        raise SmoeError(f"no tiny model for family {family!r}; have: {', '.join(tiny_families())}")
    overrides = TINY_CONFIGS[family]
    kwargs = dict(overrides) if family == "dbrx" else {**_BASE, **overrides}
    return AutoConfig.for_model(family, **kwargs | architecture)


def tiny_model(family: str, seed: int = 0, **architecture):
    """A randomly initialised text-only CausalLM of `family` (config values `architecture` over the tiny
    ones), in float32, in eval mode."""
    import transformers

    family = _TEXT_MODEL.get(family, family)
    config = tiny_config(family, **architecture)
    torch.manual_seed(seed)
    if family in _CAUSAL_LM:
        model = getattr(transformers, _CAUSAL_LM[family])(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return randomise(model, seed).float().eval()


def randomise(model, seed: int):
    """from_config leaves some parameters (fused experts, norms) constant: give every parameter distinct
    random values, so that a wrong slice can never compare equal by accident."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def save_tiny_model(family: str, out_dir: str | Path, seed: int = 0, layout: str | None = None, **architecture):
    """Save a tiny model of `family` to `out_dir` (config.json + model.safetensors); return the model.

    layout: None stores the routed experts the way the family's released checkpoints do;
    "per_expert" rewrites fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] as
    experts.E.{gate,up,down}_proj.weight, and "fused" does the reverse.
    """
    out_dir = Path(out_dir)
    family = _TEXT_MODEL.get(family, family)
    model = tiny_model(family, seed, **architecture)
    model.save_pretrained(out_dir, safe_serialization=True)
    layout = layout or RELEASED_LAYOUT.get(family)
    if layout == "per_expert":
        _rewrite(out_dir / "model.safetensors", _split_experts)
    elif layout == "fused":
        _rewrite(out_dir / "model.safetensors", _fuse_experts)
    elif layout is not None:
        raise SmoeError(f"unknown expert layout {layout!r} (per_expert, fused)")
    save_tiny_tokenizer(out_dir, model.config.get_text_config().vocab_size)
    return model


TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times; "
    "the sea was calm and the old man rowed out before the sun rose over the water."
)


def save_tiny_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A character-level BPE small enough for a tiny vocabulary, so tiny models can generate text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(set(TOKENIZER_TEXT))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, special_tokens=["<unk>", "</s>"], initial_alphabet=alphabet)
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(out_dir)


def _rewrite(path: Path, transform) -> None:
    from safetensors.torch import load_file, save_file

    save_file(transform(load_file(path)), path, metadata={"format": "pt"})


_FUSED = re.compile(r"^(?P<experts>.*experts)\.(?P<leaf>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<experts>.*experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _split_experts(tensors: dict) -> dict:
    out = {}
    for name, tensor in tensors.items():
        m = _FUSED.match(name)
        if not m:
            out[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            if m["leaf"] == "down_proj":
                out[f"{m['experts']}.{e}.down_proj.weight"] = tensor[e].clone()
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{m['experts']}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{m['experts']}.{e}.up_proj.weight"] = up.clone()
    return out


def _fuse_experts(tensors: dict) -> dict:
    out, groups = {}, {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            groups.setdefault(m["experts"], {})[(m["proj"], int(m["e"]))] = tensor
        else:
            out[name] = tensor
    for experts, parts in groups.items():
        count = 1 + max(e for _, e in parts)
        out[f"{experts}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[("gate_proj", e)], parts[("up_proj", e)]]) for e in range(count)])
        out[f"{experts}.down_proj"] = torch.stack([parts[("down_proj", e)] for e in range(count)])
    return out


if __name__ == "__main__":  # python -m smoe.testing.tiny_models OUT_DIR: one folder per family
    import sys

    root = Path(sys.argv[1])
    for fam in tiny_families():
        save_tiny_model(fam, root / fam)
        print(fam, json.loads((root / fam / "config.json").read_text())["model_type"])
