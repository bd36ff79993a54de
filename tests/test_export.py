"""`smoe export`: GGUF and MLX files read back with their own readers decode to the vault's weights."""

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from export_models import (
    GGUF_ARCHITECTURE,
    MLX_MULTIMODAL,
    exportable_config,
    exportable_vault,
    mlx_exportable_vault,
)
from safetensors import safe_open
from safetensors.torch import load_file

from smoe.export.mlx import shards
from smoe.export.source import Planned
from smoe.export.writer import export
from smoe.format.vault import TRUNK_FILE, Vault
from smoe.testing.vaults import tiny_model_dir, tiny_vault, vault_of

ROLES = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
MLX_ROLES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    """(family, bits) -> vault of a tiny exportable model; expert rows 64 (gate/up) and 32 (down) wide."""
    tmp = tmp_path_factory.mktemp("vaults")
    return {(f, b): exportable_vault(tmp, f, b) for f in ("qwen3_moe", "mixtral") for b in (4, 2)}


def smoe_cli(*args):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True)


def vault_experts(vault: Path, layer: int, role: str):
    """SMOE's own decode [E, out, in] and every weight's group scale s [E, out, in], from the vault."""
    with Vault(vault) as v:
        decoded, scales = [], []
        for e in range(v.meta["num_experts"]):
            t = next(t for t in v.read_expert(layer, e)[0] if t.role == role)
            decoded.append(t.decode())
            s = t.scales.float().repeat_interleave(64)[: t.shape[0] * t.shape[1]]
            scales.append(s.reshape(t.shape))
        return torch.stack(decoded).numpy(), torch.stack(scales).numpy(), v.meta


def assert_within_fp16_rounding_of_d(got: np.ndarray, want: np.ndarray, s: np.ndarray) -> None:
    """|q·fp16(s/h) − q·s/h| ≤ 2h · (s/h) · 2^-11 = s/1024 for every weight."""
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= s / 1024 + 1e-7 * s)


def gguf_tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def field(reader, key):
    return reader.fields[key].contents()


# --- GGUF ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,arch", [("qwen3_moe", "qwen3moe"), ("mixtral", "llama")])
def test_gguf_holds_the_tensors_and_metadata_llama_cpp_reads(vaults, tmp_path, family, arch):
    vault = vaults[(family, 4)]
    out = export(vault, "gguf", tmp_path / "m.gguf", trunk_type="bf16")
    reader = gguf.GGUFReader(out)
    config = json.loads((vault / "config.json").read_text())
    assert field(reader, "general.architecture") == arch
    assert field(reader, f"{arch}.block_count") == config["num_hidden_layers"]
    assert field(reader, f"{arch}.expert_count") == config["num_local_experts"]
    assert field(reader, f"{arch}.expert_used_count") == config["num_experts_per_tok"]
    assert field(reader, f"{arch}.embedding_length") == config["hidden_size"]
    tensors = gguf_tensors(out)
    per_block = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate_inp", *ROLES.values()}
    if family == "qwen3_moe":
        per_block |= {"attn_q_norm", "attn_k_norm"}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{b}.{n}.weight" for b in range(config["num_hidden_layers"]) for n in per_block}
    assert set(tensors) == expected
    Q = gguf.GGMLQuantizationType
    for name, t in tensors.items():
        if name.endswith(("_exps.weight",)):
            assert t.tensor_type == Q.Q4_1
        elif name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
            assert t.tensor_type == Q.F32
        else:
            assert t.tensor_type == Q.BF16
    hidden, experts = config["hidden_size"], config["num_local_experts"]
    # GGUF lists dimensions innermost first: [in, out, experts]
    assert list(tensors["blk.0.ffn_gate_exps.weight"].shape) == [hidden, 32, experts]
    assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [32, hidden, experts]


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gguf_q4_1_experts_decode_to_the_vault_weights(vaults, tmp_path, family, bits):
    vault = vaults[(family, bits)]
    tensors = gguf_tensors(export(vault, "gguf", tmp_path / "m.gguf"))
    with Vault(vault) as v:
        layers = v.meta["moe_layers"]
    for layer in layers:
        for role, name in ROLES.items():
            t = tensors[f"blk.{layer}.{name}.weight"]
            got = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.Q4_1)  # gguf's own Q4_1 decoder
            want, s, _ = vault_experts(vault, layer, role)
            assert_within_fp16_rounding_of_d(got, want, s)


def test_gguf_q4_1_blocks_are_smoe_codes_with_d_and_m_from_the_scale(vaults, tmp_path):
    """Block layout: fp16 d = s/7.5, fp16 m = −s, byte j = weight j (low nibble) | weight j+16 (high)."""
    vault = vaults[("qwen3_moe", 4)]
    block = gguf_tensors(export(vault, "gguf", tmp_path / "m.gguf"))["blk.0.ffn_gate_exps.weight"].data[0, 0, :20]
    with Vault(vault) as v:
        gate = v.read_expert(0, 0)[0][0]
    codes = gate.codes[0].numpy()
    q = np.stack([codes & 15, codes >> 4], axis=1).reshape(-1)[:32]  # SMOE: byte k = codes 2k, 2k+1
    s = np.float64(gate.scales[0].item())
    assert block[:2].view(np.float16)[0] == np.float16(s / 7.5)
    assert block[2:4].view(np.float16)[0] == np.float16(-s)
    assert np.array_equal(block[4:] & 15, q[:16]) and np.array_equal(block[4:] >> 4, q[16:])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gguf_trunk_is_the_vault_trunk(vaults, tmp_path, family):
    vault = vaults[(family, 4)]
    tensors = gguf_tensors(export(vault, "gguf", tmp_path / "m.gguf"))
    trunk = load_file(vault / TRUNK_FILE)  # float32 here: the export keeps it so
    value = lambda name: torch.from_numpy(tensors[name].data.copy())
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(value("token_embd.weight"), trunk["model.embed_tokens.weight"])
    assert torch.equal(value("output_norm.weight"), trunk["model.norm.weight"])
    q = value("blk.0.attn_q.weight")
    hf_q = trunk["model.layers.0.self_attn.q_proj.weight"]
    if family == "mixtral":  # llama.cpp's "llama" graph wants each head's rows as interleaved pairs
        heads = json.loads((vault / "config.json").read_text())["num_attention_heads"]
        q = q.reshape(heads, -1, 2, q.shape[1]).transpose(1, 2).reshape(hf_q.shape)
    assert torch.equal(q, hf_q)


@pytest.mark.parametrize("trunk_type,qtype", [("f16", "F16"), ("q8_0", "Q8_0"), ("bf16", "BF16")])
def test_gguf_trunk_type_sets_the_matrices_type(vaults, tmp_path, trunk_type, qtype):
    vault = vaults[("qwen3_moe", 4)]
    tensors = gguf_tensors(export(vault, "gguf", tmp_path / "m.gguf", trunk_type=trunk_type))
    embd = tensors["token_embd.weight"]
    assert embd.tensor_type == getattr(gguf.GGMLQuantizationType, qtype)
    want = load_file(vault / TRUNK_FILE)["model.embed_tokens.weight"].float().numpy()
    got = gguf.quants.dequantize(embd.data, embd.tensor_type).reshape(want.shape)
    rounding = {"F16": 2**-11, "BF16": 2**-8, "Q8_0": 1 / 254}[qtype]  # relative to the row's / value's magnitude
    assert np.abs(got - want).max() <= rounding * np.abs(want).max()


def test_gguf_tokenizer_is_the_vault_tokenizer(vaults, tmp_path):
    vault = vaults[("qwen3_moe", 4)]
    reader = gguf.GGUFReader(export(vault, "gguf", tmp_path / "m.gguf"))
    spec = json.loads((vault / "tokenizer.json").read_text())
    vocab = {i: t for t, i in spec["model"]["vocab"].items()}
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert field(reader, "tokenizer.ggml.tokens") == [vocab[i] for i in range(len(vocab))]
    assert len(field(reader, "tokenizer.ggml.merges")) == len(spec["model"]["merges"])
    assert field(reader, "tokenizer.ggml.eos_token_id") == 0
    assert field(reader, "tokenizer.ggml.add_bos_token") is False  # the HF tokenizer adds no BOS either


def test_gguf_names_the_qwen2_split_pattern_as_llama_cpp_does(tmp_path):
    vault = exportable_vault(tmp_path, "qwen3_moe", 4, pre="qwen2")
    assert field(gguf.GGUFReader(export(vault, "gguf", tmp_path / "m.gguf")), "tokenizer.ggml.pre") == "qwen2"


def test_gguf_rows_narrower_than_a_block_are_written_decoded(tmp_path):
    vault = exportable_vault(tmp_path, "mixtral", 4, expert_width=24)  # down rows 24 wide: no Q4_1 block fits
    tensors = gguf_tensors(export(vault, "gguf", tmp_path / "m.gguf"))
    down, gate = tensors["blk.0.ffn_down_exps.weight"], tensors["blk.0.ffn_gate_exps.weight"]
    assert down.tensor_type == gguf.GGMLQuantizationType.F32 and gate.tensor_type == gguf.GGMLQuantizationType.Q4_1
    want, _, _ = vault_experts(vault, 0, "down")
    assert np.array_equal(down.data, want)


# --- MLX -----------------------------------------------------------------------------------------


