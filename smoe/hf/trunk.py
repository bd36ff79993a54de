"""The trunk tensors the fast decoders compute with, read from the transformers model: the one place outside
the model classes that knows their decoder-layer layout (self_attn's projections, MLA's, the MoE block's
router, correction bias and shared experts, the embedding, final norm, LM head and rotary module). What it
returns is plain tensors and numbers, so the runtime's bundles (smoe.runtime.layers) do not depend on
transformers."""

from __future__ import annotations

import torch

from smoe.errors import SmoeError


def model_trunk(model) -> dict:
    """The embedding, final norm and LM head weights, the rotary module and the decoder layers of a
    transformers CausalLM."""
    base = model.model
    return {"embed": base.embed_tokens.weight, "final_norm": base.norm.weight, "lm_head": model.lm_head.weight,
            "rotary": base.rotary_emb, "layers": list(base.layers)}


def layer_tensors(layer, mla: bool, qk_norm: bool) -> dict:
    """One decoder layer's tensors in the common layout (self_attn with q/k/v/o or MLA's projections, an MoE
    block with `gate`, `experts` and optionally shared experts, or a gated dense MLP), under the names of
    smoe.runtime.layers.LayerWeights; `attention` holds GqaWeights' or MlaWeights' (kv_b as stored, 2-D)."""
    mlp = layer.mlp
    moe = hasattr(mlp, "experts")
    router, router_bias, correction = router_of(mlp) if moe else (None, None, None)
    # DeepSeek's and GLM's `shared_experts`; Qwen2-MoE's `shared_expert`, scaled by its `shared_expert_gate`
    shared = (getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)) if moe else None
    shared_gate = getattr(mlp, "shared_expert_gate", None) if moe else None
    return dict(
        input_norm=layer.input_layernorm.weight.detach(),
        attention=mla_tensors(layer.self_attn) if mla else gqa_tensors(layer.self_attn, qk_norm),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        router=router.detach() if moe else None,
        router_bias=router_bias.detach() if router_bias is not None else None,
        correction=correction.detach() if correction is not None else None,
        shared=mlp_tensors(shared) if shared is not None else None,
        shared_gate=shared_gate.weight.detach() if shared_gate is not None else None,
        dense=None if moe else mlp_tensors(mlp),
    )


def gqa_tensors(attn, qk_norm: bool) -> dict:
    """q/k/v fused, their biases, the q/k norms, o and its bias, and gpt-oss's per-head sink logits (`sinks`)."""
    fuse_qkv(attn)
    biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    sinks = getattr(attn, "sinks", None)
    return dict(qkv=attn.smoe_qkv, q_norm=attn.q_norm.weight.detach() if qk_norm else None,
                k_norm=attn.k_norm.weight.detach() if qk_norm else None, o=attn.o_proj.weight.detach(),
                qkv_bias=torch.cat([b.detach() for b in biases]) if biases[0] is not None else None,
                o_bias=attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None,
                sinks=sinks.detach() if isinstance(sinks, torch.Tensor) else None)


def mla_tensors(attn) -> dict:
    weight = lambda m: m.weight.detach() if m is not None else None
    return dict(q=weight(attn.q_proj), q_a=weight(attn.q_a_proj), q_a_norm=weight(attn.q_a_layernorm),
                q_b=weight(attn.q_b_proj), kv_a=weight(attn.kv_a_proj_with_mqa), kv_a_norm=weight(attn.kv_a_layernorm),
                kv_b=weight(attn.kv_b_proj), nope=int(attn.qk_nope_head_dim), o=weight(attn.o_proj),
                scale=float(attn.scaling))


def mlp_tensors(mlp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(p.weight.detach() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


ROUTER_WEIGHTS = ("gate", "router", "gate.wg", "router.layer", "router.gate", "router.proj")  # where MoE blocks keep the router
CORRECTION_BIASES = ("gate.e_score_correction_bias", "e_score_correction_bias", "expert_bias",
                     "gate.moe_statics.e_score_correction_bias")


def router_of(block) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(router weight [E, H], router bias or None, correction bias or None) of a transformers MoE block."""
    def find(path):
        obj = block
        for part in path.split("."):
            obj = getattr(obj, part, None)
        return obj

    router = next((m for m in map(find, ROUTER_WEIGHTS) if isinstance(getattr(m, "weight", None), torch.Tensor)), None)
    if router is None:
        raise SmoeError(f"no router found in {type(block).__name__} (looked for {', '.join(ROUTER_WEIGHTS)})")
    bias = getattr(router, "bias", None)
    correction = next((t for t in map(find, CORRECTION_BIASES) if isinstance(t, torch.Tensor)), None)
    return router.weight, bias if isinstance(bias, torch.Tensor) else None, correction


def fuse_qkv(attn) -> None:
    """One [q; k; v] matrix for one matmul; the attention module's three weights become views into it,
    so the transformers path keeps working and no memory is duplicated."""
    if hasattr(attn, "smoe_qkv"):
        return
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    fused = torch.cat([p.weight.detach() for p in projections])
    start = 0
    for p in projections:
        rows = p.weight.shape[0]
        p.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    attn.smoe_qkv = fused
