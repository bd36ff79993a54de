"""Every routing and shape value the runtime takes from config.json is checked, by every key name a
family gives it: a bad one is a one-line error when quantising (nothing written) and when a vault is
opened (a vault from an older smoe may hold one), never a crash in the compiled decode step."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smoe.cli.commands import main
from smoe.errors import SmoeError
from smoe.format.vault import CONFIG_FILE, INDEX_FILE
from smoe.source.config_checks import MAX_EXPERTS, MAX_LAYERS
from smoe.testing.vaults import reseal

NAN, INF = math.nan, math.inf

# What each kind of value must not be: the wrong sign or size, a float or bool for an int, a string, null.
NOT_A_COUNT = [0, -3, 2.0, True, "2", None]
NOT_A_SIZE = [-1, 1.5, False, "0", None]  # sizes that may be 0 (no shared expert, no MLA)
NOT_AN_EVEN_SIZE = [0, 15, 16.0, True, "16", None]
NOT_AN_EPSILON = [0, -1e-6, 1e300, NAN, True, "1e-6"]  # null: LayerNorm models (the tiny Qwen3-MoE's class refuses it)
NOT_A_BASE = [0.5, 1e-300, 1e13, NAN, True, "1e4", None]
NOT_A_SCALE = [0, 1e-7, 1e7, NAN, INF, True, "1", None]
NOT_A_TOKEN = [-2, 1.5, "eos", [], [1, "2"], True]  # -1 is "none" (nn.Embedding takes padding_idx=-1)
NOT_A_NAME = ["", 3, ["silu"]]
NOT_A_FRACTION = [0, 1.5, NAN, True, "0.5", None]
NOT_A_FLAG = [0, 1, "false", None]
NOT_LAYERS = [[-1], [1.0], [True], 3, None]

# counts past what any model has, whose per-layer or per-expert tables would exhaust memory before any other check
NOT_AN_EXPERT_COUNT = NOT_A_COUNT + [MAX_EXPERTS + 1, 10**9]
NOT_A_DEPTH = NOT_A_COUNT + [MAX_LAYERS + 1, 10**9]

KEYS = {
    # routed experts and top-k, under every family's name
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                     "ffn_config.moe_num_experts", "moe.num_experts"), NOT_AN_EXPERT_COUNT),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_top_k",
                     "moe_k", "experts_per_token", "moe_router_topk", "num_selected_experts", "ffn_config.moe_top_k",
                     "moe.experts_per_token"),
                    NOT_A_COUNT),
    # model sizes
    **dict.fromkeys(("num_hidden_layers", "n_layers", "num_layers", "n_layer"), NOT_A_DEPTH),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd",
                     "vocab_size", "max_position_embeddings", "max_seq_len", "num_attention_heads", "n_heads",
                     "num_key_value_heads", "attn_config.kv_n_heads", "intermediate_size", "moe_intermediate_size",
                     "intermediate_size_mlp", "ffn_config.ffn_hidden_size", "moe.expert_inner_dim",
                     "decoder_sparse_step", "interleave_moe_layer_step", "expert_layer_period",
                     "moe_layer_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_d_state", "mamba_d_conv",
                     "mamba_expand", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_chunk_size",
                     "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "chunk_size", "conv_kernel",
                     "block_size", "attn_layer_period", "full_attention_interval"), NOT_A_COUNT),
    **dict.fromkeys(("num_global_key_value_heads", "q_lora_rank", "kv_lora_rank", "moe_latent_size",
                     "attention_chunk_size"), NOT_A_COUNT[:-1]),  # null: none
    **dict.fromkeys(("n_group", "topk_group"), NOT_A_COUNT[:-1]),  # null: no group routing
    "head_dim": [-2, 15, 16.0, True, "16"],  # null: hidden / heads; 0: no rotary heads (MLA without rope)
    "global_head_dim": NOT_AN_EVEN_SIZE[:-1],
    "qk_rope_head_dim": [-2, 15, 16.0, True, "16", None],
    **dict.fromkeys(("qk_nope_head_dim", "v_head_dim", "shared_expert_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_intermediate_size", "n_shared_experts",
                     "num_shared_experts", "moe_num_shared_experts", "num_shared_expert", "first_k_dense_replace",
                     "num_dense_layers", "expert_layer_offset", "moe_layer_start_index", "max_window_layers",
                     "attn_layer_offset"), NOT_A_SIZE),
    **dict.fromkeys(("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers", "sliding_window"),
                    NOT_A_SIZE[:-1]),
    "moe_layer_end_index": [-2, 1.5, True, "x"],
    "moe_layer_freq": [0, 1.5, [2], [True], None],
    **dict.fromkeys(("mlp_only_layers", "moe_layers"), NOT_LAYERS),
    # routing, norms, rotary embeddings, scales
    **dict.fromkeys(("norm_topk_prob", "attention_bias", "tie_word_embeddings"), NOT_A_FLAG),
    **dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"), NOT_AN_EPSILON),
    **dict.fromkeys(("rope_theta", "attn_config.rope_theta", "rope_parameters.rope_theta",
                     "rope_parameters.full_attention.rope_theta"), NOT_A_BASE),
    **dict.fromkeys(("routed_scaling_factor", "route_scale", "embedding_multiplier", "attention_multiplier",
                     "residual_multiplier", "logits_scaling", "swiglu_limit", "rope_parameters.factor",
                     "rope_scaling.factor"), NOT_A_SCALE),
    **dict.fromkeys(("clip_qkv", "attn_config.clip_qkv", "final_logit_softcapping", "attn_logit_softcapping",
                     "rope_parameters.beta_fast", "rope_parameters.beta_slow", "rope_parameters.attention_factor",
                     "rope_parameters.low_freq_factor", "rope_parameters.high_freq_factor"), NOT_A_SCALE[:-1]),
    **dict.fromkeys(("rope_parameters.mscale", "rope_parameters.mscale_all_dim",
                     "rope_parameters.llama_4_scaling_beta"), [NAN, INF, 1e7, True, "1"]),
    **dict.fromkeys(("eos_token_id", "bos_token_id", "pad_token_id"), NOT_A_TOKEN),
    "hidden_act": NOT_A_NAME[1:],  # null: the class's default
    **dict.fromkeys(("hidden_activation", "mlp_hidden_act", "rope_parameters.rope_type"), NOT_A_NAME),
    **dict.fromkeys(("layer_types", "mlp_layer_types", "layers_block_type"), [3, [3], [""]]),
    "rope_parameters.original_max_position_embeddings": NOT_A_COUNT[:-1],
    "partial_rotary_factor": NOT_A_FRACTION,
    "rope_parameters.partial_rotary_factor": NOT_A_FRACTION[:-1],  # in a rope table, null: unused
    **dict.fromkeys(("rope_parameters.short_factor", "rope_parameters.long_factor"), [[0], [NAN], [1, -1], 1.0]),
    "text_config.num_experts_per_tok": NOT_A_COUNT,  # a wrapper's text model is checked too
}
VALUE_CASES = [(key, value) for key, values in KEYS.items() for value in values]

# Values of the right kind that contradict each other: (overrides on the tiny Qwen3-MoE of 6 experts,
# 4 layers, 4 heads over 2 key/value heads; a word the message must hold).
RELATION_CASES = {
    "top-k above the experts": ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
    "another family's top-k above the experts": ({"moe_k": 9}, "moe_k"),
    "n_group not dividing the experts": ({"n_group": 4}, "n_group"),
    "topk_group above n_group": ({"n_group": 2, "topk_group": 3}, "topk_group"),
    "kept groups holding fewer than top-k": ({"n_group": 3, "topk_group": 1, "num_experts_per_tok": 3}, "topk_group"),
    "heads not a multiple of key/value heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "heads not a multiple of global key/value heads": ({"num_global_key_value_heads": 3}, "num_global_key_value_heads"),
    "linear value heads not a multiple of key heads": ({"linear_num_key_heads": 3, "linear_num_value_heads": 4},
                                                       "linear_num_key_heads"),
    "hidden splitting into odd heads": ({"head_dim": None, "num_attention_heads": 64, "num_key_value_heads": 2},
                                        "head_dim"),
    "a window of no token": ({"sliding_window": 0, "use_sliding_window": True}, "sliding_window"),
    "MLA without rotary heads": ({"kv_lora_rank": 16, "qk_rope_head_dim": 0}, "qk_rope_head_dim"),
    "a dense layer past the last": ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    "an expert layer offset past its period": ({"expert_layer_period": 2, "expert_layer_offset": 2},
                                               "expert_layer_offset"),
    "a padding token past the vocabulary": ({"pad_token_id": 128}, "pad_token_id"),
    # values of the right kind only transformers' modules and configuration class can tell are wrong
    "an activation transformers does not know": ({"hidden_act": "bogus"}, "hidden_act"),
    "a rope type transformers does not know": ({"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4}},
                                               "rope_parameters.rope_type"),
    "layer kinds transformers does not know": ({"layer_types": ["bogus"] * 4}, "layer_types"),
    "null where the configuration class wants an epsilon": ({"rms_norm_eps": None}, "rms_norm_eps"),
    "no rotary heads where the family needs them": ({"head_dim": 0}, "head_dim"),
}
CASES = [pytest.param({key: value}, key, id=f"{key}={json.dumps(value)}") for key, value in VALUE_CASES] + [
    pytest.param(overrides, word, id=name) for name, (overrides, word) in RELATION_CASES.items()]


def edited(config: dict, overrides: dict) -> dict:
    """config with each "a.b.c" override set, nested dicts created or merged."""
    config = json.loads(json.dumps(config))
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        scope = config
        for p in parents:
            if not isinstance(scope.get(p), dict):
                scope[p] = {}
            scope = scope[p]
        scope[leaf] = value
    return config


@pytest.fixture(scope="module")
def built(tiny_qwen_vault) -> dict[str, Path]:
    """The tiny Qwen3-MoE and its vault (only copied here, never changed)."""
    return tiny_qwen_vault


def model_with(built, tmp: Path, overrides: dict) -> Path:
    """A copy of the tiny model with an edited config.json."""
    model = tmp / "model"
    model.mkdir()
    for f in built["model"].iterdir():
        shutil.copyfile(f, model / f.name)
    config = json.loads((built["model"] / CONFIG_FILE).read_text())
    (model / CONFIG_FILE).write_text(json.dumps(edited(config, overrides)))
    return model


def vault_copy(built, tmp: Path) -> Path:
    vault = tmp / "vault"
    vault.mkdir()
    for f in built["vault"].iterdir():
        shutil.copyfile(f, vault / f.name)
    return vault


def vault_with(built, tmp: Path, overrides: dict) -> Path:
    """A copy of the vault whose config.json is edited and sealed again into the index and the header,
    as a vault quantized by an older smoe (which checked nothing) holds it."""
    vault = vault_copy(built, tmp)
    config = json.loads((vault / CONFIG_FILE).read_text())
    reseal(vault, CONFIG_FILE, json.dumps(edited(config, overrides)).encode())
    return vault


def one_line_error(err: str) -> str:
    assert err.startswith("smoe: error:") and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("overrides, word", CASES)
def test_every_config_value_the_model_reads_is_checked_at_quantize(built, tmp_path, capsys, overrides, word):
    model = model_with(built, tmp_path, overrides)
    out = tmp_path / "vault"
    assert main(["quantize", str(model), "-o", str(out), "-q"]) == 2
    assert word in one_line_error(capsys.readouterr().err)
    assert not out.exists() and not list(tmp_path.glob("vault.*"))


@pytest.mark.parametrize("overrides, word", CASES)
def test_a_vault_with_a_bad_config_value_is_refused_at_open(built, tmp_path, overrides, word):
    from smoe.runtime.model import OpenedVault

    vault = vault_with(built, tmp_path, overrides)
    with pytest.raises(SmoeError, match="config.json") as refused:
        OpenedVault(vault, dtype="float32")
    assert word in str(refused.value) and "\n" not in str(refused.value)


OPENERS = {
    "generate": lambda v, tmp: ["generate", v, "-p", "the sea", "--max-tokens", "2", "--device", "cpu"],
    "eval": lambda v, tmp: ["eval", v, "--ref", v, "--data", v + "/config.json", "--device", "cpu"],
    "dequantize": lambda v, tmp: ["dequantize", v, "-o", str(tmp / "out")],
    "export gguf": lambda v, tmp: ["export", v, "--to", "gguf", "-o", str(tmp / "out.gguf"), "-q"],
    "export mlx": lambda v, tmp: ["export", v, "--to", "mlx", "-o", str(tmp / "out"), "-q"],
}


@pytest.mark.parametrize("command", OPENERS)
def test_top_k_outside_one_to_experts_is_refused_by_every_command_that_runs_a_vault(built, tmp_path, capsys, command):
    vault = vault_with(built, tmp_path, {"num_experts_per_tok": 0})
    assert main(OPENERS[command](str(vault), tmp_path)) == 2
    assert "num_experts_per_tok is 0" in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.gguf").exists()


def test_top_k_outside_one_to_experts_is_refused_before_any_kernel_runs(built, tmp_path):
    """The reported crash: top-k 0 reached the compiled step, which read past its arrays (exit 139)."""
    vault = vault_with(built, tmp_path, {"num_experts_per_tok": 0})
    command = ["generate", str(vault), "-p", "the sea", "--max-tokens", "4", "--device", "cpu"]
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", *command], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "num_experts_per_tok is 0" in one_line_error(proc.stderr)


def test_a_group_of_one_expert_is_refused_where_the_router_scores_each_group_by_its_best_two():
    """DeepSeek-V3-style routers take torch.topk(2) inside each of the n_group groups."""
    from smoe.source.config_checks import check_model_config
    from smoe.testing.tiny_models import tiny_config

    config = tiny_config("deepseek_v3").to_dict() | {"n_group": 4, "topk_group": 2}  # 4 experts, top-2
    with pytest.raises(SmoeError, match="n_group 4 leaves 1 expert per group"):
        check_model_config(config)


def test_every_checked_key_is_in_this_table():
    """A key the checks learn must get bad values here too."""
    from smoe.source.config_checks import CONFIG_VALUES, ROPE_VALUES

    tested = {key.removeprefix("rope_parameters.") for key in KEYS} | set(KEYS)
    assert set(CONFIG_VALUES) - tested == set() and set(ROPE_VALUES) - tested == set()


def test_the_configs_of_every_tiny_family_pass_the_checks():
    """Every family's own config, as transformers writes it (qwen2 writes a 0 window for none), is accepted."""
    from smoe.source.config_checks import check_model_config
    from smoe.testing.tiny_models import tiny_config, tiny_families

    for family in tiny_families():
        check_model_config(tiny_config(family).to_dict())


