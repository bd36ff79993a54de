"""What a model computes, as the decoders need it: a description read once from the config.

`smoe.source.families` and the modules beside it say where a checkpoint's tensors are; this module says
what the model does with them: the attention kind, the routing kind, the experts' activation, shared
experts and dense layers, plus the trunk features outside the common decoder layout. They are the only
modules that read config keys. The fast decoders state the descriptions they cover
(smoe.runtime.weights.fast_decoder_gap), the generic decoder
runs them all through the family's transformers modules, and the one routing function
(smoe.moe.routing.route) computes every routing kind stated here but a family's own (`custom`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from smoe.errors import SmoeError
from smoe.source import families
from smoe.source.config_checks import check_model_config
from smoe.source.config_numbers import CONFIG_KEYS, as_int, config_moe_layers, lookup, num_layers, resolve

# Trunk features outside the common decoder layout (pre-norm RMSNorm layers, rotary over the whole
# head in the half-split layout, no extra scales). A decoder that does not implement one must not
# claim a description that has it.
EXTRAS = {
    "layer_norm": "LayerNorm instead of RMSNorm",
    "norm_offset": "RMSNorm scaled by (1 + weight)",
    "sandwich_norms": "norms after attention and after the MLP as well as before",
    "post_norms": "norms after attention and after the MLP instead of before",
    "partial_rotary": "rotary embedding over part of each head",
    "interleaved_rotary": "rotary embedding over adjacent pairs instead of the two halves",
    "no_rope_layers": "layers without rotary embedding",
    "clip_qkv": "q, k and v clamped",
    "multipliers": "scales on the embedding, residual branches, attention or logits",
    "softcap": "logits soft-capped",
    "attention_gate": "attention output gated",
    "temperature_tuning": "query scaling by position",
    "latent_experts": "experts working in a projected latent space",
    "expert_scales": "per-expert output scales",
    "post_expert_norm": "a norm on each expert's output",
    "moe_output_norm": "a norm on the MoE block's output",
    "router_norm": "a norm or scale on the router's input",
    "dense_mlp_activation": "dense layers with another activation than the experts'",
    "chunked_attention": "attention within fixed chunks",
    "sparse_attention": "an indexer choosing the keys each query attends to",
    "rope_per_layer_type": "another rotary base on sliding layers than on full ones",
    "parallel_block": "attention and the MLP side by side on one norm, both added to the residual",
    "shared_average": "the shared experts' output averaged with the routed ones' instead of added",
    "sliding_kv_heads": "sliding layers with their own count of key/value heads",
    "sliding_sinks": "sink logits on the sliding layers only",
    "value_head_dim": "value heads of another width than query and key heads",
    "value_scale": "values scaled",
    "indexer_interleaved_rotary": "an indexer whose rotary embedding turns adjacent pairs instead of the two halves",
    "shared_indexer": "layers reusing the keys the previous indexer chose instead of an indexer of their own",
    "softplus_gate": "attention output times the softplus of a learned gate, per head or per element",
    "heads_per_layer": "layers with their own count of query heads",
    "sigmoid_gate": "attention output times the sigmoid of a learned gate of the layer's input, per head or per element",
    "swiglu_limit": "SwiGLU's activated gate clamped from above and its up projection both ways, at a bound per layer",
    "mlp_bias": "biases on the dense and shared MLPs' projections",
    "bidirectional_attention": "attention to later positions as well as earlier ones",
    "swiglu_gate_limit": "the experts' SwiGLU gate clamped from above before its activation, their up projection "
                         "both ways",
    "hyper_connections": "several residual streams, mixed into each branch's input and given its output by learned "
                         "gates",
    "block_sparse_attention": "an indexer choosing the blocks of keys each query attends to",
    "clamped_mlps": "the dense and shared MLPs' SwiGLU clamped as the experts' (gpt-oss's alpha and limit)",
    "latent_scale": "MLA's normalised query and key/value latents times sqrt(hidden_size / their rank)",
    "rope_key_norm": "an RMSNorm on MLA's shared rotary key before it turns",
    "mla_per_layer_type": "sliding layers with MLA sizes of their own (heads, latent rank, head widths)",
    "shared_kv_head": "one key/value head whose keys are its values, the rotary part turned back on the output",
    "grouped_output": "the attention output through a low-rank projection per group of heads, then one to the hidden "
                      "size",
    "compressed_attention": "keys compressed from blocks of positions beside the window's, on some layers chosen by "
                            "an indexer",
    "hash_routing": "layers whose experts the token id chooses (a fixed table), weighted by the router's scores",
    "undescribed": "a family this description does not cover",
}


@dataclass(frozen=True)
class Attention:
    kind: str  # "gqa" (multi-head and grouped-query included) | "mla" (DeepSeek's low-rank latent attention)
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: str | None = None  # None | "head": RMSNorm over each head | "full": over all heads together |
    # "head_after_rotary": over each head once it is rotated (HunYuan) | "l2_after_rotary": L2 norm after it (Llama 4)
    bias: bool = False  # q/k/v projections with biases
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers attending within the window
    sinks: bool = False  # learned per-head sink logits (gpt-oss)
    mixer_layers: tuple[int, ...] = ()  # layers with linear attention or a state-space mixer instead
    nope_layers: tuple[int, ...] = ()  # the extra no_rope_layers' layers, where the rule can list them
    # the extra temperature_tuning as Mistral 4 computes it, (beta, length): each query at position p scaled by
    # 1 + beta * log(1 + floor(p / length)); None where the rule does not read it
    query_temperature: tuple[float, int] | None = None
    output_gate: bool = False  # the extra attention_gate as AFMoE computes it: sigmoid(gate_proj h) on each output
    # the same gate as Qwen3-Next lays it out: its rows in q_proj, after each head's query rows ([q_h; gate_h] per head)
    query_gate: bool = False
    latent_dim: int = 0  # MLA: width of the compressed K/V latent (kv_lora_rank), what a cache keeps per token
    rope_key_dim: int = 0  # MLA: width of the rotary key all heads share (qk_rope_head_dim), cached beside it
    # MLA: the eps of the query and latent norms. transformers' MLA modules (DeepSeek-V2/V3/V3.2, GLM-4.7-Flash,
    # Mistral 4) build q_a_layernorm and kv_a_layernorm without rms_norm_eps, so with their RMSNorm's default;
    # GLM-5.3's with rms_norm_eps.
    latent_norm_eps: float = 1e-6


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid" of the router logits
    normalise: bool = True  # the k weights divided by their sum
    normalise_eps: float = 0.0  # added to that sum
    correction_bias: bool = False  # a per-expert bias added to the scores for the choice only
    choice_by_logits: bool = False  # that bias added to the logits instead: the choice by logits + bias (Kolibri)
    n_group: int = 1  # group-limited choice: experts in n_group groups, only the best topk_group used
    topk_group: int = 1
    group_score: str = "top2"  # a group's score: its best two scores summed ("top2") or its best ("max")
    scale: float = 1.0  # routed scaling factor on the weights
    router_bias: bool = False  # the router's linear layer has a bias
    weight_input: bool = False  # the weight scales the expert's input instead of its output
    custom: str | None = None  # a routing only the family's own module computes, named


@dataclass(frozen=True)
class Experts:
    intermediate_size: int | None
    activation: str = "silu"  # transformers' ACT2FN name
    gated: bool = True  # act(gate) * up; else act(up)
    clamp: tuple[float, float] | None = None  # (alpha, limit) of gpt-oss's clamped SwiGLU
    biases: bool = False  # per-expert projection biases


@dataclass(frozen=True)
class Multipliers:
    """The numbers of the extra "multipliers" (Granite's): neutral values change nothing."""

    embedding: float = 1.0  # the embeddings times this
    attention: float | None = None  # the softmax scale, in place of 1 / sqrt(head_dim)
    residual: float = 1.0  # each residual branch (attention, the MLP or MoE block) times this before it is added
    logits: float = 1.0  # the logits divided by this


@dataclass(frozen=True)
class ModelDescription:
    family: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    attention: Attention
    routing: Routing
    experts: Experts
    moe_layers: tuple[int, ...]
    shared_experts: int = 0  # shared experts every token runs, besides the routed ones
    shared_gate: bool = False  # the shared experts' output scaled by sigmoid(a learned gate of the input)
    extras: tuple[str, ...] = ()  # keys of EXTRAS
    multipliers: Multipliers | None = None  # the extra multipliers' numbers, where the rule reads them
    # the extra sandwich_norms as AFMoE lays them out: the attention's and the MLP's outputs normalised before
    # they join the residual stream, beside the usual norms of their inputs
    output_norms: bool = False
    # the extra moe_output_norm as AXK1 computes it: the MoE block's output (routed and shared experts) normalised
    moe_output_norm: bool = False
    # False: the extra post_norms as OLMo-2 lays them out, output_norms without norms on the branches' inputs
    input_norms: bool = True

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers with an MLP (or nothing routed) instead of routed experts."""
        return tuple(i for i in range(self.num_layers) if i not in set(self.moe_layers))


# ----- reading a description from a config ------------------------------------------------------
#
# Each family's facts follow its transformers modeling code (the generic decoder runs that code, and
# tests compare `route` with its routers on a tiny model of every family).

def describe_model(config: dict) -> ModelDescription:
    """The description of the model a config (config.json's dict) defines; SmoeError when the
    family is unknown or a value it reads is out of its range (config_checks.check_model_config: a decoder
    built from the description alone trusts them as the generic decoder's transformers modules do)."""
    family, model_type, configs = resolve(config or {})
    if family is None:
        raise SmoeError("config has no model_type: cannot tell the model family")
    check_model_config(config)
    c = _Config(configs)
    n_layers = num_layers(configs) or 0
    moe_layers = tuple(config_moe_layers(configs, n_layers))
    rule = _RULES.get(families.normalise_type(model_type)) or _RULES.get(family.name, _undescribed)
    facts = rule(c, n_layers)
    hidden = int(c.get(*CONFIG_KEYS["hidden_size"], default=0))
    heads = int(c.get("num_attention_heads", "n_heads", default=1))
    attention = Attention(
        kind=facts.pop("attention_kind", "gqa"), heads=heads,
        kv_heads=int(c.get("num_key_value_heads", "attn_config.kv_n_heads", default=heads)),
        head_dim=int(c.get("head_dim", default=0) or hidden // heads), qk_norm=facts.pop("qk_norm", None),
        bias=bool(facts.pop("attention_bias", c.get("attention_bias", default=False))),
        sliding_window=c.get("sliding_window") or None, sliding_layers=facts.pop("sliding_layers", ()),
        sinks=facts.pop("sinks", False), mixer_layers=facts.pop("mixer_layers", _typed_layers(c, MIXER_TYPES)),
        latent_dim=facts.pop("latent_dim", 0), rope_key_dim=facts.pop("rope_key_dim", 0),
        nope_layers=facts.pop("nope_layers", ()), query_temperature=facts.pop("query_temperature", None),
        output_gate=facts.pop("output_gate", False), query_gate=facts.pop("query_gate", False),
        latent_norm_eps=facts.pop("latent_norm_eps", Attention.latent_norm_eps),
    )
    if attention.sliding_window is None:
        attention = replace(attention, sliding_layers=())
    routing = Routing(num_experts=int(c.get(*CONFIG_KEYS["num_experts"], default=0)),
                      top_k=as_int(c.get(*CONFIG_KEYS["top_k"], default=1)), **facts.pop("routing"))
    experts = Experts(intermediate_size=as_int(c.get(*family.intermediate_keys)),
                      **({"activation": str(c.get("hidden_act", default="silu"))} | facts.pop("experts", {})))
    return ModelDescription(
        family=family.name, model_type=str(model_type), hidden_size=hidden, num_layers=n_layers,
        vocab_size=int(c.get("vocab_size", default=0)), attention=attention, routing=routing, experts=experts,
        moe_layers=moe_layers, shared_experts=int(facts.pop("shared_experts", 0)),
        shared_gate=facts.pop("shared_gate", False), extras=tuple(sorted(set(facts.pop("extras", ())))),
        multipliers=facts.pop("multipliers", None), output_norms=facts.pop("output_norms", False),
        moe_output_norm=facts.pop("moe_output_norm", False), input_norms=facts.pop("input_norms", True),
    )


class _Config:
    def __init__(self, configs: list[dict]):
        self.configs = configs

    def get(self, *keys: str, default=None):
        value = lookup(self.configs, keys)
        return default if value is None else value


MIXER_TYPES = ("linear_attention", "conv", "mamba", "mamba2", "mlp", "moe")  # layer_types that are not attention


def _typed_layers(c: _Config, kinds) -> tuple[int, ...]:
    types = c.get("layer_types", "layers_block_type")
    return tuple(i for i, t in enumerate(types) if t in kinds) if isinstance(types, list) else ()


def _sliding(c: _Config, n: int, default=None) -> tuple[int, ...]:
    """Layers attending within the window: by layer_types where the config lists them, else
    `default(n)` (the family's rule), else every layer when a window is set."""
    if isinstance(c.get("layer_types"), list):
        return _typed_layers(c, ("sliding_attention",))
    if default is not None:
        return default(n)
    return tuple(range(n)) if c.get("sliding_window") else ()


def _normalise(c: _Config, default: bool) -> bool:
    return bool(c.get("norm_topk_prob", default=default))


def _scale(c: _Config, key: str = "routed_scaling_factor", default: float = 1.0) -> float:
    return float(c.get(key, default=default))


def _groups(c: _Config, group_score: str = "top2") -> dict:
    return dict(n_group=int(c.get("n_group", default=1) or 1), topk_group=int(c.get("topk_group", default=1) or 1),
                group_score=group_score)


def _sigmoid_biased(c: _Config, normalise_default: bool = True, eps: float = 1e-20, groups: bool = True,
                    scale_key: str = "routed_scaling_factor", scale_default: float = 1.0) -> dict:
    """DeepSeek-V3's routing and its descendants: sigmoid scores, choice by score + correction bias."""
    return dict(scoring="sigmoid", correction_bias=True, normalise=_normalise(c, normalise_default),
                normalise_eps=eps, scale=_scale(c, scale_key, scale_default), **(_groups(c) if groups else {}))


def _undescribed(c: _Config, n: int) -> dict:
    """A family whose computation is not described here: only its transformers modules run it."""
    return dict(routing=dict(custom="not described"), extras=("undescribed",))


def _standard(c: _Config, n: int) -> dict:
    """Softmax top-k routing, SiLU-gated experts, GQA: Qwen3-MoE's layout."""
    return dict(routing=dict(normalise=_normalise(c, False)), qk_norm="head",
                sliding_layers=_sliding(c, n) if c.get("use_sliding_window", default=False) else ())


def _qwen2_moe(c, n):
    window = c.get("use_sliding_window", default=False)
    rule = lambda n: tuple(i for i in range(n) if i % 2 == 0 and i < c.get("max_window_layers", default=n))
    return dict(routing=dict(normalise=_normalise(c, False)), attention_bias=c.get("qkv_bias", default=True),
                sliding_layers=_sliding(c, n, rule) if window else (),
                shared_experts=int(bool(c.get("shared_expert_intermediate_size", default=0))), shared_gate=True)


def _qwen3_next(c, n, normalise=None):
    """Gated delta-net mixers between full-attention layers whose output gate rides on q_proj (per head its query
    rows, then its gate's); every norm scales by 1 + weight; Qwen2-MoE's gated shared expert. Qwen3.5-MoE's
    multimodal checkpoint adds M-RoPE, plain rotary on text (as _qwen3_vl_moe)."""
    interval = c.get("full_attention_interval", default=4)
    mixers = _typed_layers(c, ("linear_attention",)) or tuple(i for i in range(n) if (i + 1) % interval)
    return dict(routing=dict(normalise=_normalise(c, True) if normalise is None else normalise), qk_norm="head",
                mixer_layers=mixers, shared_experts=int(bool(c.get("shared_expert_intermediate_size", default=0))),
                shared_gate=True, output_gate=True, query_gate=True,
                extras=("norm_offset", "attention_gate", "partial_rotary"))


def _olmoe(c, n):
    return dict(routing=dict(normalise=_normalise(c, False)), qk_norm="full",
                extras=("clip_qkv",) if c.get("clip_qkv") else ())


def _mla(c: _Config) -> dict:
    """DeepSeek's low-rank latent attention, with the widths of what it caches per token."""
    return dict(attention_kind="mla", latent_dim=int(c.get("kv_lora_rank", default=0)),
                rope_key_dim=int(c.get("qk_rope_head_dim", default=0)))


def _deepseek_v2(c, n):
    grouped = c.get("topk_method", default="greedy") == "group_limited_greedy"
    return dict(routing=dict(normalise=False, scale=_scale(c), **(_groups(c, "max") if grouped else {})),
                **_mla(c), shared_experts=c.get("n_shared_experts", default=2) or 0,
                extras=("interleaved_rotary",))


def _deepseek_v3(c, n):
    return dict(routing=_sigmoid_biased(c), **_mla(c), shared_experts=c.get("n_shared_experts", default=1) or 0,
                extras=("interleaved_rotary",) if c.get("rope_interleave", default=True) else ())


def _deepseek_v32(c, n):
    facts = _deepseek_v3(c, n)
    return facts | dict(extras=(*facts.get("extras", ()), "sparse_attention"))


def _glm_moe_dsa(c, n):
    """DeepSeek-V3.2's facts with rotary over adjacent pairs everywhere, the indexer's included; the layers that
    indexer_types marks "shared" reuse the previous indexer layer's choice of keys."""
    facts = _deepseek_v3(c, n)
    shared = "shared" in (c.get("indexer_types") or ())
    return facts | dict(extras=("interleaved_rotary", "sparse_attention", "indexer_interleaved_rotary",
                                *(("shared_indexer",) if shared else ())))


def _mistral4(c, n):
    """DeepSeek-V3's MLA with Mistral 4's query temperature (rope_parameters' llama_4_scaling_beta over
    original_max_position_embeddings)."""
    beta = c.get("rope_parameters.llama_4_scaling_beta", "rope_scaling.llama_4_scaling_beta")
    length = c.get("rope_parameters.original_max_position_embeddings",
                   "rope_scaling.original_max_position_embeddings")
    return dict(routing=dict(normalise=_normalise(c, True), normalise_eps=1e-20, scale=_scale(c),
                             **_groups(c, "top2")),
                **_mla(c), shared_experts=c.get("n_shared_experts", default=1) or 0,
                query_temperature=(float(beta), int(length)) if beta is not None and length else None,
                extras=("interleaved_rotary", "temperature_tuning"))


def _glm4_moe(c, n):
    return dict(routing=_sigmoid_biased(c), qk_norm="head" if c.get("use_qk_norm", default=False) else None,
                shared_experts=c.get("n_shared_experts", default=1) or 0, extras=("partial_rotary",))


def _solar_open(c, n):
    """GLM-4.5's MoE block in Llama's decoder layer: no q/k norm, rotary over the whole head."""
    return dict(routing=_sigmoid_biased(c), shared_experts=c.get("n_shared_experts", default=1) or 0)


def _sarvam_moe(c, n):
    """GLM-4.5's modules with q/k norm and rotary over the whole head (its config skips the partial default)."""
    return dict(routing=_sigmoid_biased(c), qk_norm="head" if c.get("use_qk_norm", default=True) else None,
                attention_bias=c.get("use_qkv_bias", "attention_bias", default=False),
                shared_experts=c.get("n_shared_experts", "num_shared_experts", default=1) or 0)


def _sarvam_mla(c, n):
    """DeepSeek-V3's modules under other names for the shared-expert count."""
    facts = _deepseek_v3(c, n)
    return facts | dict(shared_experts=c.get("n_shared_experts", "num_shared_experts", default=1) or 0)


def _mellum(c, n):
    """Qwen3-MoE's modules, always normalised; sliding layers take another rotary base than full ones,
    which the layer library does not have (its one rotary table): a gap only where a layer slides."""
    sliding = _sliding(c, n)
    return dict(routing=dict(normalise=_normalise(c, True)), qk_norm="head", sliding_layers=sliding,
                extras=("rope_per_layer_type",) if sliding else ())


def _hy_v3(c, n):
    """Sigmoid scores chosen with a correction bias (kept on the MoE block), always normalised, scaled by
    router_scaling_factor; per-head q/k norm; ungated shared experts."""
    return dict(routing=dict(scoring="sigmoid", correction_bias=True, normalise=True, normalise_eps=1e-20,
                             scale=_scale(c, "router_scaling_factor")),
                qk_norm="head", shared_experts=c.get("num_shared_experts", default=1) or 0)


def _mixtral(c, n):
    return dict(routing=dict(normalise=True), sliding_layers=_sliding(c, n))


def _minimax(c, n):
    mixers = _typed_layers(c, ("linear_attention",)) or tuple(i for i in range(n) if i % 2)
    return dict(routing=dict(normalise=True), sliding_layers=_sliding(c, n), mixer_layers=mixers,
                extras=("multipliers",))


def _minimax_m2(c, n):
    return dict(routing=dict(scoring="sigmoid", correction_bias=True, normalise=True), qk_norm="full",
                extras=("partial_rotary",))


def _phimoe(c, n):
    return dict(routing=dict(custom="sparsemixer"), sliding_layers=_sliding(c, n), extras=("layer_norm",))


def _jamba(c, n):
    """Attention without rotary on every layer that is not a Mamba mixer."""
    period, offset = c.get("attn_layer_period", default=8), c.get("attn_layer_offset", default=4)
    mixers = tuple(i for i in range(n) if i % period != offset)
    return dict(routing=dict(normalise=False), mixer_layers=mixers, attention_bias=False,
                nope_layers=tuple(i for i in range(n) if i not in mixers), extras=("no_rope_layers",))


def _ernie4_5_moe(c, n):
    return dict(routing=dict(correction_bias=True, normalise=True), attention_bias=c.get("use_bias", default=False),
                shared_experts=c.get("moe_num_shared_experts", default=2) or 0, extras=("interleaved_rotary",))


def _hunyuan_v1_moe(c, n):
    return dict(routing=dict(normalise=True), qk_norm="head_after_rotary", shared_experts=1)


def _dots1(c, n):
    return dict(routing=_sigmoid_biased(c, normalise_default=False), qk_norm="head", sliding_layers=_sliding(c, n),
                shared_experts=c.get("n_shared_experts", default=1) or 0)


def _exaone_moe(c, n):
    """Where a window is set, the layers that do not slide have no rotary (NoPE); without layer_types, every
    sliding_window_pattern-th layer is such a full one."""
    pattern = c.get("sliding_window_pattern", default=4)
    sliding = _sliding(c, n, lambda n: tuple(i for i in range(n) if (i + 1) % pattern)) if c.get("sliding_window") else ()
    nope = tuple(i for i in range(n) if i not in sliding) if c.get("sliding_window") else ()
    return dict(routing=_sigmoid_biased(c, scale_default=2.5), qk_norm="head", attention_bias=False,
                sliding_layers=sliding, shared_experts=c.get("num_shared_experts", default=1) or 0,
                nope_layers=nope, extras=("no_rope_layers",) if nope else ())


def _afmoe(c, n):
    """Rotary on the sliding layers only (without layer_types every global_attn_every_n_layers-th layer is a
    full one); the output gate and norms around both branches; muP's embeddings times sqrt(hidden)."""
    every = c.get("global_attn_every_n_layers", default=4)
    sliding = _sliding(c, n, lambda n: tuple(i for i in range(n) if (i + 1) % every))
    nope = tuple(i for i in range(n) if i not in sliding)
    mup = bool(c.get("mup_enabled", default=False))
    hidden = int(c.get(*CONFIG_KEYS["hidden_size"], default=0))
    return dict(routing=dict(scoring="sigmoid", correction_bias=True, normalise=True, normalise_eps=1e-20,
                             scale=_scale(c, "route_scale")),
                qk_norm="head", sliding_layers=sliding, shared_experts=c.get("num_shared_experts", default=2) or 0,
                nope_layers=nope, output_gate=True, output_norms=True,
                multipliers=Multipliers(embedding=hidden ** 0.5) if mup else None,
                extras=("sandwich_norms", "attention_gate", *(("no_rope_layers",) if nope else ()),
                        *(("multipliers",) if mup else ())))


def _lfm2_moe(c, n):
    return dict(routing=dict(scoring="sigmoid", correction_bias=bool(c.get("use_expert_bias", default=True)),
                             normalise=_normalise(c, True), normalise_eps=1e-6, scale=_scale(c)),
                qk_norm="head", attention_bias=False)


def _gpt_oss(c, n):
    return dict(routing=dict(normalise=True, router_bias=True),
                experts=dict(clamp=(1.702, float(c.get("swiglu_limit", default=7.0))), biases=True),
                sliding_layers=_sliding(c, n, lambda n: tuple(range(0, n, 2))), sinks=True,
                attention_bias=c.get("attention_bias", default=True))


def _llama4(c, n):
    return dict(routing=dict(scoring="sigmoid", normalise=False, weight_input=True),
                qk_norm="l2_after_rotary" if c.get("use_qk_norm", default=True) else None, shared_experts=1,
                extras=("interleaved_rotary", "no_rope_layers", "temperature_tuning", "chunked_attention"))


def _granitemoe(c, n):
    shared = c.get("shared_intermediate_size", default=0)
    numbers = Multipliers(embedding=float(c.get("embedding_multiplier", default=1.0)),
                          attention=float(c.get("attention_multiplier", default=1.0)),
                          residual=float(c.get("residual_multiplier", default=1.0)),
                          logits=float(c.get("logits_scaling", default=1.0)))
    return dict(routing=dict(normalise=True), shared_experts=int(bool(shared)), multipliers=numbers,
                extras=("multipliers",))


def _granitemoehybrid(c, n):
    """Granite's multipliers; Mamba mixers where layer_types says so; attention without rotary unless
    position_embedding_type is "rope"."""
    facts = _granitemoe(c, n)
    facts["shared_experts"] = 1
    if c.get("position_embedding_type") != "rope":
        mixers = _typed_layers(c, MIXER_TYPES)
        facts["nope_layers"] = tuple(i for i in range(n) if i not in mixers)
        facts["extras"] += ("no_rope_layers",)
    return facts


def _gemma4(c, n):
    return dict(routing=dict(custom="per-expert scales over a normalised router input"), qk_norm="head",
                experts=dict(activation=str(c.get("hidden_activation", default="gelu_pytorch_tanh"))),
                sliding_layers=_sliding(c, n), shared_experts=1,
                extras=("sandwich_norms", "partial_rotary", "multipliers"))


def _nemotron_h(c, n):
    attention = _typed_layers(c, ("full_attention", "attention"))
    pattern = c.get("hybrid_override_pattern")
    if not attention and isinstance(pattern, str):
        attention = tuple(i for i, ch in enumerate(pattern) if ch == "*")
    return dict(routing=_sigmoid_biased(c), attention_bias=False,
                experts=dict(activation=str(c.get("mlp_hidden_act", default="relu2")), gated=False),
                mixer_layers=tuple(i for i in range(n) if i not in attention),
                shared_experts=int(bool(c.get("moe_shared_expert_intermediate_size", default=0))),
                extras=("no_rope_layers", *(("latent_experts",) if c.get("moe_latent_size") else ())))


def _dbrx(c, n):
    p = c.get("ffn_config.moe_normalize_expert_weights", default=1.0)
    return dict(routing=dict(normalise=p == 1, custom=None if p in (1, None) else f"p-norm {p}"),
                experts=dict(activation=str(c.get("ffn_config.ffn_act_fn.name", default="silu"))),
                extras=("layer_norm", *(("clip_qkv",) if c.get("attn_config.clip_qkv") else ())))


def _qwen3_vl_moe(c, n):
    """Qwen3-MoE's layers under a multimodal checkpoint, the router always normalised. Its M-RoPE gives each
    frequency the position of one of its sections (time, height, width); text alone has the same position in
    every section, which is plain rotary."""
    return dict(routing=dict(normalise=True), qk_norm="head")


def _glm4v_moe(c, n):
    """GLM-4.5's layers under a multimodal checkpoint, its M-RoPE plain rotary on text (as _qwen3_vl_moe)."""
    return _glm4_moe(c, n)


def _aria(c, n):
    """Mixtral's routing (a softmax over the chosen logits is the normalised softmax), Llama's attention, shared
    experts of hidden_act beside SiLU-gated routed ones."""
    dense = str(c.get("hidden_act", default="silu"))
    return dict(routing=dict(normalise=True), experts=dict(activation="silu"),
                shared_experts=c.get("moe_num_shared_experts", default=2) or 0,
                extras=("dense_mlp_activation",) if dense != "silu" else ())


def _deepseek_ocr2(c, n):
    """DeepSeek-V2's MoE block (softmax, not normalised, scaled) under Llama's attention."""
    grouped = c.get("topk_method", default="greedy") == "group_limited_greedy"
    return dict(routing=dict(normalise=False, scale=_scale(c), **(_groups(c, "max") if grouped else {})),
                shared_experts=c.get("n_shared_experts", default=2) or 0)


def _flint(c, n):
    """Sink logits on every layer; rotary only on the sliding layers (the full ones, and every layer without a
    window, have none); sigmoid scores without a correction bias; an ungated shared expert."""
    window = c.get("sliding_window")
    sliding = _sliding(c, n) if window else ()
    nope = tuple(i for i in range(n) if i not in sliding)
    return dict(routing=dict(scoring="sigmoid", normalise=_normalise(c, True)), qk_norm="head", sinks=True,
                sliding_layers=sliding, nope_layers=nope,
                shared_experts=int(bool(c.get("shared_expert_intermediate_size", default=0))),
                extras=("no_rope_layers",) if nope else ())


def _lara_mini(c, n):
    """Gated delta-net mixers (layer_types' linear_attention) between Qwen3's attention, rotary on the sliding
    layers only; Flint's MoE block (an ungated shared expert) under softmax routing."""
    mixers = _typed_layers(c, ("linear_attention",))
    nope = _typed_layers(c, ("full_attention",))
    return dict(routing=dict(normalise=_normalise(c, True)), qk_norm="head", mixer_layers=mixers,
                sliding_layers=_sliding(c, n), nope_layers=nope,
                shared_experts=int(bool(c.get("shared_expert_intermediate_size", default=0))),
                extras=("no_rope_layers",) if nope else ())


def _axk1(c, n):
    """DeepSeek-V3's layers, the MoE block's output normalised (its post_mlp_layernorm)."""
    facts = _deepseek_v3(c, n)
    return facts | dict(moe_output_norm=True, extras=(*facts.get("extras", ()), "moe_output_norm"))


def _kolibri1(c, n):
    """GLM-4's four norms around Qwen3-MoE's attention; where a window is set, rotary on the sliding layers only
    (EXAONE-4's NoPE full layers); experts chosen by logits + correction bias, weighted by their sigmoid
    scores (normalised where norm_topk_prob); an ungated shared expert."""
    window = c.get("sliding_window")
    sliding = _sliding(c, n) if window else ()
    nope = tuple(i for i in range(n) if i not in sliding) if window else ()
    return dict(routing=dict(scoring="sigmoid", correction_bias=True, choice_by_logits=True,
                             normalise=_normalise(c, False)),
                qk_norm="head", sliding_layers=sliding, nope_layers=nope, output_norms=True,
                shared_experts=int(bool(c.get("shared_expert_intermediate_size", default=0))),
                extras=("sandwich_norms", *(("no_rope_layers",) if nope else ())))


def _kimi_linear(c, n):
    """Delta-attention mixers (layer_types' linear_attention) between MLA layers without rotary (their rotary
    key passes unrotated), DeepSeek-V3's routing under Kimi's config keys."""
    mixers = _typed_layers(c, ("linear_attention",))
    return dict(routing=dict(scoring="sigmoid", correction_bias=True, normalise=bool(c.get("moe_renormalize",
                                                                                          default=True)),
                             normalise_eps=1e-20, scale=_scale(c), n_group=int(c.get("num_expert_group", default=1)),
                             topk_group=int(c.get("topk_group", default=1))),
                **_mla(c), mixer_layers=mixers, nope_layers=tuple(i for i in range(n) if i not in mixers),
                shared_experts=c.get("num_shared_experts", default=1) or 0, extras=("no_rope_layers",))


def _granitemoe_swa(c, n):
    """Granite's multipliers and shared MLP; sink logits on every layer, windows on the sliding ones; per-layer
    rotary bases (layer_rope_theta): 0 a layer without rotary, any base but the model's one (rope_theta, the
    table the fast decoders hold) the gap rope_per_layer_type."""
    facts = _granitemoe(c, n)
    base = c.get("rope_parameters.rope_theta", "rope_theta")
    thetas = c.get("layer_rope_theta") or [base] * n
    nope = tuple(i for i, theta in enumerate(thetas) if not theta)
    other = any(theta and theta != base for theta in thetas)
    return facts | dict(sinks=True, sliding_layers=_sliding(c, n), nope_layers=nope,
                        extras=(*facts["extras"], *(("no_rope_layers",) if nope else ()),
                                *(("rope_per_layer_type",) if other else ())))


def _flex_olmo(c, n):
    """OLMoE's attention (q/k norm over all heads) and routing in OLMo-2's layer: no norm on the attention's or
    the MLP's input, one on each of their outputs before it joins the residual stream."""
    return _olmoe(c, n) | dict(output_norms=True, input_norms=False,
                               extras=(*_olmoe(c, n).get("extras", ()), "post_norms"))


def _cohere2_moe(c, n):
    """Attention and the MLP side by side on one norm (LayerNorm unless rms_norm_eps is set); rotary over adjacent
    pairs on the sliding layers, and on the dense prefix where prefix_dense_sliding_window_pattern is 1, none on the
    other layers; the router's top-k logits through a softmax (the normalised softmax) or their sigmoids; shared
    experts averaged with the routed ones or added; the logits times logit_scale."""
    dense = [i for i in range(n) if i not in set(config_moe_layers(c.configs, n))]
    window = c.get("sliding_window")
    forced = set(dense) if c.get("prefix_dense_sliding_window_pattern", default=1) == 1 else set()
    roped = set(_sliding(c, n) if window else ()) | forced
    nope = tuple(i for i in range(n) if i not in roped)
    sigmoid = c.get("expert_selection_fn", default="softmax") == "sigmoid"
    shared = int(c.get("num_shared_experts", default=0) or 0)
    average = shared and c.get("shared_expert_combination_strategy", default="average") == "average"
    return dict(routing=dict(scoring="sigmoid", normalise=_normalise(c, True)) if sigmoid else dict(normalise=True),
                sliding_layers=_sliding(c, n), nope_layers=nope, shared_experts=shared,
                multipliers=Multipliers(logits=1 / scale if (scale := float(c.get("logit_scale", default=1.0)))
                                        else float("inf")),
                extras=("parallel_block", "interleaved_rotary", "multipliers",
                        *(("layer_norm",) if c.get("rms_norm_eps") is None else ()),
                        *(("no_rope_layers",) if nope else ()), *(("shared_average",) if average else ())))


def _mimo_v2_flash(c, n):
    """DeepSeek-V3's routing without shared experts; layers typed sliding with twice the key/value heads, sink logits
    and their own rotary parameters; values of v_head_dim, times attention_value_scale; rotary over part of each head
    (transformers' default factor 0.334 where a layer type names none)."""
    typed = _typed_layers(c, ("sliding_attention",))
    kinds = {(c.get(f"rope_parameters.{t}.rope_type", default="default"), c.get(f"rope_parameters.{t}.rope_theta"),
              c.get(f"rope_parameters.{t}.partial_rotary_factor", default=0.334))
             for t in ("full_attention", "sliding_attention")}
    head_dim = int(c.get("head_dim", default=0) or 0)
    scale = c.get("attention_value_scale")
    return dict(routing=_sigmoid_biased(c), sliding_layers=_sliding(c, n),
                extras=("partial_rotary", *(("sliding_kv_heads", "sliding_sinks") if typed else ()),
                        *(("rope_per_layer_type",) if typed and len(kinds) > 1 else ()),
                        *(("value_head_dim",) if c.get("v_head_dim", default=head_dim) != head_dim else ()),
                        *(("value_scale",) if scale is not None and scale != 1.0 else ())))


def _laguna(c, n):
    """DeepSeek-V3's sigmoid choice by score + correction bias without groups, its weights normalised and times
    moe_routed_scaling_factor (a soft-capped router is its own); a shared expert; q/k norm per head; the attention
    output times the softplus of g_proj; query heads per layer (num_attention_heads_per_layer, where any differs from
    num_attention_heads); rotary over part of each head, its part and base per layer type."""
    cap = float(c.get("moe_router_logit_softcapping", default=0.0) or 0.0)
    routing = dict(scoring="sigmoid", correction_bias=True, normalise=True,
                   scale=_scale(c, "moe_routed_scaling_factor"))
    heads = set(c.get("num_attention_heads_per_layer") or ()) - {c.get("num_attention_heads")}
    kinds = {(c.get(f"rope_parameters.{t}.rope_theta"), c.get(f"rope_parameters.{t}.partial_rotary_factor",
                                                             default=1.0))
             for t in set(c.get("layer_types") or ("full_attention",))}
    return dict(routing=dict(custom="router logits soft-capped") if cap > 0 else routing, qk_norm="head",
                sliding_layers=_sliding(c, n), shared_experts=1,
                extras=("softplus_gate", *(("heads_per_layer",) if heads else ()),
                        *(("partial_rotary",) if any(f != 1.0 for _, f in kinds) else ()),
                        *(("rope_per_layer_type",) if len(kinds) > 1 else ())))


def _step3p7(c, n):
    """DeepSeek-V3's sigmoid choice by score + correction bias without groups, the weights divided by their sum (no
    eps) and times moe_router_scaling_factor; a shared expert (share_expert_dim wide) on every MoE layer; Gemma's
    (1 + w) RMSNorms, q/k norm per head; the attention output times the sigmoid of g_proj (per head, or per channel
    where gating says neither True nor "per-head"); the sliding layers' own query heads (num_sliding_attention_heads);
    each layer type's rotary part and base; the SwiGLU clamped per layer (swiglu_limits on the experts,
    swiglu_limits_shared on the shared and dense MLPs; 0 or None: not clamped); scores times query_pre_attn_scalar
    ** -0.5 where that is not head_dim."""
    sliding = _sliding(c, n)
    heads = c.get("num_sliding_attention_heads", default=c.get("num_attention_heads"))
    kinds = {(c.get(f"rope_parameters.{t}.rope_theta"), c.get(f"rope_parameters.{t}.partial_rotary_factor",
                                                             default=1.0))
             for t in set(c.get("layer_types") or ("full_attention",))}
    limits = [v for key in ("swiglu_limits", "swiglu_limits_shared") for v in c.get(key, default=()) if v]
    head_dim = int(c.get("head_dim", default=0) or 0)
    scalar = c.get("query_pre_attn_scalar", default=head_dim)
    return dict(routing=dict(scoring="sigmoid", correction_bias=True, normalise=True,
                             scale=_scale(c, "moe_router_scaling_factor")),
                qk_norm="head", sliding_layers=sliding, shared_experts=1,
                multipliers=Multipliers(attention=scalar ** -0.5) if scalar != head_dim else None,
                extras=("norm_offset", "sigmoid_gate", *(("multipliers",) if scalar != head_dim else ()),
                        *(("heads_per_layer",) if sliding and heads != c.get("num_attention_heads") else ()),
                        *(("partial_rotary",) if any(f != 1.0 for _, f in kinds) else ()),
                        *(("rope_per_layer_type",) if len(kinds) > 1 else ()),
                        *(("swiglu_limit",) if limits else ()), *(("mlp_bias",) if c.get("mlp_bias") else ()),
                        *(("bidirectional_attention",) if c.get("use_bidirectional_attention") else ())))


def _hy_v4(c, n):
    """DeepSeek-V3.2's MLA and indexer, both turning the two halves of their rotary part, the layers indexer_types
    marks "shared" reusing the previous indexer layer's choice; sink logits, and the attention output times the
    sigmoid of gate_proj per value channel; DeepSeek-V3's routing with shared experts; the experts' SwiGLU clamped at
    swiglu_limit (transformers clamps at any limit); hyper-connections (hc_mult residual streams)."""
    shared = "shared" in (c.get("indexer_types") or ())
    return dict(routing=_sigmoid_biased(c), **_mla(c), sinks=True,
                shared_experts=c.get("n_shared_experts", default=1) or 0,
                extras=("sparse_attention", *(("shared_indexer",) if shared else ()), "sigmoid_gate",
                        "swiglu_gate_limit", "hyper_connections"))


def _minimax_m3_vl(c, n):
    """MiniMax-M3's text model: DeepSeek-V3's sigmoid choice by score + correction bias without groups, its weights
    divided by their sum and times routed_scaling_factor; one shared expert; gpt-oss's clamped SwiGLU on the experts,
    the shared expert and the dense layers; Gemma's (1 + w) RMSNorms, q/k norm per head; rotary over part of each head
    (transformers reads rope_parameters' partial_rotary_factor, not rotary_dim); the layers layer_types marks
    "minimax_m3_sparse" attending to the blocks of keys their indexer chooses."""
    factor = c.get("rope_parameters.partial_rotary_factor", default=1.0)
    sparse = "minimax_m3_sparse" in (c.get("layer_types") or ())
    return dict(routing=dict(scoring="sigmoid", correction_bias=True, normalise=True, scale=_scale(c)),
                qk_norm="head", shared_experts=1,
                experts=dict(clamp=(float(c.get("swiglu_alpha", default=1.702)),
                                    float(c.get("swiglu_limit", default=7.0)))),
                extras=("norm_offset", "clamped_mlps", *(("partial_rotary",) if factor != 1.0 else ()),
                        *(("block_sparse_attention",) if sparse else ())))


# the sizes of an MLA layer that per_layer_config may give a layer of its own (Dots3-Note's sliding layers)
MLA_SIZES = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _dots3_note(c, n):
    """Dots3-Note's text model: DeepSeek-V3's MLA over adjacent rotary pairs, its normalised latents times
    sqrt(hidden_size / rank) and its shared rotary key normalised before it turns; DeepSeek-V3.2's indexer (turning
    adjacent pairs) on the indexed layers, the sliding layers with MLA sizes and a rotary base of their own
    (per_layer_config); the attention output times the sigmoid of g_proj per head; DeepSeek-V3's routing with shared
    experts."""
    types = c.get("layer_types") or ()
    sizes = {key: {c.get(f"per_layer_config.{i}.{key}", default=c.get(key)) for i in range(n)} for key in MLA_SIZES}
    bases = {c.get(f"rope_parameters.{t}.rope_theta") for t in set(types)}
    return dict(routing=_sigmoid_biased(c), **_mla(c), shared_experts=c.get("n_shared_experts", default=1) or 0,
                sliding_layers=_sliding(c, n),
                extras=("interleaved_rotary", "latent_scale", "rope_key_norm", "sigmoid_gate",
                        *(("sparse_attention", "indexer_interleaved_rotary") if "indexed_attention" in types else ()),
                        *(("mla_per_layer_type",) if any(len(v) > 1 for v in sizes.values()) else ()),
                        *(("heads_per_layer",) if len(sizes["num_attention_heads"]) > 1 else ()),
                        *(("rope_per_layer_type",) if len(bases) > 1 else ())))


def _deepseek_v4(c, n):
    """DeepSeek-V4: one key/value head whose keys are its values, the query through a low-rank projection and an
    unweighted norm per head, rotary over adjacent pairs of each head's last part (turned back on the output), sink
    logits, the output through o_groups low-rank projections; sliding layers, compressed ones beside them; the sqrt of
    softplus of the logits chosen with the correction bias, normalised and scaled, the hash_moe layers' experts chosen
    by token id; a shared expert; the experts' and the shared expert's SwiGLU clamped at swiglu_limit;
    hyper-connections (hc_mult residual streams)."""
    types = c.get("layer_types") or ()
    return dict(routing=dict(custom="sqrt of softplus", correction_bias=True, normalise=True, normalise_eps=1e-20,
                             scale=_scale(c)),
                sinks=True, sliding_layers=_sliding(c, n), shared_experts=1,
                extras=("shared_kv_head", "grouped_output", "partial_rotary", "interleaved_rotary",
                        "swiglu_gate_limit", "hyper_connections", "rope_per_layer_type",
                        *(("compressed_attention",) if any(t != "sliding_attention" for t in types) else ()),
                        *(("hash_routing",) if "hash_moe" in (c.get("mlp_layer_types") or ()) else ())))


def _glm5_next(c, n):
    """GLM-5.3's text model: delta-attention (KDA) mixers (layer_types' linear_attention) between MLA layers without
    rotary (qk_rope_head_dim 0), whose query and latent norms take rms_norm_eps; their indexer chooses pools of
    index_kpool keys (the incomplete last pool appended where index_kpool_always_select_tail), the layers
    indexer_types marks "shared" reusing the previous indexer layer's choice; DeepSeek-V3's routing with shared
    experts; every MLP's SwiGLU (dense, shared and experts) clamped at swiglu_limit; hyper-connections (hc_mult
    residual streams, averaged before the final norm)."""
    mixers = _typed_layers(c, ("linear_attention",))
    shared = "shared" in (c.get("indexer_types") or ())
    return dict(routing=_sigmoid_biased(c), **_mla(c), latent_norm_eps=float(c.get("rms_norm_eps", default=1e-6)),
                mixer_layers=mixers, nope_layers=tuple(i for i in range(n) if i not in mixers),
                shared_experts=c.get("n_shared_experts", default=1) or 0,
                extras=("no_rope_layers", "block_sparse_attention", *(("shared_indexer",) if shared else ()),
                        "swiglu_gate_limit", "hyper_connections"))


_RULES = {
    "qwen2_moe": _qwen2_moe, "qwen3_moe": _standard, "qwen3_next": _qwen3_next,
    "qwen3_5_moe": lambda c, n: _qwen3_next(c, n, normalise=True), "olmoe": _olmoe, "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3, "deepseek_v32": _deepseek_v32, "glm_moe_dsa": _glm_moe_dsa,
    "mistral4": _mistral4, "glm4_moe": _glm4_moe, "mixtral": _mixtral,
    "minimax": _minimax, "minimax_m2": _minimax_m2, "phimoe": _phimoe, "jamba": _jamba, "ernie4_5_moe": _ernie4_5_moe,
    "hunyuan_v1_moe": _hunyuan_v1_moe, "dots1": _dots1, "exaone_moe": _exaone_moe, "afmoe": _afmoe,
    "lfm2_moe": _lfm2_moe, "gpt_oss": _gpt_oss, "llama4": _llama4, "granitemoe": _granitemoe,
    "granitemoeshared": _granitemoe, "granitemoehybrid": _granitemoehybrid, "gemma4": _gemma4,
    "nemotron_h": _nemotron_h, "dbrx": _dbrx,
    # families transformers adds, which run without a row in smoe.source.families (smoe.hf.discover)
    "solar_open": _solar_open, "sarvam_moe": _sarvam_moe, "sarvam_mla": _sarvam_mla, "hy_v3": _hy_v3,
    "mellum": _mellum, "qwen3_vl_moe": _qwen3_vl_moe, "qwen3_omni_moe_thinker": _standard, "glm4v_moe": _glm4v_moe,
    "aria": _aria, "aria_text": _aria, "deepseek_ocr2": _deepseek_ocr2, "flint": _flint, "lara_mini": _lara_mini,
    "axk1": _axk1, "kolibri1": _kolibri1, "kimi_linear": _kimi_linear, "granitemoe_swa": _granitemoe_swa,
    "flex_olmo": _flex_olmo, "cohere2_moe": _cohere2_moe, "mimo_v2_flash": _mimo_v2_flash, "laguna": _laguna,
    "step3p7": _step3p7, "hy_v4": _hy_v4, "minimax_m3_vl": _minimax_m3_vl, "minimax_m3_vl_text": _minimax_m3_vl,
    "dots3_note": _dots3_note, "dots3_note_text": _dots3_note, "deepseek_v4": _deepseek_v4,
    "glm5_next": _glm5_next, "glm5_next_text": _glm5_next,
}
