"""What each mlx-lm model file computes, one row per family `smoe export --to mlx` writes.

A row says where mlx-lm's model keeps a layer's fused experts, which trunk names it reads its own way,
which of smoe's description (smoe.source.description) its module computes, and the ModelArgs keys it
reads that the Hugging Face config spells otherwise or lacks. What the model file computes differently
is refused by name before anything is written. Every layer layout is written from the vault's MoE
layers (first_k_dense_replace, mlp_only_layers), so mlx-lm builds the layers the vault holds.

Hybrid families' mixer layers (gated delta-net, Mamba) are trunk tensors under transformers' names; where
mlx-lm's sanitize converts them only for a checkpoint it fuses itself (its early return once experts are
fused), the row's `edits` write them converted. DBRX's model file keeps each expert as its own Linear
(`per_expert`).

The Mamba-2 hybrids (granitemoehybrid, nemotron_h) are written as mlx-lm's files read them: layer kinds in its
own spelling, time_step_limit as transformers clamps the prompt's time steps (mlx-lm clamps every step;
transformers' single-token recurrent step does not clamp at all, so a decode step whose softplus falls below
the floor is the one place the two can part: transformers' own prefill and decode already disagree there).
Nemotron-H's relu² experts are ungated: the vault's up and down roles become SwitchMLP's fc1 and fc2.

Multimodal checkpoints (qwen3_vl_moe; Qwen3.5-MoE's, whose vault smoe names by its text model, qwen3_5_moe_text;
Step-3.7's, step3p7) are written from their text_config under the names mlx-lm's model gives its language model; the
vision tower, which its sanitize discards, is not written (`drops`).

Where mlx-lm's model file reads a family's release config keys rather than transformers' (mimo_v2_flash's per-layer
lists, step3p7's as mlx-lm's step3p5, kimi_linear's linear_attn_config, gemma4_text's full-layer widths that
transformers keeps in per_layer_config), the row's config writes them from transformers' values.

MiniMax-M3's text model (minimax_m3_vl; a text-only vault in transformers' names, minimax_m3_vl_text, renamed to the
checkpoint's, without dense layers: their fused gate_up_proj is one mlx-lm's sanitize leaves whole) is written under
the multimodal checkpoint's names, which are mlx-lm's: its (1 + w) norms as they are (mlx-lm's GemmaRMSNorm adds the
1), the indexer's sizes, the layer kinds and the rotary width as transformers reads them. LongCat-Flash (longcat_flash),
which smoe's description leaves undescribed, is checked on its config: its identity ("zero") experts are the router's
last zero_expert_num, which both return as the token itself.

Left refused: ernie4_5_moe (mlx-lm's sanitize drops the router's correction bias, which the release's
router chooses with), hunyuan_v1_moe (mlx-lm's hunyuan never normalises the chosen experts' weights, transformers'
does), jamba (mlx-lm's always does, transformers' never), deepseek_v4 (mlx-lm's deepseek_v41 is DeepSeek-V4.1: its
hyper-connections mix each sublayer's input with the previous one's weights, and it has no hash-routed layers),
muse_spark (mlx-lm's runs only as Metal kernels, and rounds the attention inputs, norm gains and final norm to bf16 over
an fp32 residual stream where transformers' keeps the weights' dtype).
minimax (MiniMax-Text-01's lightning attention) has no model file: mlx-lm's minimax file is MiniMax-M2's; bailing_moe
has no transformers family; bailing_hybrid (mlx-lm has it, transformers too) is no family smoe reads, so no vault of it
exists.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from smoe.export.source import require
from smoe.source.description import ModelDescription

OAI_CLAMP = (1.702, 7.0)  # mlx-lm's SwigluOAI defaults, which its gpt_oss never changes
CONFIG_CLAMP = "swiglu_alpha, swiglu_limit"  # a clamped SwiGLU at the config's alpha and limit
REFUSED = {"ernie4_5_moe": "mlx-lm's ernie4_5_moe drops the router's correction bias (its sanitize removes "
                           "e_score_correction_bias)",
           # transformers' HunYuan-MoE divides the top-k softmax weights by their sum; mlx-lm's hunyuan uses them
           # as they are, which even top-1 (weight 1 against p) makes differ
           "hunyuan_v1_moe": "mlx-lm's hunyuan does not normalise the chosen experts' weights, transformers' "
                             "hunyuan_v1_moe does",
           # the other way round: transformers' Jamba keeps the top-k softmax weights, mlx-lm's takes a softmax
           # over the k chosen logits (and places MoE layers by (i + offset) % period)
           "jamba": "mlx-lm's jamba normalises the chosen experts' weights, transformers' jamba does not",
           # mlx-lm's deepseek_v41 is DeepSeek-V4.1: each sublayer's input is collapsed from the streams by the mix
           # the previous sublayer's hyper-connection made (stream 0 before the first), where transformers' DeepSeek-V4
           # collapses by the sublayer's own; and it routes every layer by score, V4 its hash_moe layers by token id
           "deepseek_v4": "mlx-lm's deepseek_v41 (DeepSeek-V4.1) mixes each sublayer's input with the previous "
                          "hyper-connection's weights and has no hash-routed layers; transformers' deepseek_v4 mixes "
                          "with the sublayer's own and routes hash_moe layers by token id",
           # mlx-lm's muse_spark runs its routing, q/k, attention-output and expert norms as mx.fast.metal_kernel (no
           # other backend runs them), casts each layer's attention input, the (1 + w) norm gains and the final norm's
           # output to bf16, and keeps the residual stream in fp32; transformers' rounds its stream to the weights'
           # dtype after each residual gate and casts nothing else to bf16. mlx-lm builds no dense layers either
           "muse_spark": "mlx-lm's muse_spark runs only as Metal kernels and rounds attention inputs, norm gains and "
                         "the final norm to bf16 over an fp32 residual stream; transformers' muse_spark keeps the "
                         "weights' dtype throughout"}


@dataclass(frozen=True)
class MlxFamily:
    experts: str  # the fused experts' module under a layer: "mlp.switch_mlp", "mlp.experts", ...
    routing: dict  # Routing fields the model file fixes (what it reads from the config is written instead)
    layers: str = "all"  # MoE layers it builds: "all", "dense_first" (first_k_dense_replace) or "any"
    renames: tuple[tuple[str, str], ...] = ()  # trunk key rewrites into mlx-lm's names
    extras: tuple[str, ...] = ()  # description extras it computes; any other is refused
    attention: str = "gqa"
    qk_norms: tuple[str | None, ...] = (None,)
    attention_bias: tuple[bool, ...] = (False,)  # q/k/v biases it builds (never, always or as the config says)
    shared: str = "none"  # shared experts: "none", "n_shared" (n × the routed width), "gated" (qwen2_moe's),
    # "own" (one, as wide as its own config key says)
    sinks: bool = False
    sliding_window: bool = False
    expert_biases: bool = False
    clamp: tuple[float, float] | str | None = None  # gpt-oss's clamped SwiGLU (CONFIG_CLAMP: at the config's alpha
    # and limit, which the model file reads)
    activation: str = "silu"  # the experts' activation (transformers' ACT2FN name)
    gated: bool = True  # act(gate) · up; else act(up), roles up and down only
    rope_types: tuple[str, ...] = ("default",)
    config: Callable[[dict, ModelDescription, list[int]], dict] | None = None  # ModelArgs keys it adds
    nested_in: str | None = None  # the model_type of mlx-lm's file that reads these args as its text_config
    check: Callable[[str, dict, ModelDescription], None] | None = None  # the family's own refusals
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down under `experts`
    # (an ungated row's gate name is never used)
    per_expert: bool = False  # one module per expert (`experts.{e}.…`) instead of fused switch layers
    edits: tuple[tuple[str, str], ...] = ()  # (trunk key pattern, EDITS name): tensors written as mlx-lm keeps them
    drops: str | None = None  # trunk keys its sanitize discards (a multimodal checkpoint's towers): not written


# --- the ModelArgs keys each model file reads -----------------------------------------------------


def _qwen3_moe(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(num_experts=desc.routing.num_experts, norm_topk_prob=desc.routing.normalise, decoder_sparse_step=1,
                mlp_only_layers=list(desc.dense_layers))


def _dense_first(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(first_k_dense_replace=moe_layers[0], moe_layer_freq=1, norm_topk_prob=desc.routing.normalise,
                routed_scaling_factor=desc.routing.scale, n_group=desc.routing.n_group,
                topk_group=desc.routing.topk_group)


def _glm4_moe(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return _dense_first(config, desc, moe_layers) | dict(
        partial_rotary_factor=_partial_rotary(config), use_qk_norm=desc.attention.qk_norm is not None,
        attention_bias=desc.attention.bias, topk_method="noaux_tc")


def _solar_open(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # mlx-lm's solar_open runs glm4_moe's model; its ModelArgs requires intermediate_size, which only a dense layer
    # reads (Solar Open has none)
    return _glm4_moe(config, desc, moe_layers) | dict(intermediate_size=config.get("intermediate_size", 0))


def _mellum(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(num_experts=desc.routing.num_experts, norm_topk_prob=desc.routing.normalise)


def _deepseek_v3(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return _dense_first(config, desc, moe_layers) | dict(topk_method="noaux_tc", scoring_func="sigmoid")


def _deepseek_v32(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # the indexer turns the two halves (DeepSeek-V3.2) or adjacent pairs (GLM-5) as the description says; mlx-lm's
    # glm_moe_dsa takes its rotary from rope_parameters alone, so a plain one is written without scaling keys
    rope = _rope(config) if _rope_kind(config) != "default" else {
        "rope_type": "default", "rope_theta": _rope(config).get("rope_theta", config.get("rope_theta", 10000.0))}
    return _deepseek_v3(config, desc, moe_layers) | dict(
        indexer_rope_interleave="indexer_interleaved_rotary" in desc.extras, rope_parameters=rope)


MIMO_ROTARY = 0.334  # transformers' MiMo-V2-Flash rotates this share of each head where a layer type names none


def _mimo_v2_flash(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # mlx-lm reads the release's own keys: per-layer lists of kinds, each kind's heads, widths and rotary base; its
    # window is transformers' sliding_window (the release's sliding_window_size + 1), both keeping that many keys
    rope, sliding, r = _rope(config), set(desc.attention.sliding_layers), desc.routing
    kv_heads, head_dim = config["num_key_value_heads"], desc.attention.head_dim
    return dict(hybrid_layer_pattern=[int(i in sliding) for i in range(desc.num_layers)],
                moe_layer_freq=[int(i in moe_layers) for i in range(desc.num_layers)],
                add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
                sliding_window_size=config["sliding_window"], layernorm_epsilon=config["rms_norm_eps"],
                rope_theta=rope["full_attention"]["rope_theta"], swa_rope_theta=rope["sliding_attention"]["rope_theta"],
                partial_rotary_factor=rope["full_attention"].get("partial_rotary_factor", MIMO_ROTARY),
                swa_num_attention_heads=config["num_attention_heads"], swa_num_key_value_heads=2 * kv_heads,
                swa_head_dim=head_dim, v_head_dim=config.get("v_head_dim", head_dim),
                swa_v_head_dim=config.get("v_head_dim", head_dim), n_shared_experts=None, topk_method="noaux_tc",
                scoring_func="sigmoid", norm_topk_prob=r.normalise, routed_scaling_factor=r.scale, n_group=r.n_group,
                topk_group=r.topk_group)


def _step3p7(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # mlx-lm's step3p5 reads the release's keys: rotary base and part per layer, the sliding layers' heads in
    # attention_other_setting, the MoE layers as a list of numbers; 0 for a SwiGLU limit that clamps nothing
    rope, kinds, r = _rope(config), config["layer_types"], desc.routing
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    return dict(model_type="step3p5", num_attention_groups=kv_heads, attention_other_setting={
                    "num_attention_heads": config.get("num_sliding_attention_heads") or heads,
                    "num_attention_groups": kv_heads},
                rope_theta=[rope[k]["rope_theta"] for k in kinds],
                partial_rotary_factors=[rope[k].get("partial_rotary_factor", 1.0) for k in kinds], rope_scaling=None,
                use_head_wise_attn_gate=True, moe_num_experts=r.num_experts, moe_top_k=r.top_k,
                moe_router_scaling_factor=r.scale, norm_expert_weight=True,
                moe_layers_enum=",".join(str(i) for i in moe_layers),
                **{key: [v or 0 for v in config.get(key) or ()] for key in ("swiglu_limits", "swiglu_limits_shared")})


def _kimi_linear(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # mlx-lm takes the delta-attention layers (numbered from 1) and their widths from the release's linear_attn_config
    r = desc.routing
    return _dense_first(config, desc, moe_layers) | dict(
        linear_attn_config={"kda_layers": [i + 1 for i in desc.attention.mixer_layers],
                            "num_heads": config["linear_num_heads"], "head_dim": config["linear_head_dim"],
                            "short_conv_kernel_size": config["linear_conv_kernel_dim"]},
        num_experts=r.num_experts, num_experts_per_token=r.top_k, moe_renormalize=r.normalise,
        num_shared_experts=desc.shared_experts, moe_router_activation_func="sigmoid", num_expert_group=r.n_group)


def _gemma4_full_layers(config: dict) -> list[dict]:
    """transformers' per_layer_config entries of the full-attention layers (their head width, key/value heads)."""
    overrides = config.get("per_layer_config") or {}
    return [overrides.get(str(i), overrides.get(i)) or {}
            for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]