# Null or zero values that mean "absent" where the family's configuration class takes them: (family of
# smoe.testing.tiny_models, overrides, whether the pinned transformers builds the model from them too).
ABSENT_VALUES = {
    "no group routing (deepseek_v3)": ("deepseek_v3", {"n_group": None, "topk_group": None}, True),
    "no group routing (deepseek_v2)": ("deepseek_v2", {"n_group": None, "topk_group": None}, True),
    "LayerNorm instead of RMSNorm (dbrx)": ("dbrx", {"rms_norm_eps": None}, True),
    "no padding token, said as -1": ("qwen3_moe", {"pad_token_id": -1}, True),
    "no rotary heads, no MLA (deepseek-ocr)": ("deepseek_v2", {"head_dim": 0, "qk_rope_head_dim": 0,
                                                                "kv_lora_rank": None}, False),
}


@pytest.mark.parametrize("family, overrides, builds", ABSENT_VALUES.values(), ids=list(ABSENT_VALUES))
def test_absent_values_that_the_config_class_accepts_stay_valid(family, overrides, builds):
    from smoe.hf.model import build_model, read_config
    from smoe.source.config_checks import check_model_config
    from smoe.source.description import describe_model
    from smoe.testing.tiny_models import tiny_config

    config = tiny_config(family).to_dict() | overrides
    check_model_config(config)
    assert describe_model(config).family == family
    if builds:  # transformers builds the model of it (on the meta device)
        build_model(read_config(config, "config.json"), torch.float32)


