import os
import subprocess
import sys

import pytest
import torch
from routing_kinds import ROUTING_KINDS

from smoe.cli import commands as cli
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.vault import ExpertEntry, QuantisedTensor, build_blob
from smoe.runtime.cuda import kernels as kt
from smoe.testing.random import layout_for_shape, random_blob

pytest.importorskip("triton", reason="triton not installed: the Triton kernels cannot be checked")

# hidden 320 = 5 groups, inter 192 = 3 groups: with the tiles below, row blocks and group steps end
# part-way (masked tails) in both kernels.
HIDDEN, INTER = 320, 192
ODD_TILES = {"gate_up": (128, 4, 4, 1, 1), "down": (128, 4, 4, 2, 0)}
DEPTHS = [(4, 4), (2, 2), (4, 2)]  # (gate/up, down)
CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device: the kernels run on the GPU only here; the interpreter tests cover them on CPU"


def build_pool(hidden, inter, bits_gu, bits_d, n, device="cpu", spacing=64 * 3, bias_dtype=None):
    """n random experts' blobs, in reverse order with gaps between them (arbitrary cache slots)."""
    blobs = [random_blob((hidden, inter), bits_gu, bits_d, seed=i, bias_dtype=bias_dtype) for i in range(n)]
    layout = blobs[0][1]
    slot = -(-len(blobs[0][0]) // 64) * 64 + spacing
    pool = torch.zeros(n * slot + 64, dtype=torch.uint8)
    offsets = []
    for i, (raw, _) in enumerate(blobs):
        at = (n - 1 - i) * slot
        pool[at:at + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        offsets.append(at)
    return pool.to(device), layout, torch.tensor(offsets, device=device)


def routing(n_experts, tokens, k, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(tokens)])
    return idx, torch.rand(tokens, k, generator=gen)


def relative_error(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm())


# The interpreter runs in a child process: TRITON_INTERPRET must be set before triton is imported.
INTERPRETED = """
import sys, torch
from smoe.runtime.cuda import kernels as kt
cases = torch.load(sys.argv[1])
out = []
for c in cases:
    cfg = kt.DecodeConfig(**c["tiles"]) if c["tiles"] else None
    layout = kt.ExpertLayout(**c["layout"])
    if "ids" in c:  # the offsets looked up by expert id inside the kernels
        out.append(kt.decode_forward(c["pool"], layout, c["x"], c["table"], c["weights"][0], ids=c["ids"]))
    else:
        out.append(kt.experts_forward(c["pool"], layout, c["x"], c["offsets"], c["weights"], path="triton", config=cfg))
torch.save(out, sys.argv[2])
"""


def run_interpreted(cases, tmp_path):
    torch.save(cases, tmp_path / "cases.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", INTERPRETED, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   check=True, env=env, timeout=600)
    return torch.load(tmp_path / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def pools():
    return {bits: build_pool(HIDDEN, INTER, *bits, n=9) for bits in DEPTHS}


def test_interpreted_kernels_match_decode_then_matmul(pools, tmp_path):
    """One token with k = 1..8 experts (decode kernels; their offsets given, or looked up in the layer's table by
    expert id) and several tokens (grouped kernels), both depths and mixed, fp32 and bf16 activations, odd shapes,
    experts in arbitrary slots."""
    cases = []
    for bits, (pool, layout, offsets) in pools.items():
        for k in ((1, 2, 3, 4, 5, 8) if bits[0] == bits[1] else (3, 8)):
            idx, w = routing(len(offsets), 1, k, seed=k)
            x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(k))
            cases.append({"pool": pool, "layout": vars(layout), "x": x, "offsets": offsets[idx], "weights": w,
                          "tiles": ODD_TILES if k % 2 else None})
            if k == 3:  # the same experts found by id in the layer's table, with the default tiles
                cases.append(dict(cases[-1], table=offsets, ids=idx[0], tiles=None))
        for tokens, k in ((3, 2), (6, 4)):
            idx, w = routing(len(offsets), tokens, k, seed=tokens)
            idx[1] = idx[0]  # two tokens with the same experts: one run each, several pairs
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
            cases.append({"pool": pool, "layout": vars(layout), "x": x, "offsets": offsets[idx], "weights": w, "tiles": None})
    decode_k4 = next(c for c in cases if c["offsets"].shape == (1, 4))  # Q4, default tiles
    mixed_k8 = next(c for c in reversed(cases) if c["offsets"].shape == (1, 8))  # Q4 gate/up, Q2 down
    cases += [dict(c, x=c["x"].to(torch.bfloat16)) for c in (decode_k4, mixed_k8)]
    outs = run_interpreted(cases, tmp_path)
    for c, y in zip(cases, outs):
        layout = kt.ExpertLayout(**c["layout"])
        ref = kt.reference_forward(c["pool"], layout, c["x"].float(), c["offsets"], c["weights"])
        assert y.shape == c["x"].shape and y.dtype == c["x"].dtype
        assert torch.isfinite(y).all()
        # fp32: the decode kernels lose a few bits to the cancellation of x' against C (module docstring);
        # bf16: one rounding of the output (and of h and the dequantised tile in the grouped kernels)
        limit = 1e-4 if c["x"].dtype == torch.float32 else 1e-2
        err = relative_error(y, ref)
        assert err < limit, (layout.bits_gate_up, layout.bits_down, tuple(c["offsets"].shape), err)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_interpreted_kernels_add_expert_biases_and_clamp_the_swiglu_as_gpt_oss_does(bias_dtype, tmp_path):
    """Decode and grouped kernels with per-expert biases and gpt-oss's clamped SwiGLU, against the reference
    (decode, then smoe.moe.activation.activate with the biases); a limit the values pass, so that it clamps."""
    from dataclasses import replace

    pool, layout, offsets = build_pool(HIDDEN, INTER, 4, 4, n=6, bias_dtype=bias_dtype)
    clamped = replace(layout, clamp=(1.702, 0.3))
    cases = []
    for tokens, k, tiles in ((1, 3, ODD_TILES), (1, 4, None), (5, 2, None)):
        idx, w = routing(len(offsets), tokens, k, seed=tokens + k)
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(k))
        for lay in (layout, clamped):
            cases.append({"pool": pool, "layout": vars(lay), "x": x, "offsets": offsets[idx], "weights": w,
                          "tiles": tiles})
    outs = run_interpreted(cases, tmp_path)
    for c, y in zip(cases, outs):
        lay = kt.ExpertLayout(**c["layout"])
        ref = kt.reference_forward(c["pool"], lay, c["x"], c["offsets"], c["weights"])
        plain = kt.reference_forward(c["pool"], replace(lay, bias_dtype="", clamp=None), c["x"], c["offsets"],
                                     c["weights"])
        assert relative_error(y, ref) < 1e-4, (lay.clamp, tuple(c["offsets"].shape), relative_error(y, ref))
        assert relative_error(plain, ref) > 1e-2  # the biases (and the clamp) change the result


