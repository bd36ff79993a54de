"""GGUF export of the families written under names the pinned gguf package lacks (mellum, hy_v3, cohere2moe), of DBRX,
Qwen3.5-MoE, Gemma 4, Nemotron-H, MiniMax, Qwen3-VL-MoE's text model, Kimi-Linear, Granite-MoE-SWA, MiMo-V2-Flash and
the indexers of DeepSeek-V3.2 and GLM-5 (glm_moe_dsa), Laguna, Step-3.7's text model (step35), GLM-5.3's text model
(glm5-next), and the q/k rows llama.cpp's adjacent-pair RoPE takes: what each llama.cpp graph computes differently is
refused by name, and Qwen4-Exp, whose llama.cpp graph is marked for reimplementation, as a whole."""

import json

import gguf
import pytest
import torch
from export_models import (
    draw_around_unit_scale,
    exportable_config,
    exportable_vault,
    multimodal_model,
    save_byte_level_tokenizer,
    save_exportable_model,
)
from safetensors.torch import load_file

from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.export import gguf_families, gguf_mla
from smoe.export.writer import export
from smoe.format.vault import TRUNK_FILE
from smoe.source.description import describe_model
from smoe.source.gguf import permute_rope
from smoe.testing.tiny_models import tiny_default_config

FULL_BASE_ONLY = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16)


def mimo_rope(full: float | None, sliding: float | None) -> dict:
    """MiMo-V2-Flash's rotary parameters per layer type, with these partial factors (None: named nowhere)."""
    kinds = {"full_attention": (5e6, full), "sliding_attention": (1e4, sliding)}
    return {t: {"rope_type": "default", "rope_theta": theta, **({"partial_rotary_factor": f} if f else {})}
            for t, (theta, f) in kinds.items()}


# Laguna's full layers with YaRN, its sliding ones plain
LAGUNA_YARN = {"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "partial_rotary_factor": 0.5, "factor": 4.0,
                                  "original_max_position_embeddings": 64},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}
# a leading dense layer that is a full one: Cohere2-MoE rotates it only where prefix_dense_sliding_window_pattern is 1
COHERE2_DENSE_FULL = dict(mlp_layer_types=["dense", "sparse", "sparse"],
                          layer_types=["full_attention", "sliding_attention", "full_attention"])


