"""The families `smoe export --to gguf` writes but smoe does not read back: one row per family.

smoe.source.gguf's ARCHITECTURES holds the families smoe both writes and reads (and DeepSeek's MLA,
smoe.export.gguf_mla); a row here adds a family whose llama.cpp graph (src/models/<arch>.cpp) runs a
decoder smoe describes (smoe.source.description): which architecture it becomes, which of the
description's features that graph computes, and the metadata it reads that the common export does not
write. Routing comes from the description as for DeepSeek. What the graph computes differently is
refused by name, before anything is written.

glm4_moe (GLM-4.5) is llama.cpp's `glm4moe`: leading dense layers, a shared expert, sigmoid scores
chosen with the correction bias (`exp_probs_b`), rotary over the first half of each head (NeoX order,
as Hugging Face's), optional q/k norms and attention biases. Its multi-token-prediction layer is not
in a vault and is not written (llama.cpp decodes without it).

gpt_oss is llama.cpp's `gpt-oss`: attention sinks (`attn_sinks.weight`), biases on every projection, the
router and the experts, sliding-window layers as a per-layer pattern, YaRN, and the clamped SwiGLU with
llama.cpp's fixed alpha 1.702 and limit 7. llama.cpp's own converter writes the released MXFP4 experts
as they are; the graph takes any expert type, and these are Q4_1 like every family's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf

from smoe.export import gguf_mla
from smoe.export.source import require
from smoe.source.description import ModelDescription
from smoe.source.gguf import Architecture

SINKS = "self_attn.sinks"  # llama.cpp's converter names them attn_sinks.weight
CORRECTION_BIAS = "e_score_correction_bias"  # under mlp.gate (GLM-4.5, dots.llm1) or block_sparse_moe (MiniMax-M2)
OAI_CLAMP = (1.702, 7.0)  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants


@dataclass(frozen=True)
class GgufFamily:
    arch: Architecture
    routing: dict  # Routing fields the graph fixes (anything it reads from metadata is written instead)
    extras: tuple[str, ...] = ()  # description extras the graph computes; any other is refused
    qk_norms: tuple[str | None, ...] = (None,)  # q/k norm kinds the graph computes
    attention_bias: bool = False  # q/k/v/o biases read (llama.cpp's qkv loader takes them when present)
    expert_biases: bool = False
    dense_first: bool = False  # dense layers before the MoE ones (leading_dense_block_count)
    sliding_window: bool = False  # sliding-window layers, written as a per-layer pattern
    all_kv_heads: bool = False  # the graph sizes k and v as n_head heads: no grouped-query attention
    shared_gate: bool = False  # the shared expert scaled by a sigmoid gate (ffn_gate_inp_shexp)
    moe_keys: bool = False  # gating, scale, normalisation, groups, shared experts read from metadata (write_moe)
    rope_types: tuple[str, ...] = ("default",)
    check: Callable[[str, dict, ModelDescription], None] | None = None  # the family's own refusals


def _gpt_oss(name: str, config: dict, desc: ModelDescription) -> None:
    require(desc.experts.clamp == OAI_CLAMP,
            f"{name}: llama.cpp's gpt-oss clamps SwiGLU at alpha 1.702, limit 7; this model has {desc.experts.clamp}")
    require(desc.attention.bias, f"{name}: llama.cpp's gpt-oss needs attention biases")
    require(bool(desc.attention.sliding_layers), f"{name}: llama.cpp's gpt-oss needs sliding-window layers")


def _arch(arch: str, experts_key: str) -> Architecture:
    return Architecture(arch, permute_qk=False, expert_width_key=True, experts_key=experts_key, readable=False)


SOFTMAX_UNNORMALISED = dict(scoring="softmax", normalise=False, correction_bias=False, scale=1.0, n_group=1)
SIGMOID_BIASED = dict(scoring="sigmoid", correction_bias=True)
FAMILIES = {
    "glm4_moe": GgufFamily(_arch("GLM4_MOE", "n_routed_experts"), SIGMOID_BIASED, extras=("partial_rotary",),
                           qk_norms=(None, "head"), attention_bias=True, dense_first=True, moe_keys=True),
    "gpt_oss": GgufFamily(_arch("GPT_OSS", "num_local_experts"),
                          dict(scoring="softmax", normalise=True, router_bias=True, scale=1.0, n_group=1),
                          attention_bias=True, expert_biases=True, sliding_window=True, rope_types=("default", "yarn"),
                          check=_gpt_oss),
    "olmoe": GgufFamily(_arch("OLMOE", "num_experts"), SOFTMAX_UNNORMALISED, qk_norms=("full",), all_kv_heads=True),
    "qwen2_moe": GgufFamily(_arch("QWEN2MOE", "num_experts"), SOFTMAX_UNNORMALISED, attention_bias=True,
                           shared_gate=True),
    "minimax_m2": GgufFamily(_arch("MINIMAXM2", "num_local_experts"), SIGMOID_BIASED | dict(normalise=True, scale=1.0,
                             n_group=1), extras=("partial_rotary",), qk_norms=("full",), moe_keys=True),
    "dots1": GgufFamily(_arch("DOTS1", "n_routed_experts"), SIGMOID_BIASED | dict(n_group=1), qk_norms=("head",),
                        all_kv_heads=True, dense_first=True, moe_keys=True),
}
ARCHITECTURES = {name: f.arch for name, f in FAMILIES.items()}
# what a router may do beyond the fields a row fixes, refused unless the row allows it
PLAIN_ROUTING = dict(router_bias=False, weight_input=False, custom=None)


def check(name: str, config: dict, desc: ModelDescription, moe_layers: list[int], shapes: dict[str, tuple[int, ...]],
          expert_width: int) -> None:
    """What the family's llama.cpp graph assumes that this config (and the trunk's `shapes`) could contradict."""
    family = FAMILIES[name]
    layers, arch = config["num_hidden_layers"], family.arch.arch.lower()
    first = moe_layers[0] if moe_layers and family.dense_first else 0
    takes = "dense layers only before the MoE ones" if family.dense_first else "every layer MoE"
    require(moe_layers == list(range(first, layers)),
            f"{name}: llama.cpp's {arch} takes {takes}; this model's MoE layers are {moe_layers}")
    unsupported = [e for e in desc.extras if e not in family.extras]
    require(not unsupported, f"{name}: llama.cpp's {arch} does not compute {', '.join(unsupported)}")
    require(desc.attention.qk_norm in family.qk_norms,
            f"{name}: q/k norm {desc.attention.qk_norm!r} is not what llama.cpp's {arch} computes")
    require(not family.all_kv_heads or desc.attention.kv_heads == desc.attention.heads,
            f"{name}: llama.cpp's {arch} takes as many key/value heads as heads; this model has "
            f"{desc.attention.kv_heads} for {desc.attention.heads}")
    require(family.attention_bias or not desc.attention.bias, f"{name}: attention biases are not exported to GGUF")
    require(family.sliding_window or not desc.attention.sliding_layers,
            f"{name}: sliding-window attention is not exported to GGUF")
    for key, value in (PLAIN_ROUTING | family.routing).items():
        actual = getattr(desc.routing, key)
        require(actual == value, f"{name}: llama.cpp's {arch} routes with {key} = {value!r}; this model's router has "
                f"{actual!r}")
    require(desc.shared_gate == family.shared_gate,
            f"{name}: shared_gate = {desc.shared_gate} is not what llama.cpp's {arch} computes")
    rope = gguf_mla.rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    require(kind in family.rope_types, f"{name}: RoPE scaling {kind!r} is not exported to GGUF")
    gguf_mla.check_shared_experts(name, arch, shapes, expert_width, desc.shared_experts)
    if family.check:
        family.check(name, config, desc)


def write(writer: gguf.GGUFWriter, name: str, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The metadata the family's graph reads beyond the common keys."""
    if FAMILIES[name].moe_keys:
        gguf_mla.write_moe(writer, desc, moe_layers, config["num_hidden_layers"])
    if desc.shared_gate and (width := config.get("shared_expert_intermediate_size")):  # qwen2moe
        writer.add_expert_shared_feed_forward_length(width)
    if desc.attention.sliding_layers:
        sliding = set(desc.attention.sliding_layers)
        writer.add_sliding_window(desc.attention.sliding_window)
        writer.add_sliding_window_pattern([i in sliding for i in range(config["num_hidden_layers"])])
    gguf_mla.write_yarn(writer, gguf_mla.rope_parameters(config))


def pieces(key: str, shape: tuple[int, ...]) -> list[gguf_mla.Piece] | None:
    """The GGUF tensor a trunk tensor becomes where these architectures name it their own way (else None)."""
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    for suffix, tensor, kind in ((CORRECTION_BIAS, gguf.MODEL_TENSOR.FFN_EXP_PROBS_B, "bias"),
                                 (SINKS, gguf.MODEL_TENSOR.ATTN_SINKS, "weight")):
        if key.endswith(suffix):
            return [(f"{gguf.TENSOR_NAMES[tensor].format(bid=int(layer))}.{kind}", shape, lambda t: t)]
    return None
