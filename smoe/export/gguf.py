"""`smoe export VAULT --to gguf`: a GGUF file that llama.cpp loads, experts in Q4_1.

Q4_1 blocks hold 32 weights as w = q·d + m (4-bit q, fp16 d and m). An SMOE group of 64 is two
such blocks with d = s/h and m = −s, the same q (h = 7.5 at Q4; at Q2 h = 1.5 and q ∈ 0..3, a
subset of Q4_1's 16 levels). Q4_1 packs byte j of a block as weight j (low nibble) and weight
j + 16 (high nibble). Tensor names, metadata keys and layouts follow llama.cpp's own converter
(convert_hf_to_gguf.py) for the same architectures; the trunk keeps the vault's precision by default
(`--trunk-type` converts it), norms and routers in F32 as llama.cpp expects.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from smoe.errors import SmoeError
from smoe.export import gguf_families, gguf_mla
from smoe.export.source import HASH_TABLE, ExpertTensor, ExportSource, Planned, produce, require, scales_over
from smoe.format import codec
from smoe.format.dtypes import FLOAT_NAMES
from smoe.format.jsonfile import read_json
from smoe.source.description import describe_model
from smoe.source.gguf import ARCHITECTURES, EXPERT_TENSORS, Architecture, permute_rope, tensor_name_map

TRUNK_TYPES = ("bf16", "f16", "f32", "q8_0")
Q4_1_BLOCK = 32
QK_ROWS = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")


# tokenizer.json pre-tokenizer split patterns -> llama.cpp's `tokenizer.ggml.pre` names
SPLIT_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}


def write_gguf(source: ExportSource, path: Path, trunk_type: str | None = None, progress: bool = False,
               decoded_experts: bool = False, tokenizer: bool = True) -> None:
    """`trunk_type` (bf16, f16, f32, q8_0) converts the trunk's matrices; by default they keep the
    vault's dtype, which is exact. `decoded_experts` writes the experts' SMOE-decoded weights in F32
    instead of Q4_1 (4x larger; for checking llama.cpp's graph against smoe without Q4_1 arithmetic).
    `tokenizer=False` writes no vocabulary (tokenizer model "none"): llama.cpp then runs token ids only,
    which is what a benchmark of random weights needs."""
    arch = architecture(source)
    config = gguf_families.config_view(source.model_type, source.vault.config)
    check_config(source, config)
    if trunk_type is not None and trunk_type not in TRUNK_TYPES:
        raise SmoeError(f"unknown trunk type {trunk_type!r} ({', '.join(TRUNK_TYPES)})")
    writer = gguf.GGUFWriter(None, gguf_families.arch_name(source.model_type, arch))
    writer.add_name(source.dir.name)
    write_hyperparameters(writer, source, config, arch)
    if tokenizer:
        write_tokenizer(writer, source.dir, config["vocab_size"])
    else:
        writer.add_tokenizer_model("none")
    plan = trunk_plan(source, config, arch, trunk_type) + experts_plan(source, decoded_experts)
    for p in plan:
        writer.add_tensor_info(p.name, p.shape, np.uint8, p.nbytes, raw_dtype=p.dtype)
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, data in produce(plan, progress):
            writer.write_tensor_data(data)
    finally:
        writer.close()


EXPORTED = {**ARCHITECTURES, **gguf_mla.ARCHITECTURES, **gguf_families.ARCHITECTURES}


def architecture(source: ExportSource) -> Architecture:
    refused = gguf_families.REFUSED.get(source.model_type)
    require(refused is None, f"{source.model_type}: {refused}; not exported to GGUF")
    arch = EXPORTED.get(source.model_type)
    if arch is None:
        raise SmoeError(f"GGUF export supports {', '.join(EXPORTED)}; this vault is {source.model_type}")
    return arch


def check_config(source: ExportSource, config: dict) -> None:
    """What llama.cpp's graph for the architecture assumes and a config could contradict."""
    name = source.model_type
    layers = config["num_hidden_layers"]
    family = gguf_families.FAMILIES.get(name)
    require(not source.has_biases or (family and family.expert_biases),
            f"{name}: experts with biases are not exported to GGUF")
    if family:
        shapes = {key: source.trunk_shape(key) for key in source.trunk_names()}
        gguf_families.check(name, config, describe_model(config), source.meta["moe_layers"], shapes,
                            source.expert_shape(source.roles[0])[0])
        return
    if deepseek2_graph(name, architecture(source)):
        shapes = {key: source.trunk_shape(key) for key in source.trunk_names()}
        gguf_mla.check(name, config, describe_model(config), source.meta["moe_layers"], shapes,
                       source.expert_shape(source.roles[0])[0])
        require(not config.get("attention_bias"), f"{name}: attention biases are not exported to GGUF")
        return
    require(source.meta["moe_layers"] == list(range(layers)),
            f"{name}: llama.cpp needs every layer to be MoE; this model's MoE layers are {source.meta['moe_layers']}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    require(rope.get("rope_type", rope.get("type", "default")) == "default",
            f"{name}: RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not exported to GGUF")
    windowed = config.get("use_sliding_window", True) and config.get("sliding_window")  # qwen3 gates it by a flag
    require(not windowed, f"{name}: sliding-window attention is not exported to GGUF")
    require(not config.get("attention_bias"), f"{name}: attention biases are not exported to GGUF")
    if name == "qwen3_moe":
        require(config.get("norm_topk_prob", False), "qwen3_moe: llama.cpp renormalises the top-k router weights; "
                "this model has norm_topk_prob = false")


def deepseek2_graph(model_type: str, arch: Architecture) -> bool:
    """Whether smoe.export.gguf_mla writes the family (deepseek2's attention, metadata and tensors), not a row of
    smoe.export.gguf_families that names its tensors as one of those architectures (HY-V4's, as glm-dsa's)."""
    return arch.arch in gguf_mla.ARCHS and model_type not in gguf_families.FAMILIES


def rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    # Mellum names one per layer type: the full layers' is the base (Dots3-Note's indexed ones')
    # DeepSeek-V4's sliding layers turn at its "main" one
    rope = rope.get("full_attention") or rope.get("indexed_attention") or rope.get("main") or rope
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "dynamic" and rope.get("alpha"):
        # HunYuan's NTK-alpha: a fixed base (its rotary's own formula); every other family refuses "dynamic"
        dim = head_dim(config)
        theta *= rope["alpha"] ** (dim / (dim - 2))
    return theta


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def rotary_dim(config: dict) -> int:
    """The part of each head the rotary embedding turns (GLM-4.5: the first half; the full layers' part where the
    parameters are per layer type)."""
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention") or rope.get("main") or rope
    return int(head_dim(config) * rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))


