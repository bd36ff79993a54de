"""The fast CPU decoder: a forward pass for the common decoder layout (the model descriptions
smoe.runtime.weights.fast_decoder_gap admits: Qwen3-MoE and Mixtral checkpoints): few Python-level ops per layer.

At batch 1 on a CPU, time per token is mostly per-op overhead, not arithmetic: transformers' modules
spend ~1,000 small ops per token on a 6-layer model. This path reads the same trunk tensors from the
transformers model (q/k/v fused into one matrix whose slices become the model's own weights, so
nothing is copied and both paths compute the same function), keeps a static KV cache, precomputes
the rotary tables with the model's own rotary module, and calls the expert store once per layer. The
generic decoder (the transformers modules) stays the reference and runs every other family.

One-token steps run compiled (`CompiledStep`, smoe/runtime/cpu/kernels_numba.py): two calls per layer (attention
and routing; then the routed experts straight from their codes when the store prepared them in the
"codes" form, else the eager expert path) over numpy views of the same weights and KV cache, so a
prefill on the eager path and steps on the compiled one share one cache. Activations stay in fp32
there (the eager path rounds them to the model's dtype before bf16 matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from smoe.errors import SmoeError
from smoe.moe.activation import activate
from smoe.moe.dispatch import routed_sum
from smoe.moe.routing import route
from smoe.runtime.buckets import bucket
from smoe.runtime.cpu import kernels as kernels_cpu
from smoe.runtime.cpu import kernels_numba as kn
from smoe.runtime.weights import LayerWeights, layer_weights
from smoe.switches import CPU_COMPILED, PREFETCH

# At batch 1 a bf16 matmul costs ~15 us of fixed overhead here against ~3 us in fp32, while a large one
# is bandwidth-bound and cheaper in bf16: activations run in fp32, matrices up to this many weights
# are held in fp32 (an exact upcast of the bf16 source), larger ones stay in the model's dtype.
SMALL_MATRIX = 1 << 20
ACT = torch.float32


class FastCpuDecoder:
    """Prefill and one-token steps over a OpenedVault's trunk and expert store."""

    def __init__(self, sm, max_positions: int):
        cfg = sm.config.get_text_config()
        self.sm, self.store = sm, sm.store
        self.dtype = sm.dtype
        self.eps = cfg.rms_norm_eps
        attention = sm.description.attention
        self.heads, self.kv_heads, self.head_dim = attention.heads, attention.kv_heads, attention.head_dim
        self.routing, self.kind = sm.description.routing, sm.description.experts
        self.top_k = self.routing.top_k
        self.normalize = self.routing.normalise
        base = sm.model.model
        self.embed = base.embed_tokens.weight
        self.final_norm = compute_form(base.norm.weight)
        self.lm_head = compute_form(sm.model.lm_head.weight)
        self.layers = [layer_weights(layer, sm.description).map(compute_form) for layer in base.layers]
        self.cos, self.sin = rope_tables(base.rotary_emb, max_positions, self.head_dim)
        shape = (1, self.kv_heads, max_positions, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=ACT) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=ACT) for _ in self.layers]
        self.max_positions = max_positions
        self.pos = 0
        # Off by default: it pays only when reads are slow and the guess is good (BENCHMARKS.md).
        self.prefetch = PREFETCH.on()
        self.compiled = CompiledStep(self)

    def reset(self) -> None:
        self.pos = 0

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of the new tokens, appended after the cached ones."""
        start, t = self.pos, check_room(self.pos, len(ids), self.max_positions)
        if t == 1 and self.compiled.enabled:
            return self.compiled.step(ids[0])
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
            guess, _ = route(self.routing, matmul(h, self.layers[i + 1].router))
            self.store.prefetch(i + 1, torch.unique(guess).tolist())

    def experts(self, i: int, w: LayerWeights, h):
        if self.prefetch:
            self.prefetch_next(i, h)
        top_i, top_w = route(self.routing, matmul(h, w.router))
        h = h.to(self.dtype)  # the experts were prepared for the model's dtype
        top_w = top_w.to(self.dtype)
        if h.shape[0] == 1:  # decode: one token, k experts: stack their outputs, weight them in one matmul
            ids = top_i[0].tolist()
            prepared = self.store.get(i, ids)
            return (top_w @ torch.cat([expert_mlp(prepared[e], h, self.kind) for e in ids])).to(ACT)
        return self.experts_batched(i, h, top_i, top_w).to(ACT)

    def experts_batched(self, i: int, h, top_i, top_w):
        def fetch(group):
            prepared = self.store.get(i, group)
            return {e: (lambda rows, p=prepared[e]: expert_mlp(p, rows, self.kind)) for e in group}

        return routed_sum(h, top_i, top_w, fetch, per_group=self.sm.routed.experts_per_group())


def check_room(start: int, t: int, capacity: int) -> int:
    """t, after checking that t more tokens fit the KV cache."""
    if start + t > capacity:
        raise SmoeError(f"sequence of {start + t} tokens is longer than the decoder's cache ({capacity})")
    return t


def rope_tables(rotary, n: int, head_dim: int):
    """cos/sin [n, head_dim] exactly as the model's rotary module computes them."""
    cos, sin = rotary(torch.zeros(1, n, head_dim, dtype=ACT), torch.arange(n)[None])
    return cos[0], sin[0]