def mlx_decode(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """MLX affine: q LSB-first in uint32 words, w = scale·q + bias per group."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    q = ((weight[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*weight.shape[:-1], -1).astype(np.float32)
    group = q.shape[-1] // scales.shape[-1]
    expand = lambda a: np.repeat(a.astype(np.float32), group, axis=-1)
    return expand(scales) * q + expand(biases)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mlx_experts_decode_to_the_vault_weights(vaults, tmp_path, family, bits):
    vault = vaults[(family, bits)]
    out = export(vault, "mlx", tmp_path / "mlx")
    config = json.loads((out / "config.json").read_text())
    block = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    with safe_open(out / "model.safetensors", "numpy") as f:
        for layer in json.loads((vault / "index.json").read_text())["moe_layers"]:
            for role, proj in MLX_ROLES.items():
                module = f"model.layers.{layer}.{block}.switch_mlp.{proj}"
                want, s, _ = vault_experts(vault, layer, role)
                width = 64 if want.shape[-1] % 64 == 0 else 32  # down rows here are 32 wide: half groups
                assert config["quantization"][module] == {"group_size": width, "bits": bits, "mode": "affine"}
                weight, scales, biases = (f.get_tensor(f"{module}.{k}") for k in ("weight", "scales", "biases"))
                assert weight.dtype == np.uint32 and scales.dtype == np.float16 and biases.dtype == np.float16
                assert weight.shape == (want.shape[0], want.shape[1], want.shape[2] * bits // 32)
                assert scales.shape == biases.shape == (*want.shape[:2], want.shape[2] // width)
                assert_within_fp16_rounding_of_d(mlx_decode(weight, scales, biases, bits), want, s)


def test_mlx_trunk_and_files_are_what_mlx_lm_reads(vaults, tmp_path):
    vault = vaults[("mixtral", 4)]
    out = export(vault, "mlx", tmp_path / "mlx")
    trunk = load_file(vault / TRUNK_FILE)
    exported = load_file(out / "model.safetensors")  # torch reads the trunk's bf16 too
    for name, tensor in trunk.items():
        assert torch.equal(exported[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")], tensor)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(exported)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == json.loads((vault / "config.json").read_text())["rope_parameters"]["rope_theta"]
    assert (out / "tokenizer.json").read_bytes() == (vault / "tokenizer.json").read_bytes()


def test_mlx_shards_stay_under_the_limit_and_the_index_names_them_all(vaults, tmp_path):
    vault = vaults[("qwen3_moe", 4)]
    limit = 40_000
    out = export(vault, "mlx", tmp_path / "mlx", shard_bytes=limit)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == {f.name for f in files}
    for f in files:
        with safe_open(f, "pt") as st:
            names = list(st.keys())
        tensor_bytes = f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
        assert len(names) == 1 or tensor_bytes <= limit  # a tensor larger than the limit sits alone
        assert all(index["weight_map"][n] == f.name for n in names)


def test_shards_split_consecutive_tensors_at_the_limit():
    plan = [Planned(str(i), "U8", (n,), n, None) for i, n in enumerate([3, 3, 5, 1, 9, 2])]
    assert [[p.nbytes for p in run] for run in shards(plan, limit=6)] == [[3, 3], [5, 1], [9], [2]]


def test_mlx_rows_narrower_than_a_group_are_written_decoded(tmp_path):
    vault = exportable_vault(tmp_path, "mixtral", 4, expert_width=24)
    out = export(vault, "mlx", tmp_path / "mlx")
    config = json.loads((out / "config.json").read_text())
    module = "model.layers.0.block_sparse_moe.switch_mlp.down_proj"
    assert module not in config["quantization"]
    with safe_open(out / "model.safetensors", "numpy") as f:
        assert f"{module}.scales" not in f.keys()
        want, _, _ = vault_experts(vault, 0, "down")
        assert np.array_equal(f.get_tensor(f"{module}.weight"), want)


# --- MLX: the families of smoe.export.mlx_families ----------------------------------------------

MLX_FAMILIES = ["glm4_moe", "gpt_oss", "olmoe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "dots1", "minimax_m2",
                "granitemoe", "phimoe", "exaone_moe", "llama4", "afmoe", "lfm2_moe", "dbrx", "qwen3_next",
                "granitemoehybrid", "nemotron_h", "solar_open", "mellum", "glm4_moe_lite",
                "qwen3_vl_moe", "mistral4", "qwen3_5_moe_text", "qwen3_5_moe",
                "laguna", "deepseek_v32", "glm_moe_dsa", "kimi_linear", "longcat_flash",
                "minimax_m3_vl_text"]


@pytest.fixture(scope="module")
def mlx_vaults(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlx-families")
    return {f: mlx_exportable_vault(tmp, f, 4) for f in MLX_FAMILIES}


@pytest.mark.parametrize("family", MLX_FAMILIES)
def test_mlx_of_each_family_keeps_the_trunk_and_decodes_to_the_vault_experts_where_mlx_lm_reads_them(
        mlx_vaults, tmp_path, family):
    from smoe.export.mlx import expert_module, renamed
    from smoe.export.mlx_families import FAMILIES, edit

    vault = mlx_vaults[family]
    out = export(vault, "mlx", tmp_path / "mlx")
    config = json.loads((out / "config.json").read_text())
    exported = load_file(out / "model.safetensors")
    with Vault(vault) as v:
        row = FAMILIES[v.meta["model_type"]]  # Llama 4's vault is its text model, llama4_text
        layers, experts, roles = v.meta["moe_layers"], v.meta["num_experts"], v.meta["roles"]  # Nemotron-H: up, down
        biases = {(layer, role): torch.stack([v.read_expert(layer, e)[1][role] for e in range(experts)]).float()
                  for layer in layers for role in MLX_ROLES} if family == "gpt_oss" else {}
    # what mlx-lm's model reads (Qwen3-VL's vision tower is not written)
    trunk = {k: t for k, t in load_file(vault / TRUNK_FILE).items() if not (row.drops and re.search(row.drops, k))}
    assert (len(trunk) < len(load_file(vault / TRUNK_FILE))) == (family in MLX_MULTIMODAL)
    # the trunk as it is, but where the row writes a tensor as mlx-lm keeps it (Qwen3-Next's norms and convolutions)
    as_written = lambda name, t: (edit(row, name) or (lambda t: t, None))[0](t)
    assert all(torch.equal(exported[renamed(name, row)], as_written(name, tensor)) for name, tensor in trunk.items())
    assert row.edits or all(edit(row, name) is None for name in trunk)
    expert_names = set()
    for layer in layers:
        for role in roles:
            want, s, _ = vault_experts(vault, layer, role)
            for expert in range(experts) if row.per_expert else (None,):
                module = expert_module(row, layer, role, expert)
                parts = ("weight", "scales", "biases", *(("bias",) if biases else ()))
                weight, scales, offsets, *bias = (exported[f"{module}.{k}"].numpy() for k in parts)
                expert_names |= {f"{module}.{k}" for k in parts}
                assert config["quantization"][module]["bits"] == 4
                mine = slice(None) if expert is None else expert  # DBRX: one expert's module each
                assert_within_fp16_rounding_of_d(mlx_decode(weight, scales, offsets, 4), want[mine], s[mine])
                if biases:  # gpt-oss: the experts' own biases, exact
                    assert np.array_equal(bias[0], biases[(layer, role)].numpy())
    assert set(exported) == {renamed(name, row) for name in trunk} | expert_names


def test_mlx_qwen3_next_norms_and_convolutions_are_written_as_mlx_lm_sanitizes_a_checkpoint(mlx_vaults, tmp_path):
    """mlx-lm converts them only while fusing a checkpoint's experts; the export's experts come fused."""
    vault = mlx_vaults["qwen3_next"]
    exported = load_file(export(vault, "mlx", tmp_path / "mlx") / "model.safetensors")
    trunk = load_file(vault / TRUNK_FILE)
    for name in ("model.norm.weight", "model.layers.1.self_attn.q_norm.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(exported[name], trunk[name] + 1)
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert torch.equal(exported[conv], trunk[conv].movedim(2, 1))
    gated = "model.layers.0.linear_attn.norm.weight"  # the gated norm multiplies by its weight as it is
    assert torch.equal(exported[gated], trunk[gated])


def test_mlx_configs_carry_what_each_model_args_reads(mlx_vaults, tmp_path):
    from smoe.export.mlx_families import text_config

    configs = {f: json.loads((export(v, "mlx", tmp_path / f) / "config.json").read_text()) for f, v in mlx_vaults.items()}
    read = configs.get
    glm = read("glm4_moe")
    assert (glm["partial_rotary_factor"], glm["first_k_dense_replace"], glm["use_qk_norm"]) == (0.5, 1, True)
    assert (glm["n_group"], glm["topk_group"], glm["routed_scaling_factor"], glm["rope_scaling"]) == (4, 2, 2.5, None)
    oss = read("gpt_oss")
    assert oss["layer_types"] == ["sliding_attention", "full_attention"] and oss["rope_scaling"]["rope_type"] == "yarn"
    assert read("minimax_m2")["rotary_dim"] == 16  # transformers' MiniMax-M2 rotates whole heads unless told
    assert read("deepseek_v2")["rope_scaling"]["factor"] == 4.0
    assert read("deepseek_v3")["topk_method"] == "noaux_tc" and read("olmoe")["norm_topk_prob"] is False
    exaone = read("exaone_moe")  # its window set to 16: three sliding layers, then a full one without rotary
    assert exaone["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] and exaone["sliding_window"] == 16
    assert (exaone["is_moe_layer"], exaone["num_shared_experts"]) == ([False, True, True, True], 1)
    afmoe = read("afmoe")  # transformers' values, not mlx-lm's defaults (routed scale 2.826, two dense layers)
    assert (afmoe["mup_enabled"], afmoe["num_dense_layers"], afmoe["route_norm"], afmoe["route_scale"]) == (
        True, 1, True, 2.0)
    assert read("lfm2_moe")["num_dense_layers"] == 1 and read("lfm2_moe")["tie_word_embeddings"] is True
    assert read("phimoe")["lm_head_bias"] is True and read("granitemoe")["embedding_multiplier"] == 12.0
    assert (read("dbrx")["attn_config"]["clip_qkv"], read("dbrx")["n_layers"]) == (8.0, 2)  # its names, as they are
    qwen3_next = read("qwen3_next")  # linear attention, then full: a full layer every second one
    assert (qwen3_next["full_attention_interval"], qwen3_next["partial_rotary_factor"]) == (2, 0.25)
    assert (qwen3_next["norm_topk_prob"], qwen3_next["mlp_only_layers"]) == (True, [])
    granite = read("granitemoehybrid")  # mlx-lm's spelling of the kinds; no rotary (transformers' default)
    assert (granite["layer_types"], granite["position_embedding_type"]) == (["mamba", "attention"], "nope")
    assert (granite["logits_scaling"], granite["time_step_limit"]) == (8.0, [0.5, 0.8])
    nemotron = read("nemotron_h")  # transformers clamps the prompt's time steps at time_step_min
    assert (nemotron["hybrid_override_pattern"], nemotron["n_shared_experts"]) == (list("ME*-E"), 1)
    assert (nemotron["time_step_limit"], nemotron["routed_scaling_factor"]) == ([0.6, float("inf")], 2.5)
    solar = read("solar_open")  # glm4_moe's model, every layer MoE, no q/k norm, rotary over whole heads
    assert (solar["first_k_dense_replace"], solar["use_qk_norm"], solar["partial_rotary_factor"]) == (0, False, 1.0)
    assert (solar["n_group"], solar["topk_group"], solar["routed_scaling_factor"]) == (4, 2, 2.5)
    mellum = read("mellum")  # transformers' num_local_experts under mlx-lm's name; rotary bases per layer type as given
    assert (mellum["num_experts"], mellum["layer_types"]) == (4, ["sliding_attention", "full_attention"])
    assert mellum["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    lite = read("glm4_moe_lite")
    assert (lite["first_k_dense_replace"], lite["topk_method"], lite["n_group"], lite["rope_scaling"]) == (
        1, "noaux_tc", 4, None)
    llama4 = read("llama4")  # mlx-lm's multimodal llama4 reads the text model's args, quantization beside them
    assert llama4["model_type"] == "llama4" and llama4["text_config"]["interleave_moe_layer_step"] == 2
    assert llama4["quantization"]["bits"] == 4 and "quantization" not in llama4["text_config"]
    mistral4 = read("mistral4")  # its YaRN and query temperature in rope_parameters, as mlx-lm's mistral4 reads them
    assert (mistral4["first_k_dense_replace"], mistral4["n_group"], mistral4["rope_interleave"]) == (1, 4, True)
    assert mistral4["rope_parameters"]["rope_type"] == "yarn" and mistral4["rope_parameters"]["llama_4_scaling_beta"] == 0.1
    qwen3_5 = read("qwen3_5_moe_text")  # mlx-lm's qwen3_5_moe reads the text model's args
    assert (qwen3_5["text_config"]["full_attention_interval"], qwen3_5["text_config"]["norm_topk_prob"]) == (2, True)
    assert qwen3_5["text_config"]["rope_parameters"]["partial_rotary_factor"] == 0.25
    laguna = read("laguna")  # transformers' names, which mlx-lm's laguna reads as they are
    assert (laguna["num_attention_heads_per_layer"], laguna["mlp_layer_types"][0]) == ([4, 8, 8, 4], "dense")
    vl = read("qwen3_vl_moe")  # mlx-lm's qwen3_vl_moe reads the text model's args, transformers' expert count renamed
    assert (vl["text_config"]["num_experts"], vl["text_config"]["norm_topk_prob"]) == (4, True)
    assert "vision_config" not in vl and vl["text_config"]["rope_theta"] == 5e5
    # the indexer turns the two halves (DeepSeek-V3.2) or adjacent pairs (GLM-5); mlx-lm's glm_moe_dsa reads only
    # rope_parameters; both take the dense layers before the MoE ones from first_k_dense_replace
    dsa, glm5 = read("deepseek_v32"), read("glm_moe_dsa")
    assert (dsa["indexer_rope_interleave"], glm5["indexer_rope_interleave"]) == (False, True)
    assert glm5["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (dsa["first_k_dense_replace"], dsa["topk_method"], dsa["index_topk"]) == (2, "noaux_tc", 2048)
    kimi = read("kimi_linear")  # the release's linear_attn_config, delta-attention layers numbered from 1
    assert kimi["linear_attn_config"] == {"kda_layers": [1, 2], "num_heads": 4, "head_dim": 16,
                                          "short_conv_kernel_size": 4}
    assert (kimi["first_k_dense_replace"], kimi["num_shared_experts"], kimi["moe_router_activation_func"]) == (
        1, 1, "sigmoid")
    tied = {"text_config": {"tie_word_embeddings": True}, "tie_word_embeddings": False}  # the text model's default
    assert text_config(tied)["tie_word_embeddings"] is False  # transformers ties by the top level's
    assert all(read(f)["model_type"] == f.removesuffix("_text") for f in MLX_FAMILIES)
    assert llama4["text_config"]["model_type"] == "llama4_text"


MLX_REFUSALS = [
    ("gpt_oss", dict(), "truncate = false"),  # as released: mlx-lm's YaRN rounds the correction range
    ("gpt_oss", dict(swiglu_limit=5.0), "clamps SwiGLU"),
    ("qwen2_moe", dict(norm_topk_prob=True), "normalise = False"),
    ("qwen2_moe", dict(head_dim=32), "head_dim = hidden_size / heads"),
    ("olmoe", dict(clip_qkv=8.0), "does not compute clip_qkv"),
    ("dots1", dict(attention_bias=True), "attention biases = True"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave"),
    ("deepseek_v3", dict(num_experts_per_tok=1), "single chosen expert"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}), "'linear'"),
    ("minimax_m2", dict(attention_bias=True), "attention biases = True"),
    ("mixtral", dict(sliding_window=16), "sliding-window"),
    ("granitemoe", dict(head_dim=32), "head_dim = hidden_size / heads"),
    ("phimoe", dict(), "attention biases = False"),  # transformers' default; Phi-3.5-MoE has them
    ("phimoe", dict(attention_bias=True, num_experts_per_tok=1), "sparsemixer chooses 2 experts"),
    ("phimoe", dict(attention_bias=True), "lm_head_bias = false"),
    ("phimoe", dict(attention_bias=True, lm_head_bias=True, tie_word_embeddings=True), "tied embeddings"),
    ("exaone_moe", dict(layer_types=["full_attention"] * 4), "no sliding layer"),
    ("exaone_moe", dict(num_experts_per_tok=1), "single chosen expert"),
    ("llama4", dict(), "q/k norm with eps 1e-05"),  # transformers' rms_norm_eps; mlx-lm's q/k norm takes 1e-6
    ("llama4", dict(rms_norm_eps=1e-6, num_experts_per_tok=2), "one expert per token"),
    ("llama4", dict(rms_norm_eps=1e-6, no_rope_layers=[1, 1, 1, 1]), "no_rope_layers"),
    ("llama4", dict(rms_norm_eps=1e-6, attention_chunk_size=None), "attends in chunks"),
    ("llama4", dict(rms_norm_eps=1e-6, moe_layers=[3]), "interleave_moe_layer_step"),
    ("llama4", dict(rms_norm_eps=1e-6, num_hidden_layers=2, moe_layers=[1]), "mask from layer 4"),
    ("afmoe", dict(layer_types=["sliding_attention"] * 4), "both sliding and full"),
    ("afmoe", dict(num_experts_per_tok=1), "single chosen expert"),
    ("lfm2_moe", dict(tie_word_embeddings=False), "untied lm_head"),
    ("lfm2_moe", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1e6}), "'linear'"),
    ("dbrx", dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": None}), "always clips"),
    ("dbrx", dict(attn_config={"kv_n_heads": 2, "rope_theta": 5e5, "clip_qkv": 8.0}), "not transformers' rotary base"),
    ("dbrx", dict(ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 24,
                              "moe_normalize_expert_weights": 2.0}), "p-norm 2.0"),
    ("qwen3_next", dict(layer_types=["full_attention", "linear_attention"]), "every k-th layer"),
    ("qwen3_next", dict(layer_types=["linear_attention", "linear_attention"]), "every k-th layer"),
    ("qwen3_next", dict(norm_topk_prob=True, shared_expert_intermediate_size=0), "0 shared experts"),
    ("granitemoehybrid", dict(mamba_n_groups=2), "mamba_n_groups = 2"),  # mlx-lm's gated norm spans all groups
    ("granitemoehybrid", dict(mamba_n_groups=1, head_dim=32), "head_dim = hidden_size / heads"),
    ("granitemoehybrid", dict(mamba_n_groups=1, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1e4}), "'linear'"),
    ("granitemoehybrid", dict(mamba_n_groups=1, time_step_limit=None), "time_step_limit None"),
    ("nemotron_h", dict(n_group=2, topk_group=1), "n_group = 1"),  # mlx-lm zeroes dropped groups' scores
    ("nemotron_h", dict(mamba_hidden_act="gelu"), "mamba_hidden_act 'gelu'"),
    ("nemotron_h", dict(mlp_hidden_act="silu"), "relu2 \\(not gated\\) experts; this model's are silu"),
    ("nemotron_h", dict(num_experts_per_tok=1), "single chosen expert"),
    ("nemotron_h", dict(moe_latent_size=16), "does not compute latent_experts"),
    ("nemotron_h", dict(layers_block_type=["linear_attention", "moe", "full_attention", "conv"]), "layer kinds"),
    ("solar_open", dict(num_experts_per_tok=1), "single chosen expert"),
    ("solar_open", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), "'linear'"),
    ("mellum", dict(layer_types=["sliding_attention"] * 2), "mask from a full-attention layer"),
    ("mellum", dict(rope_parameters={t: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
                                     for t in ("full_attention", "sliding_attention")}), "'linear' on full_attention"),
    ("mellum", dict(rope_parameters={t: {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
                                     for t in ("full_attention", "sliding_attention")}), "part of each head"),
    ("mellum", dict(attention_bias=True), "attention biases = True"),
    ("mellum", dict(mlp_layer_types=["dense", "sparse"]), "takes every layer MoE"),
    ("glm4_moe_lite", dict(rms_norm_eps=1e-6, rope_interleave=False), "rope_interleave"),
    ("glm4_moe_lite", dict(rms_norm_eps=1e-6, num_experts_per_tok=1), "single chosen expert"),
    ("mistral4", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mscale": 0.707,
                                       "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.1}),
     "no mscale_all_dim"),
    ("mistral4", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "truncate": False,
                                       "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.1}),
     "truncate = false"),
    ("mistral4", dict(head_dim=8, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                   "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.1}),
     "YaRN over 2 channels"),  # the tiny config's head_dim (the rope part) · its partial factor 8 / 24
    ("mistral4", dict(rope_interleave=None), "rope_interleave = null"),
    ("qwen3_5_moe_text", dict(layer_types=["full_attention", "linear_attention"]), "every k-th layer"),
    ("qwen3_5_moe_text", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.25}), "'linear'"),
    ("qwen3_5_moe_text", dict(shared_expert_intermediate_size=0), "0 shared experts"),
    ("laguna", dict(gating="per-element"), "gating 'per-element'"),
    ("laguna", dict(moe_router_logit_softcapping=30.0), "custom = None"),
    ("laguna", dict(layer_types=["sliding_attention"] * 2), "mask from a full-attention layer"),
    ("laguna", dict(rope_parameters={t: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                         "original_max_position_embeddings": 16}
                                     for t in ("full_attention", "sliding_attention")}), "'yarn' on full_attention"),
    ("laguna", dict(attention_bias=True), "attention biases = True"),
    ("qwen3_vl_moe", dict(attention_bias=True), "attention biases = True"),  # mlx-lm's qwen3_moe never builds them
    ("deepseek_v32", dict(num_experts_per_tok=1), "single chosen expert"),
    ("deepseek_v32", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "truncate": False,
                                           "original_max_position_embeddings": 16}), "truncate = false"),
    # transformers' GLM-5 reuses the previous indexer's keys on a "shared" layer; mlx-lm's runs an indexer on each
    ("glm_moe_dsa", dict(indexer_types=["full", "shared", "full"]), "does not compute shared_indexer"),
    # the tiny config's heads, 16 wide: int(16 · 0.334) = 5 channels, of which transformers turns 3 pairs, mlx-lm 5
    ("mimo_v2_flash", dict(), "5 channels"),
    ("mimo_v2_flash", dict(head_dim=48, layer_types=["full_attention"] * 2), "both sliding and full"),
    ("mimo_v2_flash", dict(head_dim=48, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "one partial_rotary_factor"),
    ("mimo_v2_flash", dict(head_dim=48, rope_parameters={
        t: {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
        for t in ("full_attention", "sliding_attention")}), "'yarn' on full_attention"),
    ("mimo_v2_flash", dict(head_dim=48, num_experts_per_tok=1), "single chosen expert"),
    ("mimo_v2_flash", dict(head_dim=48, tie_word_embeddings=True), "tied embeddings"),
    # the tiny config's query_pre_attn_scalar is the release's head_dim (128): scores scaled otherwise than mlx-lm's
    ("gemma4_text", dict(hidden_size_per_layer_input=16), "per-layer input embeddings"),
    ("gemma4_text", dict(num_kv_shared_layers=1), "num_kv_shared_layers"),
    ("gemma4_text", dict(use_bidirectional_attention="all"), "bidirectional attention"),
    ("gemma4_text", dict(attention_k_eq_v=False, per_layer_config={"1": {"head_dim": 32, "num_key_value_heads": 1}}),
     "1 key/value heads on full layers"),
    ("gemma4_text", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "'linear' on sliding_attention"),
    # 5 of 32 channels: transformers turns 2 pairs, mlx-lm 3
    ("gemma4_text", dict(per_layer_config={"1": {"head_dim": 32}}, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.15625, "rope_theta": 1e6}}),
     "proportional RoPE over 5.0 of 32"),
    ("kimi_linear", dict(num_expert_group=2, topk_group=1), "n_group = 1"),  # mlx-lm zeroes dropped groups' scores
    ("kimi_linear", dict(q_lora_rank=32), "q_lora_rank 32"),
    ("kimi_linear", dict(layer_types=["full_attention"] * 3), "both delta-attention and MLA"),
    ("kimi_linear", dict(num_experts_per_token=1), "single chosen expert"),
    ("step3p7", dict(), "does not compute multipliers"),
    ("step3p7", dict(query_pre_attn_scalar=16, gating="per-element"), "gating 'per-element'"),
    ("step3p7", dict(query_pre_attn_scalar=16, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3125}}),
     "5 channels on full_attention"),
    ("step3p7", dict(query_pre_attn_scalar=16, rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}}),
     "'yarn' on full_attention"),
    ("step3p7", dict(query_pre_attn_scalar=16, swiglu_limits=[-1.0] * 3), "negative SwiGLU limits"),
    ("step3p7", dict(query_pre_attn_scalar=16, use_bidirectional_attention=True),
     "does not compute bidirectional_attention"),
    ("qwen3_vl_moe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}), "'linear'"),
    # mlx-lm's minimax_m3_vl makes every layer not full_attention block-sparse; transformers only minimax_m3_sparse ones
    ("minimax_m3_vl", dict(layer_types=["full_attention", "sliding_attention"]), r"layer types \['sliding_attention'\]"),
    # transformers turns the indexer's heads by the attention's cos and sin cut at index_head_dim
    ("minimax_m3_vl", dict(layer_types=["full_attention", "minimax_m3_sparse"], index_head_dim=8),
     "rotary part of 16 channels wider than the indexer's heads"),
    ("minimax_m3_vl", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e6}), "'linear'"),
    # a text-only vault's dense MLP is one fused gate_up_proj, which mlx-lm's sanitize splits only under block_sparse_moe
    ("minimax_m3_vl_text", dict(mlp_layer_types=["dense", "sparse"]), r"dense layers \[0\] keep a fused gate_up_proj"),
    ("minimax_m3_vl_text", dict(layer_types=["full_attention", "sliding_attention"]),
     r"layer types \['sliding_attention'\]"),
    ("longcat_flash", dict(tie_word_embeddings=True), "tied embeddings"),  # mlx-lm's longcat_flash reads lm_head
    ("longcat_flash", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7,
                                            "original_max_position_embeddings": 16}), "'yarn'"),
]


@pytest.mark.parametrize("family,changes,named", MLX_REFUSALS)
def test_mlx_refuses_what_each_mlx_lm_model_file_computes_differently(family, changes, named):
    from smoe.errors import SmoeError
    from smoe.export import mlx_families
    from smoe.source.description import describe_model

    config = exportable_config(family, architecture=GGUF_ARCHITECTURE.get(family)).to_dict()
    (config.get("text_config") or config).update(changes)  # a multimodal checkpoint's: its text model's
    desc = describe_model(config)
    with pytest.raises(SmoeError, match=named):
        mlx_families.check(desc.model_type, config, desc, list(desc.moe_layers), {}, 32)


@pytest.mark.parametrize("family,named", [("hunyuan_v1_moe", "does not normalise the chosen experts' weights"),
                                          ("jamba", "normalises the chosen experts' weights, transformers'")])
def test_mlx_refuses_families_whose_mlx_lm_router_weighs_experts_otherwise(family, named):
    from smoe.errors import SmoeError
    from smoe.export import mlx_families

    with pytest.raises(SmoeError, match=f"{family}: .*{named}"):
        mlx_families.family(family)


def test_mlx_refuses_deepseek_v4_whose_mlx_lm_file_is_deepseek_v4_1():
    from smoe.errors import SmoeError
    from smoe.export import mlx_families

    with pytest.raises(SmoeError, match="deepseek_v4: mlx-lm's deepseek_v41 .*previous hyper-connection's weights"):
        mlx_families.family("deepseek_v4")


def test_mlx_refuses_muse_spark_whose_mlx_lm_file_rounds_to_bf16_on_metal_kernels_only():
    from smoe.errors import SmoeError
    from smoe.export import mlx_families

    with pytest.raises(SmoeError, match="muse_spark: mlx-lm's muse_spark runs only as Metal kernels .*bf16"):
        mlx_families.family("muse_spark")


def test_mlx_minimax_m3_args_are_what_transformers_reads_of_the_release_config():
    """The release nests the indexer and the sparse layers in sparse_attention_config and gives a rotary_dim that
    transformers does not read (it turns head_dim · rope_parameters' factor); mlx-lm would read them otherwise."""
    from smoe.export.mlx_families import model_args
    from smoe.source.description import describe_model

    text = dict(model_type="minimax_m3_vl_text", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, rotary_dim=64, intermediate_size=32, num_local_experts=8,
                num_experts_per_tok=2, moe_layer_freq=[0, 1, 1], rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                sparse_attention_config={"sparse_num_index_heads": 2, "sparse_index_dim": 32, "sparse_block_size": 16,
                                         "sparse_topk_blocks": 4, "sparse_attention_freq": [0, 1, 1]})
    config = dict(model_type="minimax_m3_vl", text_config=text)
    desc = describe_model(config)
    args = model_args("minimax_m3_vl", config, desc, [1, 2])
    assert args["model_type"] == "minimax_m3_vl"
    t = args["text_config"]
    assert t["rotary_dim"] == 16 and t["sparse_attention_config"] is None
    assert t["layer_types"] == ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"]
    assert t["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert (t["index_n_heads"], t["index_head_dim"], t["index_block_size"], t["index_topk_blocks"],
            t["index_local_blocks"]) == (2, 32, 16, 4, 1)


def test_mlx_ernie_is_refused_at_export_naming_the_correction_bias_mlx_lm_drops(tmp_path):
    vault = exportable_vault(tmp_path, "ernie4_5_moe", 4)
    r = smoe_cli("export", vault, "--to", "mlx", "-o", tmp_path / "mlx")
    assert r.returncode == 2 and "e_score_correction_bias" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "mlx").exists()


# --- GGUF: DeepSeek's MLA as llama.cpp's deepseek2 ----------------------------------------------


@pytest.fixture(scope="module")
def deepseek_vault(tmp_path_factory):
    """A tiny DeepSeek-V3 of the exportable shapes: dense first layer, 4 groups of 2 experts, q_lora."""
    return exportable_vault(tmp_path_factory.mktemp("deepseek"), "deepseek_v3", 4)


def test_gguf_deepseek_writes_mla_as_one_latent_head_with_the_routing_smoe_computes(deepseek_vault, tmp_path):
    out = export(deepseek_vault, "gguf", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(out)
    c = json.loads((deepseek_vault / "config.json").read_text())
    get = lambda key: field(reader, f"deepseek2.{key}")
    assert field(reader, "general.architecture") == "deepseek2"
    assert get("attention.head_count_kv") == 1
    assert get("attention.key_length") == c["kv_lora_rank"] + c["qk_rope_head_dim"]
    assert get("attention.value_length") == c["kv_lora_rank"]
    assert get("attention.key_length_mla") == c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    assert get("attention.value_length_mla") == c["v_head_dim"]
    assert get("attention.q_lora_rank") == c["q_lora_rank"] and get("rope.dimension_count") == c["qk_rope_head_dim"]
    assert get("leading_dense_block_count") == c["first_k_dense_replace"] == 1
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID  # the config has no scoring_func
    assert (get("expert_group_count"), get("expert_group_used_count")) == (c["n_group"], c["topk_group"]) == (4, 2)
    assert get("expert_weights_scale") == pytest.approx(c["routed_scaling_factor"]) and get("expert_weights_norm")
    assert get("expert_shared_count") == c["n_shared_experts"]
    assert (get("feed_forward_length"), get("expert_feed_forward_length")) == (c["intermediate_size"], 32)
    tensors = gguf_tensors(out)
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= set(tensors)
    assert not any(n.startswith("blk.0.") and ("exps" in n or "shexp" in n) for n in tensors)
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_gate_shexp.weight", "blk.1.exp_probs_b.bias"} <= set(tensors)
    assert not any("attn_kv_b" in n for n in tensors)


def test_gguf_deepseek_kv_b_is_split_into_key_and_value_rows_as_llama_cpp_reads_them(deepseek_vault, tmp_path):
    tensors = gguf_tensors(export(deepseek_vault, "gguf", tmp_path / "m.gguf"))
    trunk = load_file(deepseek_vault / TRUNK_FILE)
    c = json.loads((deepseek_vault / "config.json").read_text())
    heads, nope, v, latent = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    value = lambda name: torch.from_numpy(tensors[name].data.copy())
    for layer in range(c["num_hidden_layers"]):
        kv_b = trunk[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].view(heads, nope + v, latent)
        # GGUF lists dimensions innermost first: k_b [nope, latent, heads], v_b [latent, v, heads]
        assert list(tensors[f"blk.{layer}.attn_k_b.weight"].shape) == [nope, latent, heads]
        assert torch.equal(value(f"blk.{layer}.attn_k_b.weight"), kv_b[:, :nope].transpose(1, 2))
        assert torch.equal(value(f"blk.{layer}.attn_v_b.weight"), kv_b[:, nope:])
    bias = trunk["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(value("blk.1.exp_probs_b.bias"), bias.float())


DEEPSEEK_REFUSALS = [
    ("deepseek_v2", dict(n_group=4, topk_group=2, topk_method="group_limited_greedy"), "best expert"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave"),
    ("deepseek_v3", dict(num_hidden_layers=27, q_lora_rank=32), "V2-Lite"),
    ("deepseek_v3", dict(num_hidden_layers=48, vocab_size=128256, q_lora_rank=32), "vocabulary 128256"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                          "mscale": 1.0, "mscale_all_dim": 0.707}), "mscale"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "'linear'"),
]


@pytest.mark.parametrize("family,changes,named", DEEPSEEK_REFUSALS)
def test_gguf_deepseek_refuses_what_llama_cpp_computes_differently(family, changes, named):
    from smoe.errors import SmoeError
    from smoe.export import gguf_mla
    from smoe.source.description import describe_model
    from smoe.testing.tiny_models import tiny_config

    config = tiny_config(family).to_dict() | {"n_routed_experts": 8, "moe_intermediate_size": 32} | changes
    layers = config["num_hidden_layers"]
    with pytest.raises(SmoeError, match=named):
        gguf_mla.check(family, config, describe_model(config), list(range(1, layers)), {}, 32)


def test_gguf_deepseek_v2_with_group_limited_routing_is_refused_at_export_by_name(tmp_path):
    model = tiny_model_dir(tmp_path, "deepseek_v2", architecture=dict(n_routed_experts=8, n_group=4, topk_group=2,
                                                                      topk_method="group_limited_greedy"))
    vault_of(model, tmp_path / "vault")
    r = smoe_cli("export", tmp_path / "vault", "--to", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 2 and "group_limited_greedy" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob("m.gguf.partial-*"))


def test_a_deepseek2_gguf_is_written_but_not_read_back(deepseek_vault, tmp_path):
    """smoe writes llama.cpp's deepseek2 but does not read it as a checkpoint: refused by name, not misread."""
    from smoe.errors import SmoeError
    from smoe.source.gguf import GgufCheckpoint

    out = export(deepseek_vault, "gguf", tmp_path / "m.gguf")
    with pytest.raises(SmoeError, match="'deepseek2' is not one smoe reads"):
        GgufCheckpoint(out)


# --- GGUF: the families written only (smoe.export.gguf_families) --------------------------------

WRITTEN_ONLY = {"glm4_moe": "glm4moe", "gpt_oss": "gpt-oss", "olmoe": "olmoe", "qwen2_moe": "qwen2moe",
                "minimax_m2": "minimax-m2", "dots1": "dots1", "granitemoe": "granitemoe", "granitemoeshared": "granitemoe",
                "hunyuan_v1_moe": "hunyuan-moe", "ernie4_5_moe": "ernie4_5-moe", "exaone_moe": "exaone-moe",
                "afmoe": "afmoe", "llama4_text": "llama4", "lfm2_moe": "lfm2moe", "qwen3_next": "qwen3next",
                "granitemoehybrid": "granitehybrid", "jamba": "jamba", "solar_open": "glm4moe", "sarvam_moe": "glm4moe",
                "sarvam_mla": "deepseek2", "glm4_moe_lite": "deepseek2", "mistral4": "mistral4"}


@pytest.fixture(scope="module")
def family_vaults(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families")
    return {f: exportable_vault(tmp, f, 4) for f in WRITTEN_ONLY}


def arch_tensor_names(arch: str, layers: int) -> set[str]:
    """Every tensor name llama.cpp's architecture lists (gguf's MODEL_TENSORS), with either suffix or none (ssm_a)."""
    kinds = gguf.MODEL_TENSORS[next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)]
    names = {gguf.TENSOR_NAMES[k].format(bid=b) for k in kinds for b in range(layers)}
    return names | {f"{n}.{suffix}" for n in names for suffix in ("weight", "bias")}


@pytest.mark.parametrize("family", WRITTEN_ONLY)
def test_gguf_of_each_family_names_only_tensors_its_llama_cpp_architecture_lists(family_vaults, tmp_path, family):
    vault, arch = family_vaults[family], WRITTEN_ONLY[family]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    reader = gguf.GGUFReader(out)
    config = json.loads((vault / "config.json").read_text())
    layers = config["num_hidden_layers"]
    assert field(reader, "general.architecture") == arch and field(reader, f"{arch}.block_count") == layers
    tensors = gguf_tensors(out)
    assert set(tensors) <= arch_tensor_names(arch, layers)
    with Vault(vault) as v:
        moe_layers, experts = v.meta["moe_layers"], v.meta["num_experts"]
    assert field(reader, f"{arch}.expert_count") == experts
    for layer in moe_layers:
        assert list(tensors[f"blk.{layer}.ffn_gate_exps.weight"].shape) == [config["hidden_size"], 32, experts]
        for role, name in ROLES.items():
            got = gguf.quants.dequantize(tensors[f"blk.{layer}.{name}.weight"].data, gguf.GGMLQuantizationType.Q4_1)
            want, s, _ = vault_experts(vault, layer, role)
            assert_within_fp16_rounding_of_d(got, want, s)


def test_gguf_glm4_moe_ropes_part_of_each_head_and_routes_as_smoe_describes(family_vaults, tmp_path):
    vault = family_vaults["glm4_moe"]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    reader, c = gguf.GGUFReader(out), json.loads((vault / "config.json").read_text())
    get = lambda key: field(reader, f"glm4moe.{key}")
    assert get("rope.dimension_count") == c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"] == 8
    assert get("leading_dense_block_count") == c["first_k_dense_replace"] == 1
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm")
    assert get("expert_weights_scale") == pytest.approx(c["routed_scaling_factor"])
    assert (get("expert_group_count"), get("expert_group_used_count")) == (c["n_group"], c["topk_group"])
    assert (get("feed_forward_length"), get("expert_feed_forward_length")) == (c["intermediate_size"], 32)
    tensors = gguf_tensors(out)
    trunk = load_file(vault / TRUNK_FILE)
    assert torch.equal(torch.from_numpy(tensors["blk.1.exp_probs_b.bias"].data.copy()),
                       trunk["model.layers.1.mlp.gate.e_score_correction_bias"].float())
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_up_shexp.weight", "blk.1.attn_q.bias", "blk.1.attn_k_norm.weight"} <= set(tensors)


def test_gguf_gpt_oss_holds_the_expert_biases_sinks_and_sliding_layers(family_vaults, tmp_path):
    vault = family_vaults["gpt_oss"]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    reader, c = gguf.GGUFReader(out), json.loads((vault / "config.json").read_text())
    assert field(reader, "gpt-oss.attention.sliding_window") == c["sliding_window"]
    assert field(reader, "gpt-oss.attention.sliding_window_pattern") == [t == "sliding_attention" for t in c["layer_types"]]
    assert field(reader, "gpt-oss.rope.scaling.type") == "yarn"
    tensors = gguf_tensors(out)
    trunk = load_file(vault / TRUNK_FILE)
    sinks = tensors["blk.1.attn_sinks.weight"]
    assert sinks.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(sinks.data.copy()), trunk["model.layers.1.self_attn.sinks"])
    with Vault(vault) as v:
        for role, name in ROLES.items():
            bias = tensors[f"blk.1.{name}.bias"]
            want = torch.stack([v.read_expert(1, e)[1][role] for e in range(v.meta["num_experts"])]).float()
            assert bias.tensor_type == gguf.GGMLQuantizationType.F32
            assert torch.equal(torch.from_numpy(bias.data.copy()), want)


FAMILY_REFUSALS = [
    ("gpt_oss", dict(swiglu_limit=5.0), "limit 7"),
    ("gpt_oss", dict(attention_bias=False), "needs attention biases"),
    ("olmoe", dict(num_key_value_heads=2), "as many key/value heads as heads"),
    ("qwen2_moe", dict(norm_topk_prob=True), "normalise = False"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}), "'linear'"),
    ("dots1", dict(sliding_window=16, layer_types=["sliding_attention"] * 3), "sliding-window"),
    ("granitemoe", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "'linear'"),
    ("hunyuan_v1_moe", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "fixed alpha"),
    ("hunyuan_v1_moe", dict(attention_bias=True), "attention biases"),
    ("ernie4_5_moe", dict(use_bias=True), "attention biases"),  # its graph drops the output projection's bias
    ("exaone_moe", dict(sliding_window=None), "needs sliding-window layers"),
    ("afmoe", dict(mup_enabled=False), r"sqrt\(hidden_size\)"),
    ("afmoe", dict(layer_types=["sliding_attention", "full_attention"] * 2), "every 4th layer"),
    ("llama4_text", dict(attention_chunk_size=32), "chunks of 8192"),
    ("llama4_text", dict(no_rope_layers=[1, 1, 1, 1]), "NoPE on every 4th layer"),
    ("llama4_text", dict(attn_temperature_tuning=False), "scales NoPE queries"),
    ("llama4_text", dict(use_qk_norm=False), "q/k norm exactly when"),  # 4 experts: llama.cpp norms q and k
    ("llama4_text", dict(moe_layers=[3]), "interleave_moe_layer_step = 2th"),
    ("llama4_text", dict(attention_bias=True), "attention biases"),
    ("llama4_text", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "'llama3'"),
    ("lfm2_moe", dict(conv_bias=True), "short-convolution biases"),
    ("lfm2_moe", dict(tie_word_embeddings=False), "untied lm_head"),
    ("lfm2_moe", dict(routed_scaling_factor=2.0), "scale = 1.0"),  # llama.cpp's lfm2moe reads no scale
    ("lfm2_moe", dict(use_expert_bias=False), "correction_bias = True"),
    ("qwen3_next", dict(linear_value_head_dim=32), "key and value heads of one width"),
    ("qwen3_next", dict(shared_expert_intermediate_size=0), "needs the gated shared expert"),
    ("qwen3_next", dict(rms_norm_eps=1e-5), "L2-norm eps"),
    ("qwen3_next", dict(norm_topk_prob=False), "normalise = True"),
    ("qwen3_next", dict(mlp_only_layers=[0]), "every layer MoE"),
    ("qwen3_next", dict(attention_bias=True), "attention biases"),
    ("granitemoehybrid", dict(mamba_expand=4), "mamba_expand = 2"),
    ("granitemoehybrid", dict(mamba_conv_bias=False), "adds a convolution bias"),
    ("granitemoehybrid", dict(mamba_proj_bias=True), "no Mamba projection biases"),
    ("granitemoehybrid", dict(time_step_limit=[0.5, 0.8]), "does not clamp the time step"),
    ("granitemoehybrid", dict(hidden_act="gelu"), "takes SiLU"),
    ("solar_open", dict(n_shared_experts=0), "shared expert to every MoE layer"),
    ("sarvam_moe", dict(n_shared_experts=0), "shared expert to every MoE layer"),
    ("solar_open", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), "'linear'"),
    ("jamba", dict(mamba_expand=4), "mamba_expand = 2"),
    ("jamba", dict(mamba_conv_bias=False), "adds a convolution bias"),
    ("jamba", dict(mamba_proj_bias=True), "no Mamba projection biases"),
    ("jamba", dict(hidden_act="gelu"), "takes SiLU"),
    ("jamba", dict(head_dim=32), "heads that span the hidden size"),
    ("hy_v4", dict(n_shared_experts=0), "adds a shared expert to every MoE layer"),
    ("hy_v4", dict(hidden_act="gelu"), "takes SiLU MLPs"),
    ("hy_v4", dict(swiglu_limit=1e-6), "takes a swiglu_limit at or below 1e-06 as none"),
    ("hy_v4", dict(index_head_dim=8), r"indexer heads wider than the rotary part \(8\)"),
    ("hy_v4", dict(indexer_types=["shared", "full", "full"]), "needs layer 0 to run its own indexer"),
    ("hy_v4", dict(n_group=2, topk_group=1), "routes with n_group = 1"),
    ("hy_v4", dict(mlp_layer_types=["sparse", "dense", "sparse"]), "dense layers only before the MoE ones"),
    ("hy_v4", dict(attention_bias=True), "attention biases"),
    ("hy_v4", dict(tie_word_embeddings=True), "reads an output matrix of its own"),
    ("hy_v4", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                    "original_max_position_embeddings": 64}), "RoPE scaling 'yarn'"),
    ("deepseek_v4", dict(mlp_layer_types=["moe", "hash_moe", "moe"]), "routes by the token id the first "
     "hash_layer_count layers only"),
    ("deepseek_v4", dict(o_groups=8), "8 o_groups do not divide its 4 heads"),
    ("deepseek_v4", dict(compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}),
     "compresses by"),
    ("deepseek_v4", dict(hidden_act="gelu"), "takes SiLU MLPs"),
    ("deepseek_v4", dict(index_head_dim=32), "indexer heads of a multiple of 64"),
    ("deepseek_v4", dict(layer_types=["sliding_attention", "heavily_compressed_attention"] * 2),
     "needs a compressed_sparse_attention layer"),
    ("deepseek_v4", dict(swiglu_limit=1e-6), "takes a swiglu_limit at or below 1e-06 as none"),
    ("deepseek_v4", dict(tie_word_embeddings=True), "reads an output matrix of its own"),
    ("deepseek_v4", dict(rope_parameters={"main": {"rope_type": "default", "rope_theta": 1e4},
                                          "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "factor": 4.0,
                                                       "original_max_position_embeddings": 64}}),
     r"RoPE scaling 'yarn' \(compress\)"),
]


