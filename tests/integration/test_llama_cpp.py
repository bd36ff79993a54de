"""GGUF exports loaded by llama.cpp itself (llama-cpp-python, built from source): tokenizer, logits and
greedy tokens against smoe's streaming runtime on the same vault."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/export_models.py

import torch  # noqa: E402
from export_models import (  # noqa: E402
    agreement,
    causal_lm,
    draw_around_unit_scale,
    exportable_config,
    exportable_vault,
    figures_line,
    integration_vault,
    multimodal_model,
    prompt_ids,
    save_byte_level_tokenizer,
    smoe_logits,
    teacher_forced_agreement,
)
from llama_cpp import Llama  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from smoe.convert.sculpt import sculpt  # noqa: E402
from smoe.export.gguf import write_gguf  # noqa: E402
from smoe.export.source import ExportSource  # noqa: E402
from smoe.export.writer import export  # noqa: E402
from smoe.testing.tiny_models import TINY_CONFIGS  # noqa: E402

# llama.cpp multiplies Q4_1 weights with activations it rounds to 8 bits (Q8_1) per 32 values, and a
# BF16 trunk with BF16 activations: logits differ by a few hundredths typically, and a near-tie of
# the router can move one position further. Measured on the shared models: mean KL ≤ 6e-4, top-1 100%.
MEAN_KL = 5e-3
TOP1 = 0.95


GGML_F32 = 0


def load(path: Path, f32_cache: bool = False, flash_attn: bool = False) -> Llama:
    cache = dict(type_k=GGML_F32, type_v=GGML_F32) if f32_cache else {}
    return Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2, verbose=False, flash_attn=flash_attn,
                 **cache)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_llama_cpp_logits_follow_smoe(tmp_path_factory, tmp_path, family, bits):
    vault = integration_vault(tmp_path_factory, family, bits)
    llm = load(export(vault, "gguf", tmp_path / "model.gguf"))
    ids = prompt_ids(vault)
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float32)
    a = agreement(smoe_logits(vault, ids), got)
    print("\n" + figures_line(f"llama.cpp {family} Q{bits}", a))
    assert a["mean_kl"] < MEAN_KL and a["top1"] >= TOP1


@pytest.mark.parametrize("tokenizer", ["qwen3_moe", "mixtral", "tiny-qwen2-split"])
def test_llama_cpp_tokenizes_like_the_vault_tokenizer(tmp_path_factory, tmp_path, tokenizer):
    """The shared models' GPT-2 pre-tokenizer, and Qwen2/3's split pattern on a tiny model."""
    if tokenizer == "tiny-qwen2-split":
        vault = exportable_vault(tmp_path, "qwen3_moe", 4, pre="qwen2")
    else:
        vault = integration_vault(tmp_path_factory, tokenizer, 4)
    llm = load(export(vault, "gguf", tmp_path / "model.gguf"))
    hf = AutoTokenizer.from_pretrained(vault)
    for text in ["The quick brown fox jumps over the lazy dog.", "  It's 1895;\n\tWatson  said: \"no!\" ", "café naïve — ok"]:
        ids = hf(text)["input_ids"]
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == ids
        assert llm.detokenize(ids).decode() == hf.decode(ids)


def test_llama_cpp_greedy_tokens_are_smoe_argmax(tmp_path_factory, tmp_path):
    vault = integration_vault(tmp_path_factory, "qwen3_moe", 4)
    llm = load(export(vault, "gguf", tmp_path / "model.gguf"))
    prompt = prompt_ids(vault, 48)
    generated = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        generated.append(token)
        if len(generated) == 24:
            break
    share = teacher_forced_agreement(vault, prompt, generated)
    print(f"\nllama.cpp greedy tokens smoe also picks: {100 * share:.1f}% of {len(generated)}")
    assert share >= TOP1


# The shared DeepSeek model's sigmoid router has a near-tie at one of the 128 positions, which summation
# order flips (Δlogit 0.43 there, ≤ 0.014 at every other position): its mean KL is 3e-5.
DECODED_MEAN_KL = {"deepseek_v3": 1e-4}
# llama.cpp's default F16 cache rounds the indexer's keys, which flips DeepSeek-V3.2's top-16 where two keys' scores lie
# within 1e-4 (2 of the 128 positions: Δlogit 0.36 there, mean KL 6e-5); with F32 caches it computes smoe's logits to
# 1e-6, the indexer's choice included. HY-V4's indexer likewise (keeping 16; with the F16 cache max |Δlogit| 0.86,
# mean KL 2.9e-4); Dots3-Note's too (keeping 16 from 8 heads: its Q4 export with the F16 cache mean KL 3.0e-3, top-1
# 95.3%, with F32 caches 2.5e-5 and 98.4%); DeepSeek-V4's keys (with the F16 cache its decoded logits differ by 7.9e-4 of
# their largest, mean KL 6.3e-8; with F32 caches, its first layer hash-routed, 8.6e-7, 1.1e-13); GLM-5.3's pooled keys and
# latents (with the F16 cache max |Δlogit| 0.14, mean KL 1.8e-5; with F32 caches 3.3e-6 of their largest, 1.1e-12)
F32_CACHE = {"tiny-deepseek_v32", "tiny-glm_moe_dsa", "tiny-hy_v4", "tiny-dots3_note", "tiny-deepseek_v4",
             "tiny-glm5_next"}
# llama.cpp's minimax-m3 attends block-sparsely only with flash attention (without it, to every key)
FLASH_ATTENTION = {"minimax_m3_vl"}


# the families only written (smoe.export.gguf_families), on tiny models at their fullest (tests/export_models.py)
WRITTEN_ONLY = ["glm4_moe", "gpt_oss", "olmoe", "qwen2_moe", "minimax_m2", "dots1", "granitemoe", "granitemoeshared",
                "hunyuan_v1_moe", "ernie4_5_moe", "exaone_moe", "afmoe", "llama4_text", "lfm2_moe", "qwen3_next",
                "granitemoehybrid", "jamba", "solar_open", "sarvam_moe", "sarvam_mla", "glm4_moe_lite", "mistral4",
                "mellum", "hy_v3", "dbrx", "qwen3_5_moe_text", "gemma4_text", "deepseek_v32", "nemotron_h", "minimax",
                "qwen3_vl_moe", "glm4v_moe", "kimi_linear", "granitemoe_swa", "qwen3_5_moe", "gemma4", "cohere2_moe",
                "mimo_v2_flash", "glm_moe_dsa", "laguna", "step3p7", "hy_v4", "minimax_m3_vl",
                "dots3_note", "deepseek_v4", "glm5_next"]
# the families written last, each on a tiny model at its fullest where llama.cpp computes it, its norms drawn around 1
# so that attention scores and router logits are of unit scale: Mellum's sliding layer narrower than the prompt, at
# the full layers' rotary base (llama.cpp's mellum rotates both kinds alike); HY-V3's dense layer between MoE ones;
# DBRX's experts as wide as a Q4_1 block and a q/k/v clamp that bites; Qwen3.5's heads wide enough for the default M-RoPE
# sections (ggml asserts they span at most a head), two value heads per key head (which the export tiles); Gemma 4's
# full layer wider than its sliding one, with one key/value head whose keys are its values, and a final softcap that bites;
# DeepSeek-V3.2's indexer keeping 16 of the prompt's positions (its default 2048 keeps them all), its heads as wide as
# llama.cpp's smallest Hadamard rotation, 8 of them so that few keys score an exact 0 (ReLU ties); Nemotron-H's Mamba2
# in two groups (its gated norm per group), 8 experts in 4 groups of which 2 are used, a routed scale; MiniMax's
# lightning layers on either side of a softmax one (each its own decay rate), blocks of 16 (transformers' chunked
# form, one block in llama.cpp), its residual factors away from 1, rms_norm_eps 1e-5 as released; the multimodal
# checkpoints' text models (Qwen3-VL's heads wide enough for its default M-RoPE sections, GLM-4.5V's correction bias
# drawn, Gemma 4's as gemma4_text's); Kimi-Linear's experts in 2 groups of which 1 is used, rms_norm_eps 1e-5 (its
# graph's delta-attention L2-norm eps, where transformers fixes 1e-6); Granite-MoE-SWA's sliding layers narrower than
# the prompt, one without rotary, grouped key/value heads, a shared MLP and multipliers away from 1; Cohere2-MoE's
# leading dense layer (full, rotated) of its own width, sliding layers narrower than the prompt and a full one without
# rotary, a shared expert averaged in, sigmoid scores normalised (the release's) and a logit scale away from 1;
# MiMo-V2-Flash's leading dense layer, sliding layers narrower than the prompt (their own rotary base, twice the
# key/value heads, sink logits) between full ones, values narrower than the heads and scaled, its correction bias drawn,
# heads wide enough that the rotary part (0.334 of each) is a whole number of pairs; GLM-5's (glm_moe_dsa) indexer on
# two layers each followed by one that reuses its choice, keeping 64 of the prompt's positions, its heads as
# DeepSeek-V3.2's above, its leading dense layer, 8 experts in 4 groups of which 2 are used, its correction bias drawn
# (keeping 16, llama.cpp's Q8_1 rounding of the activations flips the indexer's choice at a few positions of this
# random model: Q2 mean KL 5.4e-3, top-1 92.2%; with F32 trunk and decoded experts it is smoe's choice, mean KL 1e-10);
# Laguna's leading dense layer, sliding layers narrower than the prompt between full ones, each type's rotary part
# (half of each head on the full layers) and base, query heads per layer, a shared expert wider than the routed ones,
# a routed scale, its correction bias drawn (a parameter), one softplus gate per head (per channel in its own test);
# Step-3.7's text model, its (1 + w) norms drawn around 0: a leading dense layer, sliding layers narrower than the
# prompt with twice the query heads between full ones, half of each head turned on the full layers and all of it on
# the sliding ones at another base, a shared expert wider than the routed ones, 8 experts, a routed scale, its
# correction bias drawn, the SwiGLU clamped where it bites (experts and shared or dense MLPs, unclamped on one layer
# each); HY-V4's leading dense layer, its indexer on two layers each followed by one that reuses its choice, keeping 16
# of the prompt's positions from 8 heads wider than the rotary part, 8 experts, its correction bias drawn, the experts'
# SwiGLU clamped where it bites, the hyper-connections' eps and magnitude away from their defaults and their scales
# drawn around 1 (so that each stream's gate follows its input), rms_norm_eps 1e-5 as released; MiniMax-M3's text
# model, its (1 + w) norms drawn around 0: a leading dense layer wider than the experts, block-sparse layers keeping 2
# blocks of 16 keys (the local one among them) for each of its 2 key/value heads, half of each head turned, 8 experts,
# its correction bias drawn; Dots3-Note's text model: a leading dense layer, two indexed layers keeping 16 of the
# prompt's positions from 8 heads (with 4, keys the ReLU leaves at 0 tie at the 16th place, which torch and ggml break
# apart), two sliding layers of twice the heads, their own latent rank and head widths, narrower than the prompt, each
# layer type at its own rotary base, 8 experts, a routed scale, its correction bias drawn; DeepSeek-V4: a sliding layer, a
# sparse one (compressing by 4, its indexer keeping 8 of the prompt's 32 compressed keys from 8 heads as wide as llama.cpp's
# smallest Hadamard rotation) and a heavily compressed one (by 128), a quarter of each head turned at each kind's base,
# output groups of two heads, 8 experts, its correction bias drawn, the SwiGLU clamped where it bites, the
# hyper-connections' eps away from its default and their scales drawn around 1, the first layer hash-routed (its
# token-id table drawn, each token's experts distinct: draw_hash_tables); GLM-5.3's text model: delta-attention layers on
# either side of two MLA ones, the first running its indexer and the second reusing its choice, which keeps 4 pools of 4
# of the prompt's keys (and the incomplete last pool) from 8 heads, a leading dense layer, 8 experts, a routed scale, its
# correction bias drawn, every MLP's SwiGLU clamped where it bites, the hyper-connections' eps away from its default and
# their scales drawn around 1
STEP3P7_LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
ALSO_CONFIGS = {"mellum": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                               rope_parameters={t: {"rope_type": "default", "rope_theta": 1e4}
                                                for t in ("full_attention", "sliding_attention")}),
                "hy_v3": dict(num_hidden_layers=3, mlp_layer_types=["sparse", "dense", "sparse"]),
                "dbrx": dict(ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32},
                             attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 0.5}),
                "qwen3_5_moe_text": dict(head_dim=64),
                "gemma4_text": dict(global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                                    final_logit_softcapping=5.0),
                "deepseek_v32": dict(index_topk=16, index_head_dim=64, index_n_heads=8),
                "nemotron_h": dict(n_groups=2, n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5),
                "minimax": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                                  "linear_attention"],
                                **{f"{t}_alpha_factor": 3.5 for t in ("linear_attn", "full_attn", "mlp")}),
                "qwen3_vl_moe": dict(head_dim=64), "glm4v_moe": {}, "qwen3_5_moe": dict(head_dim=64),
                "gemma4": {k: v for k, v in TINY_CONFIGS["gemma4_text"].items() if k != "moe_intermediate_size"}
                | dict(global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1,
                       final_logit_softcapping=5.0),
                "kimi_linear": dict(num_expert_group=2, topk_group=1),
                "granitemoe_swa": dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention",
                                                                         "sliding_attention"],
                                       layer_rope_theta=[1e4, 1e4, 0.0], sliding_window=16, num_key_value_heads=2,
                                       shared_intermediate_size=32, embedding_multiplier=2.0, logits_scaling=3.0,
                                       residual_multiplier=0.5, attention_multiplier=0.2),
                "cohere2_moe": dict(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention",
                                                                      "sliding_attention", "full_attention"],
                                    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=16,
                                    prefix_dense_intermediate_size=64, num_shared_experts=1,
                                    expert_selection_fn="sigmoid", logit_scale=4.0),
                "mimo_v2_flash": dict(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention",
                                                                        "sliding_attention", "full_attention"],
                                      mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=16,
                                      head_dim=48, v_head_dim=32, n_routed_experts=8),
                "glm_moe_dsa": dict(num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                    layer_types=["indexed_attention"] * 4, indexer_types=["full", "shared"] * 2,
                                    index_topk=64, index_head_dim=64, index_n_heads=8, n_routed_experts=8, n_group=4,
                                    topk_group=2),
                "laguna": dict(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention",
                                                                 "sliding_attention", "full_attention"],
                               mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=16,
                               num_attention_heads_per_layer=[4, 8, 8, 4], num_experts=8,
                               shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5),
                "step3p7": dict(num_hidden_layers=4, layer_types=STEP3P7_LAYERS, sliding_window=16,
                                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_sliding_attention_heads=8,
                                n_routed_experts=8, share_expert_dim=64, moe_router_scaling_factor=2.5,
                                query_pre_attn_scalar=16, swiglu_limits=[0.0, 0.3, None, 0.3],
                                swiglu_limits_shared=[0.3, 0.0, 0.3, 0.3],
                                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                    "partial_rotary_factor": 0.5},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e3,
                                                                       "partial_rotary_factor": 1.0}}),
                "hy_v4": dict(num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                              layer_types=["indexed_attention"] * 4, indexer_types=["full", "shared"] * 2,
                              index_topk=16, index_head_dim=32, index_n_heads=8, n_routed_experts=8, swiglu_limit=0.5,
                              hc_eps=0.05, hc_magnitude=1.5),
                "minimax_m3_vl": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=2, index_n_heads=2,
                                      index_head_dim=32, index_block_size=16, index_topk_blocks=2, index_local_blocks=1,
                                      layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3,
                                      mlp_layer_types=["dense"] + ["sparse"] * 3, intermediate_size=32,
                                      shared_intermediate_size=32, dense_intermediate_size=64, num_local_experts=8,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "partial_rotary_factor": 0.5}),
                "dots3_note": dict(num_hidden_layers=4, layer_types=["indexed_attention"] * 2 + ["sliding_attention"] * 2,
                                   mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_routed_experts=8,
                                   routed_scaling_factor=2.5, sliding_window=16, index_topk=16, index_head_dim=64,
                                   index_n_heads=8, shared_experts_intermediate_size=32,
                                   per_layer_config={i: dict(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32,
                                                             qk_nope_head_dim=24, v_head_dim=24, head_dim=32)
                                                     for i in (2, 3)}),
                "deepseek_v4": dict(layer_types=["sliding_attention", "compressed_sparse_attention",
                                                 "heavily_compressed_attention"],
                                    mlp_layer_types=["hash_moe", "moe", "moe"],
                                    sliding_window=16, index_topk=8, index_head_dim=64, index_n_heads=8, o_groups=2,
                                    head_dim=32, n_routed_experts=8, swiglu_limit=0.5, hc_eps=0.05,
                                    rope_parameters={t: {"rope_type": "default", "rope_theta": theta,
                                                         "partial_rotary_factor": 0.25}
                                                     for t, theta in (("main", 1e4), ("compress", 1.6e5))}),
                "glm5_next": dict(num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention",
                                                                    "indexed_attention", "linear_attention"],
                                  mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                                  indexer_types=["full", "full", "shared", "full"], index_topk=16, index_kpool=4,
                                  index_head_dim=32, index_n_heads=8, n_routed_experts=8, swiglu_limit=0.5,
                                  hc_eps=0.05)}
# multimodal checkpoints, whose vault holds the text model beside the vision tower: ALSO_CONFIGS holds their text
# model's values
MULTIMODAL = {"qwen3_vl_moe", "glm4v_moe", "qwen3_5_moe", "gemma4", "step3p7", "minimax_m3_vl", "dots3_note",
              "glm5_next"}
OFFSET_NORMS = {"step3p7", "minimax_m3_vl"}  # RMSNorms scaled by 1 + w
BIASED_BUFFERS = {"glm4v_moe", "kimi_linear", "mimo_v2_flash", "glm_moe_dsa", "step3p7", "hy_v4", "minimax_m3_vl",
                  "dots3_note", "deepseek_v4", "glm5_next"}
# drawn around 1, as norms are
UNIT_PARAMETERS = {"hy_v4": ("hc.scale", "hc_scale"), "deepseek_v4": ("hc.scale", "hc_scale"), "glm5_next": ("hc.scale",)}


def tiny_vault(tmp: Path, family: str, bits: int) -> Path:
    """exportable_vault's vault of `family`, or ALSO_CONFIGS' model with unit-scale norms for the families there."""
    if family not in ALSO_CONFIGS:
        return exportable_vault(tmp, family, bits)
    torch.manual_seed(0)
    if family in MULTIMODAL:
        model = multimodal_model(family, ALSO_CONFIGS[family])
    else:
        model = causal_lm(family, exportable_config(family, architecture=ALSO_CONFIGS[family]))
    # q_norm, input_layernorm, DBRX's norm_1 and norm_f; around 0 where the norm scales by 1 + w
    draw_around_unit_scale(model, family in OFFSET_NORMS, UNIT_PARAMETERS.get(family, ()),
                           bias_buffers=family in BIASED_BUFFERS)
    model_dir, vault = tmp / f"{family}-model", tmp / f"{family}-q{bits}"
    model.save_pretrained(model_dir)
    save_byte_level_tokenizer(model_dir)
    sculpt(model_dir, vault, bits=bits, progress=False)
    return vault


def decoded_agreement(vault, tmp_path, label: str, **options) -> dict:
    """llama.cpp's logits on the vault's GGUF with an F32 trunk and F32 decoded experts (`options` for load) against
    smoe's, printed under `label`."""
    llm = load(export(vault, "gguf", tmp_path / "model.gguf", trunk_type="f32", decoded_experts=True), **options)
    ids = prompt_ids(vault)
    llm.eval(ids)
    a = agreement(smoe_logits(vault, ids), np.array(llm.scores[: len(ids)], dtype=np.float32))
    print("\n" + figures_line(f"{label}, F32 trunk and decoded experts", a))
    return a


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "tiny-deepseek_v3", "tiny-deepseek_v2",
                                    *(f"tiny-{f}" for f in WRITTEN_ONLY)])
