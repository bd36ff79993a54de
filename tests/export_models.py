"""Tiny models the GGUF and MLX exports can hold: every layer MoE (DeepSeek: after its dense first layer), rows
that Q4_1 / MLX groups fit, and a byte-level BPE tokenizer (what llama.cpp's "gpt2" tokenizer reads)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.testing.tiny_models import TOKENIZER_TEXT, tiny_config, tiny_default_config

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SHARED_MODELS = {"qwen3_moe": SHARED / "models" / "qwen3-moe-28m", "mixtral": SHARED / "models" / "mixtral-28m-b",
                 "deepseek_v3": SHARED / "models" / "deepseek-v3-30m"}
# Each family at its fullest where llama.cpp computes it: DeepSeek-V3's sigmoid with correction bias, 4 groups of
# which 2 are used, q_lora; V2 softmax without groups and YaRN, as V2-Lite; GLM-4.5 with attention biases, q/k norms,
# a routed scale and groups; as many key/value heads as heads and every layer MoE where llama.cpp needs it (gpt-oss's
# tiny config is as released: biases everywhere, sinks, alternate sliding layers, YaRN)
FULLEST = {
    "qwen3_moe": dict(decoder_sparse_step=1, norm_topk_prob=True),
    "qwen2_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek_v3": dict(n_routed_experts=8, n_group=4, topk_group=2, q_lora_rank=32),
    "deepseek_v2": dict(n_routed_experts=8, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "glm4_moe": dict(n_routed_experts=8, n_group=4, topk_group=2, attention_bias=True, use_qk_norm=True,
                     routed_scaling_factor=2.5),
    "dots1": dict(n_routed_experts=8, routed_scaling_factor=2.5, norm_topk_prob=True, num_key_value_heads=4),
    "olmoe": dict(num_key_value_heads=4),
    # Granite's four multipliers away from 1 (attention's away from 1/sqrt(head_dim)) and attention biases;
    # HunYuan's NTK-alpha RoPE as released; two ERNIE shared experts; EXAONE-MoE and AFMoE with a full, rotary-free
    # fourth layer beside sliding ones (their tiny configs' layer lists are built for 3 layers: given here)
    **{f: dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=8.0,
               attention_bias=True) for f in ("granitemoe", "granitemoeshared")},
    "hunyuan_v1_moe": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 100.0,
                                            "factor": 1.0}),
    "ernie4_5_moe": dict(moe_num_shared_experts=2),
    "exaone_moe": dict(num_hidden_layers=4, sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                       mlp_layer_types=["dense"] + ["sparse"] * 3, num_experts=8, n_group=4, topk_group=2),
    "afmoe": dict(num_hidden_layers=4, global_attn_every_n_layers=4, mup_enabled=True, route_scale=2.0,
                  layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    # Llama 4's text model (GGUF; MLX writes the multimodal "llama4") at llama.cpp's fixed chunk of 8192
    "llama4_text": dict(attention_chunk_size=8192),
    # Jamba's every pairing: Mamba with a dense MLP (layer 0) and with experts (1, 3), attention with a dense MLP (2);
    # a time-step rank of 4, what "auto" (ceil(hidden / 16)) makes of the hidden size 64
    # the families transformers runs with GLM-4.5's or DeepSeek-V3's modules (transformers' defaults shrunk): groups,
    # a routed scale, q_lora and attention biases where they have them
    "solar_open": dict(n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5, attention_bias=True),
    "sarvam_moe": dict(n_routed_experts=8, n_group=4, topk_group=2, attention_bias=True),
    "sarvam_mla": dict(n_routed_experts=8, n_group=4, topk_group=2, q_lora_rank=32),
    "glm4_moe_lite": dict(n_routed_experts=8, n_group=4, topk_group=2),
    # Mistral 4's query temperature stepping every 16 positions, so that the prompt sees it grow
    "mistral4": dict(n_routed_experts=8, n_group=4, topk_group=2, q_lora_rank=32, first_k_dense_replace=1,
                     routed_scaling_factor=2.0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                      "original_max_position_embeddings": 16}),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, mamba_dt_rank=4),
}
# config values that change the model's tensors for the GGUF tests (exportable_vault): LFM2-MoE's tied embeddings,
# as released (llama.cpp's lfm2moe reads no lm_head; the MLX tests keep its untied default for their refusal);
# Granite-hybrid with attention biases, its Mamba in two groups (its gated norm per group) and its four multipliers
# away from 1
GGUF_ARCHITECTURE = {"lfm2_moe": dict(tie_word_embeddings=True),
                     "granitemoehybrid": dict(attention_bias=True, mamba_n_groups=2, embedding_multiplier=0.5,
                                              attention_multiplier=0.0625, residual_multiplier=2.0, logits_scaling=0.25),
                     # DeepSeek-V4 with a hash-routed first layer, its output groups of whole heads and its indexer's
                     # heads as wide as llama.cpp's smallest Hadamard rotation (each refused otherwise)
                     "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe", "moe"], o_groups=2, index_head_dim=64)}
VOCAB = 300  # 256 byte symbols + merges + one special token


def exportable_config(family: str, expert_width: int = 32, architecture: dict | None = None):
    """The family's tiny config, or transformers' default config shrunk where smoe has no tiny model of it."""
    try:  # a family smoe has a tiny model of (llama4 and the other multimodal ones: of their text model)
        config = tiny_config(family, **(architecture or {}))
    except SmoeError:
        config = tiny_default_config(family)
        for key, value in (architecture or {}).items():
            setattr(config, key, value)
    config.vocab_size = VOCAB
    # the experts' width: moe_intermediate_size where the family has one, else intermediate_size
    setattr(config, "moe_intermediate_size" if hasattr(config, "moe_intermediate_size") else "intermediate_size",
            expert_width)
    for key, value in FULLEST.get(family, {}).items():
        setattr(config, key, value)
    config.bos_token_id = config.eos_token_id = 0
    return config


# families whose RMSNorm weights are drawn around 1 rather than 0: attention scores and router logits of unit scale,
# so that rotary, the query temperature and the router's gating function each move the logits
UNIT_NORMS = {"jamba", "solar_open", "sarvam_moe", "sarvam_mla", "glm4_moe_lite", "mistral4"}
# families whose causal LM transformers' auto classes do not map
CAUSAL_LM = {"mistral4": "Mistral4ForCausalLM"}


def causal_lm(family: str, config):
    import transformers

    if family in CAUSAL_LM:
        return getattr(transformers, CAUSAL_LM[family])(config).float()
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_exportable_model(family: str, out_dir: Path, expert_width: int = 32, seed: int = 0, pre: str = "gpt-2",
                          architecture: dict | None = None) -> Path:
    """A random model of `family` whose experts are `expert_width` wide (32: fits Q4_1 and MLX groups)."""
    torch.manual_seed(seed)
    model = causal_lm(family, exportable_config(family, expert_width, architecture))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            if family in UNIT_NORMS and name.endswith("norm.weight"):
                param.add_(1.0)
        draw_hash_tables(model, generator)
    model.save_pretrained(out_dir)
    save_byte_level_tokenizer(out_dir, pre)
    return out_dir


# Qwen2/Qwen3's split pattern (their tokenizer.json), applied before the byte-level mapping
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")


def save_byte_level_tokenizer(out_dir: Path, pre: str = "gpt-2") -> None:
    """A byte-level BPE trained on a short text; `pre`: GPT-2's own regex, or Qwen2's split pattern."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>").save_pretrained(out_dir)