@pytest.mark.parametrize("family,changes,named", FAMILY_REFUSALS)
def test_gguf_refuses_what_each_llama_cpp_graph_computes_differently(family, changes, named):
    from smoe.errors import SmoeError
    from smoe.export import gguf_families
    from smoe.source.description import describe_model

    config = exportable_config(family, architecture=GGUF_ARCHITECTURE.get(family)).to_dict()
    (config.get("text_config") or config).update(changes)  # a multimodal checkpoint's: its text model's
    desc = describe_model(config)
    with pytest.raises(SmoeError, match=named):
        gguf_families.check(family, config, desc, list(desc.moe_layers), {}, 32)


def test_gguf_refuses_shared_experts_of_two_widths_where_the_graph_reads_one(tmp_path):
    from smoe.errors import SmoeError
    from smoe.export import gguf_families
    from smoe.source.description import describe_model

    config = exportable_config("granitemoeshared").to_dict()
    shapes = {f"model.layers.{i}.shared_mlp.output_linear.weight": (64, w) for i, w in enumerate((48, 32))}
    with pytest.raises(SmoeError, match=r"shared experts of widths \[32, 48\]"):
        gguf_families.check("granitemoeshared", config, describe_model(config), [0, 1], shapes, 32)


def metadata(out: Path, arch: str):
    reader = gguf.GGUFReader(out)
    return lambda key: field(reader, f"{arch}.{key}")


