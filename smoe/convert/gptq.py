"""GPTQ for a batch of matrices of one shape at once: a layer's experts, one projection.

`encode_gptq_batch` computes for each of E [out, in] matrices what `encoders.encode_gptq` computes for one: the
weighted scale search, GPTQ's column sweep with error feedback, and the least-squares refit of the scales. Each
matrix keeps its own Hessian, column order, inverse factor and scales; every step runs once for all E of them
(one batched factorisation, one batched matmul per block, one kernel per column operation). GPTQ's sweep is
sequential over columns, and one matrix's column is too small to fill a GPU: one matrix at a time, the GPU
spends its time launching kernels. The results are those of the one-matrix encoder up to the order of
floating-point sums: a value at a rounding boundary can round the other way, and its error feedback then moves a
few codes after it in the same row.

Runs on whatever device the weights are on (plain torch: CPU or CUDA).
"""

from __future__ import annotations

import torch

from smoe.convert.encoders import BLOCK, DAMP, fp16_scale, search_weighted
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.codec import GROUP_SIZE, half_range

ROW_CHUNK_ELEMENTS = 1 << 28  # fp64 elements of the refit's per-row contraction held at once (2 GiB)


def encode_gptq_batch(w: torch.Tensor, hessians: torch.Tensor, bits: int, names: list[str] | None = None):
    """w [E, out, in], hessians [E, in, in] (E[x xᵀ] of each matrix's inputs) -> (packed codes uint8
    [E, G, 64·bits/8], fp16 scales [E, G]): for each e, what encoders.encode_gptq(w[e], hessians[e], bits) gives."""
    codec.check_bits(bits)
    names = names or [f"tensor {e}" for e in range(w.shape[0])]
    W = as_batch(w, hessians, names)
    H = hessians.to(W.device, torch.float32)
    scales = weighted_scales(W, torch.diagonal(H, dim1=1, dim2=2), bits, names)
    codes = gptq_codes_batch(W, H, scales, bits)
    scales = refit_scales_batch(W, H, codes, scales, half_range(bits))
    groups = expert_groups(codes)
    packed = codec.pack_codes(groups.reshape(-1, GROUP_SIZE).to(torch.uint8), bits)
    return packed.view(groups.shape[0], groups.shape[1], -1), scales.to(torch.float16)


def as_batch(w: torch.Tensor, hessians: torch.Tensor, names: list[str]) -> torch.Tensor:
    if w.dim() != 3 or hessians.dim() != 3 or hessians.shape != (w.shape[0], w.shape[2], w.shape[2]):
        raise SmoeError(f"tensors {names[0]}..: weights {tuple(w.shape)} do not match calibration inputs "
                        f"{tuple(hessians.shape)} (expected [E, out, in] and [E, in, in])")
    return w.detach().to(torch.float32)


def expert_groups(x: torch.Tensor) -> torch.Tensor:
    """[E, out, in] -> [E, G, 64]: each matrix cut into groups by itself, its tail zero-padded (codec.to_groups)."""
    flat = x.reshape(x.shape[0], -1)
    pad = codec.num_groups(flat.shape[1]) * GROUP_SIZE - flat.shape[1]
    if pad:
        flat = torch.cat([flat, flat.new_zeros(flat.shape[0], pad)], dim=1)
    return flat.view(flat.shape[0], -1, GROUP_SIZE)


# --- weighted scale search -----------------------------------------------------------------------


def weighted_scales(W: torch.Tensor, diag: torch.Tensor, bits: int, names: list[str]) -> torch.Tensor:
    """[E, G] fp32 scales of encoders.encode_weighted for each matrix: the search is per group, so the groups of
    all E matrices are searched as one list."""
    E, out_dim, in_dim = W.shape
    # the grid search per matrix: its scales are the search's floor, and it refuses NaN/inf under the matrix's name
    grid = torch.stack([codec.encode(W[e], bits, name=names[e])[1] for e in range(E)]).to(W.device, torch.float32)
    groups = expert_groups(W).reshape(-1, GROUP_SIZE)
    weights = element_weights_batch(diag, out_dim).reshape(-1, GROUP_SIZE)
    return search_weighted(groups, weights, bits, grid.reshape(-1)).to(W.device).view(E, -1)


def element_weights_batch(importance: torch.Tensor, out_dim: int) -> torch.Tensor:
    """encoders.element_weights for each row of importance [E, in]: [E, G, 64], each with its own tie-breaking floor."""
    imp = importance.to(torch.float32).clamp(min=0)
    imp = imp + 1e-6 * imp.mean(dim=1, keepdim=True) + 1e-30
    groups = expert_groups(imp.repeat(1, out_dim))
    numel = out_dim * importance.shape[1]
    return groups * codec.valid_mask(groups.shape[1], numel, groups.device)


# --- the column sweep ----------------------------------------------------------------------------