def exportable_vault(tmp: Path, family: str, bits: int = 4, expert_width: int = 32, pre: str = "gpt-2") -> Path:
    model = save_exportable_model(family, tmp / f"{family}-model-{expert_width}-{pre}", expert_width, pre=pre,
                                  architecture=GGUF_ARCHITECTURE.get(family))
    vault = tmp / f"{family}-q{bits}-{expert_width}-{pre}"
    sculpt(model, vault, bits=bits, progress=False)
    return vault


# --- integration: the shared trained models when present, else tiny ones ----------------------


def integration_vault(tmp_path_factory, family: str, bits: int) -> Path:
    """A vault of the shared trained `family` model (sculpted once per test session), or of a tiny
    exportable model when ../shared is absent (the reason is printed)."""
    root = tmp_path_factory.getbasetemp() / "export-vaults"
    vault = root / f"{family}-q{bits}"
    if vault.exists():
        return vault
    root.mkdir(parents=True, exist_ok=True)
    model = SHARED_MODELS[family]
    if not model.exists():
        print(f"{model} is absent: using a tiny random {family} model instead")
        model = root / f"{family}-tiny-model"
        if not model.exists():
            save_exportable_model(family, model)
    sculpt(model, vault, bits=bits, progress=False)
    return vault


# A passage of a public-domain novel (the shared corpus's validation text from character 20,000): the same prompt
# whether or not ../shared is present, so that every check sees the same tokens in every checkout. The tiny random
# models' routers and indexers sit near ties, and which positions flip depends on the text: on a seeded shuffle of the
# tiny tokenizer's words instead, a single flip (tiny DeepSeek-V4's at position 101, GLM-5.3's at 109)
# moved the decoded exports' mean KL past 1e-5, and Q4's top-1 fell where the best two logits lead by under 0.01
PROSE = Path(__file__).resolve().parent / "fixtures" / "prose.txt"


