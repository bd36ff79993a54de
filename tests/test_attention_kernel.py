"""The decode-attention kernel (smoe.runtime.cuda.attention) computes what the GPU decoder's torch block computes
for one token: the same residual, expert input and router logits, and the same KV cache writes, for every
kind it covers. Run through the Triton interpreter in a child process (TRITON_INTERPRET must be set before
triton is imported); on a CUDA machine the GPU runtime's tests run it for real."""

import pytest

from smoe.testing.interpreted import interpreted_json

pytest.importorskip("triton", reason="triton not installed: the attention kernel cannot be checked")

CHILD = r"""
import dataclasses, json, sys
import torch
from smoe.bench.decode import MODELS
from smoe.runtime.cuda.attention import covers
from smoe.runtime.cuda.decode import AttentionStep, attention_block
from smoe.source.description import describe_model

out = {}
for case in json.loads(sys.argv[1]):
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    heads, kv, hd, rot, capacity, hidden = case["heads"], case["kv"], case["hd"], case["rot"], case["capacity"], 96
    d = describe_model(dict(MODELS["qwen3-30b-a3b"]))
    d = dataclasses.replace(d, attention=dataclasses.replace(d.attention, heads=heads, kv_heads=kv, head_dim=hd,
                                                             qk_norm="head" if case["norm"] else None))
    freqs = 1.0 / 10000 ** (torch.arange(0, max(rot, 2), 2).float() / max(rot, 2))
    angles = torch.arange(capacity).float()[:, None] * freqs[None, : rot // 2]
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    w = lambda *shape: (torch.randn(*shape) / shape[-1] ** 0.5).to(dtype)
    args = dict(positions=torch.arange(capacity), cos=cos, sin=sin, input_norm=1 + 0.1 * torch.randn(hidden),
                qkv=w((heads + 2 * kv) * hd, hidden), qkv_bias=w((heads + 2 * kv) * hd) if case["bias"] else None,
                qk_norm=(1 + 0.1 * torch.randn(heads + kv, hd)).to(dtype) if case["norm"] else None,
                q_norm_full=None, k_norm_full=None, o=w(hidden, heads * hd), post_norm=1 + 0.1 * torch.randn(hidden),
                router=w(8, hidden), description=d, eps=1e-6, dtype=dtype,
                sinks=torch.randn(heads) if case["sinks"] else None, window=case["window"], rotary=rot > 0)
    caches = [torch.randn(1, kv, capacity, hd).to(dtype) for _ in range(2)]
    x, added, pos = torch.randn(1, hidden), torch.randn(1, hidden), torch.tensor([case["pos"]])
    ref_caches = [c.clone() for c in caches]
    ref = attention_block(x, added, pos, k_cache=ref_caches[0], v_cache=ref_caches[1], **args)
    assert covers(d, type("Layer", (), {"gated": False})) is None
    got = AttentionStep(compiled=False)(x, added, pos, k_cache=caches[0], v_cache=caches[1], **args)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    out[case["name"]] = {"x": rel(got[0], ref[0]), "h": rel(got[1], ref[1]), "logits": rel(got[2], ref[2]),
                         "k": rel(caches[0], ref_caches[0]), "v": rel(caches[1], ref_caches[1]),
                         "others": bool(torch.equal(caches[0][:, :, : case["pos"]], ref_caches[0][:, :, : case["pos"]])
                                        and torch.equal(caches[0][:, :, case["pos"] + 1:],
                                                        ref_caches[0][:, :, case["pos"] + 1:]))}
print(json.dumps(out))
"""

BASE = dict(seed=0, dtype="float32", heads=4, kv=2, hd=64, rot=64, capacity=96, norm=True, bias=False, sinks=False,
            window=None, pos=70)
CASES = [
    BASE | dict(name="qwen3: per-head q/k norm, full rotary, positions over three blocks"),
    BASE | dict(name="bf16", dtype="bfloat16", seed=1),
    BASE | dict(name="partial rotary, no norm, q/k/v bias, one query head per KV head", heads=4, kv=4, rot=32,
                norm=False, bias=True, seed=2),
    BASE | dict(name="the first position (nothing cached)", pos=0, seed=3),
    BASE | dict(name="gpt-oss: sliding window and sinks", norm=False, sinks=True, window=16, pos=45, seed=4),
    BASE | dict(name="window wider than the sequence, sinks", norm=False, sinks=True, window=128, pos=20, seed=5),
    BASE | dict(name="no rotary, a head width not a power of two", rot=0, hd=80, heads=6, kv=3, pos=33, seed=6),
    BASE | dict(name="more blocks than splits: several blocks a split, the window across splits", capacity=2200,
                pos=2150, heads=4, kv=1, sinks=True, window=1000, seed=7),
]
BOUND = {"float32": 1e-5, "bfloat16": 2e-2}  # bf16: the kernel rounds where the torch ops round, not always alike


@pytest.fixture(scope="module")
def errors():
    return interpreted_json(CHILD, CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_token_attention_kernel_matches_the_torch_block(errors, case):
    got, bound = errors[case["name"]], BOUND[case["dtype"]]
    assert max(got["x"], got["h"], got["logits"]) < bound, got
    assert got["k"] < bound and got["v"] < bound, got  # the token's key and value written where the block writes them
    assert got["others"], "the kernel wrote to cache positions other than the token's"