def test_llama_cpp_graph_reproduces_smoe_when_weights_are_decoded(tmp_path_factory, tmp_path, family):
    """With F32 trunk and F32 decoded experts llama.cpp computes what smoe computes (up to summation
    order, which can still flip a near-tie of the router, or of the best two logits, at a rare position):
    the metadata, tensor names and q/k layout are right, and the gap above is Q4_1/BF16 arithmetic alone.
    The tiny DeepSeeks add what the shared one lacks: group-limited sigmoid routing with q_lora (V3), YaRN
    and softmax (V2); the other tiny models are the families only written: GLM-4.5's partial rotary and
    groups, gpt-oss's sinks, biases, sliding layers and YaRN, and the rest."""
    if family.startswith("tiny-"):
        vault = tiny_vault(tmp_path, family.removeprefix("tiny-"), 4)
    else:
        vault = integration_vault(tmp_path_factory, family, 4)
    a = decoded_agreement(vault, tmp_path, f"llama.cpp {family} Q4", f32_cache=family in F32_CACHE,
                          flash_attn=family.removeprefix("tiny-") in FLASH_ATTENTION)
    assert a["median_pos_max_abs"] < 1e-3 * a["ref_max_abs"]
    assert a["mean_kl"] < DECODED_MEAN_KL.get(family, 1e-5) and a["top1_clear"] == 1.0