def prompt_ids(vault: Path, tokens: int = 128) -> list[int]:
    """The first `tokens` ids of PROSE in the vault's tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(vault)(PROSE.read_text(encoding="utf-8"))["input_ids"]
    assert len(ids) >= tokens, f"{PROSE} holds {len(ids)} tokens, fewer than the {tokens} asked for"
    return ids[:tokens]


def smoe_logits(vault: Path, ids: list[int]):
    """fp32 logits [T, V] of the streaming runtime."""
    from smoe.runtime.model import OpenedVault

    sm = OpenedVault(vault, dtype="float32")
    try:
        return sm.logits(torch.tensor([ids]))[0].numpy()
    finally:
        sm.close()


def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def agreement(ref, got) -> dict:
    """How closely logits `got` [T, V] follow `ref`: largest and typical |Δ|, KL(ref‖got), top-1."""
    diff = np.abs(ref - got)
    p, q = log_softmax(ref), log_softmax(got)
    kl = (np.exp(p) * (p - q)).sum(-1)
    best_two = np.sort(ref, axis=-1)[:, -2:]
    lead = best_two[:, 1] - best_two[:, 0]
    return {
        "positions": ref.shape[0],
        "ref_max_abs": float(np.abs(ref).max()),
        "max_abs": float(diff.max()),
        "max_rel": float(diff.max() / np.abs(ref).max()),
        "median_pos_max_abs": float(np.median(diff.max(-1))),  # the typical position, router near-ties aside
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1": float((ref.argmax(-1) == got.argmax(-1)).mean()),
        # top-1 where the reference's best logit leads its second by more than the position's largest |Δ|: a lead
        # that rounding alone cannot overturn
        "top1_clear": float((ref.argmax(-1) == got.argmax(-1))[lead > diff.max(-1)].mean()),
    }


def figures_line(what: str, a: dict) -> str:
    return (f"{what}: {a['positions']} positions, max |Δlogit| {a['max_abs']:.4f} (relative {a['max_rel']:.2e}), "
            f"median per-position max {a['median_pos_max_abs']:.4f}, mean KL {a['mean_kl']:.2e}, "
            f"max KL {a['max_kl']:.2e}, top-1 {100 * a['top1']:.1f}%")


def teacher_forced_agreement(vault: Path, prompt: list[int], generated: list[int]) -> float:
    """Share of another runtime's greedy tokens that smoe's own argmax picks at the same step, smoe
    reading that runtime's sequence (so one early near-tie does not cascade)."""
    logits = smoe_logits(vault, prompt + generated[:-1])
    picks = logits[len(prompt) - 1 :].argmax(-1)
    return float((picks == np.array(generated)).mean())