def write_hyperparameters(writer, source: ExportSource, config: dict, arch: Architecture) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(gguf_families.head_count(source.model_type, config))
    if deepseek2_graph(source.model_type, arch):
        gguf_mla.write_attention(writer, config, describe_model(config))
        gguf_mla.write_moe(writer, describe_model(config), source.meta["moe_layers"], config["num_hidden_layers"])
    elif gguf_families.has_mla(source.model_type):  # Kimi-Linear's MLA layers beside its delta-attention ones
        desc = describe_model(config)
        gguf_mla.write_attention(writer, config, desc, gguf_families.kv_heads(source.model_type, config, desc))
    else:
        writer.add_head_count_kv(gguf_families.kv_heads(source.model_type, config, describe_model(config)))
        full = gguf_families.full_head_dim(source.model_type, config)  # Gemma 4's global heads (proportional RoPE)
        writer.add_key_length(full or head_dim(config))
        writer.add_value_length(full or gguf_families.value_width(source.model_type, config) or head_dim(config))
        writer.add_rope_dimension_count(full or gguf_families.rope_width(source.model_type, config)
                                        or rotary_dim(config))
    if source.model_type in gguf_families.FAMILIES:
        shapes = {key: source.trunk_shape(key) for key in source.trunk_names()}
        gguf_families.write(writer, source.model_type, config, describe_model(config), source.meta["moe_layers"], shapes)
    writer.add_rope_freq_base(rope_theta(config))
    if "layer_norm" not in describe_model(config).extras:  # DBRX's LayerNorm eps is its family's to write
        writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", config.get("norm_eps")))  # LFM2: norm_eps
    writer.add_vocab_size(config["vocab_size"])
    writer.add_expert_count(source.num_experts)
    writer.add_expert_used_count(source.meta["top_k"])
    expert_width = source.expert_shape(source.roles[0])[0]
    if arch.expert_width_key:
        writer.add_feed_forward_length(gguf_families.dense_width(source.model_type, config, expert_width,
                                                                 source.meta["moe_layers"]))
        writer.add_expert_feed_forward_length(expert_width)
    else:
        writer.add_feed_forward_length(expert_width)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)


