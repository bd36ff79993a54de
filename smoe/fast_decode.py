"""A lean forward pass for the common decoder layout (Qwen3-MoE, Mixtral): few Python-level ops per layer.

At batch 1 on a CPU, time per token is mostly per-op overhead, not arithmetic: transformers' modules
spend ~1,000 small ops per token on a 6-layer model. This path reads the same trunk tensors from the
transformers model (q/k/v fused into one matrix whose slices become the model's own weights, so
nothing is copied and both paths compute the same function), keeps a static KV cache, precomputes the rotary tables with the model's own rotary module, and calls the expert
store once per layer. The transformers path stays the reference and the fallback for other families.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from smoe import kernels_cpu

SUPPORTED = {"qwen3_moe": True, "mixtral": False}  # family -> has per-head q/k RMSNorm
# At batch 1 a bf16 matmul costs ~15 us of fixed overhead here against ~3 us in fp32, while a large one
# is bandwidth-bound and cheaper in bf16: activations run in fp32, matrices up to this many weights
# are held in fp32 (an exact upcast of the bf16 source), larger ones stay in the model's dtype.
SMALL_MATRIX = 1 << 20
ACT = torch.float32


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q; k; v] rows; the model's own q/k/v weights are views into it
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor | None  # None: a dense layer (Qwen3-MoE's mlp_only_layers / decoder_sparse_step)
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate, up, down of a dense MLP


def supports(sm) -> bool:
    text = sm.config.get_text_config()
    return (sm.vault.meta["family"] in SUPPORTED and getattr(text, "sliding_window", None) in (None, 0)
            and not getattr(text, "attention_bias", False) and getattr(text, "hidden_act", "silu") == "silu")


class LeanDecoder:
    """Prefill and one-token steps over a StreamingModel's trunk and expert store."""

    def __init__(self, sm, max_positions: int):
        cfg = sm.config.get_text_config()
        self.sm, self.store = sm, sm.store
        self.dtype = sm.dtype
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.top_k = cfg.num_experts_per_tok
        self.normalize = getattr(cfg, "norm_topk_prob", True)
        base = sm.model.model
        self.embed = base.embed_tokens.weight
        self.final_norm = compute_form(base.norm.weight)
        self.lm_head = compute_form(sm.model.lm_head.weight)
        self.layers = [self.layer_weights(layer, SUPPORTED[sm.vault.meta["family"]]) for layer in base.layers]
        self.cos, self.sin = self.rope_tables(base.rotary_emb, max_positions)
        shape = (1, self.kv_heads, max_positions, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=ACT) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=ACT) for _ in self.layers]
        self.max_positions = max_positions
        self.pos = 0
        # Off by default: it pays only when reads are slow and the guess is good (BENCHMARKS.md).
        self.prefetch = os.environ.get("SMOE_PREFETCH") == "1"

    @staticmethod
    def layer_weights(layer, qk_norm: bool) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        fuse_qkv(attn)
        moe = hasattr(mlp, "experts")
        dense = None if moe else tuple(compute_form(p.weight) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        return LayerWeights(
            input_norm=compute_form(layer.input_layernorm.weight),
            qkv=compute_form(attn.smoe_qkv),
            q_norm=compute_form(attn.q_norm.weight) if qk_norm else None,
            k_norm=compute_form(attn.k_norm.weight) if qk_norm else None,
            o=compute_form(attn.o_proj.weight), post_norm=compute_form(layer.post_attention_layernorm.weight),
            router=compute_form(mlp.gate.weight) if moe else None, dense=dense,
        )

    def rope_tables(self, rotary, n: int):
        """cos/sin [n, head_dim] exactly as the model's rotary module computes them."""
        probe = torch.zeros(1, n, self.head_dim, dtype=ACT)
        cos, sin = rotary(probe, torch.arange(n)[None])
        return cos[0], sin[0]

    def reset(self) -> None:
        self.pos = 0

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of the new tokens, appended after the cached ones."""
        start, t = self.pos, len(ids)
        if start + t > self.max_positions:
            raise ValueError("sequence longer than the decoder's cache")
        x = self.embed[torch.tensor(ids)].to(ACT)  # [T, H]
        cos, sin = self.cos[start : start + t, None], self.sin[start : start + t, None]  # [T, 1, hd]
        for i, w in enumerate(self.layers):
            x = x + self.attention(i, w, F.rms_norm(x, x.shape[-1:], w.input_norm, self.eps), cos, sin, start)
            h = F.rms_norm(x, x.shape[-1:], w.post_norm, self.eps)
            x = x + (self.experts(i, w, h) if w.router is not None else dense_mlp(w.dense, h))
        self.pos = start + t
        return matmul(F.rms_norm(x, x.shape[-1:], self.final_norm, self.eps), self.lm_head)

    def attention(self, i: int, w: LayerWeights, h, cos, sin, start: int):
        t, hd = h.shape[0], self.head_dim
        q, k, v = matmul(h, w.qkv).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q = q.view(t, self.heads, hd)
        k = k.view(t, self.kv_heads, hd)
        if w.q_norm is not None:
            q = F.rms_norm(q, (hd,), w.q_norm, self.eps)
            k = F.rms_norm(k, (hd,), w.k_norm, self.eps)
        q, k = rotate(torch.cat([q, k], dim=1), cos, sin).split([self.heads, self.kv_heads], dim=1)
        end = start + t
        k_cache, v_cache = self.k_cache[i], self.v_cache[i]
        k_cache[0, :, start:end] = k.transpose(0, 1)
        v_cache[0, :, start:end] = v.view(t, self.kv_heads, hd).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k_cache[:, :, :end], v_cache[:, :, :end],
            is_causal=t > 1 and start == 0, attn_mask=self.causal_mask(start, t) if t > 1 and start else None,
            enable_gqa=True,
        )
        return matmul(out[0].transpose(0, 1).reshape(t, -1), w.o)

    @staticmethod
    def causal_mask(start: int, t: int) -> torch.Tensor:
        """New tokens see every cached token and the new ones up to themselves."""
        return torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start)

    def prefetch_next(self, i: int, h) -> None:
        """Guess layer i+1's experts from layer i's expert input through layer i+1's router (the
        residual stream changes little between layers) and start reading them."""
        if i + 1 < len(self.layers) and self.layers[i + 1].router is not None:
            guess = torch.topk(matmul(h, self.layers[i + 1].router), self.top_k, dim=-1).indices
            self.store.prefetch(i + 1, torch.unique(guess).tolist())

    def experts(self, i: int, w: LayerWeights, h):
        if self.prefetch:
            self.prefetch_next(i, h)
        logits = matmul(h, w.router).float()
        if self.normalize:  # softmax then renormalising the top k = softmax over the top-k logits
            top_logits, top_i = torch.topk(logits, self.top_k, dim=-1)
            top_w = torch.softmax(top_logits, dim=-1)
        else:
            top_w, top_i = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        h = h.to(self.dtype)  # the experts were prepared for the model's dtype
        top_w = top_w.to(self.dtype)
        if h.shape[0] == 1:  # decode: one token, k experts: stack their outputs, weight them in one matmul
            ids = top_i[0].tolist()
            prepared = self.store.get(i, ids)
            return (top_w @ torch.cat([expert_mlp(prepared[e], h) for e in ids])).to(ACT)
        return self.experts_batched(i, h, top_i, top_w).to(ACT)

    def experts_batched(self, i: int, h, top_i, top_w):
        out = torch.zeros_like(h)
        for batch in self.sm.engine.batches(i, torch.unique(top_i).tolist()):
            prepared = self.store.get(i, batch)
            for e in batch:
                token_idx, slot = torch.where(top_i == e)
                y = expert_mlp(prepared[e], h[token_idx]) * top_w[token_idx, slot, None]
                out.index_add_(0, token_idx, y)
        return out


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


def compute_form(w: torch.Tensor) -> torch.Tensor:
    """The weight as the lean path multiplies it: small matrices and vectors in fp32, large as stored."""
    return w.to(ACT) if w.dim() == 1 or w.numel() <= SMALL_MATRIX else w


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] (fp32) times w^T, in w's dtype when it differs (the result comes back in fp32)."""
    if w.dtype == x.dtype:
        return F.linear(x, w)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


def dense_mlp(weights, x):
    gate, up, down = weights
    return matmul(F.silu(matmul(x, gate)) * matmul(x, up), down)


def expert_mlp(expert, x):
    gate, up = kernels_cpu.gate_and_up(x, expert)
    return kernels_cpu.linear(F.silu(gate) * up, expert, "down")


def rotate(x, cos, sin):
    """Rotary embedding, half-split layout (rotate_half), x [T, heads, hd], cos/sin [T, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
