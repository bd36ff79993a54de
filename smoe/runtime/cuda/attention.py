"""A one-token step's grouped-query attention in two Triton kernels.

Inside a layer's compiled block the single-token attention was a handful of small kernels: the q/k head norm
and rotary, two scatters into the KV cache, the visibility mask over the whole static cache and SDPA under it
(which reads every position of the cache, used or not). At batch 1 each costs a launch's latency rather than
bytes, so one kernel does all of it, split like flash decoding: a program per (query head, split of the cached
positions) normalises and rotates its query row, runs an online softmax over its split's positions in blocks
and writes its partial max, denominator and weighted sum; split 0 also takes the new position, its key and
value from registers (the other programs of the group may not have written them yet), and its first query
head of a group writes that KV entry. A second kernel folds each head's splits together (and the sink logit
where the layer has one, gpt-oss). One program per head over every position was a chain of dependent block
loads: 14.8 us a layer at ~160 positions on the H200 (BENCHMARKS.md).

What it computes is smoe.runtime.cuda.decode.attention_block's middle for the kinds `covers` admits (q/k norm per
head before rotary or none, half-split rotary over all or the first part of a head, or none, a sliding window,
sinks); the rest stays on the compiled torch ops. tests/test_attention_kernel.py holds it to attention_block
through the interpreter.
"""

from __future__ import annotations

import torch