@pytest.mark.parametrize("family,changes,named", [
    ("mellum", FULL_BASE_ONLY, "rotates sliding layers at the full layers' base"),
    ("dbrx", dict(ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32,
                              "moe_normalize_expert_weights": 2.0}), "'p-norm 2.0'"),
    ("dbrx", dict(ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32,
                              "ffn_act_fn": {"name": "gelu"}}), "takes SiLU experts"),
    ("hy_v3", dict(attention_bias=True), "attention biases"),
    ("qwen3_5_moe_text", {}, r"M-RoPE sections spanning at most a head \(16\); this model's are \[11, 11, 10, 0\]"),
    ("qwen3_5_moe_text", dict(head_dim=64, rms_norm_eps=1e-5), "q/k L2-norm eps"),
    ("granitemoe_swa", dict(layer_rope_theta=[1e4, 5e5]), "does not compute rope_per_layer_type"),
    ("granitemoe_swa", dict(sliding_window=None), "needs sliding-window layers"),
    ("kimi_linear", dict(linear_num_heads=2), "as many delta-attention heads as attention heads"),
    ("kimi_linear", dict(moe_renormalize=False), "routes with normalise = True"),
    ("qwen3_vl_moe", {}, r"qwen3vlmoe takes M-RoPE sections spanning at most a head \(16\); this model's are "
     r"\[24, 20, 20, 0\]"),
    ("gemma4_text", dict(hidden_size_per_layer_input=8), "per-layer embeddings"),
    ("gemma4_text", dict(per_layer_config={"0": {"head_dim": 32}, "1": {"head_dim": 32}}), "per_layer_config"),
    ("nemotron_h", dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"]),
     r"layers \[3\] are dense MLPs"),
    ("nemotron_h", dict(time_step_min=0.01), "does not clamp the Mamba2 time step"),
    ("nemotron_h", dict(moe_shared_expert_intermediate_size=0), "needs the shared expert"),
    ("minimax", dict(mlp_alpha_factor=2.0), "scales every residual by one factor"),
    ("minimax", dict(full_attn_beta_factor=0.5), "scales every residual by one factor"),
    ("minimax", dict(partial_rotary_factor=0.5), "turns the whole head"),
    ("cohere2_moe", dict(num_shared_experts=1, shared_expert_combination_strategy="sum"), "averages the shared experts"),
    ("cohere2_moe", COHERE2_DENSE_FULL | dict(prefix_dense_sliding_window_pattern=2),
     r"layers without rotary are \(0, 2\), not \(2,\)"),
    ("cohere2_moe", dict(sliding_window=None), "needs sliding-window layers"),
    ("cohere2_moe", dict(hidden_act="gelu"), "takes SiLU experts"),
    ("cohere2_moe", dict(attention_bias=True), "attention biases"),
    ("cohere2_moe", dict(logit_scale=0.0), "reads a logit_scale of 0 as none"),
    ("cohere2_moe", dict(mlp_layer_types=["sparse", "dense", "sparse"]), "dense layers only before the MoE ones"),
    ("mimo_v2_flash", dict(layer_types=["full_attention"] * 2), "needs sliding-window layers"),
    ("mimo_v2_flash", dict(rope_parameters=mimo_rope(0.5, 0.334)), "turns one rotary width on every layer"),
    ("mimo_v2_flash", dict(rope_parameters=mimo_rope(None, None)), "turns one rotary width on every layer"),
    ("mimo_v2_flash", dict(routed_scaling_factor=2.0), "routes with scale = 1.0"),
    ("mimo_v2_flash", dict(n_group=2, topk_group=1), "routes with n_group = 1"),
    ("mimo_v2_flash", dict(attention_bias=True), "attention biases"),
    ("laguna", dict(moe_router_logit_softcapping=30.0), "router has 'router logits soft-capped'"),
    ("laguna", dict(rope_parameters=LAGUNA_YARN), "RoPE scaling {'full_attention': 'yarn'"),
    ("laguna", dict(hidden_act="gelu"), "takes SiLU experts"),
    ("laguna", dict(attention_bias=True), "attention biases"),
    ("laguna", dict(mlp_layer_types=["sparse", "dense"]), "dense layers only before the MoE ones"),
])
def test_gguf_refuses_what_the_added_graphs_compute_differently(family, changes, named):
    config = exportable_config(family).to_dict() | changes
    desc = describe_model(config)
    with pytest.raises(SmoeError, match=named):
        gguf_families.check(family, gguf_families.config_view(family, config), desc, list(desc.moe_layers), {}, 32)


def test_gguf_mellum_with_one_rotary_base_is_written_as_mellum(tmp_path):
    vault = exportable_vault(tmp_path, "mellum", 4)
    reader = gguf.GGUFReader(export(vault, "gguf", tmp_path / "m.gguf"))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "mellum"
    assert {"blk.0.attn_q_norm.weight", "blk.1.ffn_gate_exps.weight"} <= {t.name for t in reader.tensors}


# Step-3.7's text model as llama.cpp's step35 computes it: a full layer (half of each head turned) and a sliding one
# (all of it, another base), scores by 1 / sqrt(head_dim)
STEP35_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e3, "partial_rotary_factor": 1.0}}
STEP3P7 = dict(layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=16,
               query_pre_attn_scalar=16, rope_parameters=STEP35_ROPE, swiglu_limits=[None, None, 7.0])


def step3p7_config(**changes) -> dict:
    """Step-3.7's config.json with its text model's values changed (per_layer_config remade from them)."""
    from transformers import Step3p7Config

    config = tiny_default_config("step3p7").to_dict()
    text = {k: v for k, v in config["text_config"].items() if k != "per_layer_config"} | STEP3P7 | changes
    return Step3p7Config(**config | dict(text_config=text)).to_dict()


def refused_or_passed(family: str, config: dict, named: str | None) -> None:
    """The family's GGUF checks on `config`: passed where `named` is None, else refused with that in the message."""
    desc = describe_model(config)
    run = lambda: gguf_families.check(family, gguf_families.config_view(family, config), desc,
                                      list(desc.moe_layers), {}, 32)
    if named is None:
        assert run() is None
        return
    with pytest.raises(SmoeError, match=named):
        run()