def trunk_tensor(tensors: dict, name: str) -> torch.Tensor:
    return torch.from_numpy(tensors[name].data.copy())


def test_gguf_granite_holds_its_multipliers_split_shared_mlp_and_pair_ordered_q_k(family_vaults, tmp_path):
    from smoe.source.gguf import permute_rope

    vault = family_vaults["granitemoeshared"]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    get, c = metadata(out, "granitemoe"), json.loads((vault / "config.json").read_text())
    assert get("embedding_scale") == pytest.approx(c["embedding_multiplier"])
    assert get("attention.scale") == pytest.approx(c["attention_multiplier"])
    assert get("residual_scale") == pytest.approx(c["residual_multiplier"])
    assert get("logit_scale") == pytest.approx(c["logits_scaling"])
    assert (get("feed_forward_length"), get("expert_shared_feed_forward_length")) == (32, c["shared_intermediate_size"])
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    gate, up = trunk["model.layers.1.shared_mlp.input_linear.weight"].float().chunk(2)
    assert torch.equal(trunk_tensor(tensors, "blk.1.ffn_gate_shexp.weight"), gate)
    assert torch.equal(trunk_tensor(tensors, "blk.1.ffn_up_shexp.weight"), up)
    q = trunk["model.layers.1.self_attn.q_proj.weight"].float()
    assert torch.equal(trunk_tensor(tensors, "blk.1.attn_q.weight"), permute_rope(q, c["num_attention_heads"]))
    assert "blk.1.attn_output.bias" in tensors