def gptq_codes_batch(W: torch.Tensor, H: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """[E, out, in] codes (fp32 holding integers), each matrix column by column in the order of decreasing
    diagonal of its own Hessian, errors fed forward through its own inverse factor."""
    E, rows, n = W.shape
    h = half_range(bits)
    inv, step = element_steps_batch(scales, rows, n, h)
    order = torch.argsort(torch.diagonal(H, dim1=1, dim2=2), dim=1, descending=True)
    U = inverse_factors(H, order)
    # transposed, a column of all E matrices is E contiguous runs of `rows` values: a column step reads them whole
    cols = order[:, :, None].expand(E, n, rows)
    Wt, inv, step = (x.transpose(1, 2).gather(1, cols).contiguous() for x in (W, inv, step))
    alive = (inv > 0).to(torch.float32)  # a zero scale stores code 0
    codes = torch.empty_like(Wt)
    for i1 in range(0, n, BLOCK):
        i2 = min(i1 + BLOCK, n)
        err = sweep_block(Wt[:, i1:i2], inv[:, i1:i2], step[:, i1:i2], alive[:, i1:i2], U[:, i1:i2, i1:i2], h,
                          codes[:, i1:i2])
        if i2 < n:  # the block's errors reach the later columns in one batched matmul (GPTQ's lazy update)
            Wt[:, i2:].baddbmm_(U[:, i1:i2, i2:].transpose(1, 2), err, alpha=-1)
    return torch.empty_like(codes).scatter_(1, cols, codes).transpose(1, 2)


def sweep_block(W, inv, step, alive, U, h: float, codes) -> torch.Tensor:
    """One block of columns, in place on W [E, B, rows] and codes: each column quantised with codec's arithmetic
    (x·(h/s) + h, rounded half to even, clamped), its error divided by U[j, j] and spread over the block's later
    columns. Returns those scaled errors [E, B, rows]."""
    err = torch.empty_like(W)
    for j in range(W.shape[1]):
        x, code, e = W[:, j], codes[:, j], err[:, j]
        torch.mul(x, inv[:, j], out=code)
        code.add_(h).round_().clamp_(0, 2 * h).mul_(alive[:, j])
        torch.sub(x, (code - h) * step[:, j], out=e)
        e.div_(U[:, j, j, None])
        W[:, j + 1 :].addcmul_(U[:, j, j + 1 :, None], e[:, None, :], value=-1)
    return err


def element_steps_batch(scales: torch.Tensor, rows: int, cols: int, h: float):
    """encoders.element_steps for scales [E, G]: [E, rows, cols] tensors of h/s (0 for a zero scale) and s/h."""
    per_weight = scales.repeat_interleave(GROUP_SIZE, dim=1)[:, : rows * cols].reshape(-1, rows, cols)
    inv = torch.where(per_weight > 0, h / per_weight.clamp(min=1e-30), 0.0)
    return inv, per_weight / h


def inverse_factors(H: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """encoders.inverse_factor for each matrix: upper Cholesky factors of the damped H⁻¹ in each one's order."""
    E, n, _ = H.shape
    Hp = H.double().gather(1, order[:, :, None].expand(E, n, n)).gather(2, order[:, None, :].expand(E, n, n))
    diag = torch.diagonal(Hp, dim1=1, dim2=2)
    diag.copy_(torch.where(diag > 0, diag, 1.0))  # inputs never seen: decoupled, so the factor exists
    diag += DAMP * diag.mean(dim=1, keepdim=True)
    L = torch.linalg.cholesky(Hp)
    del Hp
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()


# --- least-squares refit of the scales -------------------------------------------------------------


def refit_scales_batch(W, H, codes, scales, h) -> torch.Tensor:
    """encoders.refit_scales for each matrix: given the codes, each row's fp16 scales minimising
    tr((W - Ŵ) H (W - Ŵ)ᵀ), kept for the rows where that lowers the error (only where groups lie within rows)."""
    E, out_dim, in_dim = W.shape
    if in_dim % GROUP_SIZE:
        return scales
    per_row = in_dim // GROUP_SIZE
    q = (codes - h) / h  # Ŵ = q · s, s the group's scale
    Hd = H.double()
    rows = max(1, ROW_CHUNK_ELEMENTS // (E * per_row * in_dim))
    solved = torch.cat([solve_rows(W[:, r0 : r0 + rows], Hd, q[:, r0 : r0 + rows], per_row)
                        for r0 in range(0, out_dim, rows)], dim=1)
    candidate = fp16_scale(solved.reshape(E, -1).float())
    candidate = torch.where((scales > 0) & (candidate > 0), candidate, scales)  # a zero scale means all-zero codes
    better = row_errors_batch(W, Hd, q, candidate) < row_errors_batch(W, Hd, q, scales)  # per row, all its groups
    return torch.where(better.repeat_interleave(per_row, dim=1), candidate, scales)


def solve_rows(w, Hd, q, per_row: int) -> torch.Tensor:
    """[E, R, per_row] least-squares scales of R rows: A s = b with A_gh = q_gᵀ H_gh q_h, b_g = q_gᵀ H_g· w."""
    E, R, in_dim = w.shape
    Q = q.double().reshape(E, R, per_row, GROUP_SIZE)
    P = torch.einsum("ergi,egic->ergc", Q, Hd.view(E, per_row, GROUP_SIZE, in_dim))  # q_gᵀ H_g·, per row
    A = torch.einsum("erghj,erhj->ergh", P.view(E, R, per_row, per_row, GROUP_SIZE), Q)
    b = torch.einsum("ergc,erc->erg", P, w.double())
    ridge = 1e-9 * torch.diagonal(A, dim1=2, dim2=3).mean(dim=2).clamp(min=1e-30)
    A = A + ridge[:, :, None, None] * torch.eye(per_row, dtype=A.dtype, device=A.device)
    return torch.linalg.solve(A, b.unsqueeze(-1)).squeeze(-1)


def row_errors_batch(W, Hd, q, scales) -> torch.Tensor:
    """[E, out]: (W - Ŵ) H (W - Ŵ)ᵀ per row of each matrix, for Ŵ = q · (group scale)."""
    E, out_dim, in_dim = W.shape
    per_weight = scales.repeat_interleave(GROUP_SIZE, dim=1)[:, : out_dim * in_dim].reshape(E, out_dim, in_dim)
    delta = (W - q * per_weight).double()
    return (torch.bmm(delta, Hd) * delta).sum(dim=2)
