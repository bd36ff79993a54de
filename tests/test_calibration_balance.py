"""Expert-balanced calibration: every token's down inputs through every expert, blended in by `balance`."""

from dataclasses import replace

import pytest
import torch

from smoe.convert import calibrate
from smoe.errors import SmoeError
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tiny_model_dir(tmp_path_factory.mktemp("balance"), "qwen3_moe").parent
    (root / "calib.txt").write_text((TOKENIZER_TEXT + "\n") * 40)
    return root


@pytest.fixture(scope="module")
def both(tiny):
    """(routed statistics, the same collected with every token's down inputs and balance 1)."""
    collect = lambda b: calibrate.collect(tiny / "model", tiny / "calib.txt", tokens=256, progress=False, balance=b)
    return collect(0.0), collect(1.0)


def test_every_token_statistics_equal_each_expert_run_on_every_token(tiny, both):
    routed, balanced = both
    model, modules = calibrate.load_source_model(tiny / "model")
    seen = {}
    for m in modules.values():
        m.register_forward_pre_hook(lambda module, args: seen.setdefault(module.smoe_layer, []).append(args[0]))
    with torch.inference_mode():
        for window in calibrate.calibration_windows(tiny / "model", tiny / "calib.txt", 256):
            model(input_ids=window, use_cache=False)
    assert sorted(balanced.unrouted) == balanced.layers == routed.layers
    for layer, calls in seen.items():
        m, x = modules[layer], torch.cat(calls).double()
        gate, up = (x @ m.gate_up_proj.double().transpose(1, 2)).chunk(2, dim=-1)  # [E, T, n] each
        inner = m.act_fn(gate) * up
        assert torch.allclose(balanced.unrouted[layer], inner.transpose(1, 2) @ inner, rtol=1e-4, atol=1e-9)
        assert torch.equal(balanced.counts[layer], routed.counts[layer])  # the routed sums are untouched
        assert torch.allclose(balanced.sums[layer]["down"], routed.sums[layer]["down"], rtol=1e-6, atol=1e-9)


def test_balance_blends_routed_and_every_token_second_moments(both):
    routed, balanced = both
    layer = balanced.layers[0]
    for e in range(balanced.num_experts):
        every_gate = (balanced.layer_sums[layer] / balanced.layer_tokens[layer]).float()
        every_down = (balanced.unrouted[layer][e] / balanced.layer_tokens[layer]).float()
        assert torch.allclose(balanced.second_moment(layer, e, "gate"), every_gate)  # every expert: the layer's input
        assert torch.allclose(balanced.second_moment(layer, e, "down"), every_down)
        half = replace(balanced, balance=0.5)
        for role, every in (("up", every_gate), ("down", every_down)):
            mixed = (routed.second_moment(layer, e, role) + every) / 2
            assert torch.allclose(half.second_moment(layer, e, role), mixed, rtol=1e-5, atol=1e-8)
            assert torch.equal(replace(balanced, balance=0.0).second_moment(layer, e, role),
                               routed.second_moment(layer, e, role))


def test_balance_without_every_token_statistics_is_an_error(both):
    routed, _ = both
    with pytest.raises(SmoeError, match="balance above 0"):
        replace(routed, balance=0.5).second_moment(routed.layers[0], 0, "down")


def test_balance_outside_zero_to_one_is_an_error(tiny):
    with pytest.raises(SmoeError, match="between 0 and 1"):
        calibrate.collect(tiny / "model", tiny / "calib.txt", tokens=256, progress=False, balance=1.5)