def test_gguf_hunyuan_writes_its_ntk_alpha_rope_as_the_fixed_base_it_is(family_vaults, tmp_path):
    vault = family_vaults["hunyuan_v1_moe"]
    get, c = metadata(export(vault, "gguf", tmp_path / "m.gguf"), "hunyuan-moe"), json.loads((vault / "config.json").read_text())
    rope, dim = c["rope_parameters"], c["head_dim"]
    assert get("rope.freq_base") == pytest.approx(rope["rope_theta"] * rope["alpha"] ** (dim / (dim - 2)), rel=1e-6)
    assert get("expert_shared_feed_forward_length") == c["intermediate_size"]


def test_gguf_ernie_holds_its_correction_bias_as_a_vector_and_its_moe_layout(family_vaults, tmp_path):
    vault = family_vaults["ernie4_5_moe"]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    get, c = metadata(out, "ernie4_5-moe"), json.loads((vault / "config.json").read_text())
    assert (get("leading_dense_block_count"), get("interleave_moe_layer_step")) == (c["moe_layer_start_index"], 1)
    assert get("expert_shared_feed_forward_length") == 32 * c["moe_num_shared_experts"]
    bias = load_file(vault / TRUNK_FILE)["model.layers.1.mlp.moe_statics.e_score_correction_bias"]
    assert torch.equal(trunk_tensor(gguf_tensors(out), "blk.1.exp_probs_b.bias"), bias.float().reshape(-1))


@pytest.mark.parametrize("family,arch,bias", [("exaone_moe", "exaone-moe", "mlp.e_score_correction_bias"),
                                              ("afmoe", "afmoe", "mlp.expert_bias")])
def test_gguf_exaone_and_afmoe_mark_the_sliding_layers_they_rotate_and_route_as_smoe_describes(
        family_vaults, tmp_path, family, arch, bias):
    from smoe.source.description import describe_model

    vault = family_vaults[family]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    get = metadata(out, arch)
    with Vault(vault) as v:
        c = v.config
    r = describe_model(c).routing
    assert get("attention.sliding_window_pattern") == [t == "sliding_attention" for t in c["layer_types"]] == [True] * 3 + [False]
    assert get("attention.sliding_window") == c["sliding_window"] and get("leading_dense_block_count") == 1
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm")
    assert get("expert_weights_scale") == pytest.approx(r.scale) and r.scale != 1.0
    want = load_file(vault / TRUNK_FILE)[f"model.layers.1.{bias}"].float()
    assert torch.equal(trunk_tensor(gguf_tensors(out), "blk.1.exp_probs_b.bias"), want)


def test_gguf_llama4_interleaves_dense_and_moe_layers_and_keeps_q_k_rows_in_pair_order(family_vaults, tmp_path):
    vault = family_vaults["llama4_text"]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    get, c = metadata(out, "llama4"), json.loads((vault / "config.json").read_text())
    assert get("interleave_moe_layer_step") == c["interleave_moe_layer_step"] == 2
    assert (get("feed_forward_length"), get("expert_feed_forward_length")) == (c["intermediate_size_mlp"], 32)
    assert "llama4.attention.sliding_window" not in gguf.GGUFReader(out).fields  # else llama.cpp turns chunks off
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_shexp.weight", "blk.1.ffn_gate_inp.weight"} <= set(tensors)
    assert not any(n.startswith("blk.0.") and "exps" in n for n in tensors)
    q = trunk["model.layers.1.self_attn.q_proj.weight"].float()  # Hugging Face's rotary already pairs adjacent rows
    assert torch.equal(trunk_tensor(tensors, "blk.1.attn_q.weight"), q)


def test_gguf_lfm2_moe_marks_its_convolution_layers_with_no_key_value_heads(family_vaults, tmp_path):
    vault = family_vaults["lfm2_moe"]
    out = export(vault, "gguf", tmp_path / "m.gguf", trunk_type="bf16")
    get, c = metadata(out, "lfm2moe"), json.loads((vault / "config.json").read_text())
    kv = c["num_key_value_heads"]
    assert list(get("attention.head_count_kv")) == [kv if t == "full_attention" else 0 for t in c["layer_types"]]
    assert get("shortconv.l_cache") == c["conv_L_cache"] and get("leading_dense_block_count") == 1
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm")
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    conv = tensors["blk.0.shortconv.conv.weight"]  # [hidden, 1, L] squeezed, F32 whatever the trunk type
    assert conv.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(trunk_tensor(tensors, "blk.0.shortconv.conv.weight"),
                       trunk["model.layers.0.conv.conv.weight"].float().squeeze(1))
    assert torch.equal(trunk_tensor(tensors, "blk.1.exp_probs_b.bias"),
                       trunk["model.layers.1.feed_forward.expert_bias"].float())
    assert "output.weight" not in tensors and "token_embd_norm.weight" in tensors  # tied; LFM2's final norm


def test_gguf_qwen3_next_writes_its_delta_net_layers_as_llama_cpp_s_converter_rewrites_them(family_vaults, tmp_path):
    vault = family_vaults["qwen3_next"]
    out = export(vault, "gguf", tmp_path / "m.gguf", trunk_type="bf16")
    get, c = metadata(out, "qwen3next"), json.loads((vault / "config.json").read_text())
    assert list(get("attention.recurrent_layers")) == [t == "linear_attention" for t in c["layer_types"]] == [True, False]
    assert (get("ssm.conv_kernel"), get("ssm.state_size"), get("ssm.group_count"), get("ssm.time_step_rank"),
            get("ssm.inner_size")) == (c["linear_conv_kernel_dim"], c["linear_key_head_dim"], c["linear_num_key_heads"],
                                      c["linear_num_value_heads"], c["linear_value_head_dim"] * c["linear_num_value_heads"])
    assert get("rope.dimension_count") == c["head_dim"] // 4 and get("expert_shared_feed_forward_length") == 32
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    attn = "model.layers.0.linear_attn."
    # per key head [q, k, v, z] in transformers; llama.cpp's converter writes every head's q, then k, then v, and z apart
    k_heads, k_dim = c["linear_num_key_heads"], c["linear_key_head_dim"]
    v_width = c["linear_num_value_heads"] // k_heads * c["linear_value_head_dim"]
    heads = trunk[attn + "in_proj_qkvz.weight"].float().view(k_heads, 2 * k_dim + 2 * v_width, -1)
    q, k, v, z = (heads[:, a:b].reshape(-1, c["hidden_size"]) for a, b in
                  ((0, k_dim), (k_dim, 2 * k_dim), (2 * k_dim, 2 * k_dim + v_width), (2 * k_dim + v_width, None)))
    bf16 = lambda t: t.to(torch.bfloat16).float()
    assert torch.equal(trunk_tensor(tensors, "blk.0.attn_qkv.weight").view(torch.bfloat16).float(), bf16(torch.cat([q, k, v])))
    assert torch.equal(trunk_tensor(tensors, "blk.0.attn_gate.weight").view(torch.bfloat16).float(), bf16(z))
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_a"), -torch.exp(trunk[attn + "A_log"].float()))
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_dt.bias"), trunk[attn + "dt_bias"].float())
    conv = tensors["blk.0.ssm_conv1d.weight"]  # [channels, 1, width] squeezed, F32 whatever the trunk type
    assert conv.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_conv1d.weight"), trunk[attn + "conv1d.weight"].float().squeeze(1))
    # the (1 + w) norms written as 1 + w; the delta-net's gated norm multiplies by w itself
    for gguf_name, key in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                           ("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"),
                           ("output_norm.weight", "model.norm.weight")):
        assert torch.equal(trunk_tensor(tensors, gguf_name), trunk[key].float() + 1)
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_norm.weight"), trunk[attn + "norm.weight"].float())
    assert {"blk.1.attn_q.weight", "blk.0.ffn_gate_inp_shexp.weight", "blk.0.ssm_ba.weight"} <= set(tensors)


