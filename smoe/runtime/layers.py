"""The layer library: a decoder layer's math as plain torch ops on any device, chosen by the model
description (smoe.source.description), over one layer's trunk tensors (`LayerWeights`) and one
sequence's state (smoe.runtime.kv).

- attention: `gqa` (grouped-query and multi-head; optional q/k RMSNorm before or after rotary, q/k/v and o
  biases, a sliding window, gpt-oss's sink logits, an output gate whose rows follow v (AFMoE) or each head's
  query rows (Qwen3-Next)) or `mla` (DeepSeek's latent attention,
  whose state holds only the latents: a step is computed absorbed, the query taken into the latent space through
  kv_b's key rows, attention over the cached latents, the output leaving through kv_b's value rows, so K and V are
  never expanded per head; a prompt that starts its sequence expands its own latents instead, the cheaper form
  for many queries at once);
  rotary in the half-split or interleaved layout, or none on a NoPE layer; Mistral 4's query temperature;
- around them: Granite's multipliers (embeddings, softmax scale, residual branches, logits) and norms on each
  branch's output (AFMoE's and GLM-4's beside the norms on their inputs, OLMo-2's instead of them); norms
  that scale by 1 + weight (Qwen3-Next's) take that as their weight (weights.norm_weight);
- the MoE block: routing through smoe.moe.route (router bias, correction bias, groups, scale), the routed
  experts from the caller (the decoders differ only in where experts come from), plus shared experts;
- dense layers: a gated SiLU MLP.

Fused copies of parts of this (the compiled CPU step, the GPU's Triton kernels and graphs) are tested
against it; a description with no fused copy runs these functions eagerly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass

import torch
import torch.nn.functional as F

from smoe.moe.routing import route
from smoe.runtime.kv import KeyValues, Latents
from smoe.source.description import ModelDescription, Multipliers

ACT = torch.float32  # the residual stream and activations; matrices may stay in the model's dtype


@dataclass
class GqaWeights:
    qkv: torch.Tensor  # [q; k; v] rows, then the output gate's where `gated`
    q_norm: torch.Tensor | None  # RMSNorm weights per head [head_dim], or over all heads [heads * head_dim]
    k_norm: torch.Tensor | None
    o: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # [q; k; v] biases, when the description has them (GLM-4.5, Qwen2-MoE)
    o_bias: torch.Tensor | None = None  # gpt-oss
    sinks: torch.Tensor | None = None  # [heads]: a logit per head that joins its softmax and takes a share (gpt-oss)
    window: int | None = None  # a sliding layer: each token attends to itself and the window - 1 tokens before it
    rotary: bool = True  # False: a layer without rotary embedding (the description's nope_layers)
    gated: bool = False  # the heads' output times sigmoid of the gate rows' projection (AFMoE)
    query_gate: bool = False  # the gate's rows follow each head's query rows in q ([q_h; gate_h]: Qwen3-Next)


@dataclass
class MlaWeights:
    q: torch.Tensor | None  # [heads * (nope + rope), hidden] when the query has no low rank (DeepSeek-V2-Lite)
    q_a: torch.Tensor | None  # [q_rank, hidden], its norm [q_rank], q_b [heads * (nope + rope), q_rank]
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor | None
    kv_a: torch.Tensor  # [latent + rope, hidden]: the compressed K/V and the shared rotary key
    kv_a_norm: torch.Tensor  # [latent]
    kv_b: torch.Tensor  # [heads, nope + v_head, latent]: per head, the key rows then the value rows
    nope: int  # the query's and key's width without rotary
    o: torch.Tensor
    scale: float  # the softmax scale (YaRN's mscale included)
    rotary: bool = True  # False: the rotary key and query parts pass unrotated (Kimi-Linear's MLA)

    @property
    def k_up(self) -> torch.Tensor:
        """[heads, nope, latent]: what a head's key is of the latent (a view of kv_b)."""
        return self.kv_b[:, : self.nope]

    @property
    def v_up(self) -> torch.Tensor:
        """[heads, v_head, latent]: what a head's value is of the latent."""
        return self.kv_b[:, self.nope :]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # None: the attention's input is not normalised (OLMo-2's layout)
    attention: GqaWeights | MlaWeights
    post_norm: torch.Tensor | None  # None: nor is the MLP's
    router: torch.Tensor | None  # None: a dense layer
    router_bias: torch.Tensor | None = None  # added to the router's logits (gpt-oss)
    correction: torch.Tensor | None = None  # the routing correction bias (choice only)
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate, up, down of the shared experts
    shared_gate: torch.Tensor | None = None  # [1, hidden]: the shared experts' output scaled by sigmoid(it · h)
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # gate, up, down of a dense MLP
    attention_out_norm: torch.Tensor | None = None  # norms on the attention's and the MLP's outputs (AFMoE)
    mlp_out_norm: torch.Tensor | None = None

    def map(self, fn) -> LayerWeights:
        """The bundle with fn applied to every tensor (None and numbers stay as they are)."""
        return mapped(self, fn)


