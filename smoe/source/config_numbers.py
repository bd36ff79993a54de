"""Reading the MoE numbers from a config: which keys hold them (CONFIG_KEYS), the text configs nested in a
wrapper's, and which decoder layers are MoE by whichever convention the config follows."""

from __future__ import annotations

from smoe.source import families

# Where configs keep the MoE numbers, most specific first ("a.b" = nested dict).
CONFIG_KEYS = {
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                    "ffn_config.moe_num_experts", "moe.num_experts"),
    "top_k": ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_top_k", "moe_k",
              "experts_per_token", "moe_router_topk", "num_selected_experts", "ffn_config.moe_top_k", "moe.experts_per_token"),
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_layers": ("num_hidden_layers", "n_layers", "num_layers", "n_layer"),
    "mtp_layers": ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers"),
    "latent_size": ("moe_latent_size",),
    "context_length": ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
}
NESTED_CONFIGS = ("text_config", "language_config", "llm_config", "thinker_config")


def resolve(config: dict) -> tuple[families.Family | None, str, list[dict]]:
    """(family or None when no model_type, model_type as given, configs to read numbers from)."""
    nested = [config[k] for k in NESTED_CONFIGS if isinstance(config.get(k), dict)]
    # A wrapper (mistral3, gemma4, llama4, qwen3_5_moe, ...) names the text model in its text_config.
    for sub in nested:
        family = families.BY_TYPE.get(families.normalise_type(sub.get("model_type")))
        if family:
            return family, sub["model_type"], [sub, config]
    model_type = config.get("model_type")
    if not model_type:
        return None, "", [*nested, config]
    return families.family_of(model_type, config), model_type, [*nested, config]


def lookup(configs: list[dict], keys: tuple[str, ...]):
    for cfg in configs:
        for key in keys:
            value = cfg
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None and not isinstance(value, dict):
                return value
    return None


def config_number(config: dict, what: str) -> int | None:
    """One of CONFIG_KEYS' numbers from a config, nested text configs first; None when absent."""
    return as_int(lookup(resolve(config or {})[2], CONFIG_KEYS[what]))


def num_layers(configs: list[dict]) -> int | None:
    n = lookup(configs, CONFIG_KEYS["num_layers"])
    if n is None:  # nemotron_h keeps only the per-layer pattern
        pattern = lookup(configs, ("layers_block_type", "hybrid_override_pattern"))
        n = len(pattern) if pattern else None
    return int(n) if n is not None else None


def config_moe_layers(configs: list[dict], n: int) -> list[int]:
    """Which of the n decoder layers are MoE, by whichever convention the config follows."""

    def get(key):
        return lookup(configs, (key,))

    explicit = get("moe_layers")  # llama4
    if isinstance(explicit, list):
        return sorted(int(i) for i in explicit)
    for key in ("layers_block_type", "layer_types"):  # nemotron_h: per-layer "moe"; others mean attention
        types = get(key)
        if isinstance(types, list) and "moe" in types:
            return [i for i, t in enumerate(types) if t == "moe"]
    pattern = get("hybrid_override_pattern")  # nemotron_h as released: "MEM*E..." (E = MoE)
    if isinstance(pattern, str):
        return [i for i, c in enumerate(pattern) if c == "E"]
    if get("enable_moe_block") is False:  # gemma4 without experts
        return []
    layers = list(range(n))
    mlp_types = get("mlp_layer_types")  # glm4_moe_lite, deepseek_v32, exaone_moe: "sparse" / "dense"
    if isinstance(mlp_types, list):  # deepseek_v4: "moe", or "hash_moe" (experts chosen by the token id)
        layers = [i for i in layers if i < len(mlp_types) and mlp_types[i] in ("sparse", "moe", "hash_moe")]
    mlp_only = get("mlp_only_layers") or []  # qwen
    step = get("decoder_sparse_step") or 1
    layers = [i for i in layers if i not in mlp_only and (i + 1) % step == 0]
    first_dense = get("first_k_dense_replace") or get("num_dense_layers") or 0  # deepseek & co; lfm2, afmoe
    freq = get("moe_layer_freq") or 1
    if isinstance(freq, list):  # megatron-style per-layer 0/1 list
        layers = [i for i in layers if i < len(freq) and freq[i]]
    else:
        layers = [i for i in layers if i >= first_dense and i % freq == 0]
    if get("moe_layer_start_index") is not None:  # ernie
        start, end = get("moe_layer_start_index"), get("moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else end
        interval = get("moe_layer_interval") or 1
        layers = [i for i in layers if start <= i <= end and (i + 1) % interval == 0]
    period = get("expert_layer_period")  # jamba
    if period:
        offset = get("expert_layer_offset") or 0
        layers = [i for i in layers if i % period == offset]
    interleave = get("interleave_moe_layer_step")  # llama4 without moe_layers
    if interleave and interleave > 1:
        layers = [i for i in layers if i % interleave == interleave - 1]
    return layers


def latent_keys(family: families.Family) -> tuple[str, ...]:
    """Config keys of the width a family's experts take in where it is not the hidden size (Nemotron-H's
    moe_latent_size; Muse Spark's moe_hidden_size, its discovered row says)."""
    return (*family.latent_keys, *CONFIG_KEYS["latent_size"])


def as_int(value) -> int | None:
    """A config number; per-layer lists (hunyuan's moe_topk) give their largest."""
    if isinstance(value, list):
        value = max(value) if value else None
    return int(value) if value is not None else None
