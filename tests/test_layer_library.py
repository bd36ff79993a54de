"""The layer library (smoe.runtime.layers) run by the fast CPU decoder, against transformers' modules on the
dequantised checkpoint: every family it covers, DeepSeek's MLA in each of its forms, and the sequence state
(smoe.runtime.kv) growing in place."""

import dataclasses
from pathlib import Path

import pytest
import torch
from test_runtime import TOLERANCE, relative_error, small_budget

from smoe.quality.evaluate import load_reference
from smoe.runtime.cpu.compiled import FastCpuDecoder
from smoe.runtime.generate import logits_function, next_logits_function
from smoe.runtime.kv import Latents
from smoe.runtime.layers import MlaWeights, eager_step, mla_attention
from smoe.runtime.model import OpenedVault
from smoe.runtime.weights import fast_decoder_gap
from smoe.source.description import describe_model
from smoe.testing import vaults
from smoe.testing.tiny_models import tiny_config, tiny_families

LIBRARY = [f for f in tiny_families() if fast_decoder_gap(describe_model(tiny_config(f).to_dict())) is None]

# DeepSeek's variants beyond the tiny defaults: a query low rank, half-split rotary, group-limited routing
# with a routed scale, YaRN with its attention scale, and V2's softmax groups; then (family, values the model
# is built with, values written into its config.json after): GLM-4.7-Flash is DeepSeek-V3's layout under its
# own model type.
MLA_VARIANTS = {
    "v3-q-rank-groups": ("deepseek_v3", dict(q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2,
                                             routed_scaling_factor=2.5)),
    "v3-half-split-rotary": ("deepseek_v3", dict(rope_interleave=False)),
    # GLM-4.7-Flash's rms_norm_eps 1e-5: the query and latent norms keep their own 1e-6
    "v3-rms-eps-1e-5": ("deepseek_v3", dict(rms_norm_eps=1e-5, q_lora_rank=24)),
    "glm4_moe_lite": ("deepseek_v3", dict(q_lora_rank=24), dict(model_type="glm4_moe_lite",
                                                                architectures=["Glm4MoeLiteForCausalLM"])),
    "v3-yarn": ("deepseek_v3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                    "original_max_position_embeddings": 64, "mscale": 1.0,
                                                    "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
    "v2-group-limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_routed_experts=8, n_group=4,
                                             topk_group=2, routed_scaling_factor=16.0, q_lora_rank=24)),
}


# GQA variants beyond the tiny defaults: GLM-4.5's layout in full (q/k/v biases, per-head q/k norm, partial
# rotary, sigmoid routing with correction bias and a shared expert, a dense first layer)
GQA_VARIANTS = {
    "glm4_moe-biases-qk-norm": ("glm4_moe", dict(attention_bias=True, use_qk_norm=True)),
}


@pytest.mark.parametrize("variant", GQA_VARIANTS)
def test_gqa_attention_matches_transformers_with_biases_norms_and_partial_rotary(variant, tmp_path):
    family, architecture = GQA_VARIANTS[variant]
    model = vaults.tiny_model_dir(tmp_path, family, seed=3, architecture=architecture)
    vault = vaults.vault_of(model, tmp_path / "vault")
    assert fast_decoder_gap(describe_model(tiny_config(family, **architecture).to_dict()), "cuda") is None
    check_fast_against_reference(vault, vaults.dequantised_reference(vault, tmp_path), "codes")


# Sliding windows of 4 positions, well inside the 40-token prompts, on the layers each family's config names: every
# layer (Mixtral, Qwen3-MoE), from max_window_layers on (dots1), even layers below it (Qwen2-MoE), alternate layers
# with sinks, biases and a SwiGLU limit the tiny model's activations reach (gpt-oss).
WINDOWED = {
    "mixtral": ("mixtral", dict(sliding_window=4)),
    "qwen3_moe": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4)),
    "dots1": ("dots1", dict(sliding_window=4, max_window_layers=1)),
    "qwen2_moe": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "gpt_oss-clamped": ("gpt_oss", dict(sliding_window=4, swiglu_limit=0.02)),
}