def test_llama_cpp_laguna_gate_per_element_reproduces_smoe_when_weights_are_decoded(tmp_path, monkeypatch):
    """Laguna's other gate width: one softplus gate per channel of each head instead of one per head."""
    monkeypatch.setitem(ALSO_CONFIGS, "laguna", ALSO_CONFIGS["laguna"] | dict(gating="per-element"))
    vault = tiny_vault(tmp_path, "laguna", 4)
    a = decoded_agreement(vault, tmp_path, "llama.cpp tiny-laguna per-element gate")
    assert a["median_pos_max_abs"] < 1e-3 * a["ref_max_abs"]
    assert a["mean_kl"] < 1e-5 and a["top1_clear"] == 1.0


def test_llama_cpp_glm5_next_softplus_gate_reproduces_smoe_when_weights_are_decoded(tmp_path, monkeypatch):
    """GLM-5.3's other forget gate: without linear_lower_bound, -exp(A_log) times the softplus of the gate (llama.cpp's
    graph when the file has no kda.gate_lower_bound)."""
    monkeypatch.setitem(ALSO_CONFIGS, "glm5_next", ALSO_CONFIGS["glm5_next"] | dict(linear_lower_bound=None))
    vault = tiny_vault(tmp_path, "glm5_next", 4)
    a = decoded_agreement(vault, tmp_path, "llama.cpp tiny-glm5_next softplus gate", f32_cache=True)
    assert a["median_pos_max_abs"] < 1e-3 * a["ref_max_abs"]
    assert a["mean_kl"] < 1e-5 and a["top1_clear"] == 1.0


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("family", WRITTEN_ONLY)
def test_llama_cpp_logits_follow_smoe_for_the_families_only_written(tmp_path, family, bits):
    """Q4_1 experts and the vault's F32 trunk, on the tiny models: the same bounds as the shared models'."""
    vault = tiny_vault(tmp_path, family, bits)
    llm = load(export(vault, "gguf", tmp_path / "model.gguf"), flash_attn=family in FLASH_ATTENTION)
    ids = prompt_ids(vault)
    llm.eval(ids)
    a = agreement(smoe_logits(vault, ids), np.array(llm.scores[: len(ids)], dtype=np.float32))
    print("\n" + figures_line(f"llama.cpp tiny {family} Q{bits}", a))
    assert a["mean_kl"] < MEAN_KL and a["top1"] >= TOP1


