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
    transformers CausalLM, or of the text model of an image-text-to-text one (its `language_model`)."""
    base = model.model
    base = getattr(base, "language_model", None) or base
    return {"embed": base.embed_tokens.weight, "final_norm": first(base, FINAL_NORMS).weight,
            "lm_head": model.lm_head.weight, "rotary": first(base, ROTARY, required=False), "layers": list(base.layers)}


# the names a family gives a part of the model or of a decoder layer, in the order they are looked for
FINAL_NORMS = ("norm", "embedding_norm", "final_layernorm")  # LFM2 names its final norm embedding_norm
ROTARY = ("rotary_emb", "pos_emb")  # LFM2's pos_emb; Jamba has none (its attention has no rotary)
INPUT_NORMS = ("input_layernorm", "operator_norm")
POST_NORMS = ("post_attention_layernorm", "ffn_norm", "pre_ff_layernorm")  # LFM2's ffn_norm, Jamba's pre_ff_layernorm
MLPS = ("mlp", "block_sparse_moe", "feed_forward")  # Granite's MoE block; LFM2's and Jamba's feed_forward
OUTPUTS = ("o_proj", "out_proj")


def first(owner, names: tuple[str, ...], required: bool = True):
    """owner's attribute under the first of `names` it has (None when it has none and it is not required)."""
    found = next((getattr(owner, n) for n in names if getattr(owner, n, None) is not None), None)
    if found is None and required:
        raise SmoeError(f"{type(owner).__name__} has none of {', '.join(names)}")
    return found


SHARED_EXPERTS = ("shared_experts", "shared_expert", "shared_mlp")  # where MoE blocks keep their shared experts


def layer_tensors(layer, mla: bool, qk_norm: bool, output_gate: bool = False, output_norms: bool = False,
                  moe_output_norm: bool = False) -> dict:
    """One decoder layer's tensors in the common layout (self_attn with q/k/v/o or MLA's projections, an MoE
    block with `gate`, `experts` and optionally shared experts, or a gated dense MLP), under the names of
    smoe.runtime.layers.LayerWeights; `attention` holds GqaWeights' or MlaWeights' (kv_b as stored, 2-D).
    output_gate: the attention's gate_proj rows follow q, k and v in the fused matrix; output_norms: four norms,
    AFMoE's (post_attention_layernorm on the attention's output, pre_mlp_layernorm on the MLP's input) or GLM-4's
    (post_self_attn_layernorm on the attention's output, post_attention_layernorm on the MLP's input), and
    post_mlp_layernorm on the MLP's output, or OLMo-2's two (post_attention_layernorm and
    post_feedforward_layernorm on the outputs, none on the inputs: input_norm and post_norm None);
    moe_output_norm: the MoE block's post_mlp_layernorm on its output (AXK1's)."""
    mlp = first(layer, MLPS)
    moe = hasattr(mlp, "experts")
    router, router_bias, correction = router_of(mlp) if moe else (None, None, None)
    # DeepSeek's and GLM's `shared_experts`; Qwen2-MoE's `shared_expert`, scaled by its `shared_expert_gate`;
    # HunYuan's `shared_mlp`, and Granite's beside the MoE block
    owners = (mlp, layer)
    shared = next(filter(None, (getattr(o, n, None) for o in owners for n in SHARED_EXPERTS)), None) if moe else None
    shared_gate = getattr(mlp, "shared_expert_gate", None) if moe else None
    weight = lambda name: getattr(layer, name).weight.detach()
    if output_norms and not hasattr(layer, "input_layernorm"):  # OLMo-2's
        norms = dict(input_norm=None, post_norm=None, attention_out_norm=weight("post_attention_layernorm"),
                     mlp_out_norm=weight("post_feedforward_layernorm"))
    elif output_norms:
        afmoe = hasattr(layer, "pre_mlp_layernorm")
        norms = dict(post_norm=weight("pre_mlp_layernorm" if afmoe else "post_attention_layernorm"),
                     attention_out_norm=weight("post_attention_layernorm" if afmoe else "post_self_attn_layernorm"),
                     mlp_out_norm=weight("post_mlp_layernorm"))
    else:
        norms = dict(post_norm=first(layer, POST_NORMS).weight.detach())
        if moe_output_norm and moe:
            norms["mlp_out_norm"] = mlp.post_mlp_layernorm.weight.detach()
    if "input_norm" not in norms:
        norms["input_norm"] = first(layer, INPUT_NORMS).weight.detach()
    return dict(
        attention=mla_tensors(layer.self_attn) if mla else gqa_tensors(layer.self_attn, qk_norm, output_gate),
        **norms,
        router=router.detach() if moe else None,
        router_bias=router_bias.detach() if router_bias is not None else None,
        correction=correction.detach() if correction is not None else None,
        shared=mlp_tensors(shared) if shared is not None else None,
        shared_gate=shared_gate.weight.detach() if shared_gate is not None else None,
        dense=None if moe else mlp_tensors(mlp),
    )


