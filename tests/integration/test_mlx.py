"""MLX exports loaded by mlx-lm itself (mlx[cpu] on Linux): logits and greedy generation against
smoe's streaming runtime on the same vault."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/export_models.py

import mlx.core as mx  # noqa: E402
from export_models import (  # noqa: E402
    agreement,
    figures_line,
    integration_vault,
    mlx_exportable_vault,
    prompt_ids,
    smoe_logits,
    teacher_forced_agreement,
)
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate, generate_step  # noqa: E402

from smoe.export.writer import export  # noqa: E402


def mlx_logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids])).astype(mx.float32))[0]


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mlx_logits_follow_smoe(tmp_path_factory, tmp_path, family, bits):
    vault = integration_vault(tmp_path_factory, family, bits)
    model, _ = load(str(export(vault, "mlx", tmp_path / "mlx")))
    ids = prompt_ids(vault)
    ref = smoe_logits(vault, ids)
    # as loaded: the trunk computes in its own bf16, experts in fp32 (fp16 scales meet bf16 inputs)
    native = agreement(ref, mlx_logits(model, ids))
    print("\n" + figures_line(f"mlx-lm {family} Q{bits} (bf16 trunk)", native))
    assert native["mean_kl"] < 5e-3 and native["top1"] >= 0.95
    # in fp32 throughout, only the fp16 rounding of s/h separates the two (≤ s/1024 per weight); it
    # can still tip a near-tie of the router at a rare position, hence the median and mean bounds
    model.set_dtype(mx.float32)
    fp32 = agreement(ref, mlx_logits(model, ids))
    print(figures_line(f"mlx-lm {family} Q{bits} (fp32)", fp32))
    assert fp32["median_pos_max_abs"] < 1e-3 * fp32["ref_max_abs"]
    assert fp32["mean_kl"] < 1e-4 and fp32["top1"] >= 0.99


# the families of smoe.export.mlx_families beyond the shared models', on tiny models at their fullest
# (tests/export_models.py; gpt-oss with its YaRN range rounded, as mlx-lm computes it, and the other MLX_CHANGES and
# MLX_ARCHITECTURE there: PhiMoE's biases, Llama 4's norm eps, EXAONE's window narrower than the prompt; the multimodal
# checkpoints as MLX_MULTIMODAL builds them, Qwen3.5-MoE's vault named by its text model, qwen3_5_moe_text)
TINY_FAMILIES = ["glm4_moe", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "dots1", "minimax_m2",
                 "granitemoe", "phimoe", "exaone_moe", "llama4", "afmoe", "lfm2_moe", "dbrx", "qwen3_next",
                 "granitemoehybrid", "nemotron_h", "solar_open", "mellum", "glm4_moe_lite",
                 "qwen3_vl_moe", "mistral4", "qwen3_5_moe_text", "qwen3_5_moe",
                 "laguna"]


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_mlx_logits_follow_smoe_for_each_family(tmp_path, family, bits):
    """The tiny models' trunks are fp32, so mlx-lm computes in fp32 as loaded: only the fp16 rounding of s/h
    separates it from smoe, the bounds of the shared models' fp32 check."""
    vault = mlx_exportable_vault(tmp_path, family, bits)
    model, _ = load(str(export(vault, "mlx", tmp_path / "mlx")))
    ids = prompt_ids(vault)
    a = agreement(smoe_logits(vault, ids), mlx_logits(model, ids))
    print("\n" + figures_line(f"mlx-lm tiny {family} Q{bits}", a))
    assert a["median_pos_max_abs"] < 1e-3 * a["ref_max_abs"]
    assert a["mean_kl"] < 1e-4 and a["top1"] >= 0.99


def test_mlx_lm_gpt_oss_rotary_is_transformers_yarn(tmp_path):
    """The tiny models' attention barely depends on position, so their logits cannot tell rotary bases apart:
    the frequencies and scale mlx-lm builds from the exported config are checked against transformers' YaRN."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    vault = mlx_exportable_vault(tmp_path, "gpt_oss", 4)
    model, _ = load(str(export(vault, "mlx", tmp_path / "mlx")))
    rope = model.model.layers[0].self_attn.rope
    config = AutoConfig.from_pretrained(tmp_path / "gpt_oss-mlx-model-4")
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    np.testing.assert_allclose(1 / np.array(rope._freqs), inv_freq.numpy(), rtol=1e-6)
    assert rope.mscale == pytest.approx(attention_factor)


def test_mlx_lm_dbrx_rotates_with_transformers_rotary_base(tmp_path):
    """DBRX's logits cannot tell rotary bases apart either (a base of 1 passes the family test): mlx-lm's base,
    read from attn_config, is transformers' (rope_parameters')."""
    from transformers import AutoConfig

    vault = mlx_exportable_vault(tmp_path, "dbrx", 4)
    model, _ = load(str(export(vault, "mlx", tmp_path / "mlx")))
    config = AutoConfig.from_pretrained(tmp_path / "dbrx-mlx-model-4")
    assert model.layers[0].norm_attn_norm.attn.rope.base == config.rope_parameters["rope_theta"]


@pytest.mark.parametrize("family", ["granitemoehybrid", "nemotron_h"])
def test_mlx_lm_mamba_layers_clamp_time_steps_and_rotate_as_transformers(tmp_path, family):
    """The tiny models' Mamba layers barely move their logits (their time-step clamp taken off passes the family
    test): the clamp mlx-lm builds from the exported config is transformers' (Nemotron-H's from time_step_min), and
    its attention rotates where transformers' does (Granite: only where position_embedding_type is "rope")."""
    from transformers import AutoModelForCausalLM

    vault = mlx_exportable_vault(tmp_path, family, 4)
    model, _ = load(str(export(vault, "mlx", tmp_path / "mlx")))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-mlx-model-4")
    hf_limit = next(m.time_step_limit for m in hf.modules() if hasattr(m, "time_step_limit"))
    mixers = [m for layer in model.layers for key in ("mamba", "mixer") if (m := layer.get(key)) is not None]
    assert tuple(next(m.time_step_limit for m in mixers if "in_proj" in m)) == tuple(hf_limit)
    if family == "granitemoehybrid":
        attention = next(layer.self_attn for layer in model.layers if layer.layer_type == "attention")
        assert (attention.rope is None) == (hf.model.rotary_emb is None)


def test_mlx_lm_generates_smoe_greedy_tokens(tmp_path_factory, tmp_path):
    vault = integration_vault(tmp_path_factory, "mixtral", 4)
    model, tokenizer = load(str(export(vault, "mlx", tmp_path / "mlx")))
    model.set_dtype(mx.float32)
    prompt = prompt_ids(vault, 48)
    generated = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]  # greedy by default
    share = teacher_forced_agreement(vault, prompt, generated)
    print(f"\nmlx-lm greedy tokens smoe also picks: {100 * share:.1f}% of {len(generated)}")
    assert share == 1.0
    text = generate(model, tokenizer, tokenizer.decode(prompt), max_tokens=8)
    assert text.strip() == tokenizer.decode(generated[:8]).strip()  # mlx-lm's detokenizer drops a leading space


def test_mlx_lm_refuses_a_vault_directory_naming_its_model_type(tmp_path_factory):
    """A vault is not an MLX model (its experts are in experts.bin): mlx-lm stops at config.json's model type."""
    vault = integration_vault(tmp_path_factory, "qwen3_moe", 4)
    with pytest.raises(ValueError, match="Model type smoe_vault not supported"):
        load(str(vault))
