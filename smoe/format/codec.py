"""SMOE-Q2 / SMOE-Q4: symmetric group quantisation with one fp16 scale per 64 weights.

A tensor is flattened row-major and cut into groups of GROUP_SIZE weights (the tail is padded with
zeros). With h = (2**bits - 1) / 2 (7.5 at Q4, 1.5 at Q2) and d = s / h:

    code   = clamp(round_half_even(x * (h / s) + h), 0, 2h)      (fp32, multiply then add, no FMA)
    weight = (code - h) * d

Codes are packed LSB-first: two per byte at Q4, four per byte at Q2. The scale s of each group is the
fp16 value, among 64 candidates fp16(absmax * linspace(0.1, 1.0, 64)), that gives the least squared
error over the group's real (unpadded) weights. The error of a candidate is evaluated as

    err = d * (d * sum(q * q) - 2 * sum(x * q)),    q = code - h,

which is the squared error minus the constant sum(x * x); the sums run over the group in order, in fp32.
Pinning this arithmetic lets the numba (CPU), Triton (CUDA) and reference (torch) search backends agree bit
for bit. A scale of 0 (an all-zero group, or denormals below fp16's range) stores all-zero codes.
"""

from __future__ import annotations

import torch

from smoe.errors import SmoeError
from smoe.format.spec import CANDIDATE_FACTORS, DEPTHS, FP16_MAX, GROUP_SIZE, check_bits, half_range, packed_group_bytes  # noqa: F401 (the codec's own names for them)


