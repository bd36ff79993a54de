"""MLX exports loaded by mlx-lm itself (mlx[cpu] on Linux): logits and greedy generation against
smoe's streaming runtime on the same vault."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/export_models.py

import mlx.core as mx  # noqa: E402
import torch  # noqa: E402
from export_models import (  # noqa: E402
    agreement,
    causal_lm,
    draw_around_unit_scale,
    exportable_config,
    figures_line,
    integration_vault,
    mlx_exportable_vault,
    multimodal_model,
    prompt_ids,
    save_byte_level_tokenizer,
    smoe_logits,
    teacher_forced_agreement,
)
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate, generate_step  # noqa: E402

from smoe.convert.sculpt import sculpt  # noqa: E402
from smoe.export.writer import export  # noqa: E402
from smoe.testing.tiny_models import TINY_CONFIGS  # noqa: E402


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


# the families whose tiny models are drawn here, each at its fullest where mlx-lm computes it, its norms drawn around 1
# so that attention scores and router logits are of unit scale, its correction bias (a buffer from_config leaves 0)
# drawn: DeepSeek-V3.2's indexer keeping 16 of the prompt's positions (its default 2048 keeps them all), 8 experts in
# 4 groups of which 2 are used, YaRN with its two mscales apart (the rotated part's and the attention scale's);
# GLM-5's (glm_moe_dsa) likewise, its indexer turning adjacent pairs; MiMo-V2-Flash's leading dense layer, sliding
# layers narrower than the prompt (their own rotary base, twice the key/value heads, sink logits) between full ones,
# values narrower than the heads and scaled, heads wide enough that the rotary part (0.334 of each) is a whole number
# of pairs, 8 experts in 4 groups of which 2 are used; Step-3.7's text model, its (1 + w) norms drawn around 0: a leading
# dense layer, sliding layers narrower than the prompt with twice the query heads between full ones, half of each head
# turned on the full layers and all of it on the sliding ones at another base, a shared expert wider than the routed
# ones, 8 experts, a routed scale, the SwiGLU clamped where it bites (experts and shared or dense MLPs, unclamped on one
# layer each); Kimi-Linear's delta-attention layers before its MLA one, 8 experts, rms_norm_eps 1e-5 as released (the
# latent norm's eps in mlx-lm, 1e-6 in transformers); Gemma 4's full layers wider than its sliding ones, with one
# key/value head whose keys are its values, a final softcap that bites, 8 experts (the multimodal checkpoint's, gemma4,
# alike); MiniMax-M3's text model, its (1 + w) norms drawn around 0: a leading dense layer, block-sparse layers whose
# indexer keeps 2 of the prompt's blocks of 16 keys (one of them local), half of each head turned, 8 experts, a routed
# scale and a SwiGLU clamp that bites (alpha 1.5, limit 0.5) on the experts, shared expert and dense layer; its
# text-only vault in transformers' names (minimax_m3_vl_text) alike, every layer MoE (a dense layer's fused MLP refused);
# LongCat-Flash's two layers, 8 routed experts beside 2 identity ones, 4 chosen. Each top-k indexer (DeepSeek-V3.2's, GLM-5's) has
# as many heads as keep every query's 16th and 17th keys apart on its seed: keys that score an exact 0 (ReLU ties), or
# within 1e-6, torch's topk and MLX's argpartition order otherwise
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}
DRAWN_CONFIGS = {
    "deepseek_v32": dict(index_topk=16, index_head_dim=32, index_n_heads=8, n_routed_experts=8, n_group=4,
                         topk_group=2, rope_parameters=YARN),
    "glm_moe_dsa": dict(index_topk=16, index_head_dim=32, index_n_heads=16, n_routed_experts=8, n_group=4,
                        topk_group=2),
    "mimo_v2_flash": dict(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                            "full_attention"],
                          mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=16, head_dim=48,
                          v_head_dim=32, n_routed_experts=8, n_group=4, topk_group=2),
    "kimi_linear": dict(num_experts=8, rms_norm_eps=1e-5),
    "gemma4_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                          "full_attention"],
                        global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                        final_logit_softcapping=5.0, num_experts=8),
    "step3p7": dict(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                      "full_attention"],
                    sliding_window=16, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                    num_sliding_attention_heads=8, n_routed_experts=8, share_expert_dim=64,
                    moe_router_scaling_factor=2.5, query_pre_attn_scalar=16, swiglu_limits=[0.0, 0.3, None, 0.3],
                    swiglu_limits_shared=[0.3, 0.0, 0.3, 0.3],
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e3,
                                                           "partial_rotary_factor": 1.0}}),
    "minimax_m3_vl": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=2, index_n_heads=2, index_head_dim=32,
                          index_block_size=16, index_topk_blocks=2, index_local_blocks=1,
                          layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3,
                          mlp_layer_types=["dense"] + ["sparse"] * 3, intermediate_size=32, shared_intermediate_size=32,
                          dense_intermediate_size=64, num_local_experts=8, routed_scaling_factor=2.5, swiglu_alpha=1.5,
                          swiglu_limit=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.5}),
    "minimax_m3_vl_text": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=2, index_n_heads=2,
                               index_head_dim=32, index_block_size=16, index_topk_blocks=2, index_local_blocks=1,
                               layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3, mlp_layer_types=["sparse"] * 4,
                               intermediate_size=32, shared_intermediate_size=32, num_local_experts=8,
                               routed_scaling_factor=2.5, swiglu_alpha=1.5, swiglu_limit=0.5,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    "longcat_flash": dict(num_layers=2, n_routed_experts=8, zero_expert_num=2, moe_topk=4, ffn_hidden_size=32),
}
DRAWN_CONFIGS["gemma4"] = ({k: v for k, v in TINY_CONFIGS["gemma4_text"].items() if k != "moe_intermediate_size"}
                           | DRAWN_CONFIGS["gemma4_text"])
DRAWN_MULTIMODAL = {"step3p7", "gemma4", "minimax_m3_vl"}  # DRAWN_CONFIGS holds their text model's values
OFFSET_NORMS = {"step3p7", "minimax_m3_vl", "minimax_m3_vl_text"}  # RMSNorms scaled by 1 + w: drawn around 0
UNIT_SCALES = ("router.scale", "router.per_expert_scale")


def drawn_model(family: str):
    if family not in DRAWN_MULTIMODAL:
        return causal_lm(family, exportable_config(family, architecture=DRAWN_CONFIGS[family]))
    return multimodal_model(family, DRAWN_CONFIGS[family])


def drawn_vault(tmp: Path, family: str, bits: int) -> Path:
    """A tiny model of `family` with DRAWN_CONFIGS' values, unit-scale norms and a drawn correction bias, sculpted."""
    torch.manual_seed(0)
    model = drawn_model(family)
    # q_a_layernorm, input_layernorm, the indexer's k_norm, ...; Gemma 4's router scales too, so that its router
    # logits and expert weights are of unit scale
    draw_around_unit_scale(model, family in OFFSET_NORMS, UNIT_SCALES)
    model_dir, vault = tmp / f"{family}-model", tmp / f"{family}-q{bits}"
    model.save_pretrained(model_dir)
    save_byte_level_tokenizer(model_dir)
    sculpt(model_dir, vault, bits=bits, progress=False)
    return vault