# mlx-lm's YaRN rounds its correction range (Hugging Face's truncate = true); gpt-oss as released does not round
# it and the MLX export refuses that, so the MLX tests take gpt-oss's config with the range rounded
# EXAONE's window narrower than the prompt, so that its sliding layers slide; Llama 4's norms at the eps mlx-lm's
# llama4 takes for its q/k norm
# Granite's four multipliers away from 1 and a time-step clamp that bites (the tiny Mamba's steps are near 0.69);
# Nemotron-H's routed scale and a time_step_min that bites (transformers clamps the prompt's steps there); Mellum's
# sliding layer narrower than the prompt beside a full one, each at its own rotary base; Mistral 4's YaRN
# (its attention scale grown by mscale_all_dim) beside the query temperature, head_dim as released (qk_nope + qk_rope:
# transformers' YaRN spans head_dim · partial_rotary_factor)
MLX_CHANGES = {"gpt_oss": {"rope_parameters": {"truncate": True}}, "exaone_moe": {"sliding_window": 16},
               "llama4": {"rms_norm_eps": 1e-6},
               "granitemoehybrid": {"embedding_multiplier": 12.0, "attention_multiplier": 0.0625,
                                    "residual_multiplier": 0.22, "logits_scaling": 8.0, "time_step_limit": [0.5, 0.8]},
               "nemotron_h": {"routed_scaling_factor": 2.5, "time_step_min": 0.6},
               "mellum": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
               "mistral4": {"head_dim": 24, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}}
# config values that change the model's tensors, set before it is built: Phi-3.5-MoE's released attention and
# lm_head biases (mlx-lm's phimoe always builds them; transformers' default is none); LFM2-MoE's tied embeddings;
# DBRX's experts as wide as MLX groups (its width is ffn_config's, which exportable_config does not set); Granite's
# attention biases; Nemotron-H's Mamba in two groups (its gated norm per group) and a dense MLP layer
MLX_ARCHITECTURE = {"phimoe": dict(attention_bias=True, lm_head_bias=True), "lfm2_moe": dict(tie_word_embeddings=True),
                    "dbrx": {"ffn_config.ffn_hidden_size": 32}, "granitemoehybrid": dict(attention_bias=True),
                    "nemotron_h": dict(n_groups=2, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                      "mlp", "moe"]),
                    "laguna": dict(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention",
                                                                     "sliding_attention", "full_attention"],
                                   mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=16,
                                   num_attention_heads_per_layer=[4, 8, 8, 4], num_experts=8,
                                   shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5)}


# seed 0's tiny Qwen3.5 routes one token on a near-tie (layer 1, position 51: its second and third experts' weights
# 8e-5 apart) that the fp16 rounding of s/h tips; with fp32 scales the export computes smoe's logits to 2e-6
MLX_SEEDS = {"qwen3_5_moe_text": 1}


def mlx_exportable_vault(tmp: Path, family: str, bits: int = 4) -> Path:
    """exportable_vault's model of `family`, its config changed by MLX_CHANGES (one level deep) before sculpting."""
    import json

    model = save_mlx_model(family, tmp / f"{family}-mlx-model-{bits}", seed=MLX_SEEDS.get(family, 0))
    path = model / "config.json"
    config = json.loads(path.read_text())
    for key, value in MLX_CHANGES.get(family, {}).items():
        config[key] = config[key] | value if isinstance(value, dict) else value
    path.write_text(json.dumps(config, indent=2))
    vault = tmp / f"{family}-mlx-q{bits}"
    sculpt(model, vault, bits=bits, progress=False)
    return vault


