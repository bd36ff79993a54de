"""GPTQ for many matrices of one shape at once (a layer's experts, one projection).

The column loop of GPTQ is sequential: one column's rounding error is fed into the columns after it. On a GPU
each step is a few tiny kernels, so encoding experts one by one spends its time launching them. Here the loop
runs once for a whole batch of experts, each with its own Hessian, column order and scales, so a step's kernels
cover every expert. The codes are those `encoders.encode_gptq` chooses for each expert, up to the order of
floating-point sums.
"""

from __future__ import annotations

import torch

from smoe.convert.encoders import (
    BLOCK,
    element_steps,
    encode_weighted,
    inverse_factor,
    quantise_column,
    refit_scales,
)
from smoe.format import codec
from smoe.format.codec import half_range


def encode_gptq_many(ws: list[torch.Tensor], hessians: list[torch.Tensor], bits: int,
                     names: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(packed codes, fp16 scales) of each [out, in] matrix of `ws` (all one shape, one device), weighed by its
    [in, in] Hessian: GPTQ with scales from the weighted search, then the least-squares refit, as encode_gptq."""
    h = half_range(bits)
    hessians = [H.to(w.device, torch.float32) for w, H in zip(ws, hessians)]
    scales = [encode_weighted(w, torch.diagonal(H), bits, name)[1].float() for w, H, name in zip(ws, hessians, names)]
    ws = [w.detach().to(torch.float32) for w in ws]
    codes = gptq_codes_many(torch.stack(ws), torch.stack(hessians), scales, bits)
    out = []
    for w, H, c, s in zip(ws, hessians, codes, scales):
        s = refit_scales(w, H, c, s, h)
        groups, _ = codec.to_groups(c.reshape(-1).float())
        out.append((codec.pack_codes(groups.to(torch.uint8), bits), s.to(torch.float16)))
    return out


def gptq_codes_many(W: torch.Tensor, H: torch.Tensor, scales: list[torch.Tensor], bits: int) -> torch.Tensor:
    """[E, out, in] codes (fp32 holding integers) for E matrices at once, each column by column in the order of
    its own Hessian's diagonal, with error feedback through its own inverse factor."""
    E, out_dim, n = W.shape
    h = half_range(bits)
    steps = [element_steps(s, (out_dim, n), h) for s in scales]
    order = torch.argsort(torch.diagonal(H, dim1=1, dim2=2), dim=1, descending=True)  # [E, n]
    U = torch.stack([inverse_factor(H[e], order[e]) for e in range(E)])  # [E, n, n]
    columns = order[:, None, :].expand(E, out_dim, n)
    W = W.gather(2, columns).clone()
    inv = torch.stack([i for i, _ in steps]).gather(2, columns)
    step = torch.stack([s for _, s in steps]).gather(2, columns)
    codes = torch.zeros_like(W)
    for i1 in range(0, n, BLOCK):
        i2 = min(i1 + BLOCK, n)
        err = torch.zeros(E, out_dim, i2 - i1, device=W.device)
        for j in range(i1, i2):
            code, value = quantise_column(W[:, :, j], inv[:, :, j], step[:, :, j], h)  # [E, out]
            codes[:, :, j] = code
            e = (W[:, :, j] - value) / U[:, j, j, None]
            W[:, :, j:i2] -= e[:, :, None] * U[:, None, j, j:i2]
            err[:, :, j - i1] = e
        W[:, :, i2:] -= torch.bmm(err, U[:, i1:i2, i2:])
    return torch.empty_like(codes).scatter_(2, columns, codes)
