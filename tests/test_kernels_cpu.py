import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from smoe.errors import SmoeError
from smoe.format import codec, vault
from smoe.runtime.cpu import kernels as kc

# [out, in]: whole 64-row blocks; a partial block (112 = 64 + 48); the small model's gate/up and its
# 96-wide down (groups span rows: no int4); out not a multiple of 16 (no int4); in = 200 (rows start
# at many offsets inside a group).
SHAPES = [(128, 256), (112, 192), (96, 384), (384, 96), (40, 128), (33, 200)]
INT4_SHAPES = [s for s in SHAPES if kc.int4_fits(s)]
TOKENS = [1, 2, 3, 64]
DTYPES = [torch.float32, torch.bfloat16]


def activations(tokens, inp, dtype, seed=0):
    return torch.randn(tokens, inp, generator=torch.Generator().manual_seed(seed)).to(dtype)


def one_role(t, dtype, path, biases=None):
    expert = kc.prepare_expert([t], biases or {}, dtype, path)
    return expert, lambda x: kc.linear(x, expert, t.role)


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_dequant_path_in_fp32_is_decode_then_matmul_bit_for_bit(bits, shape, tokens):
    t = kc.random_quantised(shape, bits)
    _, run = one_role(t, torch.float32, "dequant")
    x = activations(tokens, shape[1], torch.float32)
    assert torch.equal(run(x), F.linear(x, t.decode()))
    assert kc.worst_error(x, t.decode(), run(x)) <= kc.TOLERANCE[torch.float32]


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("path", kc.PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_both_paths_match_decode_then_matmul_within_rounding(bits, shape, tokens, path, dtype):
    t = kc.random_quantised(shape, bits, seed=tokens)
    _, run = one_role(t, dtype, path)
    x = activations(tokens, shape[1], dtype)
    y = run(x)
    assert y.dtype == dtype and y.shape == (tokens, shape[0])
    assert kc.worst_error(x, t.decode(), y) <= kc.TOLERANCE[dtype]


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_expert_called_with_many_tokens_matches_decode_via_a_dense_temporary(bits, dtype):
    t = kc.random_quantised((128, 256), bits)
    _, run = one_role(t, dtype, "int4")
    x = activations(kc.DENSE_FROM_TOKENS, 256, dtype)
    assert kc.worst_error(x, t.decode(), run(x)) <= kc.TOLERANCE[dtype]


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", INT4_SHAPES)
def test_int4_form_round_trips_to_decode_bit_for_bit_in_fp32(bits, shape):
    t = kc.random_quantised(shape, bits)
    expert, _ = one_role(t, torch.float32, "int4")
    assert torch.equal(kc.dense_weight(expert.weights[t.role], torch.float32), t.decode())


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_int4_form_in_bf16_round_trips_within_one_bf16_rounding_of_decode(bits):
    t = kc.random_quantised((128, 256), bits)
    expert, _ = one_role(t, torch.bfloat16, "int4")
    w, ref = kc.dense_weight(expert.weights[t.role], torch.float32), t.decode()
    assert float(((w - ref).abs() / ref.abs()).max()) <= 2.0**-8


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", [(112, 128), (64, 192), (48, 64), (16, 128), (1536, 256)])
def test_numba_packer_matches_torchs_own_converter(bits, shape):
    t = kc.random_quantised(shape, bits)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(kc.int4_values(t.codes, bits, *shape), 1)
    assert torch.equal(kc.pack_int4(t.codes, bits, *shape), want)


@pytest.mark.parametrize("path", kc.PATHS)
@pytest.mark.parametrize("tokens", [1, 3, kc.DENSE_FROM_TOKENS])
def test_bias_is_added_in_the_activation_dtype(path, tokens):
    t = kc.random_quantised((128, 256), 4)
    bias = torch.randn(128, generator=torch.Generator().manual_seed(3))
    expert, run = one_role(t, torch.float32, path, {t.role: bias})
    x = activations(tokens, 256, torch.float32)
    _, plain = one_role(t, torch.float32, path)
    assert expert.biases[t.role].dtype == torch.float32
    torch.testing.assert_close(run(x), plain(x) + bias, rtol=0, atol=1e-6)


def test_nbytes_counts_every_tensor_held():
    shapes = {"gate": (128, 256), "up": (128, 256), "down": (256, 128)}
    tensors = [kc.random_quantised(s, 4, role=r) for r, s in shapes.items()]
    biases = {"down": torch.zeros(256)}
    dense = kc.prepare_expert(tensors, biases, torch.bfloat16, "dequant")
    int4 = kc.prepare_expert(tensors, biases, torch.bfloat16, "int4")
    weights = sum(o * i for o, i in shapes.values())
    groups = weights // codec.GROUP_SIZE
    assert dense.nbytes == 2 * weights + 2 * 256
    assert int4.nbytes == weights // 2 + groups * 2 * 2 + 2 * 256  # nibbles + bf16 (scale, zero)
    assert int4.nbytes < dense.nbytes / 3.5


def test_int4_falls_back_to_dequant_per_tensor_where_the_kernel_cannot_express_it():
    tensors = [kc.random_quantised((384, 96), 4, role="down"), kc.random_quantised((96, 384), 4, role="up")]
    expert = kc.prepare_expert(tensors, {}, torch.bfloat16, "int4")
    assert expert.path == "int4" and expert.fallbacks == ("down",) and expert.roles == ("down", "up")
    assert isinstance(expert.weights["down"], torch.Tensor) and isinstance(expert.weights["up"], kc.Int4Weight)
    assert expert.weights["down"].dtype == torch.bfloat16


def test_experts_parsed_from_a_vault_blob_run_on_both_paths():
    tensors = [kc.random_quantised((128, 256), 4, role="gate"), kc.random_quantised((256, 128), 2, role="down")]
    bias = {"down": torch.randn(256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)}
    blob, entries, bias_entries = vault.build_blob(tensors, bias)
    entry = vault.ExpertEntry(0, 0, 0, len(blob), "", entries, bias_entries)
    parsed, parsed_bias = vault.parse_blob(entry, blob)
    x = activations(3, 128, torch.float32)
    for path in kc.PATHS:
        expert = kc.prepare_expert(parsed, parsed_bias, torch.float32, path)
        y = kc.linear(x, expert, "down")
        want = F.linear(x, tensors[1].decode(), bias["down"].to(torch.float32))
        torch.testing.assert_close(y, want, rtol=0, atol=1e-5)


def test_zero_tokens_give_an_empty_result():
    t = kc.random_quantised((128, 256), 4)
    for path in kc.PATHS:
        _, run = one_role(t, torch.bfloat16, path)
        assert run(torch.empty(0, 256, dtype=torch.bfloat16)).shape == (0, 128)


def test_auto_picks_int4_for_bf16_on_vectorised_builds_and_dequant_otherwise():
    vectorised = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    assert kc.choose_path(torch.bfloat16, 4) == ("int4" if vectorised else "dequant")
    assert kc.choose_path(torch.bfloat16, 2) == kc.choose_path(torch.bfloat16, 4)
    assert kc.choose_path(torch.float32, 4) == "dequant"
    assert kc.choose_path(torch.float16, 4) == "dequant"
    assert kc.choose_path(torch.bfloat16, 4, tokens=kc.INT4_MAX_TOKENS + 1) == "dequant"
    t = kc.random_quantised((128, 256), 4)
    assert kc.prepare_expert([t], {}, torch.float32).path == "codes"  # a small expert: the compiled kernels


def test_auto_picks_codes_for_small_experts_and_the_torch_paths_for_large_ones():
    small, large = [(192, 384), (384, 96)], [(768, 2048), (2048, 768)]
    vectorised = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    for dtype in DTYPES:
        assert kc.choose_path(dtype, 4, shapes=small) == "codes"
        assert kc.choose_path(dtype, 2, shapes=small) == "codes"
        assert kc.choose_path(dtype, 4, shapes=large) == ("int4" if vectorised and dtype == torch.bfloat16 else "dequant")
    assert kc.choose_path(torch.bfloat16, 2, shapes=[(40, 38)]) != "codes"  # a Q2 row must start on a byte
    assert kc.choose_path(torch.bfloat16, 4, tokens=kc.INT4_MAX_TOKENS + 1, shapes=small) == "dequant"


def test_codes_form_holds_the_vault_bytes_and_counts_them():
    shapes = {"gate": (192, 384), "down": (384, 96)}
    tensors = [kc.random_quantised(s, 4, role=r) for r, s in shapes.items()]
    expert = kc.prepare_expert(tensors, {}, torch.bfloat16, "codes", fuse=True)
    assert expert.path == "codes" and not expert.fallbacks and expert.roles == ("gate", "down")
    gate, down = expert.weights["gate"], expert.weights["down"]
    assert gate.codes.nbytes == 192 * 384 // 2 and gate.steps.nbytes == 4 * 192 * 384 // 64  # as stored
    assert down.codes.shape == (384, 128 // 2)  # rows starting mid-group padded to whole groups
    assert expert.nbytes == sum(w.codes.nbytes + w.steps.nbytes for w in (gate, down))


def test_codes_path_falls_back_to_dequant_for_rows_not_starting_on_a_byte():
    t = kc.random_quantised((40, 38), 2, role="down")
    expert = kc.prepare_expert([t], {}, torch.float32, "codes")
    assert expert.fallbacks == ("down",) and isinstance(expert.weights["down"], torch.Tensor)
    x = activations(2, 38, torch.float32)
    assert torch.equal(kc.linear(x, expert, "down"), F.linear(x, t.decode()))


def test_unknown_path_and_depth_are_refused():
    t = kc.random_quantised((128, 256), 4)
    with pytest.raises(SmoeError, match="unknown CPU kernel path"):
        kc.prepare_expert([t], {}, torch.float32, "int8")
    with pytest.raises(SmoeError):
        kc.choose_path(torch.bfloat16, 3)


def test_self_check_raises_when_the_zero_point_is_dropped(monkeypatch):
    right = kc.scales_and_zeros
    monkeypatch.setattr(kc, "scales_and_zeros", lambda *a: right(*a) * torch.tensor([1.0, 0.0]).to(a[-1]))
    with pytest.raises(SmoeError, match="disagrees with SMOE-Q4"):
        kc.self_check.__wrapped__(torch.bfloat16)


def test_self_check_raises_when_the_packed_layout_is_wrong(monkeypatch):
    wrong = (32, "pairs") if kc.kernel_layout() != (32, "pairs") else (64, "halves")
    monkeypatch.setattr(kc, "kernel_layout", lambda: wrong)
    with pytest.raises(SmoeError, match="disagrees"):
        kc.self_check.__wrapped__(torch.float32)


def test_preparing_int4_leaves_torch_thread_count_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kc.prepare_expert([kc.random_quantised((128, 256), 2)], {}, torch.bfloat16, "int4")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("capability,layout", [("avx2", (32, "halves")), ("default", (32, "pairs"))])
def test_other_cpu_builds_layouts_are_detected_and_pass_the_self_check(capability, layout):
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("needs an x86 CPU with AVX2")
    script = (
        "import torch; from smoe.runtime.cpu import kernels as kc\n"
        "print(kc.kernel_layout())\n"
        "t = kc.random_quantised((112, 192), 2)\n"
        "e = kc.prepare_expert([t], {}, torch.bfloat16, 'int4')\n"
        "x = torch.randn(5, 192).bfloat16()\n"
        "assert kc.worst_error(x, t.decode(), kc.linear(x, e, 'w')) <= kc.TOLERANCE[torch.bfloat16]\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(layout)


def test_benchmark_reports_every_method_against_the_baseline():
    from smoe.bench import kernels_cpu as bench

    (row,) = bench.bench_matmul(torch.bfloat16, (("small", 96, 384),), (1,))
    assert row["int4_fits"] and row["baseline_ms"] > 0
    assert {"int4_kernel_speedup", "int4_path_speedup", "decode_per_call_speedup"} <= row.keys()


@pytest.mark.parametrize("path", ["dequant", "int4"])
@pytest.mark.parametrize("shape", [(128, 256), (96, 96)])
def test_fused_gate_up_gives_the_same_gate_and_up_as_separate_projections(path, shape):
    g = torch.Generator().manual_seed(3)
    tensors = []
    for role in ("gate", "up", "down"):
        w = torch.randn(shape if role != "down" else shape[::-1], generator=g)
        tensors.append(vault.QuantisedTensor(role, tuple(w.shape), 4, *codec.encode(w, 4)))
    biases = {"gate": torch.randn(shape[0], generator=g), "up": torch.randn(shape[0], generator=g)}
    fused = kc.prepare_expert(tensors, biases, torch.bfloat16, path, fuse=True)
    plain = kc.prepare_expert(tensors, biases, torch.bfloat16, path)
    assert "gate_up" in fused.weights and "gate" not in fused.weights
    x = activations(3, shape[1], torch.bfloat16)
    for a, b in zip(kc.gate_and_up(x, fused), kc.gate_and_up(x, plain)):
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