@pytest.mark.parametrize("changes,named", [
    ({}, None),
    (dict(layer_types=["full_attention"] * 3), "needs sliding-window layers"),
    (dict(gating="per-element"), "gates each head's output; this model's gating is 'per-element'"),
    (dict(rope_parameters=STEP35_ROPE | {"full_attention": LAGUNA_YARN["full_attention"]}), "RoPE scaling"),
    (dict(rope_parameters=STEP35_ROPE | {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "turns half of each head on the full layers"),
    (dict(query_pre_attn_scalar=32), "does not compute multipliers"),
    (dict(mlp_bias=True), "does not compute mlp_bias"),
    (dict(use_bidirectional_attention=True), "does not compute bidirectional_attention"),
    (dict(attention_bias=True), "attention biases"),
])
def test_gguf_refuses_what_step35_computes_differently(changes, named):
    refused_or_passed("step3p7", step3p7_config(**changes), named)


def test_gguf_step35_heads_and_rotary_width_are_the_graph_s():
    """head_count per layer (the sliding layers' own), and rope.dimension_count the whole head: step35 halves it on
    the full layers."""
    config = gguf_families.config_view("step3p7", step3p7_config(num_sliding_attention_heads=8))
    assert gguf_families.head_count("step3p7", config) == [4, 8, 4]
    assert gguf_families.rope_width("step3p7", config) == 16


def test_gguf_q_k_biases_move_with_their_rows_for_adjacent_pair_rope(tmp_path):
    """llama.cpp's granitemoe ropes adjacent pairs: q/k rows are reordered, and a bias row is part of its row."""
    vault = exportable_vault(tmp_path, "granitemoeshared", 4)
    tensors = {t.name: t for t in gguf.GGUFReader(export(vault, "gguf", tmp_path / "m.gguf")).tensors}
    trunk = load_file(vault / TRUNK_FILE)
    config = exportable_config("granitemoeshared")
    for name, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
        got = torch.from_numpy(tensors[f"blk.1.attn_{name}.bias"].data.copy())
        assert torch.equal(got, permute_rope(trunk[f"model.layers.1.self_attn.{name}_proj.bias"].float(), heads))


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("width", [16, 96])
def test_gguf_refuses_an_indexer_llama_cpp_cannot_rotate(family, width):
    """llama.cpp's deepseek32 and glm-dsa rotate the indexer's q and k by a Hadamard matrix of a power of two from 64."""
    config = exportable_config(family).to_dict() | dict(index_head_dim=width)
    desc = describe_model(config)
    with pytest.raises(SmoeError, match=f"index_head_dim is {width}"):
        gguf_mla.check(family, config, desc, list(desc.moe_layers), {}, 32)


def test_gguf_refuses_rope_scaling_glm_dsa_reads_no_multiplier_for():
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    config = exportable_config("glm_moe_dsa", architecture=dict(index_head_dim=64)).to_dict() | dict(
        rope_parameters=rope)
    desc = describe_model(config)
    with pytest.raises(SmoeError, match="glm-dsa reads no YaRN log multiplier; RoPE scaling 'yarn'"):
        gguf_mla.check("glm_moe_dsa", config, desc, list(desc.moe_layers), {}, 32)


def test_gguf_glm_moe_dsa_is_written_as_glm_dsa_with_the_layers_that_run_their_own_indexer(tmp_path):
    types = ["full", "shared", "full"]
    model = save_exportable_model("glm_moe_dsa", tmp_path / "model", architecture=dict(index_head_dim=64,
                                                                                        indexer_types=types))
    sculpt(model, tmp_path / "vault", bits=4, progress=False)
    reader = gguf.GGUFReader(export(tmp_path / "vault", "gguf", tmp_path / "m.gguf"))
    arch = reader.fields["general.architecture"]
    written = reader.fields["glm-dsa.attention.indexer.types"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "glm-dsa"
    assert [bool(written.parts[i][0]) for i in written.data] == [True, False, True]
    names = {t.name for t in reader.tensors}
    assert "blk.2.indexer.k_norm.weight" in names and not any(n.startswith("blk.1.indexer.") for n in names)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_gguf_takes_q_lora_at_the_depths_deepseek2_reads_as_lite_for_the_indexed_graphs(family):
    """deepseek32 and glm-dsa read q_lora_rank at every depth, where deepseek2 takes 27 layers for V2-Lite without it
    (tests/test_export.py holds that refusal)."""
    config = exportable_config(family, architecture=dict(index_head_dim=64)).to_dict() | dict(q_lora_rank=32)
    desc = describe_model(config)
    deep = config | dict(num_hidden_layers=27)
    assert gguf_mla.check(family, deep, desc, list(range(1, 27)), {}, 32) is None


# GLM-5.3's text model: delta-attention layers on either side of two MLA ones, the second reusing the first's indexer
GLM5_NEXT = dict(num_hidden_layers=4, layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                                                   "linear_attention"],
                 mlp_layer_types=["dense", "sparse", "sparse", "sparse"], indexer_types=["full", "full", "shared", "full"],
                 index_topk=16, index_kpool=4, index_head_dim=32, index_n_heads=8, n_routed_experts=8, swiglu_limit=0.5)


def glm5_next_config(**changes) -> dict:
    """GLM-5.3's config.json with its text model's values changed."""
    from transformers import Glm5NextConfig

    config = tiny_default_config("glm5_next").to_dict()
    return Glm5NextConfig(**config | dict(text_config=config["text_config"] | GLM5_NEXT | changes)).to_dict()


@pytest.mark.parametrize("changes,named", [
    ({}, None),
    (dict(linear_num_heads=2), "glm5_next: llama.cpp's glm5-next takes as many delta-attention heads as attention heads"),
    (dict(hc_mult=2), "takes 4 hyper-connection streams; this model's hc_mult is 2"),
    (dict(index_kpool=1), "pools more than one key; this model's index_kpool is 1"),
    (dict(index_kpool_always_select_tail=False), "attends to no key before the first full pool"),
    (dict(hidden_act="gelu"), "takes SiLU convolutions and MLPs"),
    (dict(n_shared_experts=0), "adds a shared expert to every MoE layer"),
    (dict(swiglu_limit=1e-6), "takes a swiglu_limit at or below 1e-06 as none"),
    (dict(tie_word_embeddings=True), "reads an output matrix of its own"),
    (dict(n_group=2, topk_group=1), "routes with n_group = 1"),
    (dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]), "dense layers only before the MoE ones"),
    (dict(attention_bias=True), "attention biases"),
])
def test_gguf_refuses_what_glm5_next_computes_differently(changes, named):
    refused_or_passed("glm5_next", glm5_next_config(**changes), named)


