"""The CUDA scale search: the arithmetic of `smoe.format.codec` as one Triton kernel.

As in the numba search, candidates are the vector axis and the weights of a group are walked in
order, so each per-candidate sum has the reference's left-to-right order. FMA contraction is turned
off and the division is the correctly rounded one, so codes and scales match the CPU bit for bit.
Runs on CPU tensors too under TRITON_INTERPRET=1 (how the tests check it without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from smoe.format.spec import CANDIDATE_FACTORS, FP16_MAX, GROUP_SIZE, half_range, packed_group_bytes

ROUND_MAGIC = tl.constexpr(8388608.0)  # 2**23: (t + 2**23) - 2**23 rounds 0 <= t < 2**23 half to even in fp32
MAX_SCALE = tl.constexpr(FP16_MAX)


@triton.jit
def _round_half_even(t):
    return (t + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _quantise(x, inv, h):
    """Codes (as fp32) of x under 1/scale `inv`; clamping first keeps t in the range of the rounding trick."""
    t = x * inv + h
    return _round_half_even(tl.minimum(tl.maximum(t, 0.0), 2.0 * h))


@triton.jit
def _encode_kernel(
    x_ptr, factors_ptr, packed_ptr, scales_ptr, absmax_ptr, n_groups, numel,
    H: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)  # [B] group ids
    row_ok = rows < n_groups
    cols = tl.arange(0, GROUP)  # [64] weight index within a group, also the candidate index
    offs = rows[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + offs, mask=row_ok[:, None], other=0.0)  # [B, 64]

    absx = tl.abs(x)
    bad = tl.max(tl.where((absx != absx) | (absx == float("inf")), 1, 0), axis=1)  # NaN or inf
    absmax = tl.where(bad > 0, float("inf"), tl.max(absx, axis=1))
    tl.store(absmax_ptr + rows, absmax, mask=row_ok)
    usable = (absmax <= MAX_SCALE) & (absmax > 0)  # otherwise nothing to search, or an error the caller raises

    factors = tl.load(factors_ptr + cols)  # [64]
    cand = (tl.where(usable, absmax, 0.0)[:, None] * factors[None, :]).to(tl.float16).to(tl.float32)  # [B, 64]
    inv = tl.where(cand > 0, tl.math.div_rn(tl.full(cand.shape, H, tl.float32), tl.where(cand > 0, cand, 1.0)), 0.0)

    xq = tl.zeros((BLOCK, GROUP), tl.float32)
    qq = tl.zeros((BLOCK, GROUP), tl.float32)
    for j in range(GROUP):
        xj = tl.load(x_ptr + rows * GROUP + j, mask=row_ok, other=0.0)  # [B]
        real = (rows * GROUP + j) < numel  # tail padding stays out of the error
        q = _quantise(xj[:, None], inv, H) - H
        xq += tl.where(real[:, None], xj[:, None] * q, 0.0)
        qq += tl.where(real[:, None], q * q, 0.0)

    d = tl.math.div_rn(cand, tl.full(cand.shape, H, tl.float32))
    err = tl.where(cand > 0, d * (d * qq - 2.0 * xq), 0.0)
    # first index of the least error, as the sequential "strictly better" scan of the reference picks
    best_err = tl.min(err, axis=1)
    first = tl.min(tl.where(err == best_err[:, None], cols[None, :], GROUP), axis=1)
    best_s = tl.sum(tl.where(cols[None, :] == first[:, None], cand, 0.0), axis=1)
    best_s = tl.where(usable, best_s, 0.0)
    tl.store(scales_ptr + rows, best_s, mask=row_ok)

    binv = tl.where(best_s > 0, tl.math.div_rn(tl.full(best_s.shape, H, tl.float32), tl.where(best_s > 0, best_s, 1.0)), 0.0)
    codes = tl.where(best_s[:, None] > 0, _quantise(x, binv[:, None], H), 0.0).to(tl.uint8)  # [B, 64]
    PER_BYTE: tl.constexpr = 8 // BITS
    shifts = ((cols % PER_BYTE) * BITS).to(tl.uint8)
    shifted = (codes << shifts[None, :]).reshape(BLOCK, GROUP // PER_BYTE, PER_BYTE)
    packed = tl.sum(shifted.to(tl.int32), axis=2).to(tl.uint8)  # disjoint bits: sum == or
    pcols = tl.arange(0, GROUP // PER_BYTE)
    tl.store(packed_ptr + rows[:, None] * (GROUP // PER_BYTE) + pcols[None, :], packed, mask=row_ok[:, None])


def search_triton(groups: torch.Tensor, numel: int, bits: int, block: int = 16):
    """Same contract as `smoe.format.codec.search_reference`."""
    groups = groups.contiguous()
    n = groups.shape[0]
    packed = torch.empty((n, packed_group_bytes(bits)), dtype=torch.uint8, device=groups.device)
    scales = torch.empty(n, dtype=torch.float32, device=groups.device)
    absmax = torch.empty(n, dtype=torch.float32, device=groups.device)
    if n:
        factors = CANDIDATE_FACTORS.to(groups.device)
        grid = (triton.cdiv(n, block),)
        _encode_kernel[grid](
            groups, factors, packed, scales, absmax, n, numel,
            H=half_range(bits), BITS=bits, BLOCK=block, GROUP=GROUP_SIZE, enable_fp_fusion=False,
        )
    return packed, scales, absmax
