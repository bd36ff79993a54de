"""DeepSeek-V2/V3 (MLA) as llama.cpp's `deepseek2` architecture: what `smoe export --to gguf` adds for it.

llama.cpp runs MLA absorbed, as smoe's fast decoders do: the cache holds the latent (kv_lora_rank) and
the shared rotary key, so the file declares one K/V head of width kv_lora_rank + rope and the real
head sizes under the `_mla` keys, and kv_b_proj is written as two tensors — k_b, each head's key rows
transposed ([heads, kv_lora_rank, nope]), and v_b, its value rows ([heads, v_head_dim, kv_lora_rank]) —
as llama.cpp's own converter writes them. Routing comes from smoe's description of the model (the
same facts smoe.moe.route computes with), not from config keys the converter guesses at: a
DeepSeek-V3 config without `scoring_func` still says sigmoid. Leading dense layers are written as
dense FFNs, shared experts as `ffn_*_shexp`, the correction bias as `exp_probs_b`.

What llama.cpp's graph cannot compute the same way is refused by name: a group score other than the
top-2 sum (DeepSeek-V2's group-limited greedy ranks groups by their best expert), half-split rotary
(rope_interleave = false), YaRN whose two mscales differ, dense layers after a MoE layer, q_lora on a
model llama.cpp takes for a Lite one.

Beside deepseek_v3 and deepseek_v2 (smoe.source.gguf's table, which smoe also reads), ARCHITECTURES adds
the families transformers runs with DeepSeek-V3's attention and router that are written only: glm4_moe_lite
(GLM-4.7-Flash: DeepSeek-V3's attention, GLM-4.5's MoE block, which routes as DeepSeek-V3's does; llama.cpp's
converter writes it as deepseek2), sarvam_mla (DeepSeek-V3's modules under its own config), and mistral4 as
llama.cpp's `mistral4` (deepseek2's loader and graph) with its query temperature 1 + beta · log(1 + floor(position /
length)), written as the attention.temperature_scale and _length that graph reads (llama.cpp's converter writes
neither for a Hugging Face checkpoint). deepseek_v32 is llama.cpp's `deepseek32` (a name the pinned gguf package lacks,
written as a string; its tensors are named as glm-dsa's): deepseek2's attention beside the sparse-attention indexer,
whose head count, head width and top-k are written and whose tensors keep their names. Its graph scores keys as
transformers does (ReLU of q·k over half-split rotary, weighted by weights_proj, summed over heads; a positive scale
and a Hadamard rotation of q and k leave the choice alone) and rotates with a Hadamard matrix of a power of two from
64: other indexer widths are refused. It keeps the indexer's keys in the K cache's type: the default F16 can flip the
top-k where two keys score within about 1e-4; with an F32 cache the choice is transformers'. glm_moe_dsa (GLM-5) is
llama.cpp's `glm-dsa`, the same graph but for its indexer's rotary over adjacent pairs (as transformers turns it) and its
layers whose indexer_types is "shared", which reuse the previous indexer layer's choice: indexer_types is written as
the converter writes it (true where "full"; without it llama.cpp takes GLM-5.2's pattern for a context from 2^20). That
graph reads no YaRN log multiplier, so RoPE scaling is refused, and no LayerNorm eps: the indexer's key norm runs at
eps 0, where transformers' takes 1e-6.
kimi_linear's MLA layers (smoe.export.gguf_families) are written by write_attention and pieces too, with key/value heads
per layer (0 on its delta-attention layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import gguf
import torch

from smoe.export.source import require
from smoe.source.description import ModelDescription
from smoe.source.gguf import Architecture

ARCH = "DEEPSEEK2"
# llama.cpp's mistral4 is deepseek2's loader and graph (down projections in F32); GLM_DSA's tensor table names
# deepseek32's, the indexer's included
ARCHS = (ARCH, "MISTRAL4", "GLM_DSA")
ARCHITECTURES = {t: Architecture(arch, permute_qk=False, expert_width_key=True, experts_key="n_routed_experts",
                                 readable=False)
                 for t, arch in (("glm4_moe_lite", ARCH), ("sarvam_mla", ARCH), ("mistral4", "MISTRAL4"),
                                 ("deepseek_v32", "GLM_DSA"), ("glm_moe_dsa", "GLM_DSA"))}
# llama.cpp's names of the families with the indexer: deepseek32 is written under glm-dsa's tensor table
INDEXED = {"deepseek_v32": "deepseek32", "glm_moe_dsa": "glm-dsa"}
# the description's extras each one's indexer computes: glm-dsa's turns adjacent pairs and may be shared
INDEXER_EXTRAS = {"deepseek_v32": ("sparse_attention",),
                  "glm_moe_dsa": ("sparse_attention", "indexer_interleaved_rotary", "shared_indexer")}
INDEXER_ROTATION = 64  # the smallest Hadamard matrix llama.cpp rotates the indexer's q and k by
# what the description may say that the deepseek2 graph computes: the query temperature from its metadata
EXTRAS = ("interleaved_rotary", "temperature_tuning")
# llama.cpp takes a deepseek2 of these depths for V2-Lite (and its kin), which has no q_lora, and does
# not read q_lora_rank for them; also one of 48 layers with a vocabulary of 128256 (Kanana-2)
LITE_LAYERS = (26, 27)
LITE_DEPTH_VOCAB = (48, 128256)
KV_B = "self_attn.kv_b_proj.weight"
CORRECTION_BIAS = "mlp.gate.e_score_correction_bias"


def check(name: str, config: dict, desc: ModelDescription, moe_layers: list[int], shapes: dict[str, tuple[int, ...]],
          expert_width: int) -> None:
    """What the deepseek2 graph assumes that this config (and the trunk's `shapes`) could contradict."""
    if name in INDEXED:
        _check_indexer(name, config, desc)
        desc = replace(desc, extras=tuple(e for e in desc.extras if e not in INDEXER_EXTRAS[name]))
    layers = config["num_hidden_layers"]
    first = moe_layers[0] if moe_layers else layers
    require(moe_layers == list(range(first, layers)),
            f"{name}: llama.cpp's deepseek2 takes dense layers only before the MoE ones; this model's MoE layers are "
            f"{moe_layers}")
    require(desc.attention.kind == "mla", f"{name}: llama.cpp's deepseek2 needs MLA attention")
    unsupported = [e for e in desc.extras if e not in EXTRAS]
    require(not unsupported, f"{name}: llama.cpp's deepseek2 does not compute {', '.join(unsupported)}")
    require("interleaved_rotary" in desc.extras,
            f"{name}: rope_interleave = false (half-split rotary) is not what llama.cpp's deepseek2 computes")
    r = desc.routing
    require(r.n_group <= 1 or r.topk_group >= r.n_group or r.group_score == "top2",
            f"{name}: llama.cpp ranks expert groups by their top-2 sum; this model's router ranks them by their best "
            f"expert (topk_method group_limited_greedy)")
    require(r.scoring in ("softmax", "sigmoid"), f"{name}: router scoring {r.scoring!r} has no llama.cpp gating function")
    check_shared_experts(name, "deepseek2", shapes, expert_width, desc.shared_experts)
    # deepseek32 and glm-dsa always read q_lora_rank
    lite = name not in INDEXED and (layers in LITE_LAYERS or (layers, config.get("vocab_size")) == LITE_DEPTH_VOCAB)
    require(not (lite and config.get("q_lora_rank")),
            f"{name}: llama.cpp reads a {layers}-layer deepseek2 (vocabulary {config.get('vocab_size')}) as "
            f"DeepSeek-V2-Lite, without q_lora; this model has q_lora_rank {config.get('q_lora_rank')}")
    rope = rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    require(kind in ("default", "yarn"), f"{name}: RoPE scaling {kind!r} is not exported to GGUF")
    if kind == "yarn":
        require(rope.get("mscale", 1.0) == rope.get("mscale_all_dim", rope.get("mscale", 1.0)),
                f"{name}: YaRN with mscale {rope.get('mscale')} != mscale_all_dim {rope.get('mscale_all_dim')} is not "
                "what llama.cpp's deepseek2 computes")


def _check_indexer(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's deepseek32 rotates the indexer's q and k by a Hadamard matrix of the largest power of two from 64
    that divides their width, and asserts the rotary part fits in them: a width that is not such a power is refused."""
    width = config["index_head_dim"]
    require("sparse_attention" in desc.extras, f"{name}: llama.cpp's {INDEXED[name]} needs the indexer")
    if name == "glm_moe_dsa":
        kind = rope_parameters(config).get("rope_type", "default")
        require(kind == "default", f"{name}: llama.cpp's glm-dsa reads no YaRN log multiplier; RoPE scaling {kind!r} "
                "is not exported to GGUF")
    require(width >= INDEXER_ROTATION and width & (width - 1) == 0 and config["qk_rope_head_dim"] <= width,
            f"{name}: llama.cpp's {INDEXED[name]} rotates the indexer heads by a Hadamard matrix of a power of two from "
            f"{INDEXER_ROTATION}; this model's index_head_dim is {width}")


def check_shared_experts(name: str, arch: str, shapes: dict[str, tuple[int, ...]], expert_width: int,
                         shared: int) -> None:
    """llama.cpp sizes the shared experts as `shared` routed ones side by side."""
    for key, shape in shapes.items():
        if ".mlp.shared_experts." in key:
            width = shape[0] if key.endswith(("gate_proj.weight", "up_proj.weight")) else shape[-1]
            require(width == expert_width * shared,
                    f"{name}: shared experts {width} wide; llama.cpp's {arch} takes {shared} × the routed experts' "
                    f"{expert_width}")


def rope_parameters(config: dict) -> dict:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def write_attention(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription,
                    kv_heads: int | list[int] = 1) -> None:
    """One K/V head of the latent plus the rotary key (`kv_heads` per layer where some layers are not attention); the
    real head sizes under the `_mla` keys; Mistral 4's query temperature 1 + beta · log(1 + floor(position / length)),
    which llama.cpp reads as scale and length."""
    latent, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_head_count_kv(kv_heads)
    writer.add_q_lora_rank(config.get("q_lora_rank") or 0)  # 0: q is one projection
    writer.add_kv_lora_rank(latent)
    writer.add_key_length(latent + rope)
    writer.add_value_length(latent)
    writer.add_key_length_mla(config["qk_nope_head_dim"] + rope)
    writer.add_value_length_mla(config["v_head_dim"])
    writer.add_rope_dimension_count(rope)
    write_yarn(writer, rope_parameters(config))
    if desc.attention.query_temperature is not None:
        beta, length = desc.attention.query_temperature
        writer.add_attn_temperature_scale(beta)
        writer.add_attn_temperature_length(length)
    if "sparse_attention" in desc.extras:
        writer.add_indexer_head_count(config["index_n_heads"])
        writer.add_indexer_key_length(config["index_head_dim"])
        writer.add_indexer_top_k(config["index_topk"])
    if config.get("indexer_types"):  # glm-dsa: which layers run their own indexer
        writer.add_array(f"{writer.arch}.attention.indexer.types", [t == "full" for t in config["indexer_types"]])


def write_yarn(writer: gguf.GGUFWriter, rope: dict) -> None:
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(rope[key])
    if rope.get("mscale_all_dim") is not None:
        # llama.cpp divides this key by 0.1 on load (its converter writes it so)
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_moe(writer: gguf.GGUFWriter, desc: ModelDescription, moe_layers: list[int], num_layers: int) -> None:
    r = desc.routing
    writer.add_leading_dense_block_count(moe_layers[0] if moe_layers else num_layers)
    writer.add_expert_shared_count(desc.shared_experts)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if r.scoring == "sigmoid"
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    if r.scale != 1.0:
        writer.add_expert_weights_scale(r.scale)
    if r.normalise:
        writer.add_expert_weights_norm(True)
    if r.n_group > 1 and r.topk_group < r.n_group:
        writer.add_expert_group_count(r.n_group)
        writer.add_expert_group_used_count(r.topk_group)


Piece = tuple[str, tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]


def pieces(key: str, shape: tuple[int, ...], config: dict) -> list[Piece] | None:
    """The GGUF tensors one trunk tensor becomes, where deepseek2 names or shapes it its own way (else None)."""
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    if key.endswith(KV_B):
        heads, latent = config["num_attention_heads"], shape[1]
        nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
        require(shape[0] == heads * (nope + v), f"trunk tensor {key}: {shape[0]} rows, the config says "
                f"{heads} heads × ({nope} + {v})")
        k_b = lambda t: t.view(heads, nope + v, latent)[:, :nope].transpose(1, 2).contiguous()
        v_b = lambda t: t.view(heads, nope + v, latent)[:, nope:].contiguous()
        return [(f"blk.{layer}.attn_k_b.weight", (heads, latent, nope), k_b),
                (f"blk.{layer}.attn_v_b.weight", (heads, v, latent), v_b)]
    if key.endswith(CORRECTION_BIAS):
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_EXP_PROBS_B].format(bid=int(layer))
        return [(f"{name}.bias", shape, lambda t: t)]
    return None