from smoe.runtime.cuda.kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _normed_rotated(row_ptr, norm_ptr, cos_ptr, sin_ptr, pos, d, dm, eps,
                        HD: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr):
        """One head's row [HD] (fp32): RMS-normalised by its weights, then its first ROT values rotated in the
        half-split layout (value i pairs with i +- ROT/2). The partner values are loaded again, permuted, as a
        row held in registers cannot be shuffled."""
        HALF: tl.constexpr = ROT // 2
        x = tl.load(row_ptr + d, mask=dm, other=0.0).to(tl.float32)
        if HAS_NORM:
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + eps)
            x = (x * r).to(row_ptr.dtype.element_ty).to(tl.float32)  # the norm's result in the model's dtype
            x = x * tl.load(norm_ptr + d, mask=dm, other=0.0).to(tl.float32)
            x = x.to(row_ptr.dtype.element_ty).to(tl.float32)
        if ROT > 0:
            partner = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))
            p = tl.load(row_ptr + partner, mask=dm, other=0.0).to(tl.float32)
            if HAS_NORM:
                p = (p * r).to(row_ptr.dtype.element_ty).to(tl.float32)
                p = p * tl.load(norm_ptr + partner, mask=dm, other=0.0).to(tl.float32)
                p = p.to(row_ptr.dtype.element_ty).to(tl.float32)
            rot = d < ROT
            c = tl.load(cos_ptr + pos * ROT + d, mask=rot, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + pos * ROT + d, mask=rot, other=0.0).to(tl.float32)
            sign = tl.where(d < HALF, -1.0, 1.0)
            x = tl.where(rot, x * c + sign * p * s, x)
        return x

    @triton.jit
    def _attention_split(qkv_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, norm_ptr, part_ptr,
                         head_stride, eps, scale, window, chunk,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                         ROT: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
        """Query head h's attention over split s's positions [s * chunk, (s + 1) * chunk) of those it sees:
        the running max, denominator and weighted sum written to part_ptr [heads, splits, BLOCK_D + 2]. Split 0
        also takes the new position (its key and value from registers) and writes its KV entry."""
        h, s = tl.program_id(0), tl.program_id(1)
        group: tl.constexpr = HEADS // KV_HEADS
        g = h // group
        d = tl.arange(0, BLOCK_D)
        dm = d < HD
        pos = tl.load(pos_ptr)
        q = _normed_rotated(qkv_ptr + h * HD, norm_ptr + h * HD, cos_ptr, sin_ptr, pos, d, dm, eps, HD, ROT, HAS_NORM)
        k = _normed_rotated(qkv_ptr + (HEADS + g) * HD, norm_ptr + (HEADS + g) * HD, cos_ptr, sin_ptr, pos, d, dm,
                            eps, HD, ROT, HAS_NORM)
        v = tl.load(qkv_ptr + (HEADS + KV_HEADS + g) * HD + d, mask=dm, other=0.0)
        k_head, v_head = k_ptr + g * head_stride, v_ptr + g * head_stride
        k = k.to(k_ptr.dtype.element_ty)  # as the cache holds it, which is what the other positions are read as
        first = s == 0
        if (h % group == 0) & first:
            tl.store(k_head + pos * HD + d, k, mask=dm)
            tl.store(v_head + pos * HD + d, v.to(v_ptr.dtype.element_ty), mask=dm)
        q = q.to(qkv_ptr.dtype.element_ty).to(tl.float32) * scale
        # split 0 starts from the new position; the others from nothing (max -inf, weight 0)
        m = tl.where(first, tl.sum(q * k.to(tl.float32), axis=0), float("-inf"))
        den = tl.where(first, 1.0, 0.0)
        acc = tl.where(first, v.to(v_ptr.dtype.element_ty).to(tl.float32), 0.0)
        lo = pos * 0
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        start = tl.maximum(lo, s * chunk)
        stop = tl.minimum(pos, (s + 1) * chunk)
        while start < stop:  # a while loop: its bound is a device value (range() over one fails in the interpreter)
            n = start + tl.arange(0, BLOCK_N)
            nm = n < stop
            keys = tl.load(k_head + n[:, None] * HD + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            values = tl.load(v_head + n[:, None] * HD + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            scores = tl.sum(keys.to(tl.float32) * q[None, :], axis=1)
            scores = tl.where(nm, scores, float("-inf"))
            top = tl.maximum(m, tl.max(scores, axis=0))
            alpha = tl.exp(m - top)
            p = tl.exp(scores - top)
            acc = acc * alpha + tl.sum(p[:, None] * values.to(tl.float32), axis=0)
            den = den * alpha + tl.sum(p, axis=0)
            m = top
            start += BLOCK_N
        part = part_ptr + (h * tl.num_programs(1) + s) * (BLOCK_D + 2)
        tl.store(part + d, acc)
        tl.store(part + BLOCK_D, m)
        tl.store(part + BLOCK_D + 1, den)

    @triton.jit
    def _attention_combine(part_ptr, sinks_ptr, out_ptr, splits,
                           HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr):
        """Query head h's output from its splits' partial softmaxes (and its sink's logit, whose share is dropped)."""
        h = tl.program_id(0)
        d = tl.arange(0, BLOCK_D)
        sp = tl.arange(0, BLOCK_S)
        sm = sp < splits
        rows = part_ptr + (h * splits + sp) * (BLOCK_D + 2)
        m = tl.load(rows + BLOCK_D, mask=sm, other=float("-inf"))
        top = tl.max(m, axis=0)  # finite: split 0 holds the new position
        w = tl.exp(m - top)
        den = tl.sum(w * tl.load(rows + BLOCK_D + 1, mask=sm, other=0.0), axis=0)
        acc = tl.sum(w[:, None] * tl.load(rows[:, None] + d[None, :], mask=sm[:, None], other=0.0), axis=0)
        if HAS_SINKS:
            den = den + tl.exp(tl.load(sinks_ptr + h).to(tl.float32) - top)
        tl.store(out_ptr + h * HD + d, (acc / den).to(out_ptr.dtype.element_ty), mask=d < HD)


BLOCK_N = 32  # cached positions a loop step reads: [32, head_dim] keys and values
MAX_SPLITS = 64  # programs per query head over the cached positions


def covers(description, layer) -> str | None:
    """Why the kernel does not compute this GQA layer's single-token attention, or None when it does."""
    a = description.attention
    if a.qk_norm not in (None, "head"):
        return f"q/k norm {a.qk_norm!r}"
    if "interleaved_rotary" in description.extras:
        return "interleaved rotary"
    if layer.gated:
        return "an output gate"
    if a.query_temperature is not None:
        return "a query temperature"
    if a.heads % a.kv_heads:
        return "query heads not a multiple of the KV heads"
    if a.head_dim > 512:
        return f"head_dim {a.head_dim} (the kernel holds a head in registers)"
    return None


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None, sinks: torch.Tensor | None,
                     *, heads: int, kv_heads: int, head_dim: int, eps: float, scale: float | None,
                     window: int | None, rotary: bool) -> torch.Tensor:
    """One token's attention output [1, heads * head_dim] (qkv's dtype) from its projected row qkv [1, (heads +
    2 kv_heads) head_dim] at position pos (int64 [1], on the device: no host read, so it can be captured); the
    token's key and value are written to the caches [kv_heads, positions, head_dim] at pos. cos/sin [positions,
    rotary width]; qk_norm [heads + kv_heads, head_dim] (q's rows then k's) or None; sinks [heads] or None."""
    out = torch.empty(1, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    rot = cos.shape[-1] if rotary else 0
    block_d = triton.next_power_of_2(head_dim)
    splits, chunk = position_splits(k_cache.shape[1])
    part = torch.empty(heads, splits, block_d + 2, dtype=torch.float32, device=qkv.device)
    _attention_split[(heads, splits)](
        qkv.contiguous(), k_cache, v_cache, pos, cos.contiguous(), sin.contiguous(),
        qk_norm if qk_norm is not None else qkv, part, k_cache.stride(0), float(eps),
        float(scale if scale is not None else head_dim ** -0.5), int(window or 0), chunk,
        HEADS=heads, KV_HEADS=kv_heads, HD=head_dim, BLOCK_D=block_d, ROT=rot, HAS_NORM=qk_norm is not None,
        HAS_WINDOW=window is not None, BLOCK_N=BLOCK_N, num_warps=4)
    _attention_combine[(heads,)](part, sinks if sinks is not None else part, out, splits, HD=head_dim,
                                 BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
                                 HAS_SINKS=sinks is not None, num_warps=4)
    return out


def position_splits(capacity: int) -> tuple[int, int]:
    """(splits, positions per split) for a cache of `capacity` positions: at most MAX_SPLITS programs per head,
    each over whole BLOCK_N blocks. A step's latency is its longest chain of dependent block loads, so the
    positions are spread over programs; splits past the sequence's end find nothing and return at once."""
    blocks = -(-capacity // BLOCK_N)
    splits = min(blocks, MAX_SPLITS)
    return splits, -(-blocks // splits) * BLOCK_N
