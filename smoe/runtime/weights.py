"""The one per-layer weight bundle of the fast decoders: a decoder layer's trunk tensors, taken from the
transformers model (so both decoders compute with the very tensors the generic decoder uses)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from smoe.errors import SmoeError
from smoe.source.description import ModelDescription


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q; k; v] rows; the model's own q/k/v weights are views into it
    q_norm: torch.Tensor | None  # per-head RMSNorm weights [head_dim], when the description has them
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor | None  # None: a dense layer
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate, up, down of a dense MLP

    def map(self, fn) -> LayerWeights:
        """The bundle with fn applied to every tensor (None stays None)."""
        def one(v):
            if v is None:
                return None
            return tuple(fn(t) for t in v) if isinstance(v, tuple) else fn(v)

        return LayerWeights(**{f.name: one(getattr(self, f.name)) for f in fields(self)})


def layer_weights(layer, description: ModelDescription) -> LayerWeights:
    """The trunk tensors of one decoder layer in the common layout (self_attn with q/k/v/o, an MoE
    block with `gate` and `experts` or a gated dense MLP)."""
    attn, mlp = layer.self_attn, layer.mlp
    fuse_qkv(attn)
    moe = hasattr(mlp, "experts")
    qk_norm = description.attention.qk_norm == "head"
    router = router_of(mlp)[0] if moe else None
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(), qkv=attn.smoe_qkv,
        q_norm=attn.q_norm.weight.detach() if qk_norm else None, k_norm=attn.k_norm.weight.detach() if qk_norm else None,
        o=attn.o_proj.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
        router=router.detach() if moe else None,
        dense=None if moe else tuple(p.weight.detach() for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)),
    )


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


def fast_decoder_gap(d: ModelDescription) -> str | None:
    """Why the fast decoders (the compiled CPU step and the GPU's) do not cover description d, or None
    when they do. They implement: GQA attention without biases, windows or sinks, optionally with
    per-head q/k RMSNorm; softmax routing (normalised or not) without correction bias, groups, scale
    or router bias; SiLU-gated experts without biases; no shared experts; gated SiLU dense layers;
    none of the EXTRAS."""
    a, r, e = d.attention, d.routing, d.experts
    gaps = [
        (a.kind != "gqa", f"{a.kind} attention"),
        (a.qk_norm not in (None, "head"), f"{a.qk_norm} q/k norm"),
        (a.bias, "attention biases"),
        (bool(a.sliding_layers), "sliding-window attention"),
        (a.sinks, "attention sinks"),
        (bool(a.mixer_layers), "linear-attention or state-space layers"),
        (r.custom is not None, f"its own routing ({r.custom})"),
        (r.scoring != "softmax", f"{r.scoring} routing"),
        (r.correction_bias, "a routing correction bias"),
        (r.n_group > 1, "group-limited routing"),
        (r.scale != 1.0 or r.normalise_eps, "scaled routing weights"),
        (r.router_bias, "a router bias"),
        (r.weight_input, "routing weights on the experts' input"),
        (e.clamp is not None, "clamped SwiGLU experts"),
        (e.clamp is None and (not e.gated or e.activation != "silu"), f"{e.activation} experts"),
        (e.biases, "expert biases"),
        (d.shared_experts > 0, "shared experts"),
        *((True, f"{extra}") for extra in d.extras),
    ]
    found = [what for gap, what in gaps if gap]
    return ", ".join(found) if found else None
