"""CPU kernels of smoe.convert.encoders, fused with numba: one pass per group for the weighted scale search,
and GPTQ's column sweep without per-column interpreter overhead. Same arithmetic as the torch code in
smoe.convert.encoders (errors summed in fp64), which the GPU uses."""

from __future__ import annotations

import numba
import numpy as np
import torch

from smoe.format.search_numba import _round_to_fp16
from smoe.format.spec import CANDIDATE_FACTORS, GROUP_SIZE


@numba.njit(inline="always")
def _code(x, inv, h):
    return min(max(np.rint(x * inv + h), np.float32(0.0)), np.float32(2.0) * h)


@numba.njit(inline="always")
def _weighted_error(groups, weights, g, s, h):
    """sum_j w_j (x_j - x̂_j)² of group g at fp16 scale s (fp32 codes as codec computes them, fp64 sum)."""
    err = 0.0
    if s > 0:
        inv = h / s
        d = s / h
        for j in range(GROUP_SIZE):
            q = _code(groups[g, j], inv, h) - h
            diff = np.float64(groups[g, j]) - np.float64(q * d)
            err += weights[g, j] * diff * diff
    else:
        for j in range(GROUP_SIZE):
            err += weights[g, j] * np.float64(groups[g, j]) ** 2
    return err


@numba.njit(parallel=True, cache=True, error_model="numpy")
def _search_weighted(groups, weights, factors, h, grid_scales, iterations, scales_out):
    h = np.float32(h)
    buf = np.empty((groups.shape[0], factors.shape[0]), np.float32)
    for g in numba.prange(groups.shape[0]):
        absmax = np.float32(0.0)
        for j in range(GROUP_SIZE):
            absmax = max(absmax, abs(groups[g, j]))
        best_s = grid_scales[g]
        best = _weighted_error(groups, weights, g, best_s, h)
        if absmax == 0.0:
            scales_out[g] = best_s
            continue
        cand = buf[g]
        for i in range(factors.shape[0]):
            cand[i] = absmax * factors[i]
        _round_to_fp16(cand)
        for i in range(factors.shape[0]):
            err = _weighted_error(groups, weights, g, cand[i], h)
            if err < best:
                best, best_s = err, cand[i]
        one = np.empty(1, np.float32)
        for _ in range(iterations):  # least-squares scale given the codes, rounded to fp16, requantised
            if best_s <= 0:
                break
            inv, num, den = h / best_s, 0.0, 0.0
            for j in range(GROUP_SIZE):
                q = np.float64(_code(groups[g, j], inv, h) - h)
                num += weights[g, j] * groups[g, j] * q
                den += weights[g, j] * q * q
            if den <= 0 or num <= 0:
                break
            one[0] = min(np.float32(num / den * h), np.float32(65504.0))
            _round_to_fp16(one)
            err = _weighted_error(groups, weights, g, one[0], h)
            if not err < best:
                break
            best, best_s = err, one[0]
        scales_out[g] = best_s


def search_weighted_numba(groups: torch.Tensor, weights: torch.Tensor, h: float, grid_scales: torch.Tensor,
                          iterations: int) -> torch.Tensor:
    out = np.empty(groups.shape[0], np.float32)
    _search_weighted(groups.contiguous().numpy(), weights.double().contiguous().numpy(), CANDIDATE_FACTORS.numpy(),
                     h, grid_scales.float().contiguous().numpy(), iterations, out)
    return torch.from_numpy(out)


@numba.njit(cache=True, error_model="numpy")
def _gptq(W, inv, step, U, h, codes):
    """Columns in order; each column's error, scaled by 1/U[j, j], is spread over the later columns."""
    rows, cols = W.shape
    h = np.float32(h)
    for j in range(cols):
        for r in range(rows):
            x = W[r, j]
            if inv[r, j] > 0:
                c = _code(x, inv[r, j], h)
                value = (c - h) * step[r, j]
            else:
                c, value = np.float32(0.0), np.float32(0.0)
            codes[r, j] = c
            e = (x - value) / U[j, j]
            for k in range(j + 1, cols):
                W[r, k] -= e * U[j, k]


def gptq_numba(W: torch.Tensor, inv: torch.Tensor, step: torch.Tensor, U: torch.Tensor, h: float) -> torch.Tensor:
    """W, inv, step [rows, cols] fp32 in processing order, U [cols, cols]: codes [rows, cols] (fp32)."""
    w = W.contiguous().numpy().copy()
    codes = np.empty_like(w)
    _gptq(w, inv.contiguous().numpy(), step.contiguous().numpy(), U.contiguous().numpy(), h, codes)
    return torch.from_numpy(codes)