def num_groups(numel: int) -> int:
    return -(-numel // GROUP_SIZE)


def encoded_nbytes(numel: int, bits: int) -> tuple[int, int]:
    """(code bytes, scale bytes) of a tensor of `numel` weights, padding included."""
    groups = num_groups(numel)
    return groups * packed_group_bytes(bits), groups * 2


def bits_per_weight(bits: int) -> float:
    """Stored bits per weight including the fp16 scale: 4.25 at Q4, 2.25 at Q2."""
    return bits + 16 / GROUP_SIZE


# --- packing -------------------------------------------------------------------------------------


def depth_name(weights: dict[int, int]) -> str:
    """`SMOE-Q4` when every expert weight has one depth; else `mixed (62% Q4, 38% Q2)`, by share of
    expert weights, deepest first: a mixed vault's header depth is only its default, not what it holds."""
    used = {b: n for b, n in weights.items() if n}
    if len(used) <= 1:
        return f"SMOE-Q{next(iter(used or weights))}"
    total = sum(used.values())
    return "mixed (" + ", ".join(f"{100 * n / total:.0f}% Q{b}" for b, n in sorted(used.items(), reverse=True)) + ")"


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [G, 64] -> packed uint8 [G, 64 * bits / 8], LSB-first."""
    per_byte = 8 // bits
    c = codes.to(torch.uint8).reshape(codes.shape[0], codes.shape[1] // per_byte, per_byte)
    packed = torch.zeros(c.shape[:2], dtype=torch.uint8, device=codes.device)
    for k in range(per_byte):
        packed |= c[:, :, k] << (bits * k)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [G, 64 * bits / 8] -> uint8 codes [G, 64]."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.reshape(-1, packed.shape[-1], 1) >> shifts) & mask
    return codes.reshape(-1, packed.shape[-1] * per_byte)


# --- encode --------------------------------------------------------------------------------------

# Weights encoded per call: bounded fp32 scratch whatever the tensor size; a GPU wants more per launch.
CHUNK_WEIGHTS = {"cpu": 1 << 21, "cuda": 1 << 25}


def encode(w: torch.Tensor, bits: int = 4, name: str = "tensor", backend: str | None = None):
    """Quantise any-shaped `w` -> (packed codes uint8 [G, 64*bits/8], scales fp16 [G]).

    `backend` picks the scale-search implementation: "numba" (CPU), "triton" (CUDA) or "reference"
    (plain torch, slow); by default the one for w's device. `name` is used in error messages.
    """
    check_bits(bits)
    search = search_function(backend or ("triton" if w.is_cuda else "numba"))
    flat = w.detach().reshape(-1)
    chunk = CHUNK_WEIGHTS.get(flat.device.type, CHUNK_WEIGHTS["cpu"])
    codes, scales = [], []
    for start in range(0, max(flat.numel(), 1), chunk):
        groups, numel = to_groups(flat[start : start + chunk])
        packed, chunk_scales, absmax = search(groups, numel, bits)
        check_encodable(absmax, name, first_group=start // GROUP_SIZE)
        codes.append(packed)
        scales.append(chunk_scales)
    return torch.cat(codes), torch.cat(scales).to(torch.float16)


def search_function(backend: str):
    if backend == "reference":
        return search_reference
    if backend == "numba":
        from smoe.format.search_numba import search_numba

        return search_numba
    if backend == "triton":
        from smoe.format.search_triton import search_triton

        return search_triton
    raise SmoeError(f"unknown scale-search backend {backend!r} (numba, triton, reference)")


def to_groups(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """1-D weights -> fp32 [G, 64], zero-padding the tail; returns the groups and the real size."""
    numel = flat.numel()
    pad = num_groups(numel) * GROUP_SIZE - numel
    groups = flat.to(torch.float32)
    if pad:
        groups = torch.cat([groups, groups.new_zeros(pad)])
    return groups.view(-1, GROUP_SIZE), numel


def check_encodable(absmax: torch.Tensor, name: str, first_group: int = 0) -> None:
    """Raise on a group holding NaN/inf, or too large for an fp16 scale."""
    bad = ~(absmax <= FP16_MAX)  # also catches NaN
    if bool(bad.any()):
        g = int(bad.nonzero()[0, 0])
        value = float(absmax[g])
        what = "NaN or inf weight" if value != value or value == float("inf") else f"|weight| {value:.6g} above the fp16 range"
        raise SmoeError(f"tensor {name}: {what} in group {first_group + g} (cannot encode)")


def candidate_scales(absmax: torch.Tensor) -> torch.Tensor:
    """[G] absmax -> [G, 64] candidate scales: fp16-rounded (as stored), held in fp32."""
    factors = CANDIDATE_FACTORS.to(absmax.device)
    return (absmax[:, None] * factors[None, :]).to(torch.float16).to(torch.float32)


def group_absmax(groups: torch.Tensor) -> torch.Tensor:
    """Per-group max |x|; inf where a group holds NaN or inf."""
    finite = torch.isfinite(groups).all(dim=1)
    return torch.where(finite, groups.abs().amax(dim=1), float("inf"))


def valid_mask(n_groups: int, numel: int, device) -> torch.Tensor:
    """[G, 64] True for real weights, False for tail padding."""
    idx = torch.arange(n_groups * GROUP_SIZE, device=device).view(n_groups, GROUP_SIZE)
    return idx < numel


def search_reference(groups: torch.Tensor, numel: int, bits: int):
    """The spec in plain torch: groups [G, 64] fp32 -> (packed codes, scales fp32 [G], absmax [G])."""
    h = half_range(bits)
    absmax = group_absmax(groups)
    candidates = candidate_scales(torch.where(absmax <= FP16_MAX, absmax, 0.0))
    valid = valid_mask(groups.shape[0], numel, groups.device)
    best_err = torch.full((groups.shape[0],), float("inf"), device=groups.device)
    best_s = torch.zeros(groups.shape[0], device=groups.device)
    for i in range(candidates.shape[1]):
        s = candidates[:, i]
        q = quantise_with_scale(groups, s, h) - h
        xq = sequential_sum(torch.where(valid, groups * q, 0.0))
        qq = sequential_sum(torch.where(valid, q * q, 0.0))
        d = s / h
        err = torch.where(s > 0, d * (d * qq - 2 * xq), torch.zeros_like(s))
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
    codes = quantise_with_scale(groups, best_s, h)
    return pack_codes(codes.to(torch.uint8), bits), best_s, absmax


def encode_absmax(w: torch.Tensor, bits: int = 4):
    """Baseline without search: every group's scale is fp16(absmax). Same output format as `encode`."""
    groups, _ = to_groups(w.detach().reshape(-1))
    absmax = group_absmax(groups)
    check_encodable(absmax, "tensor")
    scales = absmax.to(torch.float16).to(torch.float32)
    codes = quantise_with_scale(groups, scales, half_range(bits))
    return pack_codes(codes.to(torch.uint8), bits), scales.to(torch.float16)


def quantise_with_scale(groups: torch.Tensor, s: torch.Tensor, h: float) -> torch.Tensor:
    """fp32 codes for scales s [G]; a zero scale gives code 0."""
    inv = torch.where(s > 0, h / s, torch.zeros_like(s))
    t = (groups * inv[:, None]) + h
    codes = torch.round(t).clamp_(0, 2 * h)
    return torch.where(s[:, None] > 0, codes, torch.zeros_like(codes))


def sequential_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum along dim 1 strictly left to right in fp32 (torch.sum's order is unspecified)."""
    acc = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    for j in range(x.shape[1]):
        acc = acc + x[:, j]
    return acc


# --- decode --------------------------------------------------------------------------------------


def decode(
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    shape: tuple[int, ...] | torch.Size | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed codes [G, 64*bits/8] + fp16 scales [G] -> weights; reshaped to `shape` (padding dropped)."""
    check_bits(bits)
    h = half_range(bits)
    q = unpack_codes(codes, bits).to(torch.float32) - h
    d = scales.reshape(-1, 1).to(torch.float32) / h
    w = (q * d).reshape(-1)
    if shape is not None:
        numel = 1
        for n in shape:
            numel *= n
        w = w[:numel].reshape(shape)
    return w.to(dtype)


def weighted_snr_db(reference: torch.Tensor, approx: torch.Tensor, second_moment: torch.Tensor) -> float:
    """SNR of a projection's output over inputs of second moment H = E[x xᵀ] ([in, in], or its diagonal
    [in]): E‖W x‖² / E‖(W - Ŵ) x‖² = tr(W H Wᵀ) / tr(E H Eᵀ), in dB; the error the calibrated encoders
    minimise, where snr_db weighs every weight alike."""
    w = reference.to(torch.float32)
    e = w - approx.to(torch.float32)
    h = second_moment.to(w.device, torch.float32)
    energy = (lambda m: (m * m * h).sum()) if h.dim() == 1 else (lambda m: ((m @ h) * m).sum())
    noise = energy(e)
    if noise <= 0:
        return float("inf")
    return float(10 * torch.log10(energy(w) / noise))


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio of approx against reference, in dB."""
    ref = reference.reshape(-1).to(torch.float32)
    noise = torch.linalg.vector_norm(ref - approx.reshape(-1).to(torch.float32))
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))