def mapped(bundle, fn):
    """A weight bundle (a dataclass) with fn applied to every tensor in it, nested bundles included."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return fn(v)
        if isinstance(v, tuple):
            return tuple(fn(t) for t in v)
        return mapped(v, fn) if is_dataclass(v) else v

    return type(bundle)(**{f.name: one(getattr(bundle, f.name)) for f in fields(bundle)})


@dataclass(frozen=True)
class Step:
    """What every layer of one forward shares: the new tokens' positions and rotary tables, and what each of
    them sees of the sequence state."""

    pos: torch.Tensor  # [T] the new tokens' positions, where the state keeps them
    cos: torch.Tensor  # [T, 1, rotary dims], the cat(freqs, freqs) layout
    sin: torch.Tensor
    eps: float
    interleaved: bool  # rotary over adjacent pairs (DeepSeek) instead of the two halves
    end: int  # attention reads the state's first `end` positions
    mask: torch.Tensor | None = None  # [T, end]: what each new token sees; None: causally, after end - T held ones


def eager_step(start: int, t: int, cos, sin, eps: float, interleaved: bool) -> Step:
    """T new tokens after `start` held ones, attending over exactly the positions held (rotary tables
    [positions, d] for the whole state)."""
    return Step(torch.arange(start, start + t, device=cos.device), cos[start : start + t, None],
                sin[start : start + t, None], eps, interleaved, end=start + t)


def static_step(pos: torch.Tensor, positions: torch.Tensor, cos, sin, eps: float, interleaved: bool) -> Step:
    """New tokens at `pos` (a device tensor) attending over the whole state, masked to what each may see:
    shapes that never change, so a CUDA graph can hold the step (positions: arange of the state's capacity)."""
    return Step(pos, cos[pos][:, None], sin[pos][:, None], eps, interleaved, end=positions.shape[0],
                mask=positions[None, :] <= pos[:, None])


Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (h, ids, weights) -> routed sum


def decoder_layer(d: ModelDescription, w: LayerWeights, x, state: KeyValues | Latents, step: Step, experts: Experts):
    """x [T, hidden] (fp32) after one decoder layer: pre-norm attention, then the MoE block or dense MLP, each
    branch times the residual multiplier."""
    residual = multipliers(d).residual
    h = x if w.input_norm is None else rms_norm(x, w.input_norm, step.eps)
    out = (mla_attention(d, w.attention, h, state, step) if isinstance(w.attention, MlaWeights)
           else gqa_attention(d, w.attention, h, state, step))
    x = x + scaled(out if w.attention_out_norm is None else rms_norm(out, w.attention_out_norm, step.eps), residual)
    h = x if w.post_norm is None else rms_norm(x, w.post_norm, step.eps)
    out = moe_block(d, w, h, experts) if w.router is not None else dense_mlp(w.dense, h)
    return x + scaled(out if w.mlp_out_norm is None else rms_norm(out, w.mlp_out_norm, step.eps), residual)


def multipliers(d: ModelDescription) -> Multipliers:
    """The description's multipliers, neutral where it has none."""
    return d.multipliers or NEUTRAL


NEUTRAL = Multipliers()


def scaled(x, factor: float):
    return x if factor == 1 else x * factor


def embed(d: ModelDescription, table: torch.Tensor, ids: list[int]):
    """The tokens' embeddings [T, hidden] in fp32, times the embedding multiplier."""
    return scaled(table[torch.tensor(ids)].to(ACT), multipliers(d).embedding)


def final_logits(d: ModelDescription, x, norm, head, eps: float):
    """Logits [T, V] of the last layer's output, divided by the logits multiplier."""
    logits = matmul(rms_norm(x, norm, eps), head)
    divisor = multipliers(d).logits
    return logits if divisor == 1 else logits / divisor


def query_temperature(d: ModelDescription, pos: torch.Tensor) -> torch.Tensor | None:
    """[T] the queries' scale at positions pos where the description has Mistral 4's temperature tuning
    (1 + beta * log(1 + floor(p / length)), in fp32 as transformers computes it), else None."""
    if d.attention.query_temperature is None:
        return None
    beta, length = d.attention.query_temperature
    return 1 + beta * torch.log(1 + torch.floor(pos / length))


def rms_norm(x, weight, eps: float):
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] (fp32) times w^T, in w's dtype when it differs (the result comes back in x's dtype)."""
    if w.dtype == x.dtype:
        return F.linear(x, w)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


def bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Batched x [B, T, n] @ w [B, n, m], in w's dtype when it differs."""
    if w.dtype == x.dtype:
        return torch.bmm(x, w)
    return torch.bmm(x.to(w.dtype), w).to(x.dtype)