def default_and_fixture_configs() -> dict[str, dict]:
    """The default configuration of every MoE family the pinned transformers has (those that route: a
    default without an expert count or top-k is a dense stand-in), and every config in ../shared/fixtures."""
    from transformers import CONFIG_MAPPING

    from smoe.source.config_numbers import CONFIG_KEYS, lookup, resolve
    from smoe.source.families import FAMILIES

    configs = {}
    for model_type in sorted({t for f in FAMILIES for t in f.model_types} & set(CONFIG_MAPPING)):
        config = CONFIG_MAPPING[model_type]().to_dict()
        scopes = resolve(config)[2]
        if all(lookup(scopes, CONFIG_KEYS[k]) is not None for k in ("num_experts", "top_k")):
            configs[f"default {model_type}"] = config
    fixtures = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
    for path in sorted(fixtures.glob("**/config.json")):
        configs[str(path.relative_to(fixtures))] = json.loads(path.read_text())
    return configs


def test_ranges_admit_every_family_default_and_fixture_config():
    from smoe.source.config_checks import check_model_config
    from smoe.source.description import describe_model

    configs = default_and_fixture_configs()
    assert len(configs) >= 20
    refused = {}
    for name, config in configs.items():
        try:
            check_model_config(config)
            if _resolve_family(config):
                describe_model(config)
        except SmoeError as e:
            refused[name] = str(e)
    assert refused == {}


