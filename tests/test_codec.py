import json
import os
import subprocess
import sys

import pytest
import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.quality import codec_report as quant_report

CPU_ENCODERS = ["reference", "numba"]
SHAPES = [(128, 64), (37, 50), (3,), (2, 3, 65), (0,)]


def gaussian(shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def mixed_magnitudes(n=64 * 40, seed=1):
    """Groups spanning denormals to large values, an all-zero group and exact ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * torch.logspace(-44, 4, n)
    w[64:128] = 0.0
    w[128:192] = torch.tensor([1.0, -1.0, 0.5, -0.5] * 16)
    w[192:256] = 60000.0 * torch.sign(torch.randn(64, generator=g))
    return w


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_numba_encoder_matches_the_reference_bit_for_bit(shape, bits):
    w = gaussian(shape)
    ref = codec.encode(w, bits, backend="reference")
    fast = codec.encode(w, bits, backend="numba")
    assert torch.equal(ref[0], fast[0]) and torch.equal(ref[1], fast[1])


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_numba_encoder_matches_the_reference_on_denormals_zeros_and_large_values(bits):
    w = mixed_magnitudes()
    ref = codec.encode(w, bits, backend="reference")
    fast = codec.encode(w, bits, backend="numba")
    assert torch.equal(ref[0], fast[0]) and torch.equal(ref[1], fast[1])


def test_triton_encoder_matches_numba_bit_for_bit_under_the_interpreter(tmp_path):
    pytest.importorskip("triton", reason="triton not installed: the Triton encoder cannot be checked")
    cases = {"gauss": gaussian((33, 70), seed=3), "mixed": mixed_magnitudes(64 * 12)}
    script = (
        "import sys, torch; from smoe.format import codec\n"
        "cases = torch.load(sys.argv[1])\n"
        "out = {(k, b): codec.encode(w, b, backend='triton') for k, w in cases.items() for b in (2, 4)}\n"
        "torch.save(out, sys.argv[2])\n"
    )
    torch.save(cases, tmp_path / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   check=True, env=env, timeout=600)
    out = torch.load(tmp_path / "out.pt")
    for (name, bits), (codes, scales) in out.items():
        expect = codec.encode(cases[name], bits, backend="numba")
        assert torch.equal(codes, expect[0]) and torch.equal(scales, expect[1]), (name, bits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA encoder runs on GPU machines only")
@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_cuda_encoder_matches_cpu_bit_for_bit(bits):
    w = torch.cat([gaussian(64 * 4096), mixed_magnitudes()]).to(torch.bfloat16)
    cpu = codec.encode(w, bits)
    gpu = codec.encode(w.cuda(), bits)
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())


def test_codes_are_packed_lsb_first():
    codes = torch.arange(64, dtype=torch.uint8).view(1, 64)
    q4 = codec.pack_codes(codes % 16, 4)
    assert q4.shape == (1, 32) and int(q4[0, 0]) == 0x10 and int(q4[0, 1]) == 0x32
    q2 = codec.pack_codes(codes % 4, 2)
    assert q2.shape == (1, 16) and int(q2[0, 0]) == (0 | 1 << 2 | 2 << 4 | 3 << 6)
    assert torch.equal(codec.unpack_codes(q4, 4), codes % 16)
    assert torch.equal(codec.unpack_codes(q2, 2), codes % 4)


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_decode_follows_the_level_formula(bits):
    h = (2**bits - 1) / 2
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 2**bits, (10, 64), generator=g, dtype=torch.uint8)
    scales = (torch.rand(10, generator=g) * 3).to(torch.float16)
    w = codec.decode(codec.pack_codes(codes, bits), scales, bits)
    expect = (codes.double() - h) / h * scales.double()[:, None]
    assert torch.allclose(w.double(), expect.reshape(-1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_search_error_is_never_above_absmax_scaling_per_group(bits):
    w = gaussian((256, 64), seed=7)
    searched = codec.decode(*codec.encode(w, bits), bits, w.shape)
    baseline = codec.decode(*codec.encode_absmax(w, bits), bits, w.shape)
    err_search = (w - searched).double().pow(2).sum(dim=1)
    err_absmax = (w - baseline).double().pow(2).sum(dim=1)
    assert bool((err_search <= err_absmax * (1 + 1e-5)).all())


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_chosen_scale_is_the_least_error_candidate(bits):
    w = gaussian((16, 64), seed=11)
    codes, scales = codec.encode(w, bits)
    chosen_err = (w - codec.decode(codes, scales, bits, w.shape)).double().pow(2).sum(dim=1)
    groups, _ = codec.to_groups(w.reshape(-1))
    cands = codec.candidate_scales(groups.abs().amax(dim=1))
    h = codec.half_range(bits)
    for i in range(cands.shape[1]):
        s = cands[:, i]
        q = codec.quantise_with_scale(groups, s, h) - h
        err = (groups.double() - q.double() * (s.double() / h)[:, None]).pow(2).sum(dim=1)
        assert bool((chosen_err <= err * (1 + 1e-5) + 1e-12).all())


def test_all_zero_group_gets_zero_scale_and_zero_codes():
    w = torch.zeros(2, 64)
    w[1] = gaussian(64)
    codes, scales = codec.encode(w, 4)
    assert float(scales[0]) == 0.0 and not codes[0].any()
    assert torch.equal(codec.decode(codes, scales, 4, w.shape)[0], torch.zeros(64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_raises_naming_the_tensor(bad):
    w = gaussian(200)
    w[130] = bad
    with pytest.raises(SmoeError, match=r"layers\.3\.mlp.*NaN or inf.*group 2"):
        codec.encode(w, 4, name="layers.3.mlp.experts.gate_up_proj")


def test_weight_beyond_fp16_range_raises_naming_the_tensor():
    w = gaussian(64)
    w[5] = 70000.0
    with pytest.raises(SmoeError, match="big.weight.*above the fp16 range"):
        codec.encode(w, 2, name="big.weight")


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_denormal_weights_encode_to_finite_values(bits):
    w = torch.full((64,), 1e-40) * torch.sign(gaussian(64))
    codes, scales = codec.encode(w, bits)
    out = codec.decode(codes, scales, bits, w.shape)
    assert torch.isfinite(out).all() and (out - w).abs().max() <= 1e-7


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_tail_padding_is_left_out_of_the_search(bits):
    # one real weight in the last group: counted alone, the full-absmax candidate reproduces it exactly
    w = torch.cat([gaussian(64), torch.tensor([0.75])])
    out = codec.decode(*codec.encode(w, bits), bits, w.shape)
    assert out.shape == w.shape and float(out[64]) == 0.75


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_sizes_count_the_padding(bits):
    codes, scales = codec.encode(gaussian((3, 50)), bits)
    assert (codes.numel(), scales.numel() * 2) == codec.encoded_nbytes(150, bits) == (3 * 8 * bits, 6)


def test_bf16_input_encodes_like_its_fp32_value():
    w = gaussian((64, 64)).to(torch.bfloat16)
    a, b = codec.encode(w, 4), codec.encode(w.float(), 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_quant_report_meets_floors_and_beats_absmax():
    rows, failures = quant_report.run()
    assert failures == []
    by_bits = {r["bits"]: r for r in rows}
    assert by_bits[2]["snr_db"] >= 9.0 and by_bits[4]["snr_db"] >= 19.5
    assert by_bits[2]["snr_db"] - by_bits[2]["absmax_snr_db"] >= 3.0
    assert by_bits[4]["snr_db"] - by_bits[4]["absmax_snr_db"] >= 0.3


def test_test_quant_cli_prints_json_rows_and_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", "test-quant", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["bits"] for r in rows] == [2, 4]
    assert all(set(r) == {"bits", "rmse", "absmax", "snr_db", "absmax_snr_db"} for r in rows)


def test_unsupported_depth_is_a_clear_error():
    with pytest.raises(SmoeError, match="unsupported depth 3"):
        codec.encode(gaussian(64), 3)