def test_reference_experts_with_biases_and_the_clamp_are_transformers_gpt_oss_experts():
    """The reference path against the formula of transformers' GptOssExperts on the decoded weights."""
    from dataclasses import replace

    pool, layout, offsets = build_pool(HIDDEN, INTER, 4, 4, n=2, bias_dtype=torch.float32)
    layout = replace(layout, clamp=(1.702, 0.3))
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(0))
    gate, up, down = kt.expert_weights(pool, layout, int(offsets[1]))
    b_gate, b_up, b_down = kt.expert_biases(pool, layout, int(offsets[1]))
    g = (x @ gate.t() + b_gate).clamp(max=0.3)
    u = (x @ up.t() + b_up).clamp(-0.3, 0.3)
    want = 0.7 * (((u + 1) * (g * torch.sigmoid(g * 1.702))) @ down.t() + b_down)
    got = kt.reference_forward(pool, layout, x, offsets[1:2][None], torch.tensor([[0.7]]))
    assert relative_error(got, want) < 1e-6


def test_cpu_tensors_never_select_the_cuda_kernels(pools):
    pool, layout, offsets = pools[(4, 4)]
    idx, w = routing(len(offsets), 2, 3, seed=0)
    x = torch.randn(2, HIDDEN)
    y = kt.experts_forward(pool, layout, x, offsets[idx], w)  # path="auto"
    assert torch.equal(y, kt.reference_forward(pool, layout, x, offsets[idx], w))