@pytest.mark.parametrize("variant", WINDOWED)
def test_sliding_windows_match_transformers_before_and_past_the_window(variant, tmp_path):
    """A prefill inside the window, one-token steps out past it, a prefill over held tokens: every position's
    logits within fp32 tolerance of transformers recomputing the whole sequence; then the common check."""
    family, architecture = WINDOWED[variant]
    model = vaults.tiny_model_dir(tmp_path, family, seed=3, architecture=architecture)
    vault = vaults.vault_of(model, tmp_path / "vault")
    reference = vaults.dequantised_reference(vault, tmp_path)
    sm = OpenedVault(vault, dtype="float32", cache_bytes=small_budget(vault), kernel_path="codes")
    assert sm.description.attention.sliding_layers and sm.fast_decoder(64).compiled.enabled
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = load_reference(reference)(torch.tensor([ids]))[0]
    fast, seen = logits_function(sm, 64, "fast"), 0
    for chunk in (ids[:2], *([t] for t in ids[2:12]), ids[12:40]):
        got = fast(chunk)
        seen += len(chunk)
        assert all(relative_error(whole[seen - len(chunk) + i], row) < TOLERANCE for i, row in enumerate(got))
    sm.close()
    check_fast_against_reference(vault, reference, "codes")


# Kinds both fast decoders compute, each with values that matter within the 40-token check: EXAONE-MoE's full
# layers without rotary between sliding ones, HunYuan's q/k norm after rotary (with its biases), Granite's
# multipliers (3.0's values), Mistral 4's query temperature stepping up every 8 positions, AFMoE's output gate and
# norms, NoPE full layer and muP embeddings within a short window. Their attention is
# sharpened, so that positions (rotary, temperature) move the logits well past the tolerance.
KIND_VARIANTS = {
    "exaone_moe-nope-full-layers": ("exaone_moe", dict(
        sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "hunyuan_v1_moe-biases": ("hunyuan_v1_moe", dict(attention_bias=True)),
    "granitemoe-multipliers": ("granitemoe", dict(embedding_multiplier=12.0, attention_multiplier=0.015625,
                                                  residual_multiplier=0.22, logits_scaling=6.0)),
    "granitemoeshared-multipliers": ("granitemoeshared", dict(embedding_multiplier=12.0, attention_multiplier=0.03,
                                                              residual_multiplier=0.5, logits_scaling=3.0)),
    "mistral4-temperature": ("mistral4", dict(rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5, "original_max_position_embeddings": 8})),
    "afmoe-mup-window": ("afmoe", dict(sliding_window=4, mup_enabled=True)),
}


@pytest.mark.parametrize("variant", KIND_VARIANTS)
def test_kinds_made_to_matter_match_transformers_and_the_gpu_covers_them_too(variant, tmp_path):
    family, architecture = KIND_VARIANTS[variant]
    model = sharpened(vaults.tiny_model_dir(tmp_path, family, seed=3, architecture=architecture))
    vault = vaults.vault_of(model, tmp_path / "vault")
    d = describe_model(tiny_config(family, **architecture).to_dict())
    assert fast_decoder_gap(d) is None and fast_decoder_gap(d, "cuda") is None
    check_fast_against_reference(vault, vaults.dequantised_reference(vault, tmp_path), "codes")


# Families without a hand-made tiny model (transformers' default config shrunk, smoe.testing.coverage), one per
# mechanism the fast CPU decoder gained for them, with values that make it matter: M-RoPE on text in a multimodal
# checkpoint (the image-text-to-text class's text model); sink logits, windows and
# NoPE full layers under sigmoid routing (Flint); experts chosen by logits + correction bias and GLM-4's four norms
# (Kolibri); the MoE block's output norm and MLA without q_proj (AXK1); MLA without rotary between delta-attention
# mixers (Kimi-Linear); per-layer rotary bases with NoPE layers, sinks and Granite's multipliers (Granite-MoE-SWA);
# OLMo-2's norms on the branches' outputs only (FlexOlmo). The values: (model_type, text-config values it is built
# with, the GPU decoder's gap: None where the GPU's fast decoder covers it too).
DISCOVERED_VARIANTS = {
    "qwen3_vl_moe-mrope": ("qwen3_vl_moe", {}, None),
    "flint-window": ("flint", dict(sliding_window=4), None),
    "kolibri1-window": ("kolibri1", dict(sliding_window=4, norm_topk_prob=True),
                        "experts chosen by logits + correction bias"),
    "axk1": ("axk1", {}, "a norm on the MoE block's output"),
    "kimi_linear": ("kimi_linear", {}, "MLA layers without rotary"),
    "granitemoe_swa-nope-window": ("granitemoe_swa", dict(sliding_window=4, layer_rope_theta=[0, 10000.0],
                                                          attention_multiplier=0.2, residual_multiplier=0.5), None),
    "flex_olmo": ("flex_olmo", {}, "no norms on the attention's and the MLP's inputs"),
}


@pytest.mark.parametrize("variant", DISCOVERED_VARIANTS)
def test_families_without_a_tiny_model_of_their_own_match_transformers(variant, tmp_path):
    model_type, values, gpu_gap = DISCOVERED_VARIANTS[variant]
    model = sharpened(default_model_dir(tmp_path / "model", model_type, **values))
    vault = vaults.vault_of(model, tmp_path / "vault")
    sm = OpenedVault(vault, dtype="float32")
    assert fast_decoder_gap(sm.description) is None and fast_decoder_gap(sm.description, "cuda") == gpu_gap
    sm.close()
    check_fast_against_reference(vault, vaults.dequantised_reference(vault, tmp_path), "codes")


def default_model_dir(out: Path, model_type: str, seed: int = 3, **text_values) -> Path:
    """The walk's tiny model of model_type (smoe.testing.coverage), built with text_values in its text config,
    its correction biases random too (buffers, which smoe.testing.tiny_models.randomise leaves at 0)."""
    from smoe.testing import coverage
    from smoe.testing.tiny_models import randomise, save_tiny_tokenizer, tiny_default_config

    config = tiny_default_config(model_type)
    for key, value in text_values.items():
        setattr(config.get_text_config(), key, value)
    torch.manual_seed(seed)
    model = randomise(coverage.model_class(model_type).from_config(config, dtype=torch.float32), seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
    model.save_pretrained(out)
    save_tiny_tokenizer(out, config.get_text_config().vocab_size)
    return out


QUERY_AND_KEY = ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight", "query_layernorm.weight",
                 "key_layernorm.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight")


def sharpened(model: Path, factor: float = 8.0) -> Path:
    """The tiny model with its query and key weights (projections and norms) times factor: its random weights
    (0.05 each) make every attention nearly uniform, where positions hardly matter."""
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    tensors = {k: t * factor if "self_attn" in k and k.endswith(QUERY_AND_KEY) else t for k, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return model


def test_the_library_covers_deepseek_v2_and_v3_on_both_devices():
    assert {"qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"} <= set(LIBRARY)
    for family in ("deepseek_v2", "deepseek_v3"):
        assert fast_decoder_gap(describe_model(tiny_config(family).to_dict()), "cuda") is None


def check_fast_against_reference(vault: Path, reference: Path, kernel_path: str) -> None:
    """Prefill, one-token steps and a second prefill on the fast decoder with a cache that evicts: within fp32
    tolerance of transformers recomputing the whole sequence, and of the generic decoder step by step."""
    sm = OpenedVault(vault, dtype="float32", cache_bytes=small_budget(vault), kernel_path=kernel_path)
    sm.store.cache_bytes = sm.store.min_budget(sm.description.routing.top_k)  # one token's experts: it evicts
    assert sm.decoder == "fast" and sm.fast_decoder(64).compiled.enabled  # one-token steps run compiled
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = load_reference(reference)(torch.tensor([ids]))[0]
    fast, slow = next_logits_function(sm, 64, "fast"), next_logits_function(sm, 64, "generic")
    seen = 0
    for chunk in (ids[:30], ids[30:31], ids[31:32], ids[32:40]):
        a, b = fast(chunk), slow(chunk)
        seen += len(chunk)
        assert relative_error(whole[seen - 1], a) < TOLERANCE
        assert relative_error(b, a) < TOLERANCE
    assert sm.store.stats.evictions > 0
    sm.close()


@pytest.mark.parametrize("kernel_path", ["dequant", "codes"])
@pytest.mark.parametrize("family", LIBRARY)
def test_fast_decoder_matches_transformers_on_every_family_the_library_covers(family, kernel_path, tmp_path):
    vault, reference = vaults.tiny_vault_and_reference(tmp_path, family, seed=2)
    check_fast_against_reference(vault, reference, kernel_path)


@pytest.mark.parametrize("variant", MLA_VARIANTS)
def test_absorbed_mla_matches_transformers_in_every_deepseek_variant(variant, tmp_path):
    family, architecture, *written = MLA_VARIANTS[variant]
    model = vaults.tiny_model_dir(tmp_path, family, seed=3, architecture=architecture, **(written[0] if written else {}))
    vault = vaults.vault_of(model, tmp_path / "vault")
    check_fast_against_reference(vault, vaults.dequantised_reference(vault, tmp_path), "codes")


def test_mla_keeps_only_the_compressed_latent_and_rotary_key_per_position(tmp_path):
    vault = vaults.tiny_vault(tmp_path, "deepseek_v3", seed=2)
    sm = OpenedVault(vault, dtype="float32")
    a = sm.description.attention
    state = sm.fast_decoder(8).state
    assert all(isinstance(layer, Latents) for layer in state.layers)
    assert state.layers[0].rows.shape[1] == a.latent_dim + a.rope_key_dim < 2 * a.heads * a.head_dim
    sm.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_from_the_sequence_start_gets_from_expanded_mla_what_the_absorbed_form_gives(dtype, tmp_path):
    """The expanded form serves prompts that start a sequence, the absorbed one every other step: on the same
    prompt (absorbed forced by an explicit causal mask) both give the same attention output and the same rows."""
    vault = vaults.tiny_vault(tmp_path, "deepseek_v3", seed=2)
    sm = OpenedVault(vault, dtype="float32")
    dec, d = sm.fast_decoder(64), sm.description
    w = next(x.attention for x in dec.layers if x is not None and isinstance(x.attention, MlaWeights))
    w = dataclasses.replace(w, **{f: getattr(w, f).to(dtype) for f in ("q", "q_a", "q_b", "kv_a", "kv_b", "o")
                                  if getattr(w, f) is not None})
    t, a = 24, d.attention
    h = torch.randn(t, d.hidden_size, generator=torch.Generator().manual_seed(0))
    expanded_step = eager_step(0, t, dec.cos, dec.sin, dec.eps, dec.interleaved)
    absorbed_step = dataclasses.replace(expanded_step, mask=torch.ones(t, t, dtype=torch.bool).tril())
    outs, rows = [], []
    for step in (expanded_step, absorbed_step):
        state = Latents(torch.zeros(32, a.latent_dim + a.rope_key_dim, dtype=dtype), a.latent_dim)
        outs.append(mla_attention(d, w, h, state, step))
        rows.append(state.rows)
    assert torch.equal(rows[0], rows[1])
    assert relative_error(outs[1], outs[0]) < (TOLERANCE if dtype == torch.float32 else 2e-2)
    sm.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_sequence_state_grows_in_place_keeping_the_decoder_and_what_it_holds(family, tmp_path):
    vault = vaults.tiny_vault(tmp_path, family, seed=2)
    sm = OpenedVault(vault, dtype="float32")
    ids = torch.randint(0, 100, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    roomy = next_logits_function(sm, 64, "generic")
    expected = [roomy(ids[:20])] + [roomy([t]) for t in ids[20:]]
    decoder = FastCpuDecoder(sm, 4)  # a state of 4 positions, to grow from
    layers = decoder.layers
    got = [decoder.forward(ids[:20])[-1]] + [decoder.forward([t])[-1] for t in ids[20:]]
    assert decoder.state.capacity >= 48 and decoder.layers is layers
    for a, b in zip(expected, got):
        assert relative_error(a, b) < TOLERANCE
    assert sm.fast_decoder(8) is sm.fast_decoder(5000)  # the opened vault's decoder grows, it is not rebuilt
    sm.close()


DEEPSEEK_MODEL = vaults.SHARED_MODELS["deepseek_v3"]


@pytest.mark.skipif(not DEEPSEEK_MODEL.is_dir(), reason=f"{DEEPSEEK_MODEL} absent (the shared models live beside the "
                    "repository; the tiny deepseek models above check the same paths)")
@pytest.mark.parametrize("bits", [4, 2])
def test_the_trained_deepseek_model_runs_the_fast_decoder_as_transformers_does(bits, tmp_path):
    """The shared trained DeepSeek-V3-layout model (MLA, sigmoid group routing with its trained correction
    biases, a shared expert, a dense first layer): fast-decoder logits within fp32 tolerance of transformers
    on the dequantised checkpoint, and greedy tokens equal wherever the reference's margin allows."""
    from test_runtime import assert_greedy_agrees
    from transformers import AutoTokenizer

    from smoe.runtime.generate import generate
    from smoe.runtime.sampling import GREEDY

    vault = vaults.vault_of(DEEPSEEK_MODEL, tmp_path / "vault", bits)
    reference = load_reference(vaults.dequantised_reference(vault, tmp_path))
    check_fast_against_reference(vault, tmp_path / "reference", "codes")
    sm = OpenedVault(vault, dtype="float32", cache_bytes=small_budget(vault), kernel_path="codes")
    prompt = AutoTokenizer.from_pretrained(vault)("It was a dark and stormy night; the rain")["input_ids"]
    tokens, _ = generate(sm, prompt, max_tokens=24, params=GREEDY)
    assert_greedy_agrees(tokens, reference, prompt)
    assert sm.describe()["decoder"] == "fast"
    sm.close()


# DeepSeek config values that still parse but disagree with the checkpoint's tensors or experts
DISAGREEING = {
    "kv_lora_rank": {"kv_lora_rank": 8},
    "qk_rope_head_dim": {"qk_rope_head_dim": 4},
    "qk_nope_head_dim": {"qk_nope_head_dim": 8},
    "v_head_dim": {"v_head_dim": 4},
    "num_attention_heads": {"num_attention_heads": 2, "num_key_value_heads": 2},
    "n_group": {"n_group": 3, "topk_group": 1},
    "n_shared_experts": {"n_shared_experts": 2},
}


@pytest.mark.parametrize("key", DISAGREEING)
def test_a_deepseek_config_that_disagrees_with_its_tensors_is_one_line_at_quantize_and_at_open(key, tmp_path):
    import json

    from smoe.errors import SmoeError
    from smoe.format.vault import CONFIG_FILE

    edit = DISAGREEING[key]
    bad = vaults.tiny_model_dir(tmp_path, "deepseek_v3", name="bad", **edit)
    with pytest.raises(SmoeError) as refused:
        vaults.vault_of(bad, tmp_path / "bad-vault")
    assert "\n" not in str(refused.value) and not (tmp_path / "bad-vault").exists()
    vault = vaults.tiny_vault(tmp_path, "deepseek_v3", seed=2)
    config = json.loads((vault / CONFIG_FILE).read_text())
    vaults.reseal(vault, CONFIG_FILE, json.dumps(config | edit).encode())
    with pytest.raises(SmoeError) as refused:
        OpenedVault(vault, dtype="float32")
    assert "\n" not in str(refused.value)