def compute_form(w: torch.Tensor) -> torch.Tensor:
    """The weight as the fast decoder multiplies it: small matrices and vectors in fp32, large as stored."""
    return w.to(ACT) if w.dim() == 1 or w.numel() <= SMALL_MATRIX else w


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] (fp32) times w^T, in w's dtype when it differs (the result comes back in fp32)."""
    if w.dtype == x.dtype:
        return F.linear(x, w)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


def dense_mlp(weights, x):
    gate, up, down = weights
    return matmul(F.silu(matmul(x, gate)) * matmul(x, up), down)


def expert_mlp(expert, x, kind):
    """One expert on rows x, with the activation of the description's experts (`kind`)."""
    gate, up = kernels_cpu.gate_and_up(x, expert)
    return kernels_cpu.linear(activate(kind, gate, up), expert, "down")


def rotate(x, cos, sin):
    """Rotary embedding, half-split layout (rotate_half), x [T, heads, hd], cos/sin [T, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def as_numpy(w: torch.Tensor) -> np.ndarray:
    """A numpy view sharing w's memory: fp32 as is, bf16 as its uint16 bit patterns (what the kernels
    widen); any other dtype becomes an fp32 copy."""
    w = w.detach()
    if w.dtype == torch.bfloat16:
        return w.contiguous().view(torch.int16).numpy().view(np.uint16)
    if w.dtype != torch.float32:
        w = w.float()
    return w.contiguous().numpy()


@dataclass
class CompiledLayer:
    input_norm: np.ndarray
    qkv: np.ndarray
    q_norm: np.ndarray  # length 0: no per-head norm
    k_norm: np.ndarray
    o: np.ndarray
    post_norm: np.ndarray
    router: np.ndarray  # [0, H] for a dense layer
    dense: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    k_cache: np.ndarray  # [kv_heads, positions, hd], views of the decoder's caches
    v_cache: np.ndarray


class CompiledStep:
    """One-token decode steps of a FastCpuDecoder through the compiled kernels. Every array is extracted
    once and every buffer preallocated: per layer, Python only asks the store for the routed experts
    and passes their arrays on."""

    def __init__(self, dec: FastCpuDecoder):
        self.dec = dec
        hidden = dec.embed.shape[1]
        empty = np.zeros(0, dtype=np.float32)
        self.layers = [
            CompiledLayer(
                as_numpy(w.input_norm), as_numpy(w.qkv), as_numpy(w.q_norm) if w.q_norm is not None else empty,
                as_numpy(w.k_norm) if w.k_norm is not None else empty, as_numpy(w.o), as_numpy(w.post_norm),
                as_numpy(w.router) if w.router is not None else np.zeros((0, hidden), dtype=np.float32),
                tuple(as_numpy(m) for m in w.dense) if w.dense is not None else None,
                dec.k_cache[i][0].numpy(), dec.v_cache[i][0].numpy(),
            )
            for i, w in enumerate(dec.layers)
        ]
        self.embed, self.final_norm, self.lm_head = as_numpy(dec.embed), as_numpy(dec.final_norm), as_numpy(dec.lm_head)
        self.cos, self.sin = dec.cos.contiguous().numpy(), dec.sin.contiguous().numpy()
        # Matrices other than fp32 / bf16 (fp16 models) are held as fp32 copies; the eager path stays
        # the default there rather than doubling their memory. SMOE_CPU_COMPILED=0 turns the step off
        # (the eager path, for comparison).
        self.enabled = dec.dtype in (torch.float32, torch.bfloat16) and CPU_COMPILED.on()
        widest = max([hidden, *(m.shape[1] for layer in self.layers for m in (layer.qkv, layer.o, *(layer.dense or ())))])
        self.wide = np.zeros(widest, dtype=np.uint32)
        self.x = np.zeros(hidden, dtype=np.float32)
        self.h = np.zeros(hidden, dtype=np.float32)
        self.logits = np.zeros(self.lm_head.shape[0], dtype=np.float32)
        self.slots = bucket(dec.top_k)  # experts per call, padded: one compiled specialisation
        self.top_i = np.zeros(dec.top_k, dtype=np.int64)
        self.top_w = np.zeros(self.slots, dtype=np.float32)  # padding slots keep weight 0
        rows = max(layer.qkv.shape[0] for layer in self.layers)
        routers = max(layer.router.shape[0] for layer in self.layers)
        inter = max([m[0].shape[0] for layer in self.layers if layer.dense for m in [layer.dense]] or [0])
        self.work = np.zeros(max(kn.attention_work_size(rows, dec.head_dim, dec.max_positions, routers, hidden),
                                 2 * inter + hidden), dtype=np.float32)
        self.expert_work: dict[int, np.ndarray] = {}  # expert width -> scratch

    def step(self, token: int) -> torch.Tensor:
        """Logits [1, V] of one token appended after the cached ones."""
        dec, pos = self.dec, self.dec.pos
        kn.load_row(self.embed, token, self.x)
        for i, layer in enumerate(self.layers):
            kn.attention_and_route(self.x, pos, dec.heads, dec.eps, layer.input_norm, layer.qkv, layer.q_norm,
                                   layer.k_norm, layer.o, layer.post_norm, layer.router, layer.k_cache,
                                   layer.v_cache, self.cos, self.sin, dec.top_k, dec.normalize, self.h,
                                   self.top_i, self.top_w, self.work, self.wide)
            if layer.dense is not None:
                kn.dense_mlp(self.x, self.h, *layer.dense, self.work, self.wide)
            else:
                self.experts(i)
        dec.pos = pos + 1
        kn.final_logits(self.x, self.final_norm, dec.eps, self.lm_head, self.h, self.logits, self.wide)
        return torch.from_numpy(self.logits.copy())[None]

    def experts(self, i: int) -> None:
        dec = self.dec
        ids = self.top_i.tolist()
        if dec.prefetch:
            dec.prefetch_next(i, torch.from_numpy(self.h)[None])
        prepared = dec.store.get(i, ids)
        chosen = [prepared[e] for e in ids]
        if not all(from_codes(p) for p in chosen):
            return self.eager_experts(chosen)
        pad = [chosen[0]] * (self.slots - len(chosen))  # never read: the kernel stops at len(chosen)
        w = [p.weights for p in chosen + pad]
        inter = w[0]["gate"].shape[0]
        work = self.expert_work.get(inter)
        if work is None:
            work = self.expert_work[inter] = np.zeros(kn.experts_work_size(self.x.shape[0], inter), dtype=np.float32)
        kn.experts(self.x, self.h, len(chosen), self.top_w,
                   tuple(e["gate"].codes for e in w), tuple(e["gate"].steps for e in w),
                   tuple(e["up"].codes for e in w), tuple(e["up"].steps for e in w),
                   tuple(e["down"].codes for e in w), tuple(e["down"].steps for e in w),
                   (w[0]["gate"].lead, w[0]["down"].lead), inter, work)

    def eager_experts(self, chosen: list) -> None:
        """Experts in another form (dequant, int4, or a tensor the codes kernels cannot read)."""
        h = torch.from_numpy(self.h)[None].to(self.dec.dtype)
        y = sum(float(w) * expert_mlp(p, h, self.dec.kind).float() for w, p in zip(self.top_w, chosen))
        self.x += y[0].numpy()


def from_codes(expert) -> bool:
    """Whether the compiled expert kernel can run this prepared expert."""
    return expert.path == "codes" and not expert.fallbacks and not expert.biases and expert.roles == ("gate", "up", "down")