def _resolve_family(config: dict):
    from smoe.source.config_numbers import resolve

    return resolve(config)[0]


def index_edited(built, tmp: Path, edit) -> Path:
    """A copy of the vault whose index.json is edited by `edit(index)` and sealed again into the header."""
    vault = vault_copy(built, tmp)
    index = json.loads((vault / INDEX_FILE).read_text())
    edit(index)
    reseal(vault, INDEX_FILE, json.dumps(index).encode())
    return vault


def swap_shapes(index: dict) -> None:
    """gate and up [out, in] swapped to [in, out] everywhere: the same element count, so the same blob layout."""
    for role in ("gate", "up"):
        index["expert_shapes"][role] = index["expert_shapes"][role][::-1]
    for entry in index["experts"]:
        for t in entry["tensors"]:
            t["shape"] = index["expert_shapes"][t["role"]]


# index edits that keep the index self-consistent but disagree with config.json (tiny Qwen3-MoE: 6 experts, top-2)
INDEX_EDITS = {
    "expert shapes transposed": (swap_shapes, "expert_shapes['gate'] is [64, 24]"),
    "top-k other than the config's": (lambda index: index.update(top_k=1), "top_k is 1; config.json says 2"),
    "no top-k where the config has one": (lambda index: index.update(top_k=None), "top_k is null"),
    "another model type": (lambda index: index.update(model_type="olmoe"), "model_type is \"olmoe\""),
}