def rotate(x, cos, sin, interleaved: bool = False):
    """Rotary embedding of x [T, heads, d] with tables [T, 1, r]. Half-split: (x_i, x_{i+r/2}) pairs
    (rotate_half). Interleaved: (x_2i, x_2i+1) pairs, written out half-split; the query and the key get
    the same permutation, so their dot products are those of the interleaved layout. Partial rotary
    (tables narrower than the head, r < d): the first r values of each head rotate, the rest pass."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat([rotate(x[..., :width], cos, sin, interleaved), x[..., width:]], dim=-1)
    half = x.shape[-1] // 2
    if interleaved:
        c, s = cos[..., :half], sin[..., :half]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(query, key, value, step: Step, scale: float | None = None, window: int | None = None,
           sinks: torch.Tensor | None = None):
    """Attention of new queries [1, heads, T, e] over the state's first step.end positions [1, kv_heads, S, e],
    in the state's dtype, within the last `window` positions where one is given, with a sink logit per head
    where given; the result in fp32."""
    if window is not None or sinks is not None:
        return attend_within(query, key, value, visible(step, window), scale, sinks)
    t, held = query.shape[2], step.end - query.shape[2]
    mask = step.mask
    if mask is None and t > 1 and held:  # new tokens see every held token and the new ones up to themselves
        mask = torch.ones(t, step.end, dtype=torch.bool, device=query.device).tril(diagonal=held)
    out = F.scaled_dot_product_attention(query.to(key.dtype), key, value, attn_mask=mask[None, None] if mask is not None
                                         else None, is_causal=mask is None and t > 1, scale=scale, enable_gqa=True)
    return out.to(ACT)


def visible(step: Step, window: int | None) -> torch.Tensor:
    """[T, end] bool: the positions each new token attends to. transformers' sliding window lets a token at p
    see the keys after p - window (itself and window - 1 before it)."""
    keys = torch.arange(step.end, device=step.pos.device)
    mask = step.mask if step.mask is not None else keys[None] <= step.pos[:, None]
    return mask if window is None else mask & (keys[None] > step.pos[:, None] - window)


def attend_within(query, key, value, mask, scale: float | None, sinks: torch.Tensor | None):
    """attend() under an explicit mask [T, S]. With sinks [heads] the scores are written out: each head's
    softmax runs over its scores and its sink logit, whose share is then dropped (gpt-oss's attention)."""
    if sinks is None:
        out = F.scaled_dot_product_attention(query.to(key.dtype), key, value, attn_mask=mask[None, None], scale=scale,
                                             enable_gqa=True)
        return out.to(ACT)
    heads, t = query.shape[1], query.shape[2]
    key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))
    scores = (query.to(key.dtype) @ key.transpose(-1, -2)).to(ACT) * (scale or query.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask[None, None], float("-inf"))
    logits = torch.cat([scores, sinks.to(ACT).view(1, heads, 1, 1).expand(1, heads, t, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return (probs.to(value.dtype) @ value).to(ACT)


def gqa_attention(d: ModelDescription, w: GqaWeights, h, kv: KeyValues, step: Step):
    a, t = d.attention, h.shape[0]
    hd, end = a.head_dim, step.end
    qkv = matmul(h, w.qkv) if w.qkv_bias is None else matmul(h, w.qkv) + w.qkv_bias
    if w.query_gate:  # per head its query rows, then its gate's
        q, k, v = qkv.split([2 * a.heads * hd, a.kv_heads * hd, a.kv_heads * hd], dim=-1)
        q, gate = q.view(t, a.heads, 2, hd).unbind(2)
        q, gate = q.reshape(t, -1), gate.reshape(t, -1)
    else:
        q, k, v, gate = qkv.split([a.heads * hd, a.kv_heads * hd, a.kv_heads * hd, a.heads * hd * w.gated], dim=-1)
    if a.qk_norm == "full":  # OLMoE's: one norm over all heads, before they are split
        q, k = rms_norm(q, w.q_norm, step.eps), rms_norm(k, w.k_norm, step.eps)
    q, k = q.view(t, a.heads, hd), k.view(t, a.kv_heads, hd)
    if a.qk_norm == "head":
        q, k = rms_norm(q, w.q_norm, step.eps), rms_norm(k, w.k_norm, step.eps)
    if w.rotary:
        qk = rotate(torch.cat([q, k], dim=1), step.cos, step.sin, step.interleaved)
        q, k = qk.split([a.heads, a.kv_heads], dim=1)
    if a.qk_norm == "head_after_rotary":  # HunYuan's: each rotated head normalised
        q, k = rms_norm(q, w.q_norm, step.eps), rms_norm(k, w.k_norm, step.eps)
    kv.k.index_copy_(1, step.pos, k.transpose(0, 1).to(kv.k.dtype))
    kv.v.index_copy_(1, step.pos, v.view(t, a.kv_heads, hd).transpose(0, 1).to(kv.v.dtype))
    temperature = query_temperature(d, step.pos)
    if temperature is not None:
        q = q * temperature[:, None, None]
    out = attend(q.transpose(0, 1)[None], kv.k[None, :, :end], kv.v[None, :, :end], step, multipliers(d).attention,
                 window=w.window, sinks=w.sinks)
    out = out[0].transpose(0, 1).reshape(t, -1)
    out = matmul(out * torch.sigmoid(gate) if w.gated else out, w.o)
    return out if w.o_bias is None else out + w.o_bias


def mla_attention(d: ModelDescription, w: MlaWeights, h, kv: Latents, step: Step):
    """MLA over the latents the state keeps: one row per position, the normalised compressed K/V and the rotary key
    every head shares. A prompt that starts its sequence attends with the latents expanded into each head's keys
    and values (expanded_attention); every other step absorbed (absorbed_attention)."""
    a, t = d.attention, h.shape[0]
    nope, r = w.nope, a.latent_dim
    q = matmul(h, w.q) if w.q is not None else matmul(rms_norm(matmul(h, w.q_a), w.q_a_norm, a.latent_norm_eps), w.q_b)
    q_nope, q_rope = q.view(t, a.heads, nope + a.rope_key_dim).split([nope, a.rope_key_dim], dim=-1)
    latent, k_rope = matmul(h, w.kv_a).split([r, a.rope_key_dim], dim=-1)
    if w.rotary:
        k_rope, q_rope = rotate(k_rope[:, None], step.cos, step.sin, step.interleaved)[:, 0], rotate(
            q_rope, step.cos, step.sin, step.interleaved)
    row = torch.cat([rms_norm(latent, w.kv_a_norm, a.latent_norm_eps), k_rope], dim=-1)
    kv.rows.index_copy_(0, step.pos, row.to(kv.rows.dtype))
    temperature = query_temperature(d, step.pos)  # Mistral 4's: the whole query scaled, in either form
    if step.mask is None and step.end == t > 1:
        out = expanded_attention(w, q_nope, q_rope, kv.rows[:t], r, step, temperature)
    else:
        out = absorbed_attention(w, q_nope, q_rope, kv.rows[: step.end], r, step, temperature)
    return matmul(out.transpose(0, 1).reshape(t, -1), w.o)


def absorbed_attention(w: MlaWeights, q_nope, q_rope, rows, r: int, step: Step, temperature):
    """[heads, T, v_head]. Scores are q_nope·(k_up latent) + q_rope·k_rope = (q_nope k_up)·latent + q_rope·k_rope,
    outputs v_up (probs·latent): one K/V head of width latent + rope, the cached rows themselves, shared by every
    query head. What a step over a long state should read: the rows, never each head's keys."""
    query = torch.cat([bmm(q_nope.transpose(0, 1), w.k_up), q_rope.transpose(0, 1)], dim=-1)  # [heads, T, r + rope]
    if temperature is not None:
        query = query * temperature[None, :, None]
    out = attend(query[None], rows[None, None], rows[None, None, :, :r], step, w.scale)  # [1, heads, T, r]
    return bmm(out[0], w.v_up.transpose(1, 2))


def expanded_attention(w: MlaWeights, q_nope, q_rope, rows, r: int, step: Step, temperature):
    """[heads, T, v_head]: a prompt over its own positions, causally, the latents expanded into each head's keys
    (nope + rope wide) and values. For a whole prompt this is the cheaper form: each score costs nope + rope
    products instead of latent + rope (192 against 576 for DeepSeek-V3), and the absorbed form's one head of 576 is
    wider than SDPA's flash kernels take (256), so SDPA falls back to a slower path for it. Keys and values are
    padded to one width (zeros change no score under the explicit scale) so that those kernels take them."""
    heads, t = q_nope.shape[1], q_nope.shape[0]
    latent, k_rope = rows.split([r, rows.shape[-1] - r], dim=-1)
    k_nope, value = bmm(latent.expand(heads, t, r), w.kv_b.transpose(1, 2)).split(
        [w.nope, w.kv_b.shape[1] - w.nope], dim=-1)  # [heads, T, nope], [heads, T, v_head]
    key = torch.cat([k_nope, k_rope.expand(heads, t, -1)], dim=-1)  # every piece in the rows' dtype, as bmm gives
    query = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [heads, T, nope + rope]
    if temperature is not None:
        query = query * temperature[None, :, None]
    width = max(key.shape[-1], value.shape[-1])
    query, key, padded = (F.pad(x, (0, width - x.shape[-1])) for x in (query, key, value))
    return attend(query[None], key[None], padded[None], step, w.scale)[0, ..., : value.shape[-1]]


def moe_block(d: ModelDescription, w: LayerWeights, h, experts: Experts):
    """Routed experts (weights by smoe.moe.route) plus the shared experts, on the post-attention input h."""
    logits = matmul(h, w.router)
    top_i, top_w = route(d.routing, logits if w.router_bias is None else logits + w.router_bias, w.correction)
    out = experts(h, top_i, top_w)
    return out if w.shared is None else out + shared_mlp(w.shared, w.shared_gate, h)


def shared_mlp(shared, gate, h):
    """The shared experts' output, scaled by the sigmoid of their gate where they have one (Qwen2-MoE)."""
    out = dense_mlp(shared, h)
    return out if gate is None else out * torch.sigmoid(matmul(h, gate))


def dense_mlp(weights, x):
    gate, up, down = weights
    return matmul(F.silu(matmul(x, gate)) * matmul(x, up), down)


def rotary_dim(d: ModelDescription) -> int:
    """The width the rotary tables cover: MLA's rotary key, else the whole head."""
    return d.attention.rope_key_dim if d.attention.kind == "mla" else d.attention.head_dim


def rope_tables(rotary, n: int, dim: int):
    """cos/sin [n, dim] in the cat(freqs, freqs) layout, exactly as the model's rotary module computes them
    (a module that returns complex frequencies, DeepSeek-V2's, gives their real and imaginary parts; one that
    returns each frequency once, gpt-oss's, has them repeated)."""
    # a module keeping one table per layer kind (Mellum's): the full layers' one, the only kind a fast decoder
    # runs there (a description whose sliding layers take another base has the gap rope_per_layer_type)
    kind = {"layer_type": "full_attention"} if "layer_type" in inspect.signature(rotary.forward).parameters else {}
    out = rotary(torch.zeros(1, max(n, 2), dim, dtype=ACT), torch.arange(max(n, 2))[None], **kind)
    if isinstance(out, torch.Tensor) and out.is_complex():
        half = out[0, :n].to(torch.complex64)
        return torch.cat([half.real, half.real], dim=-1), torch.cat([half.imag, half.imag], dim=-1)
    cos, sin = out[0][0], out[1][0]
    if not repeats_its_halves(cos[1]):
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos[:n], sin[:n]


def repeats_its_halves(row: torch.Tensor) -> bool:
    """Whether a rotary table's row at position 1 is in the cat(freqs, freqs) layout: each frequency once
    (gpt-oss's tables) gives distinct cosines there, as the frequencies are distinct."""
    half = row.shape[-1] // 2
    return row.shape[-1] % 2 == 0 and torch.equal(row[:half], row[half:])