def test_gguf_granite_hybrid_writes_its_mamba2_layers_with_no_key_value_heads(family_vaults, tmp_path):
    from smoe.source.gguf import permute_rope

    vault = family_vaults["granitemoehybrid"]
    out = export(vault, "gguf", tmp_path / "m.gguf", trunk_type="bf16")
    get, c = metadata(out, "granitehybrid"), json.loads((vault / "config.json").read_text())
    kv, inner, groups = c["num_key_value_heads"], c["mamba_expand"] * c["hidden_size"], c["mamba_n_groups"]
    assert list(get("attention.head_count_kv")) == [0 if t == "linear_attention" else kv for t in c["layer_types"]]
    assert (get("ssm.conv_kernel"), get("ssm.state_size"), get("ssm.group_count"), get("ssm.inner_size"),
            get("ssm.time_step_rank")) == (c["mamba_d_conv"], c["mamba_d_state"], groups, inner, c["mamba_n_heads"])
    assert get("rope.scaling.finetuned") is False  # position_embedding_type none: no rotary, as transformers
    assert get("embedding_scale") == pytest.approx(c["embedding_multiplier"])
    assert get("residual_scale") == pytest.approx(c["residual_multiplier"])
    assert get("expert_shared_feed_forward_length") == c["shared_intermediate_size"]
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    mamba = "model.layers.0.mamba."
    for name in ("blk.0.ssm_a", "blk.0.ssm_d", "blk.0.ssm_conv1d.weight"):  # F32 whatever the trunk type
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
    heads = c["mamba_n_heads"]
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_a").reshape(heads, 1),
                       -torch.exp(trunk[mamba + "A_log"].float()).reshape(heads, 1))
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_d").reshape(heads, 1), trunk[mamba + "D"].float().reshape(heads, 1))
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_dt.bias"), trunk[mamba + "dt_bias"].float())
    norm = trunk_tensor(tensors, "blk.0.ssm_norm.weight")  # one row per group the gated norm normalises
    assert norm.shape == (groups, inner // groups) and torch.equal(norm.flatten(), trunk[mamba + "norm.weight"].float())
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_conv1d.weight"), trunk[mamba + "conv1d.weight"].float().squeeze(1))
    q = trunk["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16).float()
    got = trunk_tensor(tensors, "blk.1.attn_q.weight").view(torch.bfloat16).float()
    assert torch.equal(got, permute_rope(q, c["num_attention_heads"]))
    assert {"blk.1.attn_q.bias", "blk.0.ssm_conv1d.bias", "blk.0.ffn_gate_shexp.weight"} <= set(tensors)


def test_gguf_jamba_writes_its_mamba_layers_with_no_key_value_heads_and_experts_where_its_routers_are(
        family_vaults, tmp_path):
    vault = family_vaults["jamba"]
    out = export(vault, "gguf", tmp_path / "m.gguf", trunk_type="bf16")
    get, c = metadata(out, "jamba"), json.loads((vault / "config.json").read_text())
    kv, layers = c["num_key_value_heads"], c["num_hidden_layers"]
    attention = [i % c["attn_layer_period"] == c["attn_layer_offset"] for i in range(layers)]
    assert list(get("attention.head_count_kv")) == [kv if a else 0 for a in attention] == [0, 0, kv, 0]
    assert (get("ssm.conv_kernel"), get("ssm.inner_size"), get("ssm.state_size"), get("ssm.time_step_rank")) == (
        c["mamba_d_conv"], c["mamba_expand"] * c["hidden_size"], c["mamba_d_state"], c["mamba_dt_rank"])
    assert get("feed_forward_length") == c["intermediate_size"] == 32  # the dense layers' width and the experts'
    assert get("attention.layer_norm_rms_epsilon") == pytest.approx(c["rms_norm_eps"])  # also the dt, B and C norms'
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    mamba = "model.layers.0.mamba."
    for name in ("blk.0.ssm_a", "blk.0.ssm_d", "blk.0.ssm_conv1d.weight"):  # F32 whatever the trunk type
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_a"), -torch.exp(trunk[mamba + "A_log"].float()))
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_d"), trunk[mamba + "D"].float())
    assert torch.equal(trunk_tensor(tensors, "blk.0.ssm_conv1d.weight"), trunk[mamba + "conv1d.weight"].float().squeeze(1))
    for norm in ("dt", "b", "c"):
        assert torch.equal(trunk_tensor(tensors, f"blk.0.ssm_{norm}_norm.weight"), trunk[mamba + f"{norm}_layernorm.weight"])
    assert {"blk.0.ssm_in.weight", "blk.0.ssm_x.weight", "blk.0.ssm_dt.bias", "blk.0.ssm_out.weight"} <= set(tensors)
    with Vault(vault) as v:
        moe_layers = v.meta["moe_layers"]
    assert moe_layers == [1, 3]
    for layer in range(layers):  # a dense MLP where there is no router, attention only on the layers with kv heads
        assert (f"blk.{layer}.ffn_gate_inp.weight" in tensors) == (layer in moe_layers)
        assert (f"blk.{layer}.ffn_gate.weight" in tensors) == (layer not in moe_layers)
        assert (f"blk.{layer}.attn_q.weight" in tensors) == attention[layer] != (f"blk.{layer}.ssm_in.weight" in tensors)
    q = trunk["model.layers.2.self_attn.q_proj.weight"].to(torch.bfloat16)  # no rotary: rows as they are
    assert torch.equal(trunk_tensor(tensors, "blk.2.attn_q.weight").view(torch.bfloat16), q)


@pytest.mark.parametrize("family", ["solar_open", "sarvam_moe"])
def test_gguf_solar_open_and_sarvam_moe_are_glm4moe_with_whole_head_rotary_and_the_routing_smoe_describes(
        family_vaults, tmp_path, family):
    from smoe.source.description import describe_model

    vault = family_vaults[family]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    get = metadata(out, "glm4moe")
    with Vault(vault) as v:
        c, moe_layers = v.config, v.meta["moe_layers"]
    r = describe_model(c).routing
    assert get("rope.dimension_count") == c["head_dim"]  # transformers rotates the whole head of both
    assert get("leading_dense_block_count") == moe_layers[0] and get("expert_shared_count") == c["n_shared_experts"]
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm") == r.normalise
    assert get("expert_weights_scale") == pytest.approx(c["routed_scaling_factor"]) and r.scale == 2.5
    assert (get("expert_group_count"), get("expert_group_used_count")) == (c["n_group"], c["topk_group"]) == (4, 2)
    tensors = gguf_tensors(out)
    assert {"blk.1.attn_q.bias", "blk.1.exp_probs_b.bias", "blk.1.ffn_gate_shexp.weight"} <= set(tensors)
    assert ("blk.1.attn_q_norm.weight" in tensors) == (family == "sarvam_moe")  # Solar Open has Llama's attention


def test_gguf_sarvam_moe_splits_the_release_s_fused_qkv_and_renames_its_attention_as_transformers_does(
        family_vaults, tmp_path):
    vault = family_vaults["sarvam_moe"]
    tensors, trunk = gguf_tensors(export(vault, "gguf", tmp_path / "m.gguf")), load_file(vault / TRUNK_FILE)
    c = json.loads((vault / "config.json").read_text())
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    for suffix in ("weight", "bias"):  # the release's rows [q | k | v]
        fused = trunk[f"model.layers.1.attention.query_key_value.{suffix}"]
        for name, rows in (("attn_q", fused[:q]), ("attn_k", fused[q:q + kv]), ("attn_v", fused[q + kv:])):
            assert torch.equal(trunk_tensor(tensors, f"blk.1.{name}.{suffix}"), rows)
    for gguf_name, key in (("token_embd.weight", "model.word_embeddings.weight"),
                           ("blk.1.attn_output.weight", "model.layers.1.attention.dense.weight"),
                           ("blk.1.attn_q_norm.weight", "model.layers.1.attention.query_layernorm.weight"),
                           ("blk.1.attn_k_norm.weight", "model.layers.1.attention.key_layernorm.weight"),
                           ("blk.1.exp_probs_b.bias", "model.layers.1.mlp.gate.expert_bias")):
        assert torch.equal(trunk_tensor(tensors, gguf_name), trunk[key].float())
    assert not any("qkv" in n for n in tensors)


@pytest.mark.parametrize("family,arch", [("sarvam_mla", "deepseek2"), ("glm4_moe_lite", "deepseek2"),
                                         ("mistral4", "mistral4")])
def test_gguf_families_with_deepseek_v3_s_attention_write_mla_and_route_as_smoe_describes(
        family_vaults, tmp_path, family, arch):
    from smoe.source.description import describe_model

    vault = family_vaults[family]
    out = export(vault, "gguf", tmp_path / "m.gguf")
    get, fields = metadata(out, arch), gguf.GGUFReader(out).fields
    with Vault(vault) as v:
        c, moe_layers = v.config, v.meta["moe_layers"]
    desc = describe_model(c)
    assert field(gguf.GGUFReader(out), "general.architecture") == arch
    assert get("attention.head_count_kv") == 1 and get("attention.kv_lora_rank") == c["kv_lora_rank"]
    assert get("attention.key_length_mla") == c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    assert get("attention.q_lora_rank") == c["q_lora_rank"] == 32
    assert get("leading_dense_block_count") == moe_layers[0] == 1  # GLM-4.7-Flash's from mlp_layer_types
    gating = {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}
    assert get("expert_gating_func") == gating[desc.routing.scoring] and get("expert_weights_norm")
    assert get("expert_weights_scale") == pytest.approx(desc.routing.scale)
    assert (get("expert_group_count"), get("expert_group_used_count")) == (c["n_group"], c["topk_group"]) == (4, 2)
    rope = c["rope_parameters"]
    if family == "mistral4":  # the query temperature 1 + beta · log(1 + floor(position / length))
        assert get("attention.temperature_scale") == pytest.approx(rope["llama_4_scaling_beta"])
        assert get("attention.temperature_length") == rope["original_max_position_embeddings"] == 16
    else:
        assert f"{arch}.attention.temperature_scale" not in fields
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    heads, nope, v, latent = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    kv_b = trunk["model.layers.1.self_attn.kv_b_proj.weight"].view(heads, nope + v, latent)
    assert torch.equal(trunk_tensor(tensors, "blk.1.attn_k_b.weight"), kv_b[:, :nope].transpose(1, 2))
    assert torch.equal(trunk_tensor(tensors, "blk.1.attn_v_b.weight"), kv_b[:, nope:])
    if desc.routing.correction_bias:
        assert torch.equal(trunk_tensor(tensors, "blk.1.exp_probs_b.bias"),
                           trunk["model.layers.1.mlp.gate.e_score_correction_bias"].float())


def test_hy_v4_description_routes_as_its_router():
    """The export holds HY-V4's router to the row's routing through the description: route, from it, picks the experts
    and weights of transformers' router (with a correction bias drawn)."""
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4TopkRouter

    from smoe.moe.routing import route
    from smoe.source.description import describe_model

    config = exportable_config("hy_v4", architecture=dict(n_routed_experts=8, num_experts_per_tok=3))
    router = HYV4TopkRouter(config)
    generator = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=generator)
    router.e_score_correction_bias.copy_(torch.randn(8, generator=generator) * 0.1)
    logits, want_w, want_ids = router(torch.randn(64, config.hidden_size, generator=generator))
    ids, weights = route(describe_model(config.to_dict()).routing, logits, router.e_score_correction_bias)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(-1, order.indices), want_w.gather(-1, want_order.indices))