@pytest.fixture(scope="module", params=[-5.0, None], ids=["gate-bound", "softplus-gate"])
def glm5_next_export(request, tmp_path_factory):
    """A tiny GLM-5.3's vault (the release's names, as transformers saves them; its forget gate bounded or softplus)
    and its GGUF with a BF16 trunk."""
    tmp = tmp_path_factory.mktemp("glm5_next")
    torch.manual_seed(0)
    model = multimodal_model("glm5_next", GLM5_NEXT | dict(linear_lower_bound=request.param))
    draw_around_unit_scale(model)
    model.save_pretrained(tmp / "model")
    save_byte_level_tokenizer(tmp / "model")
    sculpt(tmp / "model", tmp / "vault", bits=4, progress=False)
    return tmp / "vault", export(tmp / "vault", "gguf", tmp / "m.gguf", trunk_type="bf16")


def test_gguf_glm5_next_writes_what_llama_cpp_s_converter_writes(glm5_next_export):
    vault, out = glm5_next_export
    reader = gguf.GGUFReader(out)
    get = lambda key: reader.fields[f"glm5-next.{key}"].contents()
    c = json.loads((vault / "config.json").read_text())["text_config"]
    assert reader.fields["general.architecture"].contents() == "glm5-next"
    assert get("attention.head_count_kv") == [0, 1, 1, 0]  # the delta-attention layers have none
    assert (get("attention.q_lora_rank"), get("attention.kv_lora_rank"), get("rope.dimension_count")) == (
        c["q_lora_rank"], c["kv_lora_rank"], 0)
    assert (get("attention.key_length_mla"), get("attention.value_length_mla")) == (c["qk_nope_head_dim"],
                                                                                    c["v_head_dim"])
    assert (get("ssm.conv_kernel"), get("kda.head_dim")) == (c["linear_conv_kernel_dim"], c["linear_head_dim"])
    bound = reader.fields.get("glm5-next.kda.gate_lower_bound")  # none: llama.cpp's softplus gate
    assert (bound.contents() if bound else None) == c["linear_lower_bound"]
    assert (get("attention.indexer.head_count"), get("attention.indexer.key_length"), get("attention.indexer.top_k"),
            get("attention.indexer.kpool"), get("attention.indexer.kpool_select_tail")) == (
        c["index_n_heads"], c["index_head_dim"], c["index_topk"], c["index_kpool"], True)
    assert get("attention.indexer.types") == [True, True, False, True]
    assert get("attention.layer_norm_epsilon") == pytest.approx(1e-6)  # the indexer's key norm
    assert (get("hyper_connection.count"), get("hyper_connection.sinkhorn_iterations")) == (c["hc_mult"],
                                                                                           c["hc_sinkhorn_iters"])
    assert get("hyper_connection.epsilon") == pytest.approx(c["hc_eps"])
    assert get("swiglu_clamp_exp") == get("swiglu_clamp_shexp") == [c["swiglu_limit"]] * c["num_hidden_layers"]
    assert get("leading_dense_block_count") == 1 and get("expert_shared_count") == c["n_shared_experts"]
    assert get("expert_gating_func") == gguf.ExpertGatingFuncType.SIGMOID and get("expert_weights_norm")
    assert get("expert_weights_scale") == pytest.approx(c["routed_scaling_factor"])
    assert "glm5-next.expert_group_count" not in reader.fields  # the graph reads no groups