@pytest.mark.parametrize("edit, word", INDEX_EDITS.values(), ids=list(INDEX_EDITS))
def test_index_shapes_and_counts_must_agree_with_config_and_trunk(built, tmp_path, capsys, edit, word):
    vault = index_edited(built, tmp_path, edit)
    assert main(["generate", str(vault), "-p", "the sea", "--max-tokens", "2", "--device", "cpu"]) == 2
    err = one_line_error(capsys.readouterr().err)
    assert "index.json" in err and word in err
    assert main(["verify", str(vault)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "index.json" in out and word in out


def test_a_router_whose_rows_disagree_with_the_experts_is_refused_at_quantize(built, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    model = model_with(built, tmp_path, {})
    weights = next(model.glob("*.safetensors"))
    tensors = load_file(weights)
    router = next(n for n in tensors if n.endswith("mlp.gate.weight"))
    tensors[router] = torch.cat([tensors[router], tensors[router][:1]])  # 7 rows for 6 experts
    save_file(tensors, weights, metadata={"format": "pt"})
    out = tmp_path / "vault"
    assert main(["quantize", str(model), "-o", str(out), "-q"]) == 2
    assert f"trunk tensor {router}: shape (7, 64)" in one_line_error(capsys.readouterr().err)
    assert not out.exists() and not list(tmp_path.glob("vault.*"))


def test_a_model_type_transformers_does_not_know_is_named_at_quantize_and_refused_at_open(tmp_path, capsys):
    from smoe.runtime.model import OpenedVault
    from smoe.testing import vaults

    model = vaults.tiny_model_dir(tmp_path, "deepseek_v3", model_type="kimi_k2")  # Kimi-K2's own model type
    vault = vaults.vault_of(model, tmp_path / "vault")
    assert "model_type 'kimi_k2' is unknown to transformers" in capsys.readouterr().err
    with pytest.raises(SmoeError, match="model_type 'kimi_k2' is unknown to transformers"):
        OpenedVault(vault)


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10**9), ("num_experts", 10**9)])
def test_inspecting_a_bare_config_with_a_count_past_any_model_is_one_line(tmp_path, capsys, key, value):
    from smoe.testing.tiny_models import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_moe").to_dict() | {key: value}))
    assert main(["inspect", str(tmp_path / "config.json")]) == 2
    assert f"{key} is {value}" in one_line_error(capsys.readouterr().err)
