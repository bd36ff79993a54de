"""Dequantisation of quantised source checkpoints, one pure function per format.

Every function takes the stored parts of one tensor as torch tensors (any leading dims, so a fused
[E, out, in] tensor or a single expert both work), computes in float32 and returns bfloat16.
Shape mismatches raise ValueError; the caller turns them into a SmoeError naming the tensor.
"""

import math

import torch

# FP4 e2m1 code -> value (sign bit 3, exponent bits 2..1, mantissa bit 0), as in the OCP MX spec.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

E8M0_BIAS = 127
MXFP4_BLOCK = 32


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack `bits`-wide unsigned integers from the last dim of `packed`.

    The last dim is read as a little-endian bitstream: value i occupies bits [i*bits, (i+1)*bits).
    For widths that divide 32 this is "LSB-first within each uint32/int32 word" (MLX, compressed-tensors)
    or "low nibble first within each byte" (MXFP4); for 3/5/6 bits the values straddle words, which is
    how MLX packs them (8 x 3-bit values in 3 bytes, 4 x 6-bit values in 3 bytes).
    Returns int32 values [..., n_bytes * 8 // bits].
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"cannot unpack {bits}-bit values")
    # Flatten before the byte view: a contiguous tensor with a size-1 last dim may still have stride != 1.
    data = packed.contiguous().reshape(-1).view(torch.uint8).reshape(*packed.shape[:-1], -1)
    mask = (1 << bits) - 1
    # Smallest run of whole bytes that holds a whole number of values.
    run_bytes = bits // math.gcd(bits, 8)
    if run_bytes == 1:
        # 1, 2, 4 or 8 bits: values never straddle bytes, so shift bytes directly (about 10x faster).
        values = (data.unsqueeze(-1) >> torch.arange(0, 8, bits, dtype=torch.uint8)) & mask
    else:
        if data.shape[-1] % run_bytes:
            raise ValueError(f"{data.shape[-1]} bytes is not a whole number of {bits}-bit runs")
        runs = data.reshape(*data.shape[:-1], -1, run_bytes).to(torch.int64)
        words = (runs << (torch.arange(run_bytes, dtype=torch.int64) * 8)).sum(dim=-1, keepdim=True)
        values = (words >> (torch.arange(run_bytes * 8 // bits, dtype=torch.int64) * bits)) & mask
    return values.reshape(*data.shape[:-1], -1).to(torch.int32)


def _expand_groups(per_group: torch.Tensor, group_size: int, length: int) -> torch.Tensor:
    """Repeat each group's value over its `group_size` columns, trimmed to `length` columns."""
    return per_group.repeat_interleave(group_size, dim=-1)[..., :length]


def _group_size(length: int, n_groups: int, configured: int | None, what: str) -> int:
    """Columns per scale group: as configured, else (per-channel, or not configured) inferred from the count."""
    size = configured if configured and n_groups > 1 else math.ceil(length / n_groups)
    if math.ceil(length / size) != n_groups:
        raise ValueError(f"{what}: {n_groups} groups do not cover {length} columns in groups of {size}")
    return size


def dequant_mlx_affine(
    weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """MLX affine quantisation (mlx.core.quantize, mode "affine").

    weight [..., out, in*bits/32] uint32 holds the codes q in [0, 2^bits) as an LSB-first bitstream;
    scales, biases [..., out, in/group_size]. For column j of group g = j // group_size:
        w[..., j] = scales[..., g] * q[..., j] + biases[..., g]
    """
    q = unpack_bits(weight, bits)
    in_features = q.shape[-1]
    if scales.shape != biases.shape or scales.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"MLX parts disagree: weight {tuple(weight.shape)}, scales {tuple(scales.shape)}, "
                         f"biases {tuple(biases.shape)}")
    group_size = _group_size(in_features, scales.shape[-1], group_size, "MLX scales")
    w = q.float() * _expand_groups(scales.float(), group_size, in_features)
    w += _expand_groups(biases.float(), group_size, in_features)
    return w.to(torch.bfloat16)


def _unpack_signed(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """compressed-tensors `unpack_from_int32`: codes were stored as q + 2^(bits-1); undo the offset."""
    return unpack_bits(packed, bits)[..., :length] - (1 << (bits - 1))


def dequant_compressed_int(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, ...],
    bits: int = 4,
    group_size: int | None = None,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors "pack-quantized" integer weights (`pack_to_int32`).

    packed [..., out, ceil(in*bits/32)] int32: codes q + 2^(bits-1), LSB-first, packed along the input dim
    (padded at the end of each row); scale [..., out, G] (G = 1 for per-channel); shape = (..., out, in).
    Symmetric:  w[..., j] = q[..., j] * scale[..., g]              with g = j // group_size
    Asymmetric: w[..., j] = (q[..., j] - zp[..., g]) * scale[..., g]
    where zero_point [..., ceil(out*bits/32), G] is packed the same way but along the output dim.
    """
    shape = tuple(int(d) for d in shape)
    in_features = shape[-1]
    q = _unpack_signed(packed, bits, in_features)
    if tuple(q.shape) != shape or tuple(scale.shape[:-1]) != shape[:-1]:
        raise ValueError(f"compressed-tensors parts disagree with weight_shape {shape}: "
                         f"packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    group_size = _group_size(in_features, scale.shape[-1], group_size, "compressed-tensors scale")
    q = q.float()
    if zero_point is not None:
        zp = _unpack_signed(zero_point.transpose(-1, -2), bits, shape[-2]).transpose(-1, -2)
        q -= _expand_groups(zp.float(), group_size, in_features)
    return (q * _expand_groups(scale.float(), group_size, in_features)).to(torch.bfloat16)


def packed_row_first(packed_zero_point: torch.Tensor, bits: int, row_in_word: int) -> torch.Tensor:
    """Shift each int32 of a zero-point row (32/bits output rows per word, packed along the output dim)
    so that output row `row_in_word` comes first: lets one output row be dequantised on its own."""
    return packed_zero_point >> (bits * row_in_word)


def dequant_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """FP8 e4m3 with block scales (DeepSeek-V3 / Kimi-K2, quant_method "fp8", weight_block_size).

    weight [..., out, in] float8_e4m3fn; scale_inv [..., ceil(out/bo), ceil(in/bi)] float32 (or e8m0).
        w[..., r, c] = float(weight[..., r, c]) * scale_inv[..., r // bo, c // bi]
    """
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block
    expected = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale_inv.shape[-2:]) != expected or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} needs weight_scale_inv [..., {expected[0]}, "
                         f"{expected[1]}] for {block_rows}x{block_cols} blocks, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block_rows, dim=-2)[..., :rows, :]
    return (weight.float() * _expand_groups(scale, block_cols, cols)).to(torch.bfloat16)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (OCP microscaling, gpt-oss `*_blocks` / `*_scales`).

    blocks [..., G, 16] uint8: 32 FP4 e2m1 codes per group, two per byte, low nibble first;
    scales [..., G] uint8 (or float8_e8m0fnu): e8m0 exponents biased by 127. Returns [..., G*32]:
        w[..., 32*g + k] = FP4_E2M1_VALUES[code[..., g, k]] * 2^(scales[..., g] - 127)
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] * 2 != MXFP4_BLOCK:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    codes = unpack_bits(blocks, 4).long()
    values = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)[codes]
    if scales.dtype == torch.float8_e8m0fnu:  # the same exponent byte, typed: its bits, not its value 2^(e-127)
        scales = scales.view(torch.uint8)
    exponents = scales.to(torch.int32) - E8M0_BIAS
    w = torch.ldexp(values, exponents.unsqueeze(-1))
    return w.reshape(*scales.shape[:-1], -1).to(torch.bfloat16)