def rotary_rows_in_pairs(t: torch.Tensor, heads: int, rope: int) -> torch.Tensor:
    """Each head's last `rope` rows reordered from halves [x0..x(r/2-1), y0..] to pairs [x0, y0, x1, y1, ...]."""
    rows = t.reshape(heads, -1, *t.shape[1:]).clone()
    half = rows[:, -rope:].clone()
    rows[:, -rope::2], rows[:, -rope + 1::2] = half[:, : rope // 2], half[:, rope // 2:]
    return rows.reshape(t.shape)


@pytest.fixture(scope="module")
def hy_v4_export(tmp_path_factory):
    """A tiny HY-V4's vault (the names transformers saves: the release's) and its GGUF with a BF16 trunk."""
    tmp = tmp_path_factory.mktemp("hy_v4")
    vault = exportable_vault(tmp, "hy_v4", 4)
    return vault, export(vault, "gguf", tmp / "m.gguf", trunk_type="bf16")


def test_gguf_hy_v4_writes_its_hyper_connections_indexer_and_clamp_as_llama_cpp_reads_them(hy_v4_export):
    vault, out = hy_v4_export
    get, c = metadata(out, "hy_v4"), json.loads((vault / "config.json").read_text())
    assert field(gguf.GGUFReader(out), "general.architecture") == "hy_v4"
    assert (get("hyper_connection.count"), get("hyper_connection.magnitude")) == (c["hc_mult"], c["hc_magnitude"])
    assert get("hyper_connection.epsilon") == pytest.approx(c["hc_eps"])
    assert list(get("swiglu_clamp_exp")) == [c["swiglu_limit"]] * c["num_hidden_layers"]
    assert (get("attention.indexer.head_count"), get("attention.indexer.key_length"), get("attention.indexer.top_k")) \
        == (c["index_n_heads"], c["index_head_dim"], c["index_topk"])
    assert list(get("attention.indexer.types")) == [t == "full" for t in c["indexer_types"]] == [True, True, False]
    assert get("attention.head_count_kv") == 1 and get("attention.key_length_mla") == c["qk_head_dim"]
    assert get("leading_dense_block_count") == 1 and get("expert_shared_count") == c["n_shared_experts"]
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm")
    assert get("expert_weights_scale") == pytest.approx(c["routed_scaling_factor"])
    assert "hy_v4.expert_group_count" not in gguf.GGUFReader(out).fields  # the graph reads no groups


def test_gguf_hy_v4_names_the_release_s_tensors_as_transformers_renames_them_keeping_the_mixings_f32(hy_v4_export):
    vault, out = hy_v4_export
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    renamed = {"output_hc_fn.weight": "model.hc_pre.hc_head.hc_head_fn",
               "output_hc_scale.weight": "model.hc_pre.hc_head.hc_head_scale",
               "blk.1.hc_attn_fn.weight": "model.layers.1.hc_pre.hc_attn_layer.hc_fn",
               "blk.1.hc_ffn_base.weight": "model.layers.1.hc_pre.hc_mlp_layer.hc_base",
               "blk.1.attn_sinks.weight": "model.layers.1.self_attn.learnable_sink_param"}
    for name, key in renamed.items():  # F32 whatever the trunk type, as the converter keeps them
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(trunk_tensor(tensors, name), trunk[key])
    bf16 = {"blk.1.attn_gate.weight": "model.layers.1.self_attn.linear_gate.weight",
            "blk.0.ffn_gate.weight": "model.layers.0.mlp.linear_gate.weight",
            "blk.1.ffn_gate_shexp.weight": "model.layers.1.mlp.shared_experts.linear_gate.weight"}
    for name, key in bf16.items():
        assert torch.equal(trunk_tensor(tensors, name).view(torch.bfloat16), trunk[key].to(torch.bfloat16))


@pytest.fixture(scope="module")
def deepseek_v4_export(tmp_path_factory):
    """A tiny DeepSeek-V4's vault (the release's names, as transformers saves them) and its GGUF."""
    tmp = tmp_path_factory.mktemp("deepseek_v4")
    vault = exportable_vault(tmp, "deepseek_v4", 4)
    return vault, export(vault, "gguf", tmp / "m.gguf")


def test_gguf_deepseek_v4_writes_what_llama_cpp_s_converter_writes(deepseek_v4_export):
    vault, out = deepseek_v4_export
    get, c = metadata(out, "deepseek4"), json.loads((vault / "config.json").read_text())
    assert field(gguf.GGUFReader(out), "general.architecture") == "deepseek4"
    assert get("attention.head_count_kv") == 1 and get("attention.key_length") == c["head_dim"]
    assert get("rope.dimension_count") == c["head_dim"] * c["rope_parameters"]["main"]["partial_rotary_factor"]
    assert get("expert_gating_func") == 4 and get("expert_weights_scale") == c["routed_scaling_factor"]
    rates = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert get("attention.compress_ratios") == [rates[t] for t in c["layer_types"]]
    assert get("attention.compress_rope_freq_base") == c["rope_parameters"]["compress"]["rope_theta"]
    assert (get("attention.output_group_count"), get("attention.output_lora_rank")) == (c["o_groups"], c["o_lora_rank"])
    assert (get("hyper_connection.count"), get("hyper_connection.sinkhorn_iterations")) == (c["hc_mult"],
                                                                                           c["hc_sinkhorn_iters"])
    assert get("swiglu_clamp_exp") == get("swiglu_clamp_shexp") == [c["swiglu_limit"]] * c["num_hidden_layers"]
    assert get("hash_layer_count") == 1 and get("embedding_length_out") == c["hidden_size"] * c["hc_mult"]


def test_gguf_deepseek_v4_names_the_release_s_tensors_as_llama_cpp_keeping_the_mixings_f32(deepseek_v4_export):
    vault, out = deepseek_v4_export
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    trunk = load_file(vault / TRUNK_FILE)
    for name, key in (("blk.1.attn_output_a.weight", "model.layers.1.attn.wo_a.weight"),
                      ("blk.2.indexer_compressor_ape.weight", "model.layers.2.attn.indexer.compressor.ape"),
                      ("blk.0.hc_ffn_fn.weight", "model.layers.0.hc_ffn_fn"), ("output_hc_fn.weight", "model.hc_head.hc_fn")):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(trunk_tensor(tensors, name), trunk[key])
    assert "blk.0.indexer.proj.weight" not in tensors  # only the sparse layer has an indexer


def test_gguf_deepseek_v4_writes_its_hash_routed_layer_s_token_id_table_as_i32(deepseek_v4_export):
    """The first layer is hash-routed: its table tid2eid (the vault's one integer trunk tensor, [vocab, top_k]) is
    written as llama.cpp's converter writes it, I32 ffn_gate_tid2eid, and that layer has no correction bias."""
    vault, out = deepseek_v4_export
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    table = load_file(vault / TRUNK_FILE)["model.layers.0.ffn.gate.tid2eid"]
    written = tensors["blk.0.ffn_gate_tid2eid.weight"]
    assert written.tensor_type == gguf.GGMLQuantizationType.I32
    assert np.array_equal(np.asarray(written.data).reshape(table.shape), table.numpy())
    assert len({tuple(row) for row in table.tolist()}) > 1  # tokens go to different experts
    assert "blk.0.exp_probs_b.bias" not in tensors and "blk.1.ffn_gate_tid2eid.weight" not in tensors


def test_gguf_an_integer_trunk_tensor_other_than_the_hash_table_is_refused_by_name(deepseek_v4_export, tmp_path):
    """Only the token-id table may be integer: the hash-routed layer's router in int8 is damage, refused by name."""
    import shutil

    from safetensors.torch import save_file

    from smoe.errors import SmoeError
    from smoe.testing.vaults import reseal

    vault = shutil.copytree(deepseek_v4_export[0], tmp_path / "v")
    tensors = load_file(vault / TRUNK_FILE)
    tensors["model.layers.0.ffn.gate.weight"] = tensors["model.layers.0.ffn.gate.weight"].to(torch.int8)
    save_file(tensors, vault / TRUNK_FILE, metadata={"format": "pt"})
    reseal(vault, TRUNK_FILE, (vault / TRUNK_FILE).read_bytes())
    with pytest.raises(SmoeError, match=r"model\.layers\.0\.ffn\.gate\.weight: I8 in the vault"):
        export(vault, "gguf", tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_gguf_a_hash_table_naming_an_expert_the_model_lacks_is_refused_and_nothing_is_written(deepseek_v4_export,
                                                                                                tmp_path):
    """llama.cpp looks the table's expert ids up unchecked: an id past the last expert is refused by name."""
    import shutil

    from safetensors.torch import save_file

    from smoe.errors import SmoeError
    from smoe.testing.vaults import reseal

    vault = shutil.copytree(deepseek_v4_export[0], tmp_path / "v")
    tensors = load_file(vault / TRUNK_FILE)
    experts = json.loads((vault / "config.json").read_text())["n_routed_experts"]
    tensors["model.layers.0.ffn.gate.tid2eid"][3, 0] = experts
    save_file(tensors, vault / TRUNK_FILE, metadata={"format": "pt"})
    reseal(vault, TRUNK_FILE, (vault / TRUNK_FILE).read_bytes())
    with pytest.raises(SmoeError, match=rf"tid2eid: expert ids outside 0..{experts - 1}"):
        export(vault, "gguf", tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
    assert not list(tmp_path.glob("m.gguf*"))


def test_gguf_hy_v4_turns_its_rotary_rows_into_the_adjacent_pairs_llama_cpp_rotates(hy_v4_export):
    """transformers' HY-V4 rotates each head's rotary part as two halves, llama.cpp's hy_v4 adjacent pairs: the rows of
    the queries, the shared rotary key and the indexer's q, k and key norm are reordered into pairs."""
    vault, out = hy_v4_export
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    c = json.loads((vault / "config.json").read_text())
    rope, attn = c["qk_rope_head_dim"], "model.layers.0.self_attn."
    rows = {"attn_q_b.weight": ("q_b_proj.weight", c["num_attention_heads"]), "attn_kv_a_mqa.weight":
            ("kv_a_proj_with_mqa.weight", 1), "indexer.attn_q_b.weight": ("indexer.wq_b.weight", c["index_n_heads"]),
            "indexer.attn_k.weight": ("indexer.wk.weight", 1)}
    for name, (key, heads) in rows.items():
        want = rotary_rows_in_pairs(trunk[attn + key].to(torch.bfloat16), heads, rope)
        assert torch.equal(trunk_tensor(tensors, f"blk.0.{name}").view(torch.bfloat16), want)
    for suffix in ("weight", "bias"):
        want = rotary_rows_in_pairs(trunk[attn + f"indexer.k_norm.{suffix}"], 1, rope)
        assert torch.equal(trunk_tensor(tensors, f"blk.0.indexer.k_norm.{suffix}"), want)


# MiniMax-M3's text model as llama.cpp's minimax-m3 computes it: a leading dense layer, block-sparse MoE layers with one
# indexer head per key/value head, half of each head turned (rope_parameters' factor; transformers reads no rotary_dim)
MINIMAX_M3 = dict(num_hidden_layers=3, head_dim=32, num_key_value_heads=2, index_n_heads=2, index_head_dim=32,
                  index_block_size=16, index_topk_blocks=2, layer_types=["full_attention"] + ["minimax_m3_sparse"] * 2,
                  mlp_layer_types=["dense", "sparse", "sparse"], intermediate_size=32, shared_intermediate_size=32,
                  dense_intermediate_size=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                               "partial_rotary_factor": 0.5})


def minimax_m3_config(**changes) -> dict:
    """MiniMax-M3's config.json with MINIMAX_M3 and `changes` over its text model's values."""
    from transformers import MiniMaxM3VLConfig

    from smoe.testing.tiny_models import tiny_default_config

    config = tiny_default_config("minimax_m3_vl").to_dict()
    text = config["text_config"] | MINIMAX_M3 | dict(vocab_size=300) | changes
    return MiniMaxM3VLConfig(**config | dict(text_config=text)).to_dict()


@pytest.mark.parametrize("changes,shapes,named", [
    ({}, {}, None),
    (dict(swiglu_alpha=1.5), {}, "clamps SwiGLU at alpha 1.702, limit 7"),
    (dict(swiglu_limit=5.0), {}, "clamps SwiGLU at alpha 1.702, limit 7"),
    (dict(layer_types=["full_attention", "minimax_m3_sparse", "full_attention"]), {},
     r"exactly the MoE layers \[1, 2\]; this model's sparse layers are \[1\]"),
    (dict(index_n_heads=1), {}, "one indexer head per key/value head"),
    (dict(index_head_dim=8), {}, "turns 16 dimensions of each indexer head"),
    (dict(mlp_layer_types=["sparse", "dense", "sparse"], layer_types=["minimax_m3_sparse", "full_attention",
                                                                       "minimax_m3_sparse"]),
     {}, "dense layers only before the MoE ones"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.5,
                           "original_max_position_embeddings": 64}), {}, "RoPE scaling 'yarn'"),
    (dict(tie_word_embeddings=True), {}, "reads an output matrix of its own"),
    ({}, {"model.language_model.layers.1.mlp.shared_experts.down_proj.weight": (64, 64)},
     "shared experts 64 wide; llama.cpp's minimax-m3 takes 1 × the routed experts' 32"),
])
def test_gguf_refuses_what_minimax_m3_computes_differently(changes, shapes, named):
    assert_gguf_check("minimax_m3_vl", minimax_m3_config(**changes), shapes, named)


def assert_gguf_check(family: str, config: dict, shapes: dict, named: str | None) -> None:
    """The family's export check on `config` passes (named None) or refuses with a message matching `named`."""
    from smoe.errors import SmoeError
    from smoe.export import gguf_families
    from smoe.source.description import describe_model

    desc = describe_model(config)
    run = lambda: gguf_families.check(family, gguf_families.config_view(family, config), desc,
                                      list(desc.moe_layers), shapes, 32)
    if named is None:
        assert run() is None
        return
    with pytest.raises(SmoeError, match=named):
        run()


@pytest.fixture(scope="module")
def minimax_m3_export(tmp_path_factory):
    """A tiny MiniMax-M3's vault (its text model and vision tower under the release's names) and its GGUF with a BF16
    trunk."""
    from export_models import multimodal_model, save_byte_level_tokenizer

    from smoe.convert.sculpt import sculpt

    tmp = tmp_path_factory.mktemp("minimax_m3")
    torch.manual_seed(0)
    multimodal_model("minimax_m3_vl", MINIMAX_M3).save_pretrained(tmp / "model")
    save_byte_level_tokenizer(tmp / "model")
    sculpt(tmp / "model", tmp / "vault", bits=4, progress=False)
    return tmp / "vault", export(tmp / "vault", "gguf", tmp / "m.gguf", trunk_type="bf16")


def test_gguf_minimax_m3_writes_its_indexer_and_the_rotary_width_transformers_turns(minimax_m3_export):
    vault, out = minimax_m3_export
    get, c = metadata(out, "minimax-m3"), json.loads((vault / "config.json").read_text())["text_config"]
    assert field(gguf.GGUFReader(out), "general.architecture") == "minimax-m3"
    assert (get("attention.indexer.head_count"), get("attention.indexer.key_length"), get("attention.indexer.top_k"),
            get("attention.indexer.block_size"), get("attention.indexer.local_blocks")) == (
        c["index_n_heads"], c["index_head_dim"], c["index_topk_blocks"], c["index_block_size"], c["index_local_blocks"])
    assert get("rope.dimension_count") == c["head_dim"] // 2 != c["rotary_dim"]  # the factor's, not rotary_dim's
    assert (get("feed_forward_length"), get("expert_feed_forward_length")) == (c["dense_intermediate_size"], 32)
    assert get("leading_dense_block_count") == 1 and get("expert_shared_count") == 1
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm")
    assert get("expert_weights_scale") == pytest.approx(c["routed_scaling_factor"])


def test_gguf_minimax_m3_writes_its_norms_as_1_plus_w_and_its_text_model_under_the_names_transformers_gives(
        minimax_m3_export):
    vault, out = minimax_m3_export
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    text = "language_model.model.layers.1."
    for name, key in (("blk.1.attn_norm.weight", "input_layernorm"), ("blk.1.attn_q_norm.weight", "self_attn.q_norm"),
                      ("blk.1.indexer.k_norm.weight", "self_attn.index_k_norm")):
        assert torch.equal(trunk_tensor(tensors, name), trunk[text + key + ".weight"].float() + 1)
    for name, key in (("blk.1.indexer.q_proj.weight", "self_attn.index_q_proj.weight"),  # F32, as the converter keeps
                      ("blk.1.exp_probs_b.bias", "block_sparse_moe.e_score_correction_bias")):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(trunk_tensor(tensors, name), trunk[text + key].float())
    for name, key in (("blk.1.ffn_up_shexp.weight", text + "block_sparse_moe.shared_experts.up_proj.weight"),
                      ("blk.0.ffn_gate.weight", "language_model.model.layers.0.mlp.gate_proj.weight"),
                      ("output.weight", "language_model.lm_head.weight")):
        assert torch.equal(trunk_tensor(tensors, name).view(torch.bfloat16), trunk[key].to(torch.bfloat16))
    assert not any("vision" in n or "mm" in n for n in tensors)  # the tower is llama.cpp's mmproj file's


def test_dots3_note_description_routes_as_its_router():
    """The export holds Dots3-Note's router to the row's routing through the description: route, from it, picks the
    experts and weights of transformers' router (with a correction bias drawn)."""
    from transformers.models.dots3_note.configuration_dots3_note import Dots3NoteTextConfig
    from transformers.models.dots3_note.modeling_dots3_note import Dots3NoteTextTopkRouter

    from smoe.moe.routing import route
    from smoe.source.description import describe_model

    config = dots3_note_config(n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.5)
    text = Dots3NoteTextConfig(**config["text_config"])
    router = Dots3NoteTextTopkRouter(text)
    generator = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=generator)
    router.e_score_correction_bias.copy_(torch.randn(8, generator=generator) * 0.1)
    logits, want_w, want_ids = router(torch.randn(64, text.hidden_size, generator=generator))
    ids, weights = route(describe_model(config).routing, logits, router.e_score_correction_bias)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(-1, order.indices), want_w.gather(-1, want_order.indices))