def _gemma4_text(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # transformers keeps the full layers' head width and key/value heads in per_layer_config (global_head_dim and
    # num_global_key_value_heads are null in its config.json); mlx-lm reads the two keys, and its defaults for the
    # softcap (30), per-layer inputs (256 wide) and tied embeddings are not transformers'
    full = next(iter(_gemma4_full_layers(config)), {})
    k_eq_v = bool(config.get("attention_k_eq_v"))
    return dict(global_head_dim=full.get("head_dim", desc.attention.head_dim),
                num_global_key_value_heads=full.get("num_key_value_heads") if k_eq_v else None,
                final_logit_softcapping=config.get("final_logit_softcapping"),
                hidden_size_per_layer_input=config.get("hidden_size_per_layer_input") or 0,
                tie_word_embeddings=config.get("tie_word_embeddings", True), enable_moe_block=True,
                num_experts=desc.routing.num_experts, top_k_experts=desc.routing.top_k,
                num_kv_shared_layers=0)


def _deepseek_v2(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    r = desc.routing
    grouped = r.n_group > 1 and r.topk_group < r.n_group
    # its rotary is always the YaRN module, which factor 1 makes plain RoPE
    rope = _rope(config) if _rope_kind(config) == "yarn" else {"factor": 1.0}
    return _dense_first(config, desc, moe_layers) | dict(
        topk_method="group_limited_greedy" if grouped else "greedy", rope_scaling=rope)


def _olmoe(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(num_experts=desc.routing.num_experts, norm_topk_prob=desc.routing.normalise,
                attention_bias=desc.attention.bias, mlp_bias=False)


def _layer_types(desc: ModelDescription) -> list[str]:
    return ["sliding_attention" if i in desc.attention.sliding_layers else "full_attention"
            for i in range(desc.num_layers)]


def _gpt_oss(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(layer_types=_layer_types(desc))


def _exaone_moe(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # the model file takes each layer's kind from these two lists, rotary only on sliding layers where any slides
    return dict(layer_types=_layer_types(desc), is_moe_layer=[i in moe_layers for i in range(desc.num_layers)],
                num_shared_experts=desc.shared_experts, norm_topk_prob=desc.routing.normalise,
                routed_scaling_factor=desc.routing.scale, n_group=desc.routing.n_group,
                topk_group=desc.routing.topk_group, topk_method="noaux_tc")


def _afmoe(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # its ModelArgs defaults (muP on, routed scale 2.826, two dense layers) are not transformers': all written
    r = desc.routing
    return dict(layer_types=_layer_types(desc), num_dense_layers=moe_layers[0], num_shared_experts=desc.shared_experts,
                route_norm=r.normalise, route_scale=r.scale, score_func="sigmoid", n_group=1, topk_group=1,
                mup_enabled=desc.multipliers is not None)


def _lfm2_moe(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(num_dense_layers=moe_layers[0])


def _qwen3_next(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return _qwen3_moe(config, desc, moe_layers) | dict(
        partial_rotary_factor=_partial_rotary(config), full_attention_interval=_full_attention_interval(desc))


def _qwen3_5_moe(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(norm_topk_prob=desc.routing.normalise, full_attention_interval=_full_attention_interval(desc))


def _full_attention_interval(desc: ModelDescription) -> int:
    """mlx-lm's qwen3_next attends in full on every k-th layer: k is the first such layer's number."""
    mixers = set(desc.attention.mixer_layers)
    return next((i + 1 for i in range(desc.num_layers) if i not in mixers), desc.num_layers + 1)


def _granitemoehybrid(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # mlx-lm spells the kinds "mamba" / "attention", rotates unless told "nope" (transformers: only if told "rope")
    # and has no defaults for the four multipliers
    m, mixers = desc.multipliers, set(desc.attention.mixer_layers)
    return dict(layer_types=["mamba" if i in mixers else "attention" for i in range(desc.num_layers)],
                position_embedding_type="nope" if "no_rope_layers" in desc.extras else "rope",
                embedding_multiplier=m.embedding, attention_multiplier=m.attention, residual_multiplier=m.residual,
                logits_scaling=m.logits, time_step_limit=_time_step_limit(config))


NEMOTRON_KINDS = {"full_attention": "*", "attention": "*", "linear_attention": "M", "mamba": "M", "moe": "E",
                  "mlp": "-"}


def _nemotron_pattern(config: dict) -> list[str]:
    """The layer kinds as transformers reads them (the list before the legacy pattern), in mlx-lm's letters."""
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if isinstance(kinds, list):
        return [NEMOTRON_KINDS.get(k, "?") for k in kinds]
    return list(config.get("hybrid_override_pattern") or "")


def _nemotron_h(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    r = desc.routing
    # mlx-lm takes the pattern before the list where both are given: written, so that it is transformers' list;
    # transformers clamps the prompt's time steps at (time_step_min, inf) whatever time_step_limit says (its
    # config's default 0.001); it builds the shared expert always, mlx-lm where n_shared_experts is set; it never
    # builds attention biases, mlx-lm as attention_bias says
    return dict(hybrid_override_pattern=_nemotron_pattern(config), n_shared_experts=1, attention_bias=False,
                norm_topk_prob=r.normalise, routed_scaling_factor=r.scale, n_group=1,
                topk_group=1, time_step_limit=[float(config.get("time_step_min", 0.001)), float("inf")])


def _time_step_limit(config: dict) -> list[float] | None:
    """Granite's clamp of the prompt's time steps: transformers' default (0, inf) where the config has none (mlx-lm's
    default is (0.001, 100))."""
    return _floats(config.get("time_step_limit", [0.0, float("inf")]))


def _floats(values) -> list[float] | None:
    """A config's number pair as floats: transformers writes a non-finite one as {"__float__": "Infinity"}."""
    if values is None:
        return None
    return [float(v["__float__"]) if isinstance(v, dict) else float(v) for v in values]


MINIMAX_M3_SPARSE = "minimax_m3_sparse"  # the layer type whose attention its indexer makes block-sparse
# transformers' flat indexer keys, the release's names for them in sparse_attention_config and transformers' defaults
MINIMAX_M3_INDEXER = {"index_n_heads": ("sparse_num_index_heads", 4), "index_head_dim": ("sparse_index_dim", 128),
                      "index_block_size": ("sparse_block_size", 128), "index_topk_blocks": ("sparse_topk_blocks", 16),
                      "index_local_blocks": ("sparse_local_block", 1)}


def _minimax_m3_layer_types(config: dict) -> list[str]:
    """The attention kind of each layer as transformers reads it: layer_types, else the release's sparse_attention_freq,
    else full attention everywhere."""
    freq = (config.get("sparse_attention_config") or {}).get("sparse_attention_freq")
    return config.get("layer_types") or (
        [MINIMAX_M3_SPARSE if f else "full_attention" for f in freq] if freq is not None
        else ["full_attention"] * config["num_hidden_layers"])


def _minimax_m3_vl(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # mlx-lm takes rotary_dim where the config has one (transformers reads only rope_parameters' factor, default 1;
    # mlx-lm's default 0.5), makes every layer not "full_attention" sparse and all of them where layer_types is absent,
    # and has no defaults for the indexer: all written as transformers reads them
    kinds = ["sparse" if i in moe_layers else "dense" for i in range(desc.num_layers)]
    return _minimax_m3_indexer(config) | dict(
        rotary_dim=_minimax_m3_rotary(config), layer_types=_minimax_m3_layer_types(config), mlp_layer_types=kinds,
        sparse_attention_config=None, sparse_attention_freq=None, moe_layer_freq=None, use_qk_norm=True,
        use_gemma_norm=True)


def _minimax_m3_indexer(config: dict) -> dict:
    """The indexer's sizes as transformers reads them: sparse_attention_config's, else the flat keys, else its defaults."""
    sparse = config.get("sparse_attention_config") or {}
    return {key: sparse.get(legacy, config.get(key, default)) for key, (legacy, default) in MINIMAX_M3_INDEXER.items()}


def _minimax_m3_rotary(config: dict) -> int:
    """The channels of each head transformers turns: head_dim times rope_parameters' factor (rotary_dim unread)."""
    return int(config.get("head_dim", 128) * _rope(config).get("partial_rotary_factor", 1.0))


def _longcat_flash(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    # its ModelArgs requires what transformers fixes: the latents scaled, identity zero experts, the chosen weights
    # never normalised
    return dict(attention_method="MLA", zero_expert_type="identity", zero_expert_num=config.get("zero_expert_num") or 0,
                mla_scale_q_lora=True, mla_scale_kv_lora=True, norm_topk_prob=False,
                router_bias=config.get("router_bias", False))


def _minimax_m2(config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    return dict(rotary_dim=int(desc.attention.head_dim * _partial_rotary(config)),
                use_qk_norm=desc.attention.qk_norm is not None, shared_intermediate_size=0)


# --- the refusals a row's fields cannot say -------------------------------------------------------


def _check_gpt_oss(name: str, config: dict, desc: ModelDescription) -> None:
    rope = _rope(config)
    # mlx-lm's YaRN always rounds the correction range (Hugging Face's truncate = true)
    require(_rope_kind(config) != "yarn" or rope.get("truncate", True),
            f"{name}: YaRN with truncate = false is not what mlx-lm's YaRN computes (it rounds the correction range)")
    sliding = set(desc.attention.sliding_layers)  # its masks come from the first layer of each kind
    require(0 < len(sliding) < desc.num_layers, f"{name}: mlx-lm's gpt_oss needs both sliding and full attention layers")


def _check_head_width(name: str, config: dict, desc: ModelDescription) -> None:
    require(desc.attention.head_dim == desc.hidden_size // desc.attention.heads,
            f"{name}: mlx-lm assumes head_dim = hidden_size / heads; this model has head_dim {desc.attention.head_dim}")


def _check_sigmoid_top1(name: str, config: dict, desc: ModelDescription) -> None:
    # the model file normalises only when more than one expert is chosen
    require(not (desc.routing.normalise and desc.routing.top_k == 1),
            f"{name}: mlx-lm does not normalise a single chosen expert's weight; this router does")


def _check_deepseek(name: str, config: dict, desc: ModelDescription) -> None:
    _check_sigmoid_top1(name, config, desc)
    require("interleaved_rotary" in desc.extras,
            f"{name}: rope_interleave = false (half-split rotary) is not what mlx-lm's {name} computes")
    _check_yarn(name, config)


def _check_yarn(name: str, config: dict) -> None:
    rope = _rope(config)
    if _rope_kind(config) == "yarn":  # Hugging Face takes mscale only beside mscale_all_dim
        require(not rope.get("mscale", 1.0) != 1.0 or rope.get("mscale_all_dim"),
                f"{name}: YaRN with mscale {rope.get('mscale')} and no mscale_all_dim is not what mlx-lm computes")
        require(rope.get("truncate", True), f"{name}: YaRN with truncate = false is not what mlx-lm computes")


def _check_mistral4(name: str, config: dict, desc: ModelDescription) -> None:
    _check_yarn(name, config)
    rope, rotated = _rope(config), config.get("qk_rope_head_dim")
    if _rope_kind(config) == "yarn":  # transformers' YaRN spans head_dim · partial_rotary_factor, mlx-lm's the rope part
        head = config.get("head_dim") or config["qk_nope_head_dim"] + rotated
        width = int(head * rope.get("partial_rotary_factor", rotated / (config["qk_nope_head_dim"] + rotated)))
        require(width == rotated, f"{name}: transformers' YaRN over {width} channels (head_dim {head} · "
                f"partial_rotary_factor) is not what mlx-lm's {name} rotates (qk_rope_head_dim {rotated})")
    # both rotate adjacent pairs or the two halves as rope_interleave says (absent: both pairs); null is false to
    # transformers, pairs to mlx-lm
    require(config.get("rope_interleave", True) is not None, f"{name}: rope_interleave = null (transformers rotates "
            f"the two halves, mlx-lm's {name} adjacent pairs) is not exported to MLX")


def _check_untied(name: str, config: dict, desc: ModelDescription) -> None:
    require(not config.get("tie_word_embeddings", False),
            f"{name}: tied embeddings are not what mlx-lm's {name} builds (it always reads lm_head)")


def _check_phimoe(name: str, config: dict, desc: ModelDescription) -> None:
    _check_head_width(name, config, desc)
    _check_untied(name, config, desc)
    # transformers' sparsemixer chooses two experts whatever the config says; mlx-lm's chooses top_k
    require(desc.routing.top_k == 2, f"{name}: transformers' sparsemixer chooses 2 experts; mlx-lm's {name} "
            f"chooses num_experts_per_tok = {desc.routing.top_k}")
    require(config.get("lm_head_bias", False), f"{name}: lm_head_bias = false is not what mlx-lm's {name} builds "
            "(an lm_head with a bias)")


def _check_exaone_moe(name: str, config: dict, desc: ModelDescription) -> None:
    _check_sigmoid_top1(name, config, desc)
    a = desc.attention  # transformers drops rotary on the full layers only where a window is set
    require(not a.nope_layers or a.sliding_layers, f"{name}: a sliding_window with no sliding layer (rotary nowhere) "
            f"is not what mlx-lm's {name} computes (rotary everywhere)")


def _check_afmoe(name: str, config: dict, desc: ModelDescription) -> None:
    _check_sigmoid_top1(name, config, desc)
    a = desc.attention  # both rotate the sliding layers only; mlx-lm's masks need a layer of each kind
    require(a.sliding_layers and len(a.sliding_layers) < desc.num_layers,
            f"{name}: mlx-lm's afmoe needs both sliding and full attention layers")


def _check_lfm2_moe(name: str, config: dict, desc: ModelDescription) -> None:
    _check_head_width(name, config, desc)
    require(config.get("tie_word_embeddings", True), f"{name}: an untied lm_head is not what mlx-lm's {name} builds "
            "(it always reads the embeddings)")


def _check_dbrx(name: str, config: dict, desc: ModelDescription) -> None:
    attn = config.get("attn_config", {})
    require(attn.get("clip_qkv") is not None,
            f"{name}: clip_qkv unset is not what mlx-lm's dbrx computes (it always clips q, k and v)")
    # mlx-lm's rotary base is attn_config's; transformers 5 takes rope_parameters' (10000 where a config has none)
    base = _rope(config).get("rope_theta", 10000.0)
    require(attn.get("rope_theta") == base, f"{name}: attn_config's rope_theta {attn.get('rope_theta')} (what mlx-lm's "
            f"dbrx rotates with) is not transformers' rotary base, rope_parameters' {base}")


def _check_qwen3_next(name: str, config: dict, desc: ModelDescription) -> None:
    every = _full_attention_interval(desc)
    linear = [i for i in range(desc.num_layers) if (i + 1) % every]
    require(list(desc.attention.mixer_layers) == linear and every <= desc.num_layers,
            f"{name}: mlx-lm's qwen3_next attends in full on every k-th layer only; this model's linear-attention "
            f"layers are {list(desc.attention.mixer_layers)}")


def _check_granitemoehybrid(name: str, config: dict, desc: ModelDescription) -> None:
    _check_head_width(name, config, desc)
    kinds = set(config.get("layer_types") or config.get("layers_block_type") or [])
    known = {"linear_attention", "mamba", "full_attention", "attention"}
    require(kinds <= known, f"{name}: layer types {sorted(kinds - known)} are not what mlx-lm's {name} builds")
    # transformers normalises the gated Mamba output per group, mlx-lm's granitemoehybrid over the whole width
    groups = config.get("mamba_n_groups", 1)
    require(groups == 1, f"{name}: mamba_n_groups = {groups} is not what mlx-lm's {name} computes (its gated norm "
            "spans all groups)")
    limit = _time_step_limit(config)
    require(limit is not None and len(limit) == 2, f"{name}: time_step_limit {limit} is not a (low, high) pair")


def _check_nemotron_h(name: str, config: dict, desc: ModelDescription) -> None:
    _check_sigmoid_top1(name, config, desc)
    act = config.get("mamba_hidden_act", "silu")
    require(act == "silu", f"{name}: mamba_hidden_act {act!r} is not what mlx-lm's {name} computes (silu)")
    pattern, mixers = _nemotron_pattern(config), set(desc.attention.mixer_layers)
    kinds = "".join(pattern)
    require(len(pattern) == desc.num_layers and "?" not in pattern, f"{name}: layer kinds {kinds!r} are not what "
            f"mlx-lm's {name} builds")
    require([i for i, k in enumerate(pattern) if k == "E"] == list(desc.moe_layers)
            and [i for i, k in enumerate(pattern) if k == "*"] == [i for i in range(desc.num_layers) if i not in mixers],
            f"{name}: layer kinds {kinds!r} disagree with the vault's MoE and attention layers")


def _rope_per_layer_type(name: str, config: dict) -> dict[str, dict]:
    """rope_parameters' entry for each layer type, plain rotary only (mlx-lm's linear is unscaled); mlx-lm takes its
    full-attention mask from such a layer."""
    kinds = sorted(set(config.get("layer_types") or []))
    require("full_attention" in kinds, f"{name}: mlx-lm's {name} takes its mask from a full-attention layer; this "
            "model has none")
    rope = {kind: _rope(config).get(kind) or {} for kind in kinds}
    for kind, params in rope.items():
        require(params.get("rope_type", "default") == "default",
                f"{name}: RoPE scaling {params.get('rope_type')!r} on {kind} layers is not exported to MLX")
    return rope


def _check_mellum(name: str, config: dict, desc: ModelDescription) -> None:
    for kind, params in _rope_per_layer_type(name, config).items():
        require(params.get("partial_rotary_factor", 1.0) == 1.0, f"{name}: rotary over part of each head on {kind} "
                "layers is not what mlx-lm's mellum computes (whole heads)")


def _check_laguna(name: str, config: dict, desc: ModelDescription) -> None:
    _rope_per_layer_type(name, config)
    gating = config.get("gating", True)  # mlx-lm's gate is one per head (or none)
    require(gating in (True, False, "per-head"), f"{name}: gating {gating!r} is not what mlx-lm's laguna computes "
            "(one gate per head)")


def _check_mimo_v2_flash(name: str, config: dict, desc: ModelDescription) -> None:
    _check_sigmoid_top1(name, config, desc)
    _check_untied(name, config, desc)
    sliding = desc.attention.sliding_layers  # mlx-lm takes each kind's mask from its first layer of that kind
    require(0 < len(sliding) < desc.num_layers, f"{name}: mlx-lm's {name} needs both sliding and full attention layers")
    rope = _rope_per_layer_type(name, config)
    factors = {kind: rope.get(kind, {}).get("partial_rotary_factor", MIMO_ROTARY) for kind in rope}
    require(len(set(factors.values())) == 1, f"{name}: rotary over {factors} of each head per layer type is not what "
            f"mlx-lm's {name} computes (one partial_rotary_factor for both)")
    width = int(desc.attention.head_dim * next(iter(factors.values())))
    require(width % 2 == 0, f"{name}: a rotated part of {width} channels (head_dim · partial_rotary_factor) is not a "
            f"whole number of pairs (transformers turns {(width + 1) // 2} pairs, mlx-lm's {name} {width} channels)")


def _check_kimi_linear(name: str, config: dict, desc: ModelDescription) -> None:
    _check_sigmoid_top1(name, config, desc)
    require(config.get("q_lora_rank") is None, f"{name}: q_lora_rank {config.get('q_lora_rank')} is not what mlx-lm's "
            f"{name} builds (one q_proj)")
    mixers = desc.attention.mixer_layers  # mlx-lm takes each kind's mask from its first layer of that kind
    require(0 < len(mixers) < desc.num_layers, f"{name}: mlx-lm's {name} needs both delta-attention and MLA layers")


def _check_gemma4_text(name: str, config: dict, desc: ModelDescription) -> None:
    require(not config.get("hidden_size_per_layer_input"), f"{name}: per-layer input embeddings "
            "(hidden_size_per_layer_input) are not exported to MLX")
    # transformers' Gemma 4 fails to run layers that reuse earlier layers' keys and values beside a prompt's logits,
    # so no export of them could be checked against the vault
    require(not config.get("num_kv_shared_layers"), f"{name}: layers reusing earlier keys and values "
            "(num_kv_shared_layers) are not exported to MLX")
    require(config.get("use_bidirectional_attention") != "all", f"{name}: bidirectional attention is not what "
            "mlx-lm's gemma4_text computes (causal)")
    full, kv_heads = _gemma4_full_layers(config), config["num_key_value_heads"]
    require(all(f == full[0] for f in full), f"{name}: full-attention layers of different widths or key/value heads "
            "are not what mlx-lm's gemma4_text builds")
    heads = (full[0] if full else {}).get("num_key_value_heads", kv_heads)
    require(config.get("attention_k_eq_v") or heads == kv_heads, f"{name}: {heads} key/value heads on full layers "
            f"without attention_k_eq_v is not what mlx-lm's gemma4_text builds ({kv_heads})")
    rope = _rope(config)
    for kind, allowed in (("sliding_attention", ("default",)), ("full_attention", ("default", "proportional"))):
        params = rope.get(kind) or {}
        kind_type = params.get("rope_type", "default")
        require(kind_type in allowed, f"{name}: RoPE {kind_type!r} on {kind} layers is not exported to MLX")
        if kind_type == "proportional":
            # transformers turns floor(factor · width / 2) pairs, mlx-lm's ProportionalRoPE ceil(int(factor · width) / 2)
            width = (full[0] if full else {}).get("head_dim", desc.attention.head_dim)
            rotated = width * params.get("partial_rotary_factor", 1.0)
            require((int(rotated) + 1) // 2 == int(rotated // 2), f"{name}: proportional RoPE over {rotated} of "
                    f"{width} channels is not what mlx-lm's gemma4_text rotates")


STEP3P7_KINDS = ("full_attention", "sliding_attention")


def _check_step3p7(name: str, config: dict, desc: ModelDescription) -> None:
    _check_untied(name, config, desc)
    kinds = set(config.get("layer_types") or ())
    require(kinds <= set(STEP3P7_KINDS), f"{name}: layer types {sorted(kinds - set(STEP3P7_KINDS))} are not what "
            "mlx-lm's step3p5 builds")
    require(not desc.attention.sliding_layers or config.get("sliding_window"), f"{name}: sliding layers without a "
            "sliding_window are not exported to MLX")
    gating = config.get("gating", True)  # transformers gates per channel unless told per head
    require(gating in (True, "per-head"), f"{name}: gating {gating!r} is not what mlx-lm's step3p5 computes (one "
            "gate per head)")
    for kind in sorted(kinds):
        params = _rope(config).get(kind) or {}
        require(params.get("rope_type", "default") == "default", f"{name}: RoPE scaling {params.get('rope_type')!r} "
                f"on {kind} layers is not exported to MLX")
        width = int(desc.attention.head_dim * params.get("partial_rotary_factor", 1.0))
        require(width % 2 == 0, f"{name}: a rotated part of {width} channels on {kind} layers is not a whole number "
                f"of pairs (transformers turns {(width + 1) // 2} pairs, mlx-lm's step3p5 {width} channels)")
    limits = [v for key in ("swiglu_limits", "swiglu_limits_shared") for v in config.get(key) or () if v]
    require(all(v > 0 for v in limits), f"{name}: negative SwiGLU limits are not what mlx-lm's step3p5 computes "
            "(no clamp)")


def _check_minimax_m3_vl(name: str, config: dict, desc: ModelDescription) -> None:
    kinds = set(_minimax_m3_layer_types(config)) - {"full_attention", MINIMAX_M3_SPARSE}
    require(not kinds, f"{name}: layer types {sorted(kinds)} are not what mlx-lm's {name} builds (it makes every "
            "layer not full_attention block-sparse)")
    rotary, width = _minimax_m3_rotary(config), _minimax_m3_indexer(config)["index_head_dim"]
    if MINIMAX_M3_SPARSE in _minimax_m3_layer_types(config):
        # transformers turns the indexer's heads by the attention's cos and sin cut at index_head_dim
        require(rotary <= width, f"{name}: a rotary part of {rotary} channels wider than the indexer's heads is not "
                f"what mlx-lm's {name} turns (its own rotary over index_head_dim)")


def _check_minimax_m3_text(name: str, config: dict, desc: ModelDescription) -> None:
    _check_minimax_m3_vl(name, config, desc)
    dense = [i for i in range(desc.num_layers) if i not in desc.moe_layers]
    require(not dense, f"{name}: dense layers {dense} keep a fused gate_up_proj, which mlx-lm's minimax_m3_vl does not "
            "split (its sanitize splits only block_sparse_moe's)")


LLAMA4_EVERY = 4  # mlx-lm's llama4 fixes NoPE on every 4th layer, chunked attention on the others


def _check_llama4(name: str, config: dict, desc: ModelDescription) -> None:
    _check_untied(name, config, desc)
    n, step = desc.num_layers, config.get("interleave_moe_layer_step", 1)
    require(desc.routing.top_k == 1, f"{name}: mlx-lm's llama4 takes one expert per token; this model "
            f"{desc.routing.top_k}")
    require(list(desc.moe_layers) == list(range(step - 1, n, step)), f"{name}: mlx-lm's llama4 takes every "
            f"interleave_moe_layer_step = {step}th layer MoE; this model's MoE layers are {list(desc.moe_layers)}")
    require(n >= LLAMA4_EVERY, f"{name}: mlx-lm's llama4 takes its full-attention mask from layer 4; this model has "
            f"{n} layers")
    roped = [int((i + 1) % LLAMA4_EVERY != 0) for i in range(n)]
    require(config.get("no_rope_layers") == roped, f"{name}: no_rope_layers {config.get('no_rope_layers')} is not "
            f"what mlx-lm's llama4 computes (NoPE on every {LLAMA4_EVERY}th layer)")
    chunked = ["chunked_attention" if r else "full_attention" for r in roped]
    require(config.get("attention_chunk_size") and config.get("layer_types", chunked) == chunked,
            f"{name}: mlx-lm's llama4 attends in chunks on the rotary layers, at full length on the others only")
    eps = config.get("rms_norm_eps")  # mlx-lm's q/k norm takes eps 1e-6, transformers' rms_norm_eps
    require(desc.attention.qk_norm is None or eps == 1e-6, f"{name}: a q/k norm with eps {eps} is not what mlx-lm's "
            "llama4 computes (1e-6)")


SOFTMAX = dict(scoring="softmax", correction_bias=False, n_group=1, scale=1.0)
GEMMA4_ROUTING = "per-expert scales over a normalised router input"  # smoe.source.description's name for it
SIGMOID_BIASED = dict(scoring="sigmoid", correction_bias=True, group_score="top2")
FAMILIES = {
    "qwen3_moe": MlxFamily("mlp.switch_mlp", SOFTMAX, layers="any", qk_norms=("head",), config=_qwen3_moe),
    # transformers 5 names Mixtral's block `mlp`; mlx-lm keeps the released `block_sparse_moe`
    "mixtral": MlxFamily("block_sparse_moe.switch_mlp", SOFTMAX | dict(normalise=True),
                         renames=((r"\.mlp\.gate\.", ".block_sparse_moe.gate."),), check=_check_head_width),
    "glm4_moe": MlxFamily("mlp.switch_mlp", SIGMOID_BIASED, layers="dense_first", extras=("partial_rotary",),
                          qk_norms=(None, "head"), attention_bias=(False, True), shared="n_shared", config=_glm4_moe,
                          check=_check_sigmoid_top1),
    "gpt_oss": MlxFamily("mlp.experts", dict(scoring="softmax", normalise=True, router_bias=True, correction_bias=False,
                                             n_group=1, scale=1.0),
                         attention_bias=(True,), sinks=True, sliding_window=True, expert_biases=True, clamp=OAI_CLAMP,
                         rope_types=("default", "yarn"), config=_gpt_oss, check=_check_gpt_oss),
    "olmoe": MlxFamily("mlp.switch_mlp", SOFTMAX, qk_norms=("full",), attention_bias=(False, True), config=_olmoe),
    "qwen2_moe": MlxFamily("mlp.switch_mlp", SOFTMAX | dict(normalise=False), attention_bias=(True,), shared="gated",
                           check=_check_head_width),
    "deepseek_v3": MlxFamily("mlp.switch_mlp", SIGMOID_BIASED, layers="dense_first", extras=("interleaved_rotary",),
                             attention="mla", attention_bias=(False, True), shared="n_shared",
                             rope_types=("default", "yarn"), config=_deepseek_v3, check=_check_deepseek),
    "deepseek_v2": MlxFamily("mlp.switch_mlp", dict(scoring="softmax", normalise=False, correction_bias=False,
                                                    group_score="max"),
                             layers="dense_first", extras=("interleaved_rotary",), attention="mla",
                             attention_bias=(False, True), shared="n_shared", rope_types=("default", "yarn"),
                             config=_deepseek_v2, check=_check_deepseek),
    # DeepSeek-V3's layers (mlx-lm's file is its deepseek_v3 but for the latent norms' eps: mlx-lm takes rms_norm_eps
    # for the q_a/kv_a norms, where transformers fixes 1e-6; written as it is, within the MLX tests' bounds at
    # transformers' default 1e-5: Q4 mean KL 1.28e-7 on the tiny model)
    "glm4_moe_lite": MlxFamily("mlp.switch_mlp", SIGMOID_BIASED, layers="dense_first", extras=("interleaved_rotary",),
                               attention="mla", attention_bias=(False, True), shared="n_shared",
                               rope_types=("default", "yarn"), config=_deepseek_v3, check=_check_deepseek),
    # DeepSeek-V3's layers with the indexer choosing index_topk keys per query (mlx-lm's indexer key norm takes
    # LayerNorm's eps 1e-5, transformers' 1e-6: written as it is, the choice it moves is within the MLX tests' bounds);
    # GLM-5 (glm_moe_dsa) is the same file with the indexer turning adjacent pairs, every layer its own indexer
    **{f: MlxFamily("mlp.switch_mlp", SIGMOID_BIASED, layers="dense_first",
                    extras=("interleaved_rotary", "sparse_attention", *more), attention="mla",
                    attention_bias=(False, True), shared="n_shared", rope_types=("default", "yarn"),
                    config=_deepseek_v32, check=_check_deepseek)
       for f, more in (("deepseek_v32", ()), ("glm_moe_dsa", ("indexer_interleaved_rotary",)))},
    # DeepSeek-V3's MLA with the query temperature (llama_4_scaling_beta), softmax routing and grouped choice
    "mistral4": MlxFamily("mlp.switch_mlp", dict(scoring="softmax", correction_bias=False, group_score="top2"),
                          layers="dense_first", extras=("interleaved_rotary", "temperature_tuning"), attention="mla",
                          attention_bias=(False, True), shared="n_shared", rope_types=("default", "yarn"),
                          config=_dense_first, check=_check_mistral4),
    "dots1": MlxFamily("mlp.experts", SIGMOID_BIASED, layers="dense_first", qk_norms=("head",), shared="n_shared",
                       config=_dense_first, check=_check_sigmoid_top1),
    "granitemoe": MlxFamily("block_sparse_moe.switch_mlp", SOFTMAX | dict(normalise=True), extras=("multipliers",),
                            attention_bias=(False, True), check=_check_head_width),
    "phimoe": MlxFamily("block_sparse_moe.switch_mlp", SOFTMAX | dict(normalise=True, custom="sparsemixer"),
                        extras=("layer_norm",), attention_bias=(True,), check=_check_phimoe),
    "exaone_moe": MlxFamily("mlp.switch_mlp", SIGMOID_BIASED, layers="any", extras=("no_rope_layers",),
                            qk_norms=("head",), shared="n_shared", sliding_window=True, config=_exaone_moe,
                            check=_check_exaone_moe),
    # the text model of Llama 4, written as mlx-lm's multimodal llama4 reads it (its llama4_text has no experts)
    "llama4_text": MlxFamily("feed_forward.experts", dict(scoring="sigmoid", normalise=False, weight_input=True,
                                                          correction_bias=False, n_group=1, scale=1.0),
                             layers="any", renames=((r"^model\.", "language_model.model."),
                                                    (r"^lm_head\.", "language_model.lm_head.")),
                             extras=("interleaved_rotary", "no_rope_layers", "temperature_tuning", "chunked_attention"),
                             qk_norms=(None, "l2_after_rotary"), attention_bias=(False, True), shared="n_shared",
                             nested_in="llama4", check=_check_llama4),
    "afmoe": MlxFamily("mlp.experts", dict(scoring="sigmoid", correction_bias=True, normalise=True, n_group=1),
                       layers="dense_first", extras=("sandwich_norms", "attention_gate", "no_rope_layers", "multipliers"),
                       qk_norms=("head",), shared="n_shared", sliding_window=True, config=_afmoe, check=_check_afmoe),
    # its short-convolution layers are trunk tensors under transformers' names, which mlx-lm's sanitize reads
    "lfm2_moe": MlxFamily("feed_forward.switch_mlp", dict(scoring="sigmoid", n_group=1), layers="dense_first",
                          qk_norms=("head",), config=_lfm2_moe, check=_check_lfm2_moe),
    # GLM-4.5's MoE block in Llama's decoder layer: mlx-lm's solar_open is its glm4_moe, told no q/k norm
    "solar_open": MlxFamily("mlp.switch_mlp", SIGMOID_BIASED, attention_bias=(False, True), shared="n_shared",
                            config=_solar_open, check=_check_sigmoid_top1),
    # Qwen3-MoE's layers, each layer type at its own rotary base
    "mellum": MlxFamily("mlp.switch_mlp", SOFTMAX, extras=("rope_per_layer_type",), qk_norms=("head",),
                        sliding_window=True, config=_mellum, check=_check_mellum),
    # sigmoid choice with a correction bias, normalised and scaled, a shared expert; per-head softplus attention gate,
    # query heads per layer, each layer type's rotary part and base
    "laguna": MlxFamily("mlp.switch_mlp", dict(scoring="sigmoid", correction_bias=True, normalise=True, n_group=1),
                        layers="any", extras=("softplus_gate", "heads_per_layer", "partial_rotary",
                                              "rope_per_layer_type"),
                        qk_norms=("head",), shared="own", sliding_window=True, check=_check_laguna),
    # Qwen3-VL-MoE's text model under the multimodal checkpoint's names, as mlx-lm's qwen3_vl_moe nests its qwen3_moe
    # (text alone: M-RoPE's sections all take the one position, plain rotary); the vision tower is not written
    "qwen3_vl_moe": MlxFamily("mlp.switch_mlp", SOFTMAX | dict(normalise=True), layers="any",
                              renames=((r"^model\.layers\.", "language_model.model.layers."),
                                       (r"^model\.language_model\.", "language_model.model."),
                                       (r"^lm_head\.", "language_model.lm_head.")),
                              qk_norms=("head",), config=_qwen3_moe, nested_in="qwen3_vl_moe", drops=r"^model\.visual\."),
    "minimax_m2": MlxFamily("block_sparse_moe.switch_mlp", SIGMOID_BIASED | dict(normalise=True, n_group=1, scale=1.0),
                            extras=("partial_rotary",), qk_norms=(None, "full"), config=_minimax_m2),
}
# mlx-lm's sanitize converts these only for checkpoints whose experts it fuses itself (its early return otherwise)
QWEN3_NEXT_EDITS = ((r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$|^model\.norm\.weight$",
                     "norm_offset"), (r"conv1d\.weight$", "conv_channels_last"))
FAMILIES |= {
    "dbrx": MlxFamily("ffn.experts", SOFTMAX | dict(normalise=True), renames=((r"^model\.layers\.", "transformer.blocks."),),
                      extras=("layer_norm", "clip_qkv"), projections=("w1", "v1", "w2"), per_expert=True,
                      check=_check_dbrx),
    # its gated delta-net layers are trunk tensors under transformers' names
    "qwen3_next": MlxFamily("mlp.switch_mlp", SOFTMAX, layers="any", extras=("norm_offset", "attention_gate",
                                                                             "partial_rotary"),
                            qk_norms=("head",), attention_bias=(False, True), shared="gated", config=_qwen3_next,
                            check=_check_qwen3_next, edits=QWEN3_NEXT_EDITS),
    # Qwen3-Next's layers in Qwen3.5's text model, its linear attention's projections split (mlx-lm's qwen3_5_moe, whose
    # sanitize converts the norms and convolutions of any checkpoint: written as they are); a multimodal checkpoint's
    # vault is named so too, its text model under model.language_model., its vision tower not written
    "qwen3_5_moe_text": MlxFamily("mlp.switch_mlp", SOFTMAX,
                                  renames=((r"^model\.language_model\.", "language_model.model."),
                                           (r"^model\.", "language_model.model."),
                                           (r"^lm_head\.", "language_model.lm_head.")),
                                  extras=("norm_offset", "attention_gate", "partial_rotary"), qk_norms=("head",),
                                  attention_bias=(False, True), shared="gated", config=_qwen3_5_moe,
                                  nested_in="qwen3_5_moe", check=_check_qwen3_next, drops=r"^model\.visual\."),
    # Mamba-2 layers and Granite's multipliers; the shared MLP beside the experts on every layer. Its sanitize
    # turns the convolutions channels-last for any checkpoint
    "granitemoehybrid": MlxFamily("block_sparse_moe.switch_mlp", SOFTMAX | dict(normalise=True),
                                  extras=("multipliers", "no_rope_layers"), attention_bias=(False, True),
                                  shared="own", config=_granitemoehybrid, check=_check_granitemoehybrid),
    # Mamba-2, attention (no rotary), MLP and MoE layers in any order; ungated relu² experts in SwitchMLP. Groups
    # are refused: mlx-lm zeroes a dropped group's scores where transformers excludes them
    "nemotron_h": MlxFamily("mixer.switch_mlp", dict(scoring="sigmoid", correction_bias=True, n_group=1),
                            layers="any", renames=((r"^model\.layers\.", "backbone.layers."),),
                            extras=("no_rope_layers",), shared="own", activation="relu2", gated=False,
                            projections=("", "fc1", "fc2"), config=_nemotron_h, check=_check_nemotron_h),
}
FAMILIES |= {
    # Step-3.7's text model (mlx-lm's step3p5), written from its text_config in the release's names, which mlx-lm's
    # sanitize maps (router, correction bias, shared expert) as they are written here; its (1 + w) norms written as
    # plain weights (the sanitize adds 1 only to a checkpoint it maps itself); the vision tower is not written
    "step3p7": MlxFamily("mlp.switch_mlp", dict(scoring="sigmoid", correction_bias=True, normalise=True, n_group=1),
                         layers="any", renames=((r"\.moe\.gate\.", ".mlp.gate.gate."),
                                                (r"\.moe\.router_bias$", ".mlp.gate.router_bias"),
                                                (r"\.share_expert\.", ".mlp.share_expert.")),
                         extras=("norm_offset", "sigmoid_gate", "heads_per_layer", "partial_rotary",
                                 "rope_per_layer_type", "swiglu_limit"),
                         qk_norms=("head",), shared="own", sliding_window=True, config=_step3p7, check=_check_step3p7,
                         edits=QWEN3_NEXT_EDITS[:1], drops=r"^(vision_model|vit_large_projector)\."),
    # Gemma 4's text model: a dense MLP beside the experts on every layer, each with its own norms; the router's
    # softmax over the chosen experts' logits is transformers' top-k of the full softmax renormalised. A multimodal
    # checkpoint's text model is written under the text model's names, its vision and audio towers not written
    "gemma4_text": MlxFamily("experts.switch_glu", SOFTMAX | dict(normalise=True, custom=GEMMA4_ROUTING),
                             renames=((r"^model\.language_model\.", "model."),),
                             drops=r"^model\.(vision_tower|embed_vision|audio_tower|embed_audio)\.",
                             extras=("sandwich_norms", "partial_rotary", "multipliers"), qk_norms=("head",),
                             shared="own", sliding_window=True, activation="gelu_pytorch_tanh", config=_gemma4_text,
                             check=_check_gemma4_text),
    # delta-attention layers between MLA layers without rotary, DeepSeek-V3's routing without groups (mlx-lm zeroes a
    # dropped group's scores where transformers excludes them); the checkpoint's block_sparse_moe (dense layers' too)
    # under mlx-lm's mlp. Its sanitize splits kv_b_proj and turns the convolutions channels-last for any checkpoint.
    # mlx-lm's latent norm takes rms_norm_eps where transformers fixes 1e-6: written as it is, within the MLX tests'
    # bounds at the release's 1e-5
    "kimi_linear": MlxFamily("mlp.switch_mlp", dict(scoring="sigmoid", correction_bias=True, n_group=1),
                             layers="dense_first", renames=((r"\.block_sparse_moe\.", ".mlp."),
                                                            (r"\.gate\.e_score_correction_bias$", ".e_score_correction_bias")),
                             extras=("no_rope_layers",), attention="mla", shared="n_shared", config=_kimi_linear,
                             check=_check_kimi_linear),
    # DeepSeek-V3's routing without shared experts; sliding layers with twice the key/value heads and sink logits (the
    # checkpoint's attention_sink_bias, mlx-lm's name too), each layer type at its own rotary base, values narrower than
    # the heads and scaled
    "mimo_v2_flash": MlxFamily("mlp.switch_mlp", SIGMOID_BIASED, layers="any",
                               extras=("partial_rotary", "rope_per_layer_type", "sliding_kv_heads", "sliding_sinks",
                                       "value_head_dim", "value_scale"),
                               sliding_window=True, config=_mimo_v2_flash, check=_check_mimo_v2_flash),
}
FAMILIES |= {
    # MiniMax-M3's text model under the multimodal checkpoint's names (the release's, mlx-lm's too): DeepSeek-V3's routing
    # without groups, a shared expert and dense layers, all with the config's clamped SwiGLU; (1 + w) norms, which
    # mlx-lm's GemmaRMSNorm computes from the weights as they are; the indexer keeping blocks of keys on the sparse
    # layers. The vision tower and projectors are not written
    "minimax_m3_vl": MlxFamily("block_sparse_moe.switch_mlp", dict(scoring="sigmoid", correction_bias=True,
                                                                   normalise=True, n_group=1),
                               layers="any", renames=((r"^model\.layers\.", "language_model.model.layers."),),
                               extras=("norm_offset", "clamped_mlps", "partial_rotary", "block_sparse_attention"),
                               qk_norms=("head",), shared="own", clamp=CONFIG_CLAMP, config=_minimax_m3_vl,
                               nested_in="minimax_m3_vl", check=_check_minimax_m3_vl,
                               drops=r"^(vision_tower|multi_modal_projector|patch_merge_mlp)\."),
    # a text-only MiniMax-M3 vault in transformers' names (fused gate_up_proj MLPs, the router and shared expert under
    # mlp, the indexer under self_attn.indexer), written under mlx-lm's minimax_m3_vl names for its language model:
    # its sanitize splits the shared expert's fused gate_up_proj; a dense layer's it leaves whole (_check_minimax_m3_text)
    "minimax_m3_vl_text": MlxFamily("block_sparse_moe.switch_mlp", dict(scoring="sigmoid", correction_bias=True,
                                                                        normalise=True, n_group=1),
                                    layers="any", renames=((r"^model\.", "language_model.model."),
                                                           (r"^lm_head\.", "language_model.lm_head."),
                                                           (r"\.mlp\.gate\.e_score_correction_bias$",
                                                            ".block_sparse_moe.e_score_correction_bias"),
                                                           (r"\.mlp\.(gate|shared_experts)\.", r".block_sparse_moe.\1."),
                                                           (r"\.self_attn\.indexer\.(q|k)_(proj|norm)\.",
                                                            r".self_attn.index_\1_\2.")),
                                    extras=("norm_offset", "clamped_mlps", "partial_rotary", "block_sparse_attention"),
                                    qk_norms=("head",), shared="own", clamp=CONFIG_CLAMP, config=_minimax_m3_vl,
                                    nested_in="minimax_m3_vl", check=_check_minimax_m3_text),
    # LongCat-Flash, which smoe's description does not describe (transformers' modules run it): two MLA sublayers and
    # two dense MLPs per layer beside the experts of the first, softmax choice by score + correction bias, never
    # normalised, times routed_scaling_factor; the router's last zero_expert_num experts return the token itself, as
    # both compute them, the routed ones under mlx-lm's switch_mlp. Its sanitize splits kv_b_proj for any checkpoint.
    # mlx-lm's latent norms take eps 1e-5 where transformers fixes 1e-6: written as it is, within the MLX tests' bounds
    "longcat_flash": MlxFamily("mlp.switch_mlp", dict(custom="not described"), layers="any", extras=("undescribed",),
                               attention_bias=(False, True), config=_longcat_flash, check=_check_untied),
}
# what a router may do beyond the fields a row fixes, refused unless the row allows it
PLAIN_ROUTING = dict(router_bias=False, weight_input=False, custom=None)


def _norm_offset(t: torch.Tensor) -> torch.Tensor:
    """transformers' (1 + w) norms as the plain weight mlx-lm's RMSNorm multiplies by, summed in fp32."""
    return (t.float() + 1.0).to(t.dtype)


def _conv_channels_last(t: torch.Tensor) -> torch.Tensor:
    """A depthwise conv1d weight [C, 1, K] as MLX's Conv1d keeps it, [C, K, 1]."""
    return t.squeeze(1).unsqueeze(-1)  # not movedim: its size-1 last axis keeps a stride that bytes cannot view


EDITS = {"norm_offset": (_norm_offset, lambda shape: shape),
         "conv_channels_last": (_conv_channels_last, lambda shape: (shape[0], shape[2], shape[1]))}


def edit(row: MlxFamily, key: str) -> tuple[Callable, Callable] | None:
    """The EDITS entry the row applies to trunk tensor `key`, if any."""
    return next((EDITS[name] for pattern, name in row.edits if re.search(pattern, key)), None)


def family(name: str) -> MlxFamily:
    require(name not in REFUSED, f"{name}: {REFUSED.get(name)}; not exported to MLX")
    row = FAMILIES.get(name)
    require(row is not None, f"MLX export supports {', '.join(FAMILIES)}; this vault is {name}")
    return row


def check(name: str, config: dict, desc: ModelDescription, moe_layers: list[int],
          shapes: dict[str, tuple[int, ...]], expert_width: int) -> None:
    """What the family's mlx-lm model file assumes that this config (and the trunk's `shapes`) could contradict."""
    row, where, config = FAMILIES[name], f"mlx-lm's {name}", text_config(config)
    _check_layers(name, row, desc, moe_layers)
    unsupported = [e for e in desc.extras if e not in row.extras]
    require(not unsupported, f"{name}: {where} does not compute {', '.join(unsupported)}")
    a = desc.attention
    require(a.kind == row.attention, f"{name}: {where} computes {row.attention} attention; this model has {a.kind}")
    require(a.qk_norm in row.qk_norms, f"{name}: q/k norm {a.qk_norm!r} is not what {where} computes")
    require(a.bias in row.attention_bias, f"{name}: attention biases = {a.bias} is not what {where} builds")
    require(a.sinks == row.sinks, f"{name}: attention sinks = {a.sinks} is not what {where} computes")
    require(row.sliding_window or not a.sliding_layers, f"{name}: sliding-window attention is not exported to MLX")
    _check_routing(name, row, desc)
    _check_experts(name, row, desc, shapes, expert_width)
    kind = _rope_kind(config)
    require(kind in row.rope_types, f"{name}: RoPE scaling {kind!r} is not exported to MLX")
    if row.check:
        row.check(name, config, desc)


def _check_layers(name: str, row: MlxFamily, desc: ModelDescription, moe_layers: list[int]) -> None:
    layers = desc.num_layers
    first = moe_layers[0] if moe_layers else layers
    if row.layers == "all":
        require(moe_layers == list(range(layers)), f"{name}: mlx-lm's {name} takes every layer MoE; this model's MoE "
                f"layers are {moe_layers}")
    elif row.layers == "dense_first":
        require(moe_layers == list(range(first, layers)) and first < layers,
                f"{name}: mlx-lm's {name} takes dense layers only before the MoE ones; this model's MoE layers are "
                f"{moe_layers}")


def _check_routing(name: str, row: MlxFamily, desc: ModelDescription) -> None:
    r = desc.routing
    grouped = r.n_group > 1 and r.topk_group < r.n_group
    for key, value in (PLAIN_ROUTING | row.routing).items():
        if key == "group_score" and not grouped:
            continue  # no group is ever dropped: how groups are ranked changes nothing
        actual = getattr(r, key)
        require(actual == value, f"{name}: mlx-lm's {name} routes with {key} = {value!r}; this model's router has "
                f"{actual!r}")


def _check_experts(name: str, row: MlxFamily, desc: ModelDescription, shapes: dict[str, tuple[int, ...]],
                   expert_width: int) -> None:
    e = desc.experts
    require(e.gated == row.gated and e.activation == row.activation,
            f"{name}: mlx-lm's {name} computes {_kind(row.activation, row.gated)} experts; this model's are "
            f"{_kind(e.activation, e.gated)}")
    require(e.clamp == row.clamp or row.clamp == CONFIG_CLAMP and e.clamp is not None,
            f"{name}: mlx-lm's {name} clamps SwiGLU at {row.clamp}; this model at {e.clamp}")
    require(e.biases == row.expert_biases, f"{name}: expert biases = {e.biases} is not what mlx-lm's {name} builds")
    require((desc.shared_experts > 0) == (row.shared != "none"),
            f"{name}: {desc.shared_experts} shared experts is not what mlx-lm's {name} computes")
    require(desc.shared_gate == (row.shared == "gated"),
            f"{name}: shared_gate = {desc.shared_gate} is not what mlx-lm's {name} computes")
    if row.shared == "n_shared":
        for key, shape in shapes.items():
            if ".mlp.shared_experts." in key:
                width = shape[0] if key.endswith(("gate_proj.weight", "up_proj.weight")) else shape[-1]
                require(width == expert_width * desc.shared_experts,
                        f"{name}: shared experts {width} wide; mlx-lm's {name} takes {desc.shared_experts} × the "
                        f"routed experts' {expert_width}")


def _kind(activation: str, gated: bool) -> str:
    return "SwiGLU" if (activation, gated) == ("silu", True) else f"{activation}{'' if gated else ' (not gated)'}"


def model_args(name: str, config: dict, desc: ModelDescription, moe_layers: list[int]) -> dict:
    """The vault's config (a multimodal checkpoint's text model) plus what the family's mlx-lm ModelArgs reads under
    its own names."""
    config = {k: v for k, v in text_config(config).items() if k != "quantization_config"}
    rope = _rope(config)
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config["rope_scaling"] = rope if _rope_kind(config) != "default" else None
    if name != "mixtral":  # mixtral's ModelArgs has no head_dim
        config.setdefault("head_dim", desc.attention.head_dim)
    row = FAMILIES[name]
    args = config | (row.config(config, desc, moe_layers) if row.config else {})
    return {"model_type": row.nested_in, "text_config": args} if row.nested_in else args


def text_config(config: dict) -> dict:
    """A multimodal checkpoint's text model config, tied as transformers ties it (by the top level's
    tie_word_embeddings); any other config as it is."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    return text | {"tie_word_embeddings": config.get("tie_word_embeddings", False)}


def _rope(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _partial_rotary(config: dict) -> float:
    """The share of each head rotated: rope_parameters' (transformers 5), else the top level's or MiniMax's rotary_dim."""
    factor = _rope(config).get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is None and config.get("rotary_dim"):
        factor = config["rotary_dim"] / (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return factor or 1.0


def _rope_kind(config: dict) -> str:
    rope = _rope(config)
    return rope.get("rope_type", rope.get("type", "default"))