# families drawn otherwise for the MLX tests: norms around 1, so that attention scores are of unit scale and each layer
# type's rotary base moves the logits; a correction bias that is a buffer (left 0 by from_config), so that it moves
# the choice
MLX_UNIT_NORMS = {"mellum", "qwen3_vl_moe", "laguna"}
MLX_BIASED_BUFFERS = {"solar_open", "glm4_moe_lite"}


# multimodal checkpoints, the values over their text model's config (Qwen3-VL's heads wide enough for its default M-RoPE
# sections)
MLX_MULTIMODAL = {"qwen3_vl_moe": dict(head_dim=64), "qwen3_5_moe": {}}


def draw_around_unit_scale(model, offset_norms: bool = False, unit_names: tuple[str, ...] = (),
                           bias_buffers: bool = True) -> None:
    """Every parameter drawn as 0.1 N(0, 1), plus 1 for norms (unless they scale by 1 + w: offset_norms) and for the
    parameters whose names end with unit_names, so that attention scores and router logits are of unit scale; the
    correction bias buffers, which from_config leaves 0, drawn too where bias_buffers."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_unit = "norm" in name.split(".")[-2] and not offset_norms or bool(unit_names) and name.endswith(unit_names)
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + is_unit)
        for name, buffer in model.named_buffers():
            if bias_buffers and name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
        draw_hash_tables(model, generator)


def draw_hash_tables(model, generator: torch.Generator) -> None:
    """DeepSeek-V4's hash-routed layers' token-id tables (from_config leaves every token on expert 0, top_k times): each
    token's top_k experts drawn distinct, so that tokens go to different experts."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.get_submodule(name.rsplit(".", 1)[0]).weight.shape[0]
                buffer.copy_(torch.rand(buffer.shape[0], experts, generator=generator).argsort(-1)[:, :buffer.shape[1]])


def multimodal_model(family: str, text_values: dict | None = None):
    """transformers' default multimodal config of `family` shrunk, `text_values` (default: MLX_MULTIMODAL's) over its
    text model's config, whose experts are 32 wide."""
    from transformers import AutoModelForImageTextToText

    config = tiny_default_config(family)
    text = {k: v for k, v in config.text_config.to_dict().items() if k != "per_layer_config"}  # derived: remade
    values = MLX_MULTIMODAL[family] if text_values is None else text_values
    config.text_config = type(config.text_config)(**text | values | dict(vocab_size=VOCAB, moe_intermediate_size=32))
    return AutoModelForImageTextToText.from_config(config, dtype=torch.float32)


def save_mlx_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """save_exportable_model's model of `family` with MLX_ARCHITECTURE's values over its config (MLX_MULTIMODAL's
    model for a multimodal checkpoint), drawn as MLX_UNIT_NORMS and MLX_BIASED_BUFFERS say."""
    if family not in {*MLX_ARCHITECTURE, *MLX_UNIT_NORMS, *MLX_BIASED_BUFFERS, *MLX_MULTIMODAL}:
        return save_exportable_model(family, out_dir, seed=seed)
    torch.manual_seed(seed)
    if family in MLX_MULTIMODAL:
        model = multimodal_model(family)
    else:
        config = exportable_config(family)
        for key, value in MLX_ARCHITECTURE.get(family, {}).items():
            *path, last = key.split(".")  # a dotted key sets a sub-config's value
            setattr(functools.reduce(getattr, path, config), last, value)
        model = causal_lm(family, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            unit = family in UNIT_NORMS | MLX_UNIT_NORMS and name.endswith("norm.weight")
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + unit)
        for name, buffer in model.named_buffers():
            if family in MLX_BIASED_BUFFERS and name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    model.save_pretrained(out_dir)
    save_byte_level_tokenizer(out_dir)
    return out_dir