# Gemma 4 normalises the experts' output (post_feedforward_layernorm_2) and adds it beside the dense MLP's: the fp16
# rounding of s/h moves its logits as much as the shared models' bf16 trunk moves theirs (tiny Q4 mean KL 2.2e-4,
# median per-position max 1.6e-3 of the largest logit, top-1 100%), so it is held to their bounds; with the experts
# decoded it computes smoe's logits to 6e-6 of the largest (the test below)
SHARED_MODEL_BOUNDS = {"gemma4_text", "gemma4"}


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("family", list(DRAWN_CONFIGS))
def test_mlx_logits_follow_smoe_for_each_drawn_family(tmp_path, family, bits):
    """The drawn tiny models' trunks are fp32 too: the bounds of the other families' test."""
    vault = drawn_vault(tmp_path, family, bits)
    model, _ = load(str(export(vault, "mlx", tmp_path / "mlx")))
    ids = prompt_ids(vault)
    a = agreement(smoe_logits(vault, ids), mlx_logits(model, ids))
    print("\n" + figures_line(f"mlx-lm tiny {family} Q{bits}", a))
    if family in SHARED_MODEL_BOUNDS:
        assert a["mean_kl"] < 5e-3 and a["top1"] >= 0.95
    else:
        assert a["median_pos_max_abs"] < 1e-3 * a["ref_max_abs"]
        assert a["mean_kl"] < 1e-4 and a["top1"] >= 0.99


# LongCat-Flash's latent norms (q_a_layernorm, kv_a_layernorm): mlx-lm fixes eps 1e-5, transformers 1e-6, which moves
# the tiny model's logits by 4.8e-4 of the largest (mean KL 6.6e-8), within the family test's bounds; set to
# transformers' below, the rest is held to fp32 summation order
LATENT_EPS = {"longcat_flash": 1e-6}


def set_latent_eps(model, eps: float) -> None:
    for layer in model.layers:
        for attention in layer.self_attn:
            attention.q_a_layernorm.eps = attention.kv_a_layernorm.eps = eps


@pytest.mark.parametrize("family", list(DRAWN_CONFIGS))
def test_mlx_lm_computes_smoe_logits_once_the_experts_are_decoded(tmp_path, family):
    """The export's experts swapped in mlx-lm's model for smoe's own decoded weights (fp32): what is left is the
    trunk, the config and the router as mlx-lm reads them, which must be smoe's to fp32 summation order (LongCat's
    latent norms at transformers' eps: LATENT_EPS)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    from smoe.export.mlx import expert_module
    from smoe.export.mlx_families import FAMILIES
    from smoe.export.source import ExportSource

    vault = drawn_vault(tmp_path, family, 4)
    model, _ = load(str(export(vault, "mlx", tmp_path / "mlx")))
    source = ExportSource(vault)
    try:
        for layer in source.meta["moe_layers"]:
            for role in source.roles:
                weight = np.stack([e.decoded() for e in source.experts(layer, role)]).astype(np.float32)
                *path, name = expert_module(FAMILIES[source.model_type], layer, role).split(".")
                parent = model
                for part in path:
                    parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
                decoded = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0], bias=False)
                decoded.weight = mx.array(weight)
                assert isinstance(getattr(parent, name), QuantizedSwitchLinear)  # the layer the export fills
                setattr(parent, name, decoded)
    finally:
        source.close()
    if family in LATENT_EPS:
        set_latent_eps(model, LATENT_EPS[family])
    ids = prompt_ids(vault)
    a = agreement(smoe_logits(vault, ids), mlx_logits(model, ids))
    print("\n" + figures_line(f"mlx-lm tiny {family} Q4, experts decoded", a))
    assert a["median_pos_max_abs"] < 1e-5 * a["ref_max_abs"]
    assert a["mean_kl"] < 1e-8 and a["top1"] == 1.0


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
