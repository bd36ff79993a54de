"""Encoders that choose SMOE codes and scales to minimise the error a projection makes on its inputs.

All of them write exactly the SMOE format of `smoe.format.codec` (packed codes + one fp16 scale per 64
weights, decoded by `codec.decode`); only the choice of codes and scales differs:

* grid     - `codec.encode`: per group, the best of 64 candidate scales for the plain squared error.
* weighted - per group, minimise sum_j w_j (x_j - x̂_j)², w_j = E[x_j²] of input channel j (the diagonal
             of ‖(W - Ŵ)x‖²): the same 64 candidates, then a least-squares refit of the scale given the
             codes, requantise, iterate; a group keeps the grid's scale when that is better.
* gptq     - the weighted scales, then codes chosen column by column with GPTQ's error feedback along
             each row using the full second moment H = E[x xᵀ] (columns in order of decreasing H_jj,
             H damped by DAMP); then, where groups lie within rows, each row's scales are refit by least
             squares under H given the codes (kept for the rows where that lowers the error).

The weighted encoders take the second moment of the projection's inputs (see smoe.convert.calibrate).
"""

from __future__ import annotations

import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.codec import GROUP_SIZE, half_range

ENCODERS = ("grid", "weighted", "gptq")
DEFAULT = "gptq"  # used when calibration text is given and no encoder is named: the best measured (QUALITY.md)
NEEDS_CALIBRATION = ("weighted", "gptq")
CALIB_TOKENS = 65536  # GPTQ overfits fewer: 16384 tokens gave Q4 KL 0.0146 on qwen3-moe-28m, 65536 gave 0.0132
REFIT_ITERATIONS = 4
DAMP = 0.1  # GPTQ's damping, a share of H's mean diagonal (0.01 overfits the calibration: QUALITY.md)
BLOCK = 128  # columns per lazy GPTQ update


def default_encoder(calib) -> str:
    """Without calibration text only `grid` can run."""
    return DEFAULT if calib is not None else "grid"


def check_encoder(encoder: str) -> None:
    if encoder not in ENCODERS:
        raise SmoeError(f"unknown encoder {encoder!r} (choose from {', '.join(ENCODERS)})")


def encode(w: torch.Tensor, bits: int, encoder: str = "grid", second_moment: torch.Tensor | None = None,
           name: str = "tensor"):
    """[out, in] weights -> (packed codes, fp16 scales) in the SMOE format, by `encoder`.

    second_moment: [in, in] E[x xᵀ] of the projection's input (weighted, gptq); a 1-D [in] vector of
    E[x_j²] is enough for `weighted`.
    """
    check_encoder(encoder)
    codec.check_bits(bits)
    if encoder == "grid":
        return codec.encode(w, bits, name=name)
    if second_moment is None:
        raise SmoeError(f"the {encoder} encoder needs calibration statistics (--calib FILE)")
    if encoder == "weighted":
        diag = second_moment if second_moment.dim() == 1 else torch.diagonal(second_moment)
        return encode_weighted(w, diag, bits, name)
    if second_moment.dim() != 2:
        raise SmoeError("the gptq encoder needs the full second-moment matrix of the inputs")
    return encode_gptq(w, second_moment, bits, name)


# --- weighted scale search -----------------------------------------------------------------------