# --- tokenizer -----------------------------------------------------------------------------------


def write_tokenizer(writer, directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (GPT-2 style) as llama.cpp's "gpt2" model, with its pre-tokenizer."""
    path = directory / "tokenizer.json"
    require(path.exists(), f"{directory}: no tokenizer.json (GGUF export writes the tokenizer into the file)")
    spec = read_json(path)
    model = spec.get("model", {})
    require(model.get("type") == "BPE" and not model.get("byte_fallback") and is_byte_level(spec.get("decoder")),
            f"{path}: GGUF export supports byte-level BPE tokenizers (GPT-2 style) only; this one is "
            f"{model.get('type')} with a {(spec.get('decoder') or {}).get('type')} decoder")
    tokens, types = token_list(spec, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer"), path))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=vocab_size)
    special.add_special_token.setdefault("bos", adds_bos(path))
    special.add_to_gguf(writer, quiet=True)


def is_byte_level(component) -> bool:
    if not component:
        return False
    parts = component.get("decoders") or component.get("pretokenizers") or [component]
    return any(p.get("type") == "ByteLevel" for p in parts)


def pre_tokenizer_name(pre, path: Path) -> str:
    """GPT-2's own regex (ByteLevel with use_regex), or a Split pattern llama.cpp knows by name."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    parts = (pre or {}).get("pretokenizers", [])
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(splits) == 1 and any(p.get("type") == "ByteLevel" and not p.get("use_regex", True) for p in parts):
        name = SPLIT_PATTERNS.get(splits[0].get("pattern", {}).get("Regex"))
        if name:
            return name
    raise SmoeError(f"{path}: pre-tokenizer not known to the GGUF export ({json.dumps(pre)[:200]})")


def token_list(spec: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens by id up to the model's vocabulary size (unused ids become [PADi]), with llama.cpp types."""
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id.update({i: t["content"] for i, t in added.items()})
    require(max(by_id) < vocab_size, f"tokenizer has id {max(by_id)}, the model's vocabulary is {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            kind = gguf.TokenType.NORMAL
            if i in added:
                kind = gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED
            types.append(kind)
    return tokens, types


def adds_bos(path: Path) -> bool:
    """Whether the tokenizer puts a token in front of the text by itself (llama.cpp must do the same)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    plain = tok.encode("a", add_special_tokens=False).ids
    return tok.encode("a", add_special_tokens=True).ids[: len(plain)] != plain


# --- tensors -------------------------------------------------------------------------------------


def ggml_type(name: str):
    return getattr(gguf.GGMLQuantizationType, name.upper())


def byte_shape(shape: tuple[int, ...], qtype) -> tuple[int, ...]:
    return gguf.quant_shape_to_byte_shape(shape, qtype)


def planned(name: str, shape: tuple[int, ...], qtype, load) -> Planned:
    raw = byte_shape(shape, qtype)
    return Planned(name, qtype, raw, int(np.prod(raw)), load)


def trunk_plan(source: ExportSource, config: dict, arch: Architecture, trunk_type: str) -> list[Planned]:
    names = tensor_name_map(arch, config["num_hidden_layers"])
    router = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP]
    plan = []
    for key in source.trunk_names():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by every runtime
        for name, shape, transform in trunk_pieces(source.model_type, key, source.trunk_shape(key), names, config, arch):
            is_router = any(name == router.format(bid=b) + ".weight" for b in range(config["num_hidden_layers"]))
            f32 = (len(shape) <= 1 or name.endswith(("_norm.weight", *gguf_families.F32_GGUF)) or is_router
                   or key.endswith(gguf_families.F32_TRUNK))
            if key.endswith(HASH_TABLE):
                qtype = ggml_type("i32")  # token ids to expert ids, as llama.cpp's converter writes them
            elif f32:
                qtype = ggml_type("f32")  # llama.cpp reads norms, biases and routers as F32
            elif trunk_type == "q8_0" and shape[-1] % 32:
                qtype = ggml_type("f16")  # as llama.cpp's converter does for rows Q8_0 cannot hold
            else:
                qtype = ggml_type(trunk_type or FLOAT_NAMES.get(source.trunk_dtype(key), "f32"))
            load = lambda key=key, qtype=qtype, transform=transform: tensor_bytes(transform(source.trunk_tensor(key)), qtype)
            plan.append(planned(name, shape, qtype, load))
    return plan


def trunk_pieces(model_type: str, key: str, shape: tuple[int, ...], names, config: dict,
                 arch: Architecture) -> list[gguf_mla.Piece]:
    """The GGUF tensors (name, shape, how to make it from the trunk tensor) one trunk tensor becomes."""
    deepseek2 = deepseek2_graph(model_type, arch)
    if deepseek2 and (split := gguf_mla.pieces(key, shape, config)) is not None:
        return split
    if not deepseek2 and (split := gguf_families.pieces(model_type, key, shape, config, names)) is not None:
        return split
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    require(name is not None, f"trunk tensor {key}: no llama.cpp name for it in {arch.arch.lower()}")
    if key.endswith(gguf_families.CONV_KERNELS) and len(shape) == 3:
        squeezed = (shape[0], shape[2])
        return [(name, squeezed, lambda t: t.reshape(squeezed))]
    if arch.permute_qk and key.endswith(QK_ROWS):  # a bias's rows move with its weight's (Granite's)
        heads = config["num_attention_heads"] if ".q_proj." in key else config["num_key_value_heads"]
        return [(name, shape, lambda t: permute_rope(t, heads))]
    return [(name, shape, lambda t: t)]


def tensor_bytes(t: torch.Tensor, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.I32:
        return t.to(torch.int32).contiguous().numpy().view(np.uint8).reshape(*t.shape[:-1], -1)
    if qtype == gguf.GGMLQuantizationType.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8).reshape(*t.shape[:-1], -1)
    data = gguf.quants.quantize(t.float().numpy(), qtype)
    return data.view(np.uint8).reshape(*t.shape[:-1], -1)


def experts_plan(source: ExportSource, decoded: bool = False) -> list[Planned]:
    plan = []
    for layer in source.meta["moe_layers"]:
        for role in source.roles:
            out, inp = source.expert_shape(role)
            # Q4_1 blocks run along rows: a row of a width that is not a multiple of 32 cannot hold
            # SMOE's groups, so such (toy-sized) tensors are written decoded, in F32.
            qtype = ggml_type("q4_1" if inp % Q4_1_BLOCK == 0 and not decoded else "f32")
            name = gguf.TENSOR_NAMES[EXPERT_TENSORS[role]].format(bid=layer) + ".weight"
            load = lambda layer=layer, role=role, qtype=qtype: np.stack(
                [expert_bytes(e, qtype) for e in source.experts(layer, role)])
            plan.append(planned(name, (source.num_experts, out, inp), qtype, load))
            if source.has_biases:  # [E, out] in F32, as llama.cpp reads every bias
                load = lambda layer=layer, role=role: torch.stack(source.expert_biases(layer, role)).float().numpy()
                plan.append(planned(name.removesuffix(".weight") + ".bias", (source.num_experts, out), ggml_type("f32"), load))
    return plan


def expert_bytes(expert: ExpertTensor, qtype) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.Q4_1:
        return q4_1_blocks(expert)
    return expert.decoded().view(np.uint8)


def q4_1_blocks(expert: ExpertTensor) -> np.ndarray:
    """[out, in] SMOE weights as Q4_1: uint8 [out, in/32 · 20], blocks of (d, m, 16 bytes of nibbles)."""
    out, inp = expert.shape
    blocks = out * inp // Q4_1_BLOCK
    q = expert.codes[: blocks * Q4_1_BLOCK].reshape(blocks, Q4_1_BLOCK)
    nibbles = q[:, :16] | (q[:, 16:] << 4)
    s = scales_over(expert, Q4_1_BLOCK).astype(np.float64)
    d = (s / codec.half_range(expert.bits)).astype(np.float16)
    m = (-s).astype(np.float16)
    packed = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), nibbles], axis=1)
    return packed.reshape(out, inp // Q4_1_BLOCK * 20)