def test_unsupported_shape_falls_back_to_decode_then_matmul_with_one_warning(capsys):
    pool, layout, offsets = build_pool(100, 64, 4, 4, n=3)  # 100 inputs per row: groups span rows
    assert layout.unsupported() is not None
    kt.warn_once.cache_clear()
    x = torch.randn(1, 100)
    idx, w = routing(3, 1, 2, seed=1)
    for _ in range(2):
        y = kt.experts_forward(pool, layout, x, offsets[idx], w, path="triton")
    assert torch.equal(y, kt.reference_forward(pool, layout, x, offsets[idx], w))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("smoe: warning:") and "decoding experts" in err[0]


def test_reference_is_decode_then_matmul():
    pool, layout, offsets = build_pool(128, 64, 2, 4, n=2)
    x = torch.randn(1, 128)
    y = kt.reference_forward(pool, layout, x, offsets[None, :], torch.tensor([[0.25, 0.75]]))
    want = torch.zeros(1, 128)
    for off, w in zip(offsets.tolist(), (0.25, 0.75)):
        gate, up, down = kt.expert_weights(pool, layout, off)
        want += w * (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    assert torch.allclose(y, want, rtol=1e-6, atol=1e-7)


def test_misaligned_blob_offsets_are_refused(pools):
    pool, layout, offsets = pools[(4, 4)]
    with pytest.raises(SmoeError, match="multiples of 64"):
        kt.experts_forward(pool, layout, torch.randn(1, HIDDEN), offsets[:2] + 4, torch.ones(2), path="triton")


@pytest.mark.parametrize("bits", DEPTHS)
def test_layout_is_the_vault_blob_layout(bits):
    raw, layout = random_blob((HIDDEN, INTER), *bits, seed=0)
    assert layout_for_shape(HIDDEN, INTER, *bits) == (layout, len(raw))
    tensors = [QuantisedTensor(r, s, b, *codec.encode(torch.randn(s), b)) for r, s, b in
               (("gate", (INTER, HIDDEN), bits[0]), ("up", (INTER, HIDDEN), bits[0]), ("down", (HIDDEN, INTER), bits[1]))]
    blob, entries, _ = build_blob(tensors)
    entry = ExpertEntry(0, 0, 0, len(blob), "", entries)
    assert kt.ExpertLayout.from_entry(entry) == layout


def test_up_only_experts_are_refused_by_name():
    t = QuantisedTensor("up", (64, 128), 4, *codec.encode(torch.randn(64, 128), 4))
    d = QuantisedTensor("down", (128, 64), 4, *codec.encode(torch.randn(128, 64), 4))
    blob, entries, _ = build_blob([t, d])
    with pytest.raises(SmoeError, match="gate, up and down"):
        kt.ExpertLayout.from_entry(ExpertEntry(0, 0, 0, len(blob), "", entries))


@pytest.mark.skipif(CUDA, reason="a CUDA device is present: the no-GPU error cannot be provoked")
def test_bench_kernels_on_cuda_without_a_gpu_fails_with_one_line(capsys):
    assert cli.main(["bench", "kernels", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("smoe: error:") and "no CUDA device" in err[0]


# --- on a GPU: real shapes ----------------------------------------------------------------------

REAL = [(4096, 1536), (2048, 768)]


def gpu_pool(hidden, inter, bits, n=12):
    from smoe.testing.random import random_pool

    pool, offsets, layout, _ = random_pool(hidden, inter, bits, bits, "cuda", n_experts=n)
    return pool, offsets, layout


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", REAL)
def test_cuda_decode_matches_reference_at_real_shapes_and_is_deterministic(bits, shape):
    pool, offsets, layout = gpu_pool(*shape, bits)
    idx, w = routing(len(offsets), 1, 8, seed=bits)
    x = torch.randn(1, shape[0], device="cuda").to(torch.bfloat16)
    sel, w = offsets[idx.cuda()], w.cuda()
    out = torch.full((1, shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = kt.decode_forward(pool, layout, x, sel[0], w[0], out=out).clone()
    again = kt.decode_forward(pool, layout, x, sel[0], w[0])
    ref = kt.reference_forward(pool, layout, x.float(), sel, w)
    by_id = kt.decode_forward(pool, layout, x, offsets, w[0], ids=idx[0].cuda())  # the table looked up in the kernels
    assert torch.isfinite(y).all() and torch.equal(y, again) and torch.equal(y, by_id)
    assert relative_error(y, ref) < 1e-2


@pytest.mark.skipif(not CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("tokens", [5, 64])
def test_cuda_grouped_matches_reference_at_real_shapes(bits, tokens):
    pool, offsets, layout = gpu_pool(*REAL[0], bits)
    idx, w = routing(len(offsets), tokens, 8, seed=tokens)
    x = torch.randn(tokens, REAL[0][0], device="cuda").to(torch.bfloat16)
    sel, w = offsets[idx.cuda()], w.cuda()
    y = kt.experts_forward(pool, layout, x, sel, w)
    ref = kt.reference_forward(pool, layout, x.float(), sel, w)
    assert torch.isfinite(y).all() and relative_error(y, ref) < 1e-2



ROUTING_SHAPES = ((32, 6), (60, 4), (64, 8), (128, 8))  # (experts, k); 60: not a power of two

ROUTE_INTERPRETED = """
import sys, torch
from smoe.runtime.cuda.routing import launch_route
from smoe.source.description import Routing
cases = torch.load(sys.argv[1])
torch.save([launch_route(Routing(**c["routing"]), c["logits"], c["bias"]) for c in cases], sys.argv[2])
"""


def routing_cases():
    cases = []
    for kind, facts in ROUTING_KINDS.items():
        for experts, k in ROUTING_SHAPES:
            if facts.get("n_group", 1) > 1 and experts & (experts - 1):
                continue  # grouped kinds over other counts stay with smoe.moe.route (kernel_takes)
            g = torch.Generator().manual_seed(experts + k)
            bias = torch.randn(experts, generator=g) * 0.5 if facts.get("correction_bias") else None
            cases.append({"routing": dict(num_experts=experts, top_k=k, **facts), "bias": bias,
                          "logits": torch.randn(5, experts, generator=g) * 3})
    return cases


def test_interpreted_routing_kernel_chooses_and_weighs_as_smoe_moe_route(tmp_path):
    from smoe.moe.routing import route
    from smoe.source.description import Routing

    cases = routing_cases()
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run([sys.executable, "-c", ROUTE_INTERPRETED, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   check=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    for c, (ids, weights) in zip(cases, torch.load(tmp_path / "out.pt")):
        want_ids, want_weights = route(Routing(**c["routing"]), c["logits"], c["bias"])
        assert torch.equal(ids, want_ids), c["routing"]
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_routing_kernel_leaves_cpu_tensors_and_uneven_groups_to_smoe_moe_route():
    from smoe.runtime.cuda.routing import fused_route, kernel_takes
    from smoe.source.description import Routing

    grouped = Routing(num_experts=60, top_k=4, scoring="sigmoid", n_group=4, topk_group=2)
    assert not kernel_takes(grouped, 60) and kernel_takes(Routing(num_experts=64, top_k=4, n_group=4, topk_group=2), 64)
    assert not kernel_takes(Routing(num_experts=8, top_k=2, custom="sparsemixer"), 8)
    from smoe.moe.routing import route

    logits = torch.randn(2, 60)
    for got, want in zip(fused_route(grouped, logits, None), route(grouped, logits, None)):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_routing_kernel_on_cuda_matches_smoe_moe_route():
    from smoe.moe.routing import route
    from smoe.runtime.cuda.routing import launch_route
    from smoe.source.description import Routing

    for c in routing_cases():
        r = Routing(**c["routing"])
        bias = c["bias"].cuda() if c["bias"] is not None else None
        ids, weights = launch_route(r, c["logits"].cuda(), bias)
        want_ids, want_weights = route(r, c["logits"], c["bias"])
        assert torch.equal(ids.cpu(), want_ids), c["routing"]
        torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-5, atol=1e-6)