def element_weights(importance: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Per-weight importance in SMOE's group layout [G, 64]: weight (r, c) gets importance[c]; padding 0.
    A small floor (1e-6 of the mean) breaks ties in groups whose inputs are all zero towards plain error."""
    out_dim, in_dim = shape
    imp = importance.to(torch.float32).clamp(min=0)
    imp = imp + 1e-6 * float(imp.mean()) + 1e-30
    flat = imp.repeat(out_dim)
    groups, _ = codec.to_groups(flat)
    return groups * codec.valid_mask(groups.shape[0], out_dim * in_dim, groups.device)


def weighted_error(groups, weights, s, h) -> torch.Tensor:
    """sum_j w_j (x_j - x̂_j)² per group for scales s [G] (fp64, direct form: no cancellation)."""
    q = codec.quantise_with_scale(groups, s, h) - h
    d = (s / h).to(torch.float64)
    wq = torch.where(s[:, None] > 0, q.double() * d[:, None], 0.0)
    return (weights.double() * (groups.double() - wq) ** 2).sum(dim=1)


def search_weighted(groups, weights, bits: int, grid_scales: torch.Tensor) -> torch.Tensor:
    """Best fp16 scale per group [G] for the weighted error, never worse than `grid_scales`."""
    h = half_range(bits)
    if not groups.is_cuda:
        from smoe.convert.encoders_numba import search_weighted_numba

        return search_weighted_numba(groups, weights, h, grid_scales, REFIT_ITERATIONS)
    absmax = codec.group_absmax(groups)
    candidates = codec.candidate_scales(absmax)
    best_s = grid_scales.to(torch.float32)
    best_err = weighted_error(groups, weights, best_s, h)
    for i in range(candidates.shape[1]):
        best_s, best_err = keep_better(groups, weights, h, candidates[:, i], best_s, best_err)
    for _ in range(REFIT_ITERATIONS):  # least squares: d = Σ w x q / Σ w q² given the codes, then requantise
        q = codec.quantise_with_scale(groups, best_s, h) - h
        num = (weights * groups * q).double().sum(dim=1)
        den = (weights * q * q).double().sum(dim=1)
        d = torch.where(den > 0, num / den.clamp(min=1e-300), 0.0)
        refit = fp16_scale(d * h)
        best_s, best_err = keep_better(groups, weights, h, refit, best_s, best_err)
    return best_s


def keep_better(groups, weights, h, s, best_s, best_err):
    err = weighted_error(groups, weights, s, h)
    better = err < best_err
    return torch.where(better, s, best_s), torch.where(better, err, best_err)


def fp16_scale(s: torch.Tensor) -> torch.Tensor:
    """Positive scales rounded to fp16 as stored (held in fp32); others 0."""
    return s.clamp(min=0, max=codec.FP16_MAX).to(torch.float16).to(torch.float32)


def encode_weighted(w: torch.Tensor, importance: torch.Tensor, bits: int, name: str = "tensor"):
    """Importance-weighted scale search; codes are round-to-nearest for the chosen scale."""
    w2 = as_matrix(w, importance, name)
    grid_codes, grid_scales = codec.encode(w2, bits, name=name)  # checks NaN/inf and range too
    groups, _ = codec.to_groups(w2.reshape(-1))
    weights = element_weights(importance.to(groups.device), tuple(w2.shape))
    scales = search_weighted(groups, weights, bits, grid_scales.to(groups.device).float())
    codes = codec.quantise_with_scale(groups, scales, half_range(bits))
    return codec.pack_codes(codes.to(torch.uint8), bits), scales.to(torch.float16)


def as_matrix(w: torch.Tensor, importance: torch.Tensor, name: str) -> torch.Tensor:
    if w.dim() != 2 or importance.shape[0] != w.shape[1]:
        raise SmoeError(f"tensor {name}: shape {tuple(w.shape)} does not match calibration inputs of width "
                        f"{importance.shape[0]}")
    return w.detach().to(torch.float32)


# --- GPTQ ----------------------------------------------------------------------------------------


def encode_gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, name: str = "tensor"):
    """GPTQ with scales fixed up front (weighted search), then a least-squares refit of the scales."""
    w2 = as_matrix(w, hessian, name)
    hessian = hessian.to(w2.device, torch.float32)
    _, scales = encode_weighted(w2, torch.diagonal(hessian), bits, name)
    h = half_range(bits)
    codes = gptq_codes(w2, hessian, scales.float(), bits)
    scales = refit_scales(w2, hessian, codes, scales.float(), h)
    groups, _ = codec.to_groups(codes.reshape(-1).float())
    return codec.pack_codes(groups.to(torch.uint8), bits), scales.to(torch.float16)


def element_steps(scales: torch.Tensor, shape: tuple[int, int], h: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale of each weight's group, as [out, in] tensors of h/s (0 for a zero scale) and s/h."""
    numel = shape[0] * shape[1]
    per_weight = scales.repeat_interleave(GROUP_SIZE)[:numel].reshape(shape)
    inv = torch.where(per_weight > 0, h / per_weight.clamp(min=1e-30), 0.0)
    return inv, per_weight / h


def quantise_column(x, inv, step, h):
    """Codes and decoded values of one column, with codec's arithmetic (x·(h/s) + h, rounded half to even)."""
    code = torch.where(inv > 0, torch.round(x * inv + h).clamp(0, 2 * h), 0.0)
    value = torch.where(inv > 0, (code - h) * step, 0.0)
    return code, value


def inverse_factor(hessian: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹ (damped, in `order`), as GPTQ uses it."""
    H = hessian[order][:, order].double().clone()
    diag = torch.diagonal(H)
    dead = diag <= 0
    H[dead, dead] = 1.0
    diag += DAMP * float(diag.mean())
    L = torch.linalg.cholesky(H)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()


def gptq_codes(w: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """[out, in] codes (fp32 holding integers) chosen column by column with error feedback."""
    h = half_range(bits)
    inv, step = element_steps(scales, tuple(w.shape), h)
    order = torch.argsort(torch.diagonal(hessian), descending=True)
    U = inverse_factor(hessian, order)
    W, inv, step = w[:, order].clone(), inv[:, order], step[:, order]
    if not W.is_cuda:
        from smoe.convert.encoders_numba import gptq_numba

        codes = gptq_numba(W, inv, step, U, h)
        out = torch.empty_like(codes)
        out[:, order] = codes
        return out
    codes = torch.zeros_like(W)
    n = W.shape[1]
    for i1 in range(0, n, BLOCK):
        i2 = min(i1 + BLOCK, n)
        err = torch.zeros(W.shape[0], i2 - i1, device=W.device)
        for j in range(i1, i2):
            code, value = quantise_column(W[:, j], inv[:, j], step[:, j], h)
            codes[:, j] = code
            e = (W[:, j] - value) / U[j, j]
            W[:, j:i2] -= e[:, None] * U[j, j:i2][None, :]
            err[:, j - i1] = e
        W[:, i2:] -= err @ U[i1:i2, i2:]
    out = torch.empty_like(codes)
    out[:, order] = codes
    return out


def refit_scales(w, hessian, codes, scales, h) -> torch.Tensor:
    """Given the codes, the fp16 scales minimising tr((W - Ŵ) H (W - Ŵ)ᵀ): one small least-squares system
    per row when groups lie within rows; kept only if the fp16-rounded result lowers the error."""
    out_dim, in_dim = w.shape
    if in_dim % GROUP_SIZE:
        return scales
    per_row = in_dim // GROUP_SIZE
    q = (codes - h) / h  # Ŵ = q · s, s the group's scale
    Hb = hessian.reshape(per_row, GROUP_SIZE, per_row, GROUP_SIZE).double()
    Hr = hessian.reshape(per_row, GROUP_SIZE, in_dim).double()
    solved = []
    for r0 in range(0, out_dim, 64):  # rows in chunks: the contraction's intermediate is rows x in x in/64
        Qg = q[r0 : r0 + 64].reshape(-1, per_row, GROUP_SIZE).double()
        A = torch.einsum("rgi,gihj,rhj->rgh", Qg, Hb, Qg)
        b = torch.einsum("rgi,gic,rc->rg", Qg, Hr, w[r0 : r0 + 64].double())
        ridge = 1e-9 * torch.diagonal(A, dim1=1, dim2=2).mean(dim=1).clamp(min=1e-30)
        A = A + ridge[:, None, None] * torch.eye(per_row, dtype=A.dtype, device=A.device)
        solved.append(torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1))
    solved = torch.cat(solved)
    candidate = fp16_scale(solved.reshape(-1).float())
    candidate = torch.where((scales > 0) & (candidate > 0), candidate, scales)  # a zero scale means all-zero codes
    better = row_errors(w, hessian, q, candidate) < row_errors(w, hessian, q, scales)  # per row, all its groups
    return torch.where(better.repeat_interleave(per_row), candidate, scales)


def row_errors(w, hessian, q, scales) -> torch.Tensor:
    """(W - Ŵ) H (W - Ŵ)ᵀ per row, for Ŵ = q · (group scale)."""
    approx = q * scales.repeat_interleave(GROUP_SIZE)[: w.numel()].reshape(w.shape)
    delta = (w - approx).double()
    return ((delta @ hessian.double()) * delta).sum(dim=1)