def test_gguf_glm5_next_names_the_release_s_tensors_as_llama_cpp_keeping_the_small_ones_f32(glm5_next_export):
    vault, out = glm5_next_export
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    trunk = load_file(vault / TRUNK_FILE)
    layer = "model.language_model.layers.{}."
    as_is = {"blk.1.hc_attn_fn.weight": layer.format(1) + "hc_attn_fn",
             "blk.2.hc_ffn_scale.weight": layer.format(2) + "hc_ffn_scale",
             "blk.1.indexer_compressor_gate.weight": layer.format(1) + "self_attn.indexer.index_kpool_compress_gate",
             "blk.1.indexer_compressor_ape.weight": layer.format(1) + "self_attn.indexer.index_kpool_compress_ape",
             "blk.1.indexer.k_norm.bias": layer.format(1) + "self_attn.indexer.k_norm.bias",
             "blk.0.ssm_dt.bias": layer.format(0) + "self_attn.dt_bias",
             "blk.3.ssm_conv1d_q.weight": layer.format(3) + "self_attn.q_conv1d.weight"}
    for name, key in as_is.items():  # F32 whatever the trunk type, as the converter keeps them
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(tensors[name].data.copy()).reshape(trunk[key].shape), trunk[key])
    a = torch.from_numpy(tensors["blk.0.ssm_a"].data.copy())
    assert torch.equal(a, -torch.exp(trunk[layer.format(0) + "self_attn.A_log"]))
    names = set(tensors)
    assert {"blk.1.indexer.attn_q_b.weight", "blk.1.indexer.proj.weight", "blk.1.attn_k_b.weight",
            "blk.3.ssm_f_a.weight", "blk.0.ffn_gate.weight", "blk.1.ffn_up_shexp.weight"} <= names
    assert not any(n.startswith("blk.2.indexer") for n in names)  # the shared layer reuses layer 1's choice
    assert not any("visual" in n or n.startswith("v.") for n in names)  # the tower is llama.cpp's mmproj file's


@pytest.mark.parametrize("family", ["qwen4_exp_text", "qwen4_exp"])
def test_gguf_qwen4_exp_is_refused_naming_the_graph_llama_cpp_marks_for_reimplementation(tmp_path, family):
    """llama.cpp 0.3.36's qwen4exp graph is marked pending complete reimplementation (TAG_QWEN4_REIMPLEMENT): nothing
    could check an export against it."""
    if family == "qwen4_exp":
        multimodal_model(family, {}).save_pretrained(tmp_path / "model")
        save_byte_level_tokenizer(tmp_path / "model")
    else:
        save_exportable_model(family, tmp_path / "model")
    sculpt(tmp_path / "model", tmp_path / "vault", bits=4, progress=False)
    with pytest.raises(SmoeError) as refused:
        export(tmp_path / "vault", "gguf", tmp_path / "m.gguf")
    message = str(refused.value)
    assert message.startswith(f"{family}: llama.cpp's qwen4exp graph is marked pending complete reimplementation")
    assert message.endswith("not exported to GGUF") and "\n" not in message and not (tmp_path / "m.gguf").exists()
