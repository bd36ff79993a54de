"""GPTQ over a batch of experts (smoe.convert.gptq) and the encode_all that uses it (smoe.convert.batched), against
GPTQ one matrix at a time and the sculptor's expert-by-expert encoding."""

import pytest
import torch

from smoe.convert import calibrate, encoders
from smoe.convert.gptq import encode_gptq_batch
from smoe.convert.sculpt import Coder, encode_batched, encode_here, layer_chunks, sculpt
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.vault import Vault
from smoe.hf.gguf import open_source
from smoe.source.matching import map_experts
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir


def experts(count: int, out: int, width: int, seed: int = 0):
    """[count, out, width] weights and Hessians of each expert's own inputs (channels of unequal size, correlated);
    every third expert has dead inputs (zero rows and columns of H), one all-zero row and a near-zero group."""
    g = torch.Generator().manual_seed(seed)
    ws, hs = [], []
    for e in range(count):
        w = torch.randn(out, width, generator=g) * 0.05
        x = torch.randn(512, width, generator=g) * (0.1 + 3 * torch.rand(width, generator=g))
        x = x + 0.5 * x.roll(1, dims=1)
        if e % 3 == 0:
            x[:, torch.randperm(width, generator=g)[: width // 8]] = 0
            w[0] = 0
            w[1, :64] *= 1e-3
        ws.append(w)
        hs.append(x.t() @ x / 512)
    return torch.stack(ws), torch.stack(hs)


def weighted_error(w, h, codes, scales, bits) -> float:
    d = (w - codec.decode(codes, scales, bits, tuple(w.shape), torch.float32)).double()
    return float(((d @ h.double()) * d).sum())


def same_groups(codes_a, scales_a, codes_b, scales_b) -> torch.Tensor:
    """Per group: same codes and same scale."""
    a, b = codes_a.reshape(scales_a.numel(), -1), codes_b.reshape(scales_b.numel(), -1)
    return (a == b).all(dim=1) & (scales_a.reshape(-1) == scales_b.reshape(-1))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("shape", [(48, 256), (40, 100)], ids=["rows-of-groups", "groups-across-rows"])
def test_batched_gptq_gives_each_expert_the_codes_and_error_of_gptq_one_matrix_at_a_time(bits, shape):
    W, H = experts(6, *shape, seed=bits)
    codes, scales = encode_gptq_batch(W, H, bits)
    same = total = 0
    for e in range(W.shape[0]):
        one_codes, one_scales = encoders.encode(W[e], bits, "gptq", H[e])
        assert codes[e].shape == one_codes.shape and scales[e].shape == one_scales.shape
        assert scales.dtype == torch.float16 and codes.dtype == torch.uint8
        equal = same_groups(codes[e], scales[e], one_codes, one_scales)
        same, total = same + int(equal.sum()), total + equal.numel()
        ours, theirs = weighted_error(W[e], H[e], codes[e], scales[e], bits), weighted_error(W[e], H[e], one_codes,
                                                                                          one_scales, bits)
        assert abs(ours - theirs) <= 0.01 * theirs
    assert same / total >= 0.999


def test_batched_gptq_refuses_weights_that_do_not_match_their_hessians():
    W, H = experts(2, 8, 64)
    with pytest.raises(SmoeError, match="do not match calibration inputs"):
        encode_gptq_batch(W, H[:, :32, :32], 4)
    W[1, 3, 5] = float("nan")
    with pytest.raises(SmoeError, match="tensor up.1: NaN"):
        encode_gptq_batch(W, H, 4, ["up.0", "up.1"])


def test_layer_chunks_keep_the_order_never_mix_layers_and_hold_at_most_the_chunk():
    todo = [(0, e) for e in range(5)] + [(2, e) for e in range(3)] + [(3, 7)]
    assert list(layer_chunks(todo, 2)) == [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 4)], [(2, 0), (2, 1)], [(2, 2)],
                                           [(3, 7)]]
    assert [key for chunk in layer_chunks(todo, 4) for key in chunk] == todo


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE (6 experts of 24 x 64 / 64 x 24 per MoE layer) and its calibration statistics."""
    root = tmp_path_factory.mktemp("batched")
    model = tiny_model_dir(root, "qwen3_moe")
    (root / "calib.txt").write_text((TOKENIZER_TEXT + "\n") * 40)
    stats = calibrate.collect(model, root / "calib.txt", tokens=256, progress=False)
    return model, root / "calib.txt", stats


@pytest.mark.parametrize("encoder", ["gptq", "grid"])
def test_batched_encoding_yields_the_experts_encode_here_yields_in_the_same_order(tiny, encoder):
    """Chunks of 4 of a layer's 6 experts, a mixed plan: same keys in order, digests, biases, tensors' roles, shapes
    and depths, SNRs; codes as GPTQ one matrix at a time gives them (grid: identical)."""
    model, _, stats = tiny
    ckpt = open_source(model, calibrated=True)
    expert_map = map_experts(ckpt.config, ckpt.names())
    depths = {(layer, role): 2 if (n + (role == "down")) % 2 else 4
              for n, layer in enumerate(expert_map.moe_layers) for role in expert_map.roles}
    coder = Coder(encoder, stats, depths, 4)
    todo = sorted(expert_map.experts)
    here = list(encode_here(ckpt, expert_map, coder, torch.device("cpu"), todo))
    batched = list(encode_batched(ckpt, expert_map, coder, torch.device("cpu"), todo, chunk=4))
    assert [e.key for e in batched] == todo
    same = total = 0
    for a, b in zip(here, batched):
        assert (a.source, a.numel, sorted(a.biases)) == (b.source, b.numel, sorted(b.biases))
        assert [(t.role, t.shape, t.bits) for t in a.tensors] == [(t.role, t.shape, t.bits) for t in b.tensors]
        assert {t.bits for t in b.tensors} == {depths[(b.key[0], t.role)] for t in b.tensors}
        assert a.snr.keys() == b.snr.keys() and a.weighted_snr.keys() == b.weighted_snr.keys() == a.snr.keys()
        for role in a.snr:
            assert b.snr[role] == pytest.approx(a.snr[role], abs=0.1)
            assert b.weighted_snr[role] == pytest.approx(a.weighted_snr[role], abs=0.05)
        for ta, tb in zip(a.tensors, b.tensors):
            equal = same_groups(ta.codes, ta.scales, tb.codes, tb.scales)
            same, total = same + int(equal.sum()), total + equal.numel()
    assert same / total >= (1.0 if encoder == "grid" else 0.999)


def test_a_vault_written_by_batched_encoding_decodes_as_the_expert_by_expert_vault(tiny, tmp_path):
    """Same entries, tensors and depths; each tensor decodes within a few codes' worth of the expert-by-expert one
    (a code at a rounding boundary may round the other way), nearly every group identical."""
    model, calib, stats = tiny
    options = {"encoder": "gptq", "calib": calib, "calib_tokens": 256, "stats": stats, "progress": False}
    sculpt(model, tmp_path / "one", encode_all=encode_here, **options)
    sculpt(model, tmp_path / "many", encode_all=encode_batched, **options)
    with Vault(tmp_path / "one") as one, Vault(tmp_path / "many") as many:
        assert sorted(one.entries) == sorted(many.entries) and many.meta["encoder"] == "gptq"
        same = total = 0
        for key in sorted(one.entries):
            for a, b in zip(one.read_expert(*key)[0], many.read_expert(*key)[0]):
                assert (a.role, a.shape, a.bits) == (b.role, b.shape, b.bits)
                reference = a.decode()
                assert float(torch.linalg.norm(b.decode() - reference)) <= 0.03 * float(torch.linalg.norm(reference))
                equal = same_groups(a.codes, a.scales, b.codes, b.scales)
                same, total = same + int(equal.sum()), total + equal.numel()
        assert same / total >= 0.99