def gqa_tensors(attn, qk_norm: bool, output_gate: bool = False) -> dict:
    """q/k/v (and the output gate's rows) fused, their biases, the q/k norms, o and its bias, and gpt-oss's
    per-head sink logits (`sinks`)."""
    fuse_qkv(attn, output_gate)
    biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    sinks = getattr(attn, "sinks", None)
    q_norm, k_norm = qk_norms(attn) if qk_norm else (None, None)
    o = first(attn, OUTPUTS)
    return dict(qkv=attn.smoe_qkv, q_norm=q_norm, k_norm=k_norm, o=o.weight.detach(),
                qkv_bias=torch.cat([b.detach() for b in biases]) if biases[0] is not None else None,
                o_bias=o.bias.detach() if o.bias is not None else None,
                sinks=sinks.detach() if isinstance(sinks, torch.Tensor) else None)


QK_NORMS = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"), ("q_layernorm", "k_layernorm"))


def qk_norms(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """The q and k norms' weights, under the first of the names QK_NORMS lists that the module has."""
    names = next((pair for pair in QK_NORMS if hasattr(attn, pair[0])), None)
    if names is None:
        raise SmoeError(f"no q/k norms found in {type(attn).__name__} (looked for {QK_NORMS})")
    return tuple(getattr(attn, name).weight.detach() for name in names)


def mla_tensors(attn) -> dict:
    # the query's projection, or its low-rank pair (AXK1's modules have no q_proj at all)
    weight = lambda name: getattr(attn, name).weight.detach() if getattr(attn, name, None) is not None else None
    return dict(q=weight("q_proj"), q_a=weight("q_a_proj"), q_a_norm=weight("q_a_layernorm"),
                q_b=weight("q_b_proj"), kv_a=weight("kv_a_proj_with_mqa"), kv_a_norm=weight("kv_a_layernorm"),
                kv_b=weight("kv_b_proj"), nope=int(attn.qk_nope_head_dim), o=weight("o_proj"),
                scale=float(attn.scaling))


def mlp_tensors(mlp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if hasattr(mlp, "input_linear"):  # Granite's: gate and up stacked in one matrix (views of it, nothing copied)
        gate, up = mlp.input_linear.weight.detach().chunk(2)
        return gate, up, mlp.output_linear.weight.detach()
    if hasattr(mlp, "w1"):  # LFM2's: w1 gate, w3 up, w2 down
        return tuple(p.weight.detach() for p in (mlp.w1, mlp.w3, mlp.w2))
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


def fuse_qkv(attn, output_gate: bool = False) -> None:
    """One [q; k; v] matrix (then gate_proj's rows, with output_gate) for one matmul; the attention module's
    weights become views into it, so the transformers path keeps working and no memory is duplicated."""
    if hasattr(attn, "smoe_qkv"):
        return
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, *((attn.gate_proj,) if output_gate else ()))
    fused = torch.cat([p.weight.detach() for p in projections])
    start = 0
    for p in projections:
        rows = p.weight.shape[0]
        p.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    attn.smoe_qkv = fused