# Dots3-Note's text model as llama.cpp's dots3note computes it: a leading dense layer, two indexed layers, a sliding one
# with twice the heads, its own latent rank and head widths (per_layer_config), 8 indexer heads of a Hadamard width
DOTS3_SLIDING = dict(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, qk_nope_head_dim=24, v_head_dim=24,
                     head_dim=32)
DOTS3_NOTE = dict(num_hidden_layers=3, layer_types=["indexed_attention", "indexed_attention", "sliding_attention"],
                  mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=16, index_topk=16, index_head_dim=64,
                  index_n_heads=8, moe_intermediate_size=32, shared_experts_intermediate_size=32,
                  per_layer_config={2: DOTS3_SLIDING})


def dots3_note_config(**changes) -> dict:
    """Dots3-Note's config.json with DOTS3_NOTE and `changes` over its text model's values (the rotary parameters and
    per-layer sizes remade from them)."""
    from transformers import Dots3NoteConfig

    from smoe.testing.tiny_models import tiny_default_config

    config = tiny_default_config("dots3_note").to_dict()
    text = {k: v for k, v in config["text_config"].items() if k not in ("per_layer_config", "rope_parameters")}
    return Dots3NoteConfig(**config | dict(text_config=text | DOTS3_NOTE | dict(vocab_size=300) | changes)).to_dict()


def sliding_rotary_factor(config: dict) -> dict:
    """The config with its sliding layers' partial_rotary_factor turning 16 of their 32 dimensions, not their 8."""
    config["text_config"]["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = 0.5
    return config


@pytest.mark.parametrize("changes,edit,shapes,named", [
    ({}, None, {}, None),
    (dict(layer_types=["full_attention", "indexed_attention", "sliding_attention"]), None, {},
     r"builds indexed_attention and sliding_attention layers only"),
    (dict(layer_types=["indexed_attention"] * 3, per_layer_config={}), None, {}, "reads a sliding window"),
    (dict(layer_types=["sliding_attention"] * 3, per_layer_config={i: DOTS3_SLIDING for i in range(3)}), None, {},
     "reads the indexer's sizes"),
    (dict(per_layer_config={2: DOTS3_SLIDING | dict(qk_rope_head_dim=16, head_dim=40)}), None, {},
     r"one qk_rope_head_dim for every layer; this model's are \[8, 16\]"),
    (dict(per_layer_config={2: DOTS3_SLIDING | dict(q_lora_rank=16)}), None, {}, "one q_lora_rank for every layer"),
    (dict(rope_parameters={"indexed_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                 "original_max_position_embeddings": 64},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), None, {},
     "RoPE scaling 'yarn' on the indexed_attention layers"),
    ({}, sliding_rotary_factor, {}, "transformers turns 16 dimensions of the sliding_attention layers' heads"),
    ({}, lambda c: c | dict(swa_kv_lora_rank=32), {}, r"a config in the release's layout \(swa_kv_lora_rank\)"),
    (dict(hidden_act="gelu"), None, {}, "takes SiLU MLPs"),
    (dict(index_head_dim=32), None, {}, "index_head_dim is 32"),
    (dict(n_group=2, topk_group=1), None, {}, "routes with n_group = 1"),
    (dict(mlp_layer_types=["sparse", "dense", "sparse"]), None, {}, "dense layers only before the MoE ones"),
    (dict(attention_bias=True), None, {}, "attention biases"),
    ({}, None, {"model.layers.1.mlp.shared_experts.down_proj.weight": (64, 64)},
     "shared experts 64 wide; llama.cpp's dots3note takes 1 × the routed experts' 32"),
])
def test_gguf_refuses_what_dots3_note_computes_differently(changes, edit, shapes, named):
    config = dots3_note_config(**changes)
    assert_gguf_check("dots3_note", edit(config) if edit else config, shapes, named)


@pytest.fixture(scope="module")
def dots3_note_export(tmp_path_factory):
    """A tiny Dots3-Note's vault (its text model under model., its towers beside, as the release names them), every
    parameter drawn, and its GGUF with a BF16 trunk."""
    from export_models import draw_around_unit_scale, multimodal_model, save_byte_level_tokenizer

    from smoe.convert.sculpt import sculpt

    tmp = tmp_path_factory.mktemp("dots3_note")
    torch.manual_seed(0)
    model = multimodal_model("dots3_note", DOTS3_NOTE)
    draw_around_unit_scale(model)
    model.save_pretrained(tmp / "model")
    save_byte_level_tokenizer(tmp / "model")
    sculpt(tmp / "model", tmp / "vault", bits=4, progress=False)
    return tmp / "vault", export(tmp / "vault", "gguf", tmp / "m.gguf", trunk_type="bf16")


def test_gguf_dots3_note_writes_each_layer_kind_s_mla_sizes_rotary_base_and_indexer_as_llama_cpp_reads_them(
        dots3_note_export):
    vault, out = dots3_note_export
    get, c = metadata(out, "dots3note"), json.loads((vault / "config.json").read_text())["text_config"]
    swa, rope = c["per_layer_config"]["2"], c["qk_rope_head_dim"]
    assert field(gguf.GGUFReader(out), "general.architecture") == "dots3note"
    assert list(get("attention.head_count")) == [c["num_attention_heads"]] * 2 + [swa["num_attention_heads"]]
    assert get("attention.head_count_kv") == 1 and get("rope.dimension_count") == rope
    assert (get("attention.kv_lora_rank"), get("attention.key_length"), get("attention.value_length")) == (
        c["kv_lora_rank"], c["kv_lora_rank"] + rope, c["kv_lora_rank"])
    assert (get("attention.kv_lora_rank_swa"), get("attention.key_length_swa"), get("attention.value_length_swa")) == (
        swa["kv_lora_rank"], swa["kv_lora_rank"] + rope, swa["kv_lora_rank"])
    assert (get("attention.key_length_mla"), get("attention.value_length_mla")) == (
        c["qk_nope_head_dim"] + rope, c["v_head_dim"])
    assert (get("attention.key_length_mla_swa"), get("attention.value_length_mla_swa")) == (
        swa["qk_nope_head_dim"] + rope, swa["v_head_dim"])
    assert (get("rope.freq_base"), get("rope.freq_base_swa")) == (
        c["rope_parameters"]["indexed_attention"]["rope_theta"], c["rope_parameters"]["sliding_attention"]["rope_theta"])
    assert get("attention.sliding_window") == c["sliding_window"]
    assert list(get("attention.sliding_window_pattern")) == [False, False, True]
    assert list(get("attention.indexer.types")) == [True, True, False]
    assert (get("attention.indexer.head_count"), get("attention.indexer.key_length"), get("attention.indexer.top_k")) \
        == (c["index_n_heads"], c["index_head_dim"], c["index_topk"])
    assert get("leading_dense_block_count") == 1 and get("expert_shared_count") == c["n_shared_experts"]
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm")


def rotary_rows_in_halves(t: torch.Tensor, heads: int, rope: int) -> torch.Tensor:
    """Each head's first `rope` rows reordered from pairs [x0, y0, x1, y1, ...] to halves [x0, x1, ..., y0, y1, ...]."""
    rows = t.reshape(heads, -1, *t.shape[1:]).clone()
    pairs = rows[:, :rope].clone()
    rows[:, : rope // 2], rows[:, rope // 2: rope] = pairs[:, 0::2], pairs[:, 1::2]
    return rows.reshape(t.shape)


def test_gguf_dots3_note_folds_its_latent_scales_into_the_norms_and_splits_kv_b_by_each_layer_s_sizes(
        dots3_note_export):
    """transformers scales the normalised query and key/value latents by sqrt(hidden_size / rank), the rank of the
    layer's kind; llama.cpp reads that scale in the norms' weights, as the converter folds it."""
    vault, out = dots3_note_export
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    c = json.loads((vault / "config.json").read_text())["text_config"]
    swa, hidden = c["per_layer_config"]["2"], c["hidden_size"]
    for name, key, rank in (("blk.0.attn_q_a_norm", "model.layers.0.self_attn.q_a_layernorm", c["q_lora_rank"]),
                            ("blk.0.attn_kv_a_norm", "model.layers.0.self_attn.kv_a_layernorm", c["kv_lora_rank"]),
                            ("blk.2.attn_kv_a_norm", "model.layers.2.self_attn.kv_a_layernorm", swa["kv_lora_rank"])):
        torch.testing.assert_close(trunk_tensor(tensors, f"{name}.weight"), trunk[f"{key}.weight"] * (hidden / rank) ** 0.5)
    assert torch.equal(trunk_tensor(tensors, "blk.2.attn_k_norm.weight"),
                       trunk["model.layers.2.self_attn.k_rope_only_layernorm.weight"])
    assert torch.equal(trunk_tensor(tensors, "blk.2.attn_gate.weight").view(torch.bfloat16),
                       trunk["model.layers.2.self_attn.g_proj.weight"].to(torch.bfloat16))
    heads, nope = swa["num_attention_heads"], swa["qk_nope_head_dim"]
    kv_b = trunk["model.layers.2.self_attn.kv_b_proj.weight"].to(torch.bfloat16).view(heads, nope + swa["v_head_dim"], -1)
    assert torch.equal(trunk_tensor(tensors, "blk.2.attn_k_b.weight").view(torch.bfloat16),
                       kv_b[:, :nope].transpose(1, 2))
    assert torch.equal(trunk_tensor(tensors, "blk.2.attn_v_b.weight").view(torch.bfloat16), kv_b[:, nope:])
    assert not any(n.startswith(("v.", "a.", "mm")) or "vision" in n or "audio" in n for n in tensors)


def test_gguf_dots3_note_turns_its_indexer_rows_into_the_halves_llama_cpp_rotates(dots3_note_export):
    """transformers' Dots3-Note indexer rotates the first qk_rope_head_dim of each head as adjacent pairs, llama.cpp's
    dots3note as two halves (NeoX): the rows of the indexer's q, k and key norm are reordered into halves."""
    vault, out = dots3_note_export
    tensors, trunk = gguf_tensors(out), load_file(vault / TRUNK_FILE)
    c = json.loads((vault / "config.json").read_text())["text_config"]
    rope, attn = c["qk_rope_head_dim"], "model.layers.0.self_attn.indexer."
    for name, key, heads in (("attn_q_b.weight", "wq_b.weight", c["index_n_heads"]), ("attn_k.weight", "wk.weight", 1)):
        want = rotary_rows_in_halves(trunk[attn + key].to(torch.bfloat16), heads, rope)
        assert torch.equal(trunk_tensor(tensors, f"blk.0.indexer.{name}").view(torch.bfloat16), want)
    for suffix in ("weight", "bias"):
        want = rotary_rows_in_halves(trunk[attn + f"k_norm.{suffix}"], 1, rope)
        assert torch.equal(trunk_tensor(tensors, f"blk.0.indexer.k_norm.{suffix}"), want)


def test_gguf_phimoe_is_refused_naming_the_routing_llama_cpp_computes_otherwise(tmp_path):
    tiny_vault(tmp_path, "phimoe")
    r = smoe_cli("export", tmp_path / "vault", "--to", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 2 and "phimoe: llama.cpp's phimoe weighs" in r.stderr and "sparsemixer" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "m.gguf").exists()


def test_gguf_olmoe_with_grouped_query_attention_is_refused_at_export_by_name(tmp_path):
    tiny_vault(tmp_path, "olmoe")  # 2 key/value heads for 4: llama.cpp's olmoe sizes k as n_head heads
    r = smoe_cli("export", tmp_path / "vault", "--to", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 2 and "as many key/value heads as heads" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "m.gguf").exists()


# --- errors and atomic output --------------------------------------------------------------------


@pytest.mark.parametrize("to,family", [("gguf", "phimoe"), ("mlx", "jamba")])
def test_unsupported_family_is_refused_by_name(tmp_path, to, family):
    tiny_vault(tmp_path, family)  # PhiMoE's sparsemixer: llama.cpp weighs by a plain softmax; Jamba's router in mlx-lm
    r = smoe_cli("export", tmp_path / "vault", "--to", to, "-o", tmp_path / "out")
    assert r.returncode == 2 and r.stderr.startswith("smoe: error:") and family in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "vault"]  # nothing half-written


def test_gguf_refuses_dense_layers_and_non_byte_level_tokenizers(tmp_path):
    tiny_vault(tmp_path, "qwen3_moe")  # decoder_sparse_step 2: dense layers between MoE ones
    r = smoe_cli("export", tmp_path / "vault", "--to", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 2 and "every layer to be MoE" in r.stderr
    # mixtral's tokenizer splits on whitespace, not byte-level
    vault_of(tiny_model_dir(tmp_path, "mixtral", name="model2"), tmp_path / "vault2")
    r = smoe_cli("export", tmp_path / "vault2", "--to", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 2 and "byte-level BPE" in r.stderr
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob("m.gguf.partial-*"))


def test_existing_output_needs_force_and_is_replaced_whole(vaults, tmp_path):
    vault = vaults[("qwen3_moe", 4)]
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    r = smoe_cli("export", vault, "--to", "gguf", "-o", out)
    assert r.returncode == 2 and "already exists" in r.stderr and out.read_bytes() == b"old"
    r = smoe_cli("export", vault, "--to", "gguf", "-o", out, "--force", "-q")
    assert r.returncode == 0, r.stderr
    assert field(gguf.GGUFReader(out), "general.architecture") == "qwen3moe"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_bad_inputs_give_one_line_errors(vaults, tmp_path):
    r = smoe_cli("export", tmp_path / "missing", "--to", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 2 and "not a vault" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = smoe_cli("export", vaults[("qwen3_moe", 4)], "--to", "gguf", "-o", tmp_path / "no" / "m.gguf")
    assert r.returncode == 2 and "no such directory" in r.stderr
    r = smoe_cli("export", vaults[("qwen3_moe", 4)], "--to", "mlx", "-o", tmp_path / "d", "--trunk-type", "f16")
    assert r.returncode == 2 and "--trunk-type" in r.stderr
