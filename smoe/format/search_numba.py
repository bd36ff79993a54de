"""The CPU scale search: the arithmetic of `smoe.format.codec`, fused into one pass per group with numba.

The 64 candidates are the vector lanes: for each weight, all candidates are evaluated side by side,
so every per-candidate sum keeps its left-to-right order (bit-exact with the reference) and the loop
still vectorises. Groups are spread over threads with prange; absmax, the fp16 rounding of the
candidates and the code packing happen in the same pass, so each weight is read from memory once.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from smoe.format.spec import CANDIDATE_FACTORS, FP16_MAX, GROUP_SIZE, half_range, packed_group_bytes

FP16_MIN_NORMAL = np.float32(2.0**-14)


@numba.njit(cache=True, inline="always")
def _round_to_fp16(values):
    """Round non-negative fp32 values (<= 65504) in place to the nearest fp16 value, ties to even."""
    bits = values.view(np.uint32)
    for i in range(values.shape[0]):
        x = values[i]
        if x < FP16_MIN_NORMAL:  # fp16 subnormals: a fixed step of 2**-24, exact in fp32
            values[i] = np.rint(x * np.float32(2.0**24)) * np.float32(2.0**-24)
        else:  # keep 10 of 23 fraction bits, round half to even (a carry bumps the exponent)
            u = bits[i]
            bits[i] = (u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)


@numba.njit(parallel=True, cache=True, error_model="numpy")
def _encode_groups(groups, numel, factors, h, bits, packed_out, scales_out, absmax_out):
    n_cand = factors.shape[0]
    h32 = np.float32(h)
    top = np.float32(2.0 * h)
    per_byte = 8 // bits
    for g in numba.prange(groups.shape[0]):
        n = min(GROUP_SIZE, numel - g * GROUP_SIZE)
        absmax = np.float32(0.0)
        for j in range(GROUP_SIZE):
            a = abs(groups[g, j])
            if a != a or a == np.inf:  # NaN or inf: reported by the caller
                absmax = np.float32(np.inf)
                break
            absmax = max(absmax, a)
        absmax_out[g] = absmax
        for k in range(packed_out.shape[1]):
            packed_out[g, k] = 0
        scales_out[g] = 0.0
        if absmax == 0.0 or not absmax <= FP16_MAX:  # nothing to search, or an error the caller raises
            continue

        cand = absmax * factors
        _round_to_fp16(cand)
        inv = np.zeros(n_cand, np.float32)
        for i in range(n_cand):
            if cand[i] > 0:
                inv[i] = h32 / cand[i]
        xq = np.zeros(n_cand, np.float32)
        qq = np.zeros(n_cand, np.float32)
        for j in range(n):
            x = groups[g, j]
            for i in range(n_cand):
                t = x * inv[i] + h32
                q = min(max(np.rint(t), np.float32(0.0)), top) - h32
                xq[i] += x * q
                qq[i] += q * q

        best = np.float32(np.inf)
        best_s = np.float32(0.0)
        for i in range(n_cand):
            s = cand[i]
            err = np.float32(0.0)
            if s > 0:
                d = s / h32
                err = d * (d * qq[i] - np.float32(2.0) * xq[i])
            if err < best:
                best = err
                best_s = s
        scales_out[g] = best_s
        if best_s > 0:
            binv = h32 / best_s
            for j in range(GROUP_SIZE):
                code = np.uint8(min(max(np.rint(groups[g, j] * binv + h32), np.float32(0.0)), top))
                packed_out[g, j // per_byte] |= code << np.uint8(bits * (j % per_byte))


def search_numba(groups: torch.Tensor, numel: int, bits: int):
    """Same contract as `smoe.format.codec.search_reference`."""
    g_np = groups.contiguous().numpy()
    packed = np.empty((g_np.shape[0], packed_group_bytes(bits)), np.uint8)
    scales = np.empty(g_np.shape[0], np.float32)
    absmax = np.empty(g_np.shape[0], np.float32)
    factors = CANDIDATE_FACTORS.numpy()
    _encode_groups(g_np, numel, factors, half_range(bits), bits, packed, scales, absmax)
    return torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(absmax)
