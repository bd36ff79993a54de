"""The fast decoders' per-layer weight bundle (smoe.runtime.layers.LayerWeights) read from the transformers
model (so they compute with the very tensors the generic decoder uses), and what the fast decoders cover."""

from __future__ import annotations

import torch

from smoe.errors import SmoeError
from smoe.runtime.layers import GqaWeights, LayerWeights, MlaWeights
from smoe.source.description import ModelDescription


def layer_weights(layer, description: ModelDescription) -> LayerWeights:
    """The trunk tensors of one decoder layer in the common layout (self_attn with q/k/v/o or MLA's
    projections, an MoE block with `gate`, `experts` and optionally shared experts, or a gated dense MLP)."""
    mlp = layer.mlp
    moe = hasattr(mlp, "experts")
    router, _, correction = router_of(mlp) if moe else (None, None, None)
    shared = getattr(mlp, "shared_experts", None) if moe else None
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(), attention=attention_weights(layer.self_attn, description),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        router=router.detach() if moe else None,
        correction=correction.detach() if correction is not None else None,
        shared=mlp_weights(shared) if shared is not None else None,
        dense=None if moe else mlp_weights(mlp),
    )


def attention_weights(attn, description: ModelDescription) -> GqaWeights | MlaWeights:
    if description.attention.kind == "mla":
        return mla_weights(attn, description)
    fuse_qkv(attn)
    qk_norm = description.attention.qk_norm == "head"
    return GqaWeights(qkv=attn.smoe_qkv, q_norm=attn.q_norm.weight.detach() if qk_norm else None,
                      k_norm=attn.k_norm.weight.detach() if qk_norm else None, o=attn.o_proj.weight.detach())


def mla_weights(attn, description: ModelDescription) -> MlaWeights:
    """MLA's projections; kv_b [heads * (nope + v_head), latent] is viewed per head (nothing is copied)."""
    a = description.attention
    weight = lambda m: m.weight.detach() if m is not None else None
    kv_b = weight(attn.kv_b_proj)
    return MlaWeights(
        q=weight(attn.q_proj), q_a=weight(attn.q_a_proj), q_a_norm=weight(attn.q_a_layernorm), q_b=weight(attn.q_b_proj),
        kv_a=weight(attn.kv_a_proj_with_mqa), kv_a_norm=weight(attn.kv_a_layernorm),
        kv_b=kv_b.view(a.heads, kv_b.shape[0] // a.heads, a.latent_dim), nope=int(attn.qk_nope_head_dim),
        o=weight(attn.o_proj), scale=float(attn.scaling),
    )


def mlp_weights(mlp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def fast_decoder_gap(d: ModelDescription, device: str = "cpu") -> str | None:
    """Why the fast decoder of a device type ("cpu" | "cuda") does not cover description d, or None when it
    does. Both run the layer library's kinds (smoe.runtime.layers, library_gap); the GPU's own GQA block
    rotates the two halves only."""
    interleaved_gqa = d.attention.kind == "gqa" and "interleaved_rotary" in d.extras
    return _gaps((library_gap(d) is not None, library_gap(d) or ""),
                 (device != "cpu" and interleaved_gqa, "interleaved rotary in GQA attention"))


def library_gap(d: ModelDescription) -> str | None:
    """What the layer library lacks for d: it runs GQA attention without biases, windows or sinks (per-head
    q/k RMSNorm optional) and MLA without biases, rotary half-split or interleaved; every routing kind
    smoe.moe.route computes; SiLU-gated experts without biases; shared experts without a gate; gated
    SiLU dense layers; no other EXTRAS."""
    a, r, e = d.attention, d.routing, d.experts
    return _gaps(
        (a.kind not in ("gqa", "mla"), f"{a.kind} attention"),
        (a.qk_norm not in (None, "head") or (a.kind == "mla" and a.qk_norm), f"{a.qk_norm} q/k norm"),
        (a.bias, "attention biases"),
        (bool(a.sliding_layers), "sliding-window attention"),
        (a.sinks, "attention sinks"),
        (bool(a.mixer_layers), "linear-attention or state-space layers"),
        (r.custom is not None, f"its own routing ({r.custom})"),
        (r.router_bias, "a router bias"),
        (r.weight_input, "routing weights on the experts' input"),
        (e.clamp is not None, "clamped SwiGLU experts"),
        (e.clamp is None and (not e.gated or e.activation != "silu"), f"{e.activation} experts"),
        (e.biases, "expert biases"),
        (d.shared_experts > 0 and d.shared_gate, "gated shared experts"),
        *((True, f"{extra}") for extra in d.extras if extra != "interleaved_rotary"),
    )


def _gaps(*gaps) -> str | None:
    found = [part for gap, what in gaps if gap for part in what.split(", ")]
    return ", ".join(dict.fromkeys(found)) or None
