"""The compiled decode kernels against torch's own operations and QuantisedTensor.decode()."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from routing_kinds import ROUTING_KINDS

from smoe.format import codec
from smoe.runtime.buckets import bucket
from smoe.runtime.cpu import kernels as kc
from smoe.runtime.cpu import kernels_numba as kn

# [out, in]: the small model's gate/up and down (in = 96: every other row starts mid-group); whole
# groups; out not a multiple of 16; in = 200 and 36 (rows start at many offsets inside a group).
SHAPES = [(192, 384), (384, 96), (128, 256), (40, 128), (33, 200), (7, 36)]


def vector(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def code_matvec(w: kc.CodesWeight, x: torch.Tensor) -> torch.Tensor:
    phases, prefix = kn.activation_buffers(w.shape[1])
    y = np.empty(w.shape[0], dtype=np.float32)
    kn.split_activation(x.numpy(), phases, prefix)
    kn.code_matvec(w.codes, w.steps, w.lead, phases, prefix, y)
    return torch.from_numpy(y)


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_code_matvec_matches_decode_then_matmul_within_fp32_rounding(bits, shape):
    t = kc.random_quantised(shape, bits, seed=shape[1])
    x = vector(shape[1])
    y = code_matvec(kc.to_codes(t), x)
    assert kc.worst_error(x[None], t.decode(), y[None]) <= kc.TOLERANCE[torch.float32]


@pytest.mark.parametrize("bits", codec.DEPTHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_padded_rows_decode_to_the_vaults_weights_bit_for_bit(bits, shape):
    t = kc.random_quantised(shape, bits)
    assert torch.equal(kc.codes_dense(kc.to_codes(t)), t.decode())


def test_a_row_must_start_on_a_byte():
    assert kn.codes_fit((8, 96), 4) and kn.codes_fit((8, 96), 2)
    assert kn.codes_fit((8, 38), 4) and not kn.codes_fit((8, 38), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_matvec_matches_torch_for_fp32_and_bf16_weights(dtype):
    w = torch.randn(70, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = vector(48)
    y = np.empty(70, dtype=np.float32)
    wn = w.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else w.numpy()
    kn.matvec(wn, x.numpy(), y, np.zeros(48, dtype=np.uint32))
    torch.testing.assert_close(torch.from_numpy(y), w.float() @ x, rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_torch():
    x, weight = vector(64), vector(64, seed=1)
    y = np.empty(64, dtype=np.float32)
    kn.rms_norm(x.numpy(), weight.numpy(), 1e-6, y)
    torch.testing.assert_close(torch.from_numpy(y), F.rms_norm(x, (64,), weight, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalize", [True, False])
def test_top_k_routing_matches_torch_softmax_and_topk(normalize):
    logits = vector(32, seed=3)
    top_i, top_w = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.float32)
    kn.top_k(logits.numpy(), 4, normalize, top_i, top_w)
    want_logits, want_i = torch.topk(logits, 4)
    want_w = torch.softmax(want_logits, -1) if normalize else torch.softmax(logits, -1)[want_i]
    assert top_i.tolist() == want_i.tolist()
    torch.testing.assert_close(torch.from_numpy(top_w), want_w, rtol=1e-6, atol=1e-7)




# kinds only the CPU's fast decoder runs: Kolibri's choice by logits + correction bias
CPU_ROUTING_KINDS = {"sigmoid, choice by logits + bias": dict(scoring="sigmoid", normalise=True, correction_bias=True,
                                                              choice_by_logits=True)}


@pytest.mark.parametrize("kind", list(ROUTING_KINDS | CPU_ROUTING_KINDS))
def test_route_kernel_chooses_and_weighs_as_smoe_moe_route(kind):
    from smoe.moe.routing import route
    from smoe.source.description import Routing

    r = Routing(num_experts=32, top_k=6, **(ROUTING_KINDS | CPU_ROUTING_KINDS)[kind])
    for seed in range(20):
        logits = vector(32, seed=seed) * 3
        bias = vector(32, seed=100 + seed) * 0.5 if r.correction_bias else None
        want_i, want_w = route(r, logits[None], bias)
        top_i, top_w = np.zeros(6, dtype=np.int64), np.zeros(8, dtype=np.float32)
        work = np.zeros(kn.route_work_size(32, r.n_group), dtype=np.float32)
        correction = bias.numpy() if bias is not None else np.zeros(0, dtype=np.float32)
        kn.route(logits.numpy(), correction, r.scoring == "sigmoid", r.choice_by_logits, r.n_group, r.topk_group,
                 r.group_score == "top2", 6, r.normalise, r.normalise_eps, r.scale, top_i, top_w, work)
        assert top_i.tolist() == want_i[0].tolist()
        torch.testing.assert_close(torch.from_numpy(top_w[:6]), want_w[0], rtol=1e-5, atol=1e-6)


def test_top_k_takes_the_lowest_index_among_equal_logits():
    top_i, top_w = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.float32)
    kn.top_k(np.array([1.0, 3.0, 2.0, 3.0, 3.0], dtype=np.float32), 2, True, top_i, top_w)
    assert top_i.tolist() == [1, 3] and top_w.tolist() == [0.5, 0.5]


def expert_arrays(experts, role):
    return tuple(e.weights[role].codes for e in experts), tuple(e.weights[role].steps for e in experts)


def run_experts(experts, weights, count, hidden, inter, h, clamp=(0.0, 0.0)):
    x = np.zeros(hidden, dtype=np.float32)
    work = np.zeros(kn.experts_work_size(hidden, inter), dtype=np.float32)
    leads = (experts[0].weights["gate"].lead, experts[0].weights["down"].lead)
    biases = tuple(tuple(e.weights[role].bias for role in ("gate", "up", "down")) for e in experts)
    kn.experts(x, h.numpy(), count, weights, *expert_arrays(experts, "gate"), *expert_arrays(experts, "up"),
               *expert_arrays(experts, "down"), biases, tuple(map(np.float32, clamp)), leads, inter, work)
    return torch.from_numpy(x)


def random_expert(hidden, inter, bits, seed, biases=False):
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    tensors = [kc.random_quantised(s, bits, seed=seed + i, role=r) for i, (r, s) in enumerate(shapes.items())]
    bias = {r: vector(s[0], seed=seed + 10 + i) * 0.1 for i, (r, s) in enumerate(shapes.items())} if biases else {}
    return kc.prepare_expert(tensors, bias, torch.float32, "codes"), tensors, bias


@pytest.mark.parametrize("bits", codec.DEPTHS)
def test_experts_kernel_matches_the_weighted_sum_of_decoded_expert_mlps(bits):
    hidden, inter = 64, 96
    pairs = [random_expert(hidden, inter, bits, seed=10 * e) for e in range(3)]
    h = vector(hidden) * 3
    weights = np.array([0.5, 0.3, 0.2], dtype=np.float32)
    got = run_experts([p for p, *_ in pairs], weights, 3, hidden, inter, h)
    want = torch.zeros(hidden)
    for w, (_, (gate, up, down), _) in zip(weights, pairs):
        want += float(w) * (down.decode() @ (F.silu(gate.decode() @ h) * (up.decode() @ h)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("limit", [0.3, 7.0])
def test_experts_kernel_adds_biases_and_clamps_the_swiglu_as_gpt_oss_does(limit):
    """gpt-oss's experts: biases on gate, up and down, and the clamped SwiGLU (smoe.moe.activation), with a limit
    the gate and up values pass (0.3) and one they stay within."""
    from smoe.moe.activation import activate
    from smoe.source.description import Experts

    hidden, inter, kind = 64, 96, Experts(96, clamp=(1.702, limit), biases=True)
    triples = [random_expert(hidden, inter, 4, seed=10 * e, biases=True) for e in range(2)]
    h = vector(hidden) * 3
    weights = np.array([0.7, 0.3], dtype=np.float32)
    got = run_experts([p for p, *_ in triples], weights, 2, hidden, inter, h, kind.clamp)
    want, passed = torch.zeros(hidden), 0.0
    for w, (_, (gate, up, down), bias) in zip(weights, triples):
        g, u = gate.decode() @ h + bias["gate"], up.decode() @ h + bias["up"]
        passed = max(passed, float(g.max()), float(u.abs().max()))
        want += float(w) * (down.decode() @ activate(kind, g, u) + bias["down"])
    assert (passed > limit) == (limit < 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_padding_experts_never_change_the_output():
    hidden, inter = 64, 96
    real = [random_expert(hidden, inter, 4, seed=e)[0] for e in range(3)]
    junk = random_expert(hidden, inter, 2, seed=99)[0]  # what a pad slot holds is never read
    h = vector(hidden)
    weights = np.array([0.5, 0.3, 0.2], dtype=np.float32)
    exact = run_experts(real, weights, 3, hidden, inter, h)
    padded = run_experts(real + [junk], np.append(weights, 0).astype(np.float32), 3, hidden, inter, h)
    assert bucket(3) == 4 and torch.equal(exact, padded)


def test_buckets_are_powers_of_two_at_least_the_count():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
