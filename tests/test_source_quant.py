"""Each source format round-trips: quantise a known float tensor by the format's own rule, dequantise, compare."""

import math

import pytest
import torch

from smoe.source import quantised as sq

torch.manual_seed(0)


def pack_bitstream(codes: torch.Tensor, bits: int, word_bytes: int) -> torch.Tensor:
    """Reference packer written independently of unpack_bits: one Python integer per row,
    value i at bit i*bits, cut into little-endian words of `word_bytes` bytes."""
    rows = codes.reshape(-1, codes.shape[-1]).tolist()
    n_bytes = math.ceil(len(rows[0]) * bits / 8 / word_bytes) * word_bytes
    out = []
    for row in rows:
        acc = sum(int(v) << (i * bits) for i, v in enumerate(row))
        out.append(list(acc.to_bytes(n_bytes, "little")))
    packed = torch.tensor(out, dtype=torch.uint8).reshape(*codes.shape[:-1], n_bytes)
    return packed.view({1: torch.uint8, 4: torch.int32}[word_bytes])


# ----- bit unpacking -----


def test_unpack_bits_reads_nibbles_lsb_first_within_a_word():
    word = torch.tensor([0x76543210], dtype=torch.int64).to(torch.int32)
    assert sq.unpack_bits(word, 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_unpack_bits_reads_low_nibble_first_within_a_byte():
    assert sq.unpack_bits(torch.tensor([0x21, 0x43], dtype=torch.uint8), 4).tolist() == [1, 2, 3, 4]


def test_unpack_bits_3bit_values_straddle_bytes_as_mlx_packs_them():
    # MLX's kernel reads 8 x 3-bit values from 3 bytes: value 3 sits at bits 9..11 (bits 1..3 of byte 1).
    values = [5, 1, 7, 6, 0, 3, 2, 4]
    packed = sum(v << (3 * i) for i, v in enumerate(values)).to_bytes(3, "little")
    assert (packed[1] >> 1) & 7 == values[3]
    assert sq.unpack_bits(torch.tensor(list(packed), dtype=torch.uint8), 3).tolist() == values


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_unpack_bits_inverts_the_reference_bitstream_packer(bits):
    codes = torch.randint(0, 1 << bits, (3, 64))
    assert torch.equal(sq.unpack_bits(pack_bitstream(codes, bits, 4), bits), codes.to(torch.int32))


# ----- MLX affine -----


def mlx_quantise(w: torch.Tensor, bits: int, group_size: int):
    """mlx.core.quantize (affine): per group, scale = (max - min) / (2^bits - 1), bias = min."""
    groups = w.float().reshape(*w.shape[:-1], -1, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / ((1 << bits) - 1)).clamp(min=1e-8)
    q = ((groups - lo[..., None]) / scales[..., None]).round().clamp(0, (1 << bits) - 1).to(torch.int64)
    return pack_bitstream(q.reshape(w.shape), bits, 4).view(torch.uint32), scales, lo, q.reshape(w.shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_mlx_affine_round_trips_to_scale_times_code_plus_bias(bits):
    w = torch.randn(16, 128)
    packed, scales, biases, q = mlx_quantise(w, bits, 64)
    assert packed.shape == (16, 128 * bits // 32)
    out = sq.dequant_mlx_affine(packed, scales, biases, bits, 64)
    expected = q.float() * scales.repeat_interleave(64, -1) + biases.repeat_interleave(64, -1)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected.to(torch.bfloat16))
    assert (out.float() - w).abs().max() <= scales.max() / 2 + 0.02


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_mlx_affine_matches_the_transformers_metal_reference(bits):
    metal = pytest.importorskip("transformers.integrations.metal_quantization")
    packed, scales, biases = metal._affine_quantize_tensor(torch.randn(8, 256), 64, bits)
    reference = metal._affine_dequantize_tensor(packed, scales, biases, 64, bits)
    assert torch.equal(sq.dequant_mlx_affine(packed, scales, biases, bits, 64), reference.to(torch.bfloat16))


def test_mlx_affine_fused_experts_equal_each_expert_alone():
    packed, scales, biases, _ = mlx_quantise(torch.randn(3, 8, 64), 4, 32)
    fused = sq.dequant_mlx_affine(packed, scales, biases, 4, 32)
    for e in range(3):
        assert torch.equal(fused[e], sq.dequant_mlx_affine(packed[e], scales[e], biases[e], 4, 32))


def test_mlx_affine_rejects_a_group_size_that_does_not_match_the_scales():
    packed, scales, biases, _ = mlx_quantise(torch.randn(4, 128), 4, 64)
    with pytest.raises(ValueError, match="groups"):
        sq.dequant_mlx_affine(packed, scales, biases, 4, 32)


# ----- compressed-tensors pack-quantized -----


def pack_to_int32(q: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors pack_to_int32: store q + 2^(bits-1), LSB-first, along `packed_dim` (rows padded)."""
    unsigned = q + (1 << (bits - 1))
    if packed_dim == 0:
        return pack_bitstream(unsigned.transpose(-1, -2), bits, 4).transpose(-1, -2).contiguous()
    return pack_bitstream(unsigned, bits, 4)


def ct_quantise(w: torch.Tensor, bits: int, group_size: int):
    """Symmetric group quantisation: scale = absmax / (2^(bits-1) - 1) per group, q = round(w / scale)."""
    out_f, in_f = w.shape
    n_groups = math.ceil(in_f / group_size)
    padded = torch.nn.functional.pad(w, (0, n_groups * group_size - in_f)).reshape(out_f, n_groups, group_size)
    qmax = (1 << (bits - 1)) - 1
    scale = (padded.abs().amax(-1) / qmax).clamp(min=1e-8).to(torch.bfloat16)
    expanded = scale.float().repeat_interleave(group_size, -1)[:, :in_f]
    q = (w / expanded).round().clamp(-qmax - 1, qmax).to(torch.int64)
    return q, scale, expanded


@pytest.mark.parametrize("bits, group_size, in_features", [(4, 32, 128), (4, 32, 100), (8, 16, 64)])
def test_compressed_int_round_trips_to_code_times_scale(bits, group_size, in_features):
    w = torch.randn(12, in_features)
    q, scale, expanded = ct_quantise(w, bits, group_size)
    packed = pack_to_int32(q, bits)
    assert packed.dtype == torch.int32 and packed.shape[-1] == math.ceil(in_features * bits / 32)
    out = sq.dequant_compressed_int(packed, scale, (12, in_features), bits, group_size)
    assert torch.equal(out, (q.float() * expanded).to(torch.bfloat16))
    assert (out.float() - w).abs().max() <= expanded.max() / 2 + 0.02


def test_compressed_int_per_channel_scale_covers_the_whole_row():
    w = torch.randn(6, 64)
    q, scale, expanded = ct_quantise(w, 4, 64)
    assert scale.shape == (6, 1)
    out = sq.dequant_compressed_int(pack_to_int32(q, 4), scale, (6, 64), 4, None)
    assert torch.equal(out, (q.float() * expanded).to(torch.bfloat16))


def test_compressed_int_asymmetric_subtracts_zero_points_packed_along_the_output_dim():
    q = torch.randint(-8, 8, (10, 64))
    zp = torch.randint(-8, 8, (10, 2))
    scale = torch.rand(10, 2) + 0.1
    packed_zp = pack_to_int32(zp, 4, packed_dim=0)
    assert packed_zp.shape == (2, 2)  # ceil(10 / 8) rows
    out = sq.dequant_compressed_int(pack_to_int32(q, 4), scale, (10, 64), 4, 32, packed_zp)
    expected = (q - zp.repeat_interleave(32, -1)).float() * scale.repeat_interleave(32, -1)
    assert torch.equal(out, expected.to(torch.bfloat16))


def test_compressed_int_rejects_a_shape_that_does_not_match_the_packed_data():
    q, scale, _ = ct_quantise(torch.randn(4, 64), 4, 32)
    with pytest.raises(ValueError, match="weight_shape"):
        sq.dequant_compressed_int(pack_to_int32(q, 4), scale, (5, 64), 4, 32)


# ----- FP8 block -----


def fp8_block_quantise(w: torch.Tensor, block: int = 128):
    """DeepSeek-V3 rule: per 128x128 block, scale_inv = absmax / 448, fp8 = w / scale_inv."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    scale_inv = torch.empty(nr, nc)
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale_inv[i, j] = tile.abs().max() / 448.0
            fp8[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return fp8, scale_inv


def test_fp8_block_round_trips_for_shapes_not_multiple_of_the_block():
    w = torch.randn(200, 300)
    fp8, scale_inv = fp8_block_quantise(w)
    out = sq.dequant_fp8_block(fp8, scale_inv)
    expected = fp8.float() * scale_inv.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.equal(out, expected.to(torch.bfloat16))
    assert ((out.float() - w).abs() <= w.abs() * 0.07 + 1e-2).all()  # e4m3 keeps 3 mantissa bits


def test_fp8_block_matches_the_transformers_reference():
    fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    fp8 = torch.randn(3, 160, 200).to(torch.float8_e4m3fn)  # fused experts, partial blocks on both dims
    scale_inv = torch.rand(3, 2, 2) + 0.5
    reference = fp8_mod._dequantize_fp8_weight(fp8, scale_inv, [128, 128], torch.float32)
    assert torch.equal(sq.dequant_fp8_block(fp8, scale_inv), reference.to(torch.bfloat16))


def test_fp8_block_rejects_scales_of_the_wrong_shape():
    fp8, _ = fp8_block_quantise(torch.randn(256, 256))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        sq.dequant_fp8_block(fp8, torch.ones(3, 2))


# ----- MXFP4 -----


def test_mxfp4_round_trips_values_on_the_fp4_grid():
    grid = torch.tensor(sq.FP4_E2M1_VALUES)
    codes = torch.randint(0, 16, (2, 5, 4, 32))
    exponents = torch.randint(-6, 6, (2, 5, 4))
    blocks = pack_bitstream(codes, 4, 1).reshape(2, 5, 4, 16)
    out = sq.dequant_mxfp4(blocks, (exponents + 127).to(torch.uint8))
    expected = (grid[codes] * 2.0 ** exponents[..., None].float()).reshape(2, 5, 128)
    assert out.shape == (2, 5, 128) and torch.equal(out, expected.to(torch.bfloat16))


def test_mxfp4_matches_transformers_convert_moe_packed_tensors():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8)
    # transformers returns gpt-oss's [E, in, out] parameter layout; the logical tensor is [E, out, in].
    reference = mxfp4.convert_moe_packed_tensors(blocks, scales).transpose(1, 2)
    assert torch.equal(sq.dequant_mxfp4(blocks, scales), reference)


def test_mxfp4_rejects_scales_that_do_not_match_the_blocks():
    with pytest.raises(ValueError, match="MXFP4"):
        sq.dequant_mxfp4(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