@pytest.mark.parametrize("name", [".", "model.safetensors", "experts.bin"])
def test_llama_cpp_refuses_a_vault_and_its_files(tmp_path_factory, name):
    """llama.cpp reads GGUF files only: a vault directory or a file in it fails to load, never runs."""
    vault = integration_vault(tmp_path_factory, "qwen3_moe", 4)
    with pytest.raises(ValueError, match="Failed to load model from file"):
        load(vault / name)


def test_llama_cpp_runs_token_ids_of_a_gguf_written_without_a_vocabulary(tmp_path):
    """What `smoe bench decode --llama-bench` writes for a random-weight model: tokenizer model "none" and the
    vocabulary size; llama.cpp loads it and its logits follow smoe's like the full file's."""
    vault = exportable_vault(tmp_path, "deepseek_v3", 4)
    source = ExportSource(vault)
    try:
        write_gguf(source, tmp_path / "ids.gguf", trunk_type="f32", decoded_experts=True, tokenizer=False)
    finally:
        source.close()
    llm = load(tmp_path / "ids.gguf")
    ids = prompt_ids(vault)
    llm.eval(ids)
    a = agreement(smoe_logits(vault, ids), np.array(llm.scores[: len(ids)], dtype=np.float32))
    assert llm.n_vocab() == json.loads((vault / "config.json").read_text())["vocab_size"]
    assert a["mean_kl"] < 1e-5 and a["top1"] == 1.0
