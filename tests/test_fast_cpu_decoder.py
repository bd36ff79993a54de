"""The compiled one-token step of the fast CPU decoder against its eager path and the transformers path."""

from pathlib import Path

import pytest
import torch
from test_runtime import TOLERANCE, TRAINED_MODEL, relative_error, small_budget

from smoe.format.vault import Vault
from smoe.runtime.cpu import compiled as fast_decode
from smoe.runtime.generate import next_logits_function
from smoe.runtime.model import OpenedVault
from smoe.testing import vaults


def tiny_vault(tmp_path: Path, family: str, depth) -> Path:
    """depth 4 or 2, or "mixed": per MoE layer, gate/up and down at different depths, alternating."""
    if depth == "mixed":
        return vaults.mixed_vault(tmp_path, family, seed=2)
    return vaults.tiny_vault(tmp_path, family, depth, seed=2)


def open_codes(vault: Path) -> OpenedVault:
    sm = OpenedVault(vault, dtype="float32", cache_bytes=small_budget(vault), kernel_path="codes")
    with Vault(vault) as v:
        layer = v.meta["moe_layers"][0]
    assert fast_decode.from_codes(sm.store.get(layer, [0])[0])  # the experts run in the compiled kernel
    return sm


def check_steps(sm: OpenedVault, steps: int = 10) -> None:
    """Prefill 30 tokens, then one-token steps: compiled logits within fp32 tolerance of the eager fast
    path and of the transformers path, and the same greedy token wherever the margin allows."""
    ids = torch.randint(0, 100, (30 + steps,), generator=torch.Generator().manual_seed(1)).tolist()
    fast = next_logits_function(sm, 64, "fast")
    compiled = sm.fast_decoder(64).compiled
    assert compiled.enabled
    slow = next_logits_function(sm, 64, "generic")
    fast_logits, slow_logits = fast(ids[:30]), slow(ids[:30])
    assert relative_error(slow_logits, fast_logits) < TOLERANCE
    # the eager path keeps its own cache position: run it on a second decoder over the same store
    reference = fast_decode.FastCpuDecoder(sm, 64)
    reference.compiled.enabled = False
    reference.forward(ids[:30])
    for token in ids[30:]:
        a, b, c = fast([token]), reference.forward([token])[-1], slow([token])
        assert relative_error(b, a) < TOLERANCE and relative_error(c, a) < TOLERANCE
        top2 = torch.topk(c, 2).values
        if top2[0] - top2[1] > 10 * float((a - c).abs().max()):
            assert int(a.argmax()) == int(c.argmax())


@pytest.mark.parametrize("depth", [4, 2, "mixed"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "hunyuan_v1_moe"])
def test_compiled_step_matches_the_eager_and_transformers_paths_on_tiny_models(family, depth, tmp_path):
    check_steps(open_codes(tiny_vault(tmp_path, family, depth)))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_compiled_mla_step_matches_the_eager_and_transformers_paths_on_a_mixed_plan(family, tmp_path):
    """DeepSeek's layout (MLA, shared expert, dense first layer; V3's grouped sigmoid routing in the route
    kernel) with gate/up and down at different depths per layer, as a bit plan writes them."""
    check_steps(open_codes(tiny_vault(tmp_path, family, "mixed")))


@pytest.mark.parametrize("bits", [4, 2])
def test_compiled_step_matches_the_eager_and_transformers_paths_on_the_trained_model(bits, tmp_path):
    vaults.vault_of(TRAINED_MODEL, tmp_path / "vault", bits)
    check_steps(open_codes(tmp_path / "vault"))


def test_compiled_step_runs_experts_of_other_forms_through_the_eager_expert_path(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", 4)
    sm = OpenedVault(vault, dtype="float32", cache_bytes=small_budget(vault), kernel_path="dequant")
    check_steps(sm, steps=4)




def test_the_decode_rate_leaves_out_the_first_step_which_compiles_after_an_install(tmp_path):
    """generate's decode tok/s times the steps after the first (on a fresh install the first compiles the step's
    kernels for seconds): here the first step is made slow on purpose (its token's callback sleeps), and the
    rate does not see it."""
    import time

    from smoe.runtime.generate import generate
    from smoe.runtime.sampling import SamplingParams

    sm = OpenedVault(tiny_vault(tmp_path, "qwen3_moe", 4), dtype="float32")
    seen = []

    def on_token(token):
        seen.append(token)
        if len(seen) == 2:  # the first decode step's token
            time.sleep(1.0)

    try:
        tokens, stats = generate(sm, [5, 6, 7], max_tokens=6, params=SamplingParams(temperature=0.0), on_token=on_token)
    finally:
        sm.close()
    assert len(tokens) == 6
    # the 4 timed steps took well under the first one's sleep (with it, 4 / rate would be 0.8 s at least)
    assert (len(tokens) - 2) / stats.decode_tok_s < 0.5
