"""The config values the runtime trusts, each held to its kind and range, and the relations between them.

transformers builds its modules from these numbers and the compiled decode step indexes arrays by
them without bounds checks: a bad value is refused when quantising and again when a vault is opened
(one written by an older smoe may hold one), never met as a crash inside a kernel. Only keys present
are checked; a key means the same in every family that uses it.
"""

from __future__ import annotations

import json
import math

from smoe.errors import SmoeError
from smoe.source import families
from smoe.source.config_numbers import (
    CONFIG_KEYS,
    NESTED_CONFIGS,
    config_moe_layers,
    latent_keys,
    lookup,
    num_layers,
    resolve,
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# Far above any model's (the largest have ~100 layers and ~1,000 experts), far below what a per-layer or
# per-expert table of the count would exhaust memory with
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
# kind -> (test, what a value of that kind must be)
_KINDS = {
    "count": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "experts": (lambda v: _is_int(v) and 1 <= v <= MAX_EXPERTS,
                f"a positive integer up to {MAX_EXPERTS:,} (with no routed experts it is not a mixture-of-experts "
                f"model)"),
    "depth": (lambda v: _is_int(v) and 1 <= v <= MAX_LAYERS, f"a positive integer up to {MAX_LAYERS:,}"),
    "size0": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "even": (lambda v: _is_int(v) and v >= 2 and v % 2 == 0,
             "a positive even integer (rotary embeddings turn pairs of its dimensions)"),
    "even0": (lambda v: _is_int(v) and v >= 0 and v % 2 == 0,
              "an even integer >= 0 (rotary embeddings turn pairs of its dimensions)"),
    "end": (lambda v: _is_int(v) and v >= -1, "a layer number, or -1 for the last layer"),
    "positive": (lambda v: _is_real(v) and v > 0, "a positive finite number"),
    # ranges of the numbers that reach arithmetic, far outside every released config, far inside what
    # overflows or underflows: a norm epsilon of 1e300 flattens every activation, a rope base of 1e-300
    # divides by zero
    "epsilon": (lambda v: _is_real(v) and 0 < v <= 0.1, "a number in (0, 0.1]"),
    "epsilon0": (lambda v: _is_real(v) and 0 <= v <= 0.1, "a number in [0, 0.1]"),
    "base": (lambda v: _is_real(v) and 1 <= v <= 1e12, "a number in [1, 1e12]"),
    "scale": (lambda v: _is_real(v) and 1e-6 <= v <= 1e6, "a number in [1e-6, 1e6]"),
    "real": (lambda v: _is_real(v) and abs(v) <= 1e6, "a number in [-1e6, 1e6]"),
    # -1 is how older converted configs say "none" (nn.Embedding takes padding_idx=-1 as the last row)
    "token": (lambda v: (_is_int(v) and v >= -1) or (isinstance(v, list) and bool(v) and all(_is_int(i) and i >= -1
                                                                                          for i in v)),
              "a token id (-1 for none), or a list of token ids"),
    "name": (lambda v: isinstance(v, str) and bool(v), "a name (a non-empty string)"),
    "names": (lambda v: isinstance(v, list) and all(isinstance(t, str) and t for t in v), "a list of names"),
    "fraction": (lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "factors": (lambda v: isinstance(v, list) and all(_is_real(x) and x > 0 for x in v),
                "a list of positive finite numbers"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "layers": (lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v), "a list of layer numbers"),
    "frequency": (lambda v: (_is_int(v) and v >= 1) or (isinstance(v, list) and all(_is_int(i) and i in (0, 1)
                                                                                     for i in v)),
                  "a positive integer, or a list of 0/1 per layer"),
}

# config key ("a.b" = nested) -> kind, under every name a supported family gives it
CONFIG_VALUES = {
    **dict.fromkeys(CONFIG_KEYS["num_experts"], "experts"),
    **dict.fromkeys(CONFIG_KEYS["top_k"], "count"),
    **dict.fromkeys(CONFIG_KEYS["hidden_size"], "count"),
    **dict.fromkeys(CONFIG_KEYS["num_layers"], "depth"),
    **dict.fromkeys(CONFIG_KEYS["mtp_layers"], "size0"),
    **dict.fromkeys(CONFIG_KEYS["latent_size"], "count"),
    "vocab_size": "count", "max_position_embeddings": "count", "max_seq_len": "count",
    # attention heads (MLA ranks and head sizes included)
    "num_attention_heads": "count", "n_heads": "count", "num_key_value_heads": "count",
    "attn_config.kv_n_heads": "count", "num_global_key_value_heads": "count",
    "head_dim": "even0", "global_head_dim": "even", "q_lora_rank": "count", "kv_lora_rank": "count",  # head_dim 0: no rope
    "qk_rope_head_dim": "even0", "qk_nope_head_dim": "size0", "v_head_dim": "size0",  # 0 without MLA (deepseek-ocr)
    # MLP widths; shared experts may be absent (0)
    "intermediate_size": "count", "moe_intermediate_size": "count", "intermediate_size_mlp": "count",
    "ffn_config.ffn_hidden_size": "count", "moe.expert_inner_dim": "count",
    "shared_expert_intermediate_size": "size0", "moe_shared_expert_intermediate_size": "size0",
    "shared_intermediate_size": "size0", "n_shared_experts": "size0", "num_shared_experts": "size0",
    "moe_num_shared_experts": "size0", "num_shared_expert": "size0",
    # routing
    "n_group": "count", "topk_group": "count", "routed_scaling_factor": "scale", "norm_topk_prob": "flag",
    "route_scale": "scale",
    # which layers attend within a window or through another mixer (smoe.source.description)
    "max_window_layers": "size0", "attn_layer_period": "count", "attn_layer_offset": "size0",
    "full_attention_interval": "count",
    # which layers are MoE (config_moe_layers)
    "decoder_sparse_step": "count", "moe_layer_freq": "frequency", "first_k_dense_replace": "size0",
    "num_dense_layers": "size0", "interleave_moe_layer_step": "count", "expert_layer_period": "count",
    "expert_layer_offset": "size0", "moe_layer_interval": "count", "moe_layer_start_index": "size0",
    "moe_layer_end_index": "end", "mlp_only_layers": "layers", "moe_layers": "layers",
    # linear-attention and state-space layers
    "linear_num_key_heads": "count", "linear_num_value_heads": "count", "linear_key_head_dim": "count",
    "linear_value_head_dim": "count", "linear_conv_kernel_dim": "count", "mamba_d_state": "count",
    "mamba_d_conv": "count", "mamba_expand": "count", "mamba_n_heads": "count", "mamba_d_head": "count",
    "mamba_n_groups": "count", "mamba_chunk_size": "count", "mamba_num_heads": "count", "mamba_head_dim": "count",
    "ssm_state_size": "count", "n_groups": "count", "chunk_size": "count", "conv_kernel": "count",
    "block_size": "count",
    # norms, positions, attention windows and scales
    "rms_norm_eps": "epsilon", "layer_norm_eps": "epsilon", "layer_norm_epsilon": "epsilon", "norm_eps": "epsilon",
    "rope_theta": "base", "attn_config.rope_theta": "base", "partial_rotary_factor": "fraction",
    "sliding_window": "size0", "attention_chunk_size": "count", "attention_bias": "flag",
    "tie_word_embeddings": "flag", "clip_qkv": "scale", "attn_config.clip_qkv": "scale",
    "final_logit_softcapping": "scale", "attn_logit_softcapping": "scale", "embedding_multiplier": "scale",
    "attention_multiplier": "scale", "residual_multiplier": "scale", "logits_scaling": "scale",
    "swiglu_limit": "scale",
    # token ids the sampler stops at or the embedding pads with (pad_token_id checked against vocab_size)
    "eos_token_id": "token", "bos_token_id": "token", "pad_token_id": "token",
    # activations and per-layer kinds: transformers looks each up in its own tables (checked by building the
    # model when quantizing, smoe.hf.model.check_buildable)
    "hidden_act": "name", "hidden_activation": "name", "mlp_hidden_act": "name", "layer_types": "names",
    "layers_block_type": "names", "mlp_layer_types": "names",
}
# null means "none" or "derive it" for these (no low-rank q or kv, no window, head_dim = hidden / heads)
NULLABLE = frozenset({
    "q_lora_rank", "kv_lora_rank", "sliding_window", "head_dim", "global_head_dim", "moe_latent_size",
    "attention_chunk_size", "clip_qkv", "attn_config.clip_qkv", "final_logit_softcapping", "attn_logit_softcapping",
    "moe_layer_end_index", "num_global_key_value_heads", *CONFIG_KEYS["mtp_layers"],
    # null where the family's configuration class accepts it: no group routing, LayerNorm instead of RMSNorm
    "n_group", "topk_group", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps",
    "eos_token_id", "bos_token_id", "pad_token_id", "hidden_act", "layer_types", "mlp_layer_types",
})
PER_LAYER = frozenset({"moe_topk", "num_experts", "moe_intermediate_size", "num_shared_expert"})  # hunyuan: lists
ROPE_DICTS = ("rope_parameters", "rope_scaling")  # each may hold one dict per attention type (gemma)
ROPE_VALUES = {
    "rope_theta": "base", "factor": "scale", "original_max_position_embeddings": "count",
    "beta_fast": "scale", "beta_slow": "scale", "mscale": "real", "mscale_all_dim": "real",
    "attention_factor": "scale", "low_freq_factor": "scale", "high_freq_factor": "scale",
    "partial_rotary_factor": "fraction", "short_factor": "factors", "long_factor": "factors",
    "llama_4_scaling_beta": "real", "rope_type": "name",
}
ROPE_REQUIRED = frozenset({"rope_theta", "factor"})  # the other rope values may be null (unused)
# routers that score an expert group by its two best experts (torch.topk(2) within the group)
GROUP_TOP2 = frozenset({"deepseek_v3", "glm4_moe", "dots1", "exaone_moe", "nemotron_h", "mistral4"})
_ABSENT = object()


def check_model_config(config: dict, num_experts: int | None = None, where: str = "config.json") -> None:
    """Every routing and shape value the runtime uses, by each family's key names: a SmoeError naming
    the first bad one. num_experts: the routed experts actually stored, where known."""
    if not isinstance(config, dict):
        return
    family, _, configs = resolve(config)
    check_resolved(config, configs, family.name if family else None, num_experts, where)


def check_resolved(config: dict, configs: list[dict], family: str | None, num_experts: int | None, where: str) -> None:
    """check_model_config of a config already resolved into its family name and the configs to read."""
    problem = _bad_value(config)
    get = lambda *keys: lookup(configs, keys)
    for relation in (_top_k_fits, _groups_fit, _heads_fit, _attention_fits, _layer_numbers_fit, _tokens_fit):
        problem = problem or relation(get, family, num_experts)
    if problem:
        raise SmoeError(f"{where}: {problem}")


def _bad_value(config: dict) -> str | None:
    """The first value not of its key's kind, in the config and the text configs nested in it."""
    scopes = [("", config)] + [(f"{k}.", config[k]) for k in NESTED_CONFIGS if isinstance(config.get(k), dict)]
    for prefix, scope in scopes:
        for key, value, kind, nullable in _values(scope):
            test, words = _KINDS[kind]
            if isinstance(value, list) and key in PER_LAYER and value and all(test(v) for v in value):
                continue
            if not (test(value) or (value is None and nullable)):
                return f"{prefix}{key} is {_show(value)}; it must be {words}" + (" or null" if nullable else "")
    return None


def _values(scope: dict):
    """(key, value, kind, nullable) of every checked key present in one config dict."""
    for key, kind in CONFIG_VALUES.items():
        value = _get(scope, key)
        if value is not _ABSENT:
            yield key, value, kind, key in NULLABLE
    for name in ROPE_DICTS:
        rope = scope.get(name)
        if not isinstance(rope, dict):
            continue
        for prefix, table in [(name, rope)] + [(f"{name}.{k}", v) for k, v in rope.items() if isinstance(v, dict)]:
            for key, kind in ROPE_VALUES.items():
                if key in table:
                    yield f"{prefix}.{key}", table[key], kind, key not in ROPE_REQUIRED


def _get(scope: dict, key: str):
    value = scope
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def check_vault_config(config: dict, meta: dict, vault_dir) -> None:
    """What every reader of a vault checks before using it: config.json's values, and the index against them."""
    check_model_config(config, meta["num_experts"], f"{vault_dir}/config.json")
    check_index_agrees(config, meta, f"{vault_dir}/index.json")


def check_index_agrees(config: dict, meta: dict, where: str = "index.json") -> None:
    """The vault index's model type, roles, experts, top-k, MoE layers and expert shapes are those config.json
    gives (a reader sizes blobs by the index and the model by the config): a SmoeError naming the first
    index field that differs. Values the config leaves out are not compared."""
    family, model_type, configs = resolve(config or {})
    if family is None:
        return
    problem = next(filter(None, (check(meta, family, str(model_type), configs) for check in _INDEX_AGREES)), None)
    if problem:
        raise SmoeError(f"{where}: {problem}")


def _index_names(meta, family, model_type, configs) -> str | None:
    if meta.get("model_type") not in (None, model_type):
        return f"model_type is {_show(meta['model_type'])}; config.json's is {_show(model_type)}"
    if meta["roles"] != list(family.roles):
        return f"roles are {_show(meta['roles'])}; {family.name} experts have {_show(list(family.roles))}"
    return None


def _index_counts(meta, family, model_type, configs) -> str | None:
    for name, keys in (("num_experts", CONFIG_KEYS["num_experts"]), ("top_k", CONFIG_KEYS["top_k"])):
        value = lookup(configs, keys)
        if _is_int(value) and meta.get(name) != value:
            return f"{name} is {_show(meta.get(name))}; config.json says {value}"
    return None


def _index_layers(meta, family, model_type, configs) -> str | None:
    n = num_layers(configs)
    if n is None or any(layout.marker for layout in family.layouts):
        return None  # MoE blocks told apart only by names (moondream): the names decided
    mtp = int(lookup(configs, CONFIG_KEYS["mtp_layers"]) or 0)
    promised, stored = set(config_moe_layers(configs, n)), set(meta["moe_layers"])
    odd = sorted((promised - stored) | {layer for layer in stored - promised if not n <= layer < n + mtp})
    if odd:
        return f"moe_layers {ranges(sorted(stored))} differ from config.json's MoE layers at layer {odd[0]}"
    return None


def _index_shapes(meta, family, model_type, configs) -> str | None:
    inner = lookup(configs, family.intermediate_keys)
    hidden = lookup(configs, CONFIG_KEYS["hidden_size"])
    outer = lookup(configs, latent_keys(family)) or hidden
    if not (_is_int(inner) and _is_int(outer)):
        return None  # per-layer widths, or no widths in the config: the checkpoint's shapes decided
    shapes = {"gate": [inner, outer], "up": [inner, outer], "down": [outer, inner]}
    for role, shape in meta["expert_shapes"].items():
        if shape != shapes[role]:
            return f"expert_shapes[{role!r}] is {shape}; config.json's sizes make it {shapes[role]} ([out, in])"
    return None


_INDEX_AGREES = (_index_names, _index_counts, _index_layers, _index_shapes)


def show_value(value) -> str:
    return _show(value)


def _show(value) -> str:
    """A config value as config.json spells it (true, null, NaN, "4"), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _smallest(value):
    return min(value) if isinstance(value, list) else value


def _top_k_fits(get, family, num_experts) -> str | None:
    counts = [_smallest(c) for c in (num_experts, get(*CONFIG_KEYS["num_experts"])) if c is not None]
    if not counts:
        return None
    experts = min(counts)
    for key in CONFIG_KEYS["top_k"]:
        k = get(key)
        if k is not None and max(k if isinstance(k, list) else [k]) > experts:
            return f"{key} is {_show(k)}: more than the {experts} routed experts"
    return None


def _groups_fit(get, family, num_experts) -> str | None:
    """DeepSeek-style routing: keep topk_group of n_group expert groups, then pick top-k experts in them."""
    groups, kept = get("n_group"), get("topk_group")
    experts = num_experts or _smallest(get(*CONFIG_KEYS["num_experts"]))
    if groups is None or experts is None:
        return None
    top_k = _smallest(get(*CONFIG_KEYS["top_k"]))
    per_group = experts // groups
    if experts % groups:
        return f"n_group {groups} does not divide the {experts} routed experts into equal groups"
    if kept is not None and kept > groups:
        return f"topk_group is {kept}: more than n_group {groups}"
    if kept is not None and top_k is not None and kept * per_group < top_k:
        return f"topk_group {kept} of {groups} groups keeps {kept * per_group} experts, fewer than the {top_k} to pick"
    if family in GROUP_TOP2 and per_group < 2:
        return f"n_group {groups} leaves {per_group} expert per group; {family} scores each group by its best two"
    return None


def _heads_fit(get, family, num_experts) -> str | None:
    heads, hidden = get("num_attention_heads", "n_heads"), get(*CONFIG_KEYS["hidden_size"])
    for key in ("num_key_value_heads", "attn_config.kv_n_heads", "num_global_key_value_heads"):
        kv = get(key)
        if heads is not None and kv is not None and heads % kv:
            return f"num_attention_heads {heads} is not a multiple of {key} {kv}"
    key_heads, value_heads = get("linear_num_key_heads"), get("linear_num_value_heads")
    if key_heads is not None and value_heads is not None and value_heads % key_heads:
        return f"linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads {key_heads}"
    # MLA families map head_dim to qk_rope_head_dim; transformers derives hidden // heads (glm4_moe's default: 42)
    derived = get("head_dim", "qk_rope_head_dim") is None and heads is not None and hidden is not None
    if derived and (hidden // heads < 2 or hidden // heads % 2):
        return (f"no head_dim, and hidden size {hidden} over {heads} heads is not an even head size "
                f"(head_dim = hidden size // num_attention_heads)")
    return None


def _attention_fits(get, family, num_experts) -> str | None:
    """A window of 0 means none only where use_sliding_window says so (qwen2 writes it so); elsewhere
    transformers masks every key. MLA (a kv_lora_rank) needs rotary and value heads in the families of
    the table (DeepSeek's modules fail without); a family transformers adds (GLM-5-Next's rotary-free
    latent attention) is left to its own configuration class's validators."""
    if get("sliding_window") == 0 and get("use_sliding_window") is not False:
        return "sliding_window is 0, a window that holds no token (give null for none)"
    rotary_mla = family in families.BY_NAME
    if get("kv_lora_rank") is not None and 0 in (get("qk_rope_head_dim") if rotary_mla else 1, get("v_head_dim")):
        return (f"kv_lora_rank {get('kv_lora_rank')} (MLA attention) needs a positive qk_rope_head_dim and v_head_dim, "
                f"got {get('qk_rope_head_dim')} and {get('v_head_dim')}")
    return None


def _layer_numbers_fit(get, family, num_experts) -> str | None:
    n = get(*CONFIG_KEYS["num_layers"])
    for key in ("mlp_only_layers", "moe_layers"):
        beyond = [i for i in get(key) or [] if n is not None and i >= n]
        if beyond:
            return f"{key} names layer {beyond[0]}, beyond the {n} layers"
    period, offset = get("expert_layer_period"), get("expert_layer_offset")
    if period is not None and offset is not None and offset >= period:
        return f"expert_layer_offset {offset} is not below expert_layer_period {period}"
    return None


def _tokens_fit(get, family, num_experts) -> str | None:
    """The padding token is a row of the embedding (an end-of-text id past the vocabulary is never sampled:
    harmless, and tiny test models keep their family's)."""
    vocab, pad = get("vocab_size"), get("pad_token_id")
    if _is_int(vocab) and _is_int(pad) and pad >= vocab:
        return f"pad_token_id is {pad}: past the vocabulary of {vocab} (the embedding's padding row)"
    return None


def ranges(values: list[int]) -> str:
    """Layer or expert numbers for a message: first..last, or the few there are."""
    if not values:
        return "none"
    return f"{values[0]}..{values[-1]}" if len(values) > 2 else ", ".join(map(str, values))
