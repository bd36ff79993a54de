"""GPTQ over a layer's experts at once (smoe.convert.gptq_batch) against GPTQ one matrix at a time."""

import pytest
import torch

from smoe.convert import encoders
from smoe.convert.gptq_batch import encode_gptq_many
from smoe.convert.sculpt import encode_batched, encode_here, layer_chunks
from smoe.format import codec
from smoe.format.vault import Vault
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir, vault_of


def experts(count: int, out: int = 32, width: int = 256, seed: int = 0):
    """Weights and Hessians of `count` experts, each with its own input statistics; every third has dead inputs."""
    g = torch.Generator().manual_seed(seed)
    ws, hs = [], []
    for e in range(count):
        ws.append(torch.randn(out, width, generator=g) * 0.05)
        x = torch.randn(512, width, generator=g) * torch.rand(width, generator=g) * 3
        if e % 3 == 0:
            x[:, : width // 8] = 0  # channels no calibration token reached: zero rows/columns of H
        hs.append(x.t() @ x / 512)
    return ws, hs


def error(w, h, codes, scales, bits):
    d = (w - codec.decode(codes, scales, bits, tuple(w.shape), torch.float32)).double()
    return float(((d @ h.double()) * d).sum())


@pytest.mark.parametrize("bits", [4, 2])
def test_batched_gptq_matches_gptq_one_matrix_at_a_time(bits):
    ws, hs = experts(6)
    batched = encode_gptq_many(ws, hs, bits, [f"e{e}" for e in range(6)])
    same = total = 0
    for w, h, (codes, scales) in zip(ws, hs, batched):
        one_codes, one_scales = encoders.encode(w, bits, "gptq", h)
        per_group = codes.reshape(scales.numel(), -1)
        equal = (per_group == one_codes.reshape(one_scales.numel(), -1)).all(dim=1) & (scales == one_scales)
        same, total = same + int(equal.sum()), total + equal.numel()
        assert error(w, h, codes, scales, bits) <= 1.01 * error(w, h, one_codes, one_scales, bits)
    assert same / total >= 0.999


def test_layer_chunks_never_mix_layers_and_keep_the_order():
    todo = [(0, e) for e in range(5)] + [(2, e) for e in range(3)]
    chunks = list(layer_chunks(todo, 2))
    assert chunks == [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 4)], [(2, 0), (2, 1)], [(2, 2)]]


def test_a_vault_encoded_a_layer_at_a_time_is_the_one_encoded_expert_by_expert(tmp_path):
    model = tiny_model_dir(tmp_path, "qwen3_moe", architecture={"num_experts": 12})
    (tmp_path / "calib.txt").write_text((TOKENIZER_TEXT + "\n") * 40)
    options = {"calib": tmp_path / "calib.txt", "calib_tokens": 256, "encoder": "gptq"}
    one = Vault(vault_of(model, tmp_path / "one", encode_all=encode_here, **options))
    many = Vault(vault_of(model, tmp_path / "many", encode_all=encode_batched, **options))
    assert sorted(one.entries) == sorted(many.entries)
    same = total = 0
    for key in sorted(one.entries):
        for a, b in zip(one.read_expert(*key)[0], many.read_expert(*key)[0]):
            assert (a.role, a.shape, a.bits) == (b.role, b.shape, b.bits)
            equal = (a.codes.reshape(a.scales.numel(), -1) == b.codes.reshape(b.scales.numel(), -1)).all(dim=1)
            same, total = same + int((equal & (a.scales == b.scales)).sum()), total + equal.numel()
    assert same / total >= 0.999
