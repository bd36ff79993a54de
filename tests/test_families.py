"""Model-family rules: every routed expert is found and counted, the rest is trunk, and each projection
is read back [out, in] exactly as the transformers module computes with it."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from smoe.errors import SmoeError
from smoe.source import families, layouts
from smoe.source.checkpoint import Checkpoint
from smoe.source.loading import load_bias, load_projection
from smoe.source.matching import map_experts
from smoe.testing.tiny_models import save_tiny_model, tiny_families

FIXTURES = Path(__file__).parents[1] / ".." / "shared" / "fixtures" / "real-checkpoints"


# ----- tiny transformers models, one per family --------------------------------------------------


# Each reference reads expert e's [out, in] weights off the live module's parameters p, the way
# its forward uses them (transformers/models/<family>/modeling_<family>.py); n = number of experts.


def reference_fused(p: dict, e: int, n: int) -> dict:
    """transformers-v5 experts: gate_up_proj [E, 2I, H] -> linear(x, .)chunk(2): gate first; down [E, H, I]."""
    gate, up = p["gate_up_proj"][e].chunk(2, dim=0)
    return {"gate": gate, "up": up, "down": p["down_proj"][e]}


def reference_gpt_oss(p: dict, e: int, n: int) -> dict:
    """x @ gate_up_proj[e] ([H, 2I]); gate = [..., ::2], up = [..., 1::2]; x @ down_proj[e] ([I, H])."""
    gate_up = p["gate_up_proj"][e]
    return {"gate": gate_up[:, ::2].T, "up": gate_up[:, 1::2].T, "down": p["down_proj"][e].T}


def reference_llama4(p: dict, e: int, n: int) -> dict:
    """bmm(x, gate_up_proj) ([H, 2I]) then chunk(2, dim=-1): gate first; bmm(., down_proj) ([I, H])."""
    gate, up = p["gate_up_proj"][e].chunk(2, dim=-1)
    return {"gate": gate.T, "up": up.T, "down": p["down_proj"][e].T}


def reference_nemotron_h(p: dict, e: int, n: int) -> dict:
    """linear(x, up_proj[e]), relu^2, linear(., down_proj[e]): no gate."""
    return {"up": p["up_proj"][e], "down": p["down_proj"][e]}


def reference_dbrx(p: dict, e: int, n: int) -> dict:
    """w1/v1/w2 viewed [E, I, H]: x @ w1[e].T, x @ v1[e].T, then . @ w2[e] (so down is w2[e].T)."""

    def block(t):
        return t.view(n, -1, t.shape[-1])[e]

    return {"gate": block(p["w1"]), "up": block(p["v1"]), "down": block(p["w2"]).T}


REFERENCE = {"gpt_oss": reference_gpt_oss, "llama4_text": reference_llama4,
             "nemotron_h": reference_nemotron_h, "dbrx": reference_dbrx}

# Families whose experts run in @use_experts_implementation modules with forward(x, top_k_index, top_k_weights)
# and a plain act_fn: their output is recomputed from the loaded projections below.
GATED_FORWARD = {"qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "olmoe", "deepseek_v2",
                 "deepseek_v3", "mistral4", "glm4_moe", "mixtral", "minimax", "minimax_m2", "phimoe", "jamba",
                 "granitemoe", "granitemoeshared", "granitemoehybrid", "gemma4_text", "ernie4_5_moe",
                 "hunyuan_v1_moe", "dots1", "exaone_moe", "afmoe", "lfm2_moe"}

_MODULE_EXPERTS = re.compile(r"(?:layers|blocks)\.(\d+)\.(.*?)(?<!shared_)experts\.(?:mlp\.)?(\w+)$")


def module_experts(model) -> dict[int, tuple[str, dict]]:
    """layer -> (experts module path, {parameter leaf: tensor}) from the live module."""
    out: dict[int, tuple[str, dict]] = {}
    for name, param in model.named_parameters():
        m = _MODULE_EXPERTS.search(name)
        if m:
            path = name[: name.rindex("experts.") + len("experts")]
            out.setdefault(int(m[1]), (path, {}))[1][m[3]] = param.detach()
    return out


def num_experts_of(config) -> int:
    ffn = getattr(config, "ffn_config", None)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return getattr(config, key)
    return ffn.moe_num_experts


TINY_CASES = [(f, None) for f in tiny_families()] + [
    ("gemma4_text", "fused"),  # what transformers itself saves
    ("qwen3_5_moe_text", "per_expert"),  # REAP-pruned copies
    ("qwen3_moe", "fused"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Save each tiny model once per module: (model, Checkpoint, plan)."""
    cache = {}

    def get(family, layout):
        if (family, layout) not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{layout}")
            model = save_tiny_model(family, out, seed=1, layout=layout)
            ckpt = Checkpoint(out)
            cache[(family, layout)] = model, ckpt, map_experts(ckpt.config, ckpt.names())
        return cache[(family, layout)]

    return get


@pytest.mark.parametrize("family,layout", TINY_CASES)
def test_tiny_model_yields_every_moe_layer_times_every_expert(tiny, family, layout):
    model, ckpt, plan = tiny(family, layout)
    layers = sorted(module_experts(model))
    n_experts = num_experts_of(model.config)
    assert plan.moe_layers == layers
    assert plan.num_experts == n_experts
    assert sorted(plan.experts) == [(layer, e) for layer in layers for e in range(n_experts)]
    for sources in plan.experts.values():
        assert tuple(s.role for s in sources) == plan.roles


@pytest.mark.parametrize("family,layout", TINY_CASES)
def test_loaded_projection_equals_the_weight_the_module_computes_with(tiny, family, layout):
    model, ckpt, plan = tiny(family, layout)
    params = module_experts(model)
    reference = REFERENCE.get(family, reference_fused)
    shapes = plan.expert_shapes()
    for layer, e in [min(plan.experts), max(plan.experts), (plan.moe_layers[0], 1)]:
        expected = reference(params[layer][1], e, plan.num_experts)
        for src in plan.experts[(layer, e)]:
            got = load_projection(ckpt, src)
            assert got.is_contiguous()
            assert tuple(got.shape) == shapes[src.role], (src, shapes)
            torch.testing.assert_close(got, expected[src.role], rtol=0, atol=0, msg=f"{src}")


@pytest.mark.parametrize("family", sorted(GATED_FORWARD))
def test_expert_rebuilt_from_loaded_projections_matches_the_module_output(tiny, family):
    # Independent of how the reference above reads the modeling code: run the experts module itself.
    model, ckpt, plan = tiny(family, None)
    layer, e = plan.moe_layers[-1], plan.num_experts - 1
    module = model.get_submodule(module_experts(model)[layer][0])
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    index = torch.full((5, 1), e, dtype=torch.long)
    with torch.no_grad():
        expected = module(x, index, torch.ones(5, 1))
    gate, up, down = (load_projection(ckpt, s) for s in plan.experts[(layer, e)])
    got = (module.act_fn(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_gpt_oss_biases_are_split_like_the_module_splits_them(tiny):
    model, ckpt, plan = tiny("gpt_oss", None)
    for layer, e in [min(plan.experts), max(plan.experts)]:
        p = module_experts(model)[layer][1]
        expected = {"gate": p["gate_up_proj_bias"][e][::2], "up": p["gate_up_proj_bias"][e][1::2],
                    "down": p["down_proj_bias"][e]}
        got = {b.role: load_bias(ckpt, b) for b in plan.biases[(layer, e)]}
        assert got.keys() == expected.keys()
        for role in got:
            torch.testing.assert_close(got[role], expected[role], rtol=0, atol=0)


def test_families_without_expert_biases_plan_none(tiny):
    assert tiny("mixtral", None)[2].biases == {}


# Names that are never routed experts, though some look like them.
NOT_EXPERT = re.compile(r"shared_expert|shared_mlp|router|\.gate\.|e_score_correction|expert_bias|"
                        r"(layers|blocks)\.\d+\.(mlp|feed_forward)\.((gate|up|down)_proj|w[123])\.")


@pytest.mark.parametrize("family,layout", TINY_CASES)
def test_trunk_is_every_other_name_and_keeps_routers_shared_experts_and_dense_mlps(tiny, family, layout):
    model, ckpt, plan = tiny(family, layout)
    names = set(ckpt.names())
    trunk = names - plan.expert_names
    assert plan.expert_names <= names
    assert {s.name for sources in plan.experts.values() for s in sources} <= plan.expert_names
    assert {n for n in names if NOT_EXPERT.search(n)} <= trunk
    assert not [n for n in trunk if re.search(r"(?<!shared_)experts\.|_linear\.weight$", n)
                and "shared_mlp" not in n]
    assert any("embed" in n or "wte" in n for n in trunk)


# ----- published checkpoint indexes --------------------------------------------------------------


def fixture_dirs():
    if not FIXTURES.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no real-checkpoint fixtures at {FIXTURES}"))]
    return sorted(p for p in FIXTURES.iterdir() if (p / "SOURCE.txt").is_file())


def source_facts(d: Path) -> dict:
    """Expected counts and key lists from a fixture's SOURCE.txt."""
    text = (d / "SOURCE.txt").read_text()
    layers = re.search(r"layers with routed experts in index: (\d+) \((\d+)\.\.(\d+)\)", text)
    ids = re.search(r"expert ids in names: 0\.\.(\d+)", text)
    config_e = re.search(r"routed experts \(config [^)]*\): (\d+)", text)
    notes = re.search(r"notes: (.*)", text, re.S)[1]
    from_notes = re.search(r"(\d+) experts", notes)
    experts = int(ids[1]) + 1 if ids else int(config_e[1]) if config_e else int(from_notes[1])
    return {
        "layers": int(layers[1]), "first": int(layers[2]), "last": int(layers[3]), "experts": experts,
        "experts_in_config": bool(config_e), "fused": not ids,
        "expert_keys": section(text, "routed-expert example keys"),
        "trunk_keys": section(text, "shared-expert keys") + section(text, "router keys"),
    }


def section(text: str, title: str) -> list[str]:
    m = re.search(rf"^{re.escape(title)}[^\n]*:\s*\n((?:  \S+\n)*)", text, re.M)
    return m[1].split() if m else []


def logical(key: str) -> str:
    """The Checkpoint's logical name of one stored part (quantisation parts collapsed)."""
    key = re.sub(r"\.weight_(packed|scale|shape|zero_point)$", ".weight", key)
    key = re.sub(r"\.(scales|biases)$", ".weight", key)
    return re.sub(r"_(blocks|scales)$", "", key)


@pytest.mark.parametrize("d", fixture_dirs(), ids=lambda d: d.name if d else "none")
def test_real_checkpoint_index_yields_exact_expert_count(d):
    facts = source_facts(d)
    ckpt = Checkpoint(d)
    num_experts = None
    if facts["fused"] and not facts["experts_in_config"]:
        # fused experts and a config without MoE numbers: the count must be asked for, not guessed
        with pytest.raises(SmoeError, match="--num-experts"):
            map_experts(ckpt.config, ckpt.names())
        num_experts = facts["experts"]
    plan = map_experts(ckpt.config, ckpt.names(), num_experts=num_experts)
    print(f"{d.name}: {plan.family} {len(plan.moe_layers)} layers x {plan.num_experts} experts")
    assert len(plan.moe_layers) == facts["layers"]
    assert (plan.moe_layers[0], plan.moe_layers[-1]) == (facts["first"], facts["last"])
    assert plan.num_experts == facts["experts"]
    assert len(plan.experts) == facts["layers"] * facts["experts"]
    assert all(len(sources) == len(plan.roles) for sources in plan.experts.values())
    assert {logical(k) for k in facts["expert_keys"]} <= plan.expert_names
    trunk = set(ckpt.names()) - plan.expert_names
    assert {logical(k) for k in facts["trunk_keys"]} <= trunk


# ----- layouts with no transformers model: synthetic files ---------------------------------------


def write_checkpoint(path: Path, config: dict, tensors: dict) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return Checkpoint(path)


def test_moondream_fused_fc1_fc2_only_in_blocks_with_a_router(tmp_path):
    E, I, H = 3, 4, 8  # noqa: E741
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for block in range(3):
        base = f"model.text.blocks.{block}.mlp."
        if block == 0:  # dense: same names, with biases, no router
            tensors |= {base + "fc1.weight": torch.randn(2 * I, H, generator=g), base + "fc1.bias": torch.randn(2 * I),
                        base + "fc2.weight": torch.randn(H, 2 * I, generator=g), base + "fc2.bias": torch.randn(H)}
        else:
            tensors |= {base + "fc1.weight": torch.randn(E, 2 * I, H, generator=g),
                        base + "fc2.weight": torch.randn(E, H, I, generator=g),
                        base + "router.weight": torch.randn(E, H), base + "router.bias": torch.randn(E)}
    tensors["model.vision.blocks.0.mlp.fc1.weight"] = torch.randn(E, 2 * I, H)  # a tower: not the decoder
    ckpt = write_checkpoint(tmp_path, {"model_type": "moondream3"}, tensors)
    with pytest.raises(SmoeError, match="--num-experts"):
        map_experts(ckpt.config, ckpt.names())
    plan = map_experts(ckpt.config, ckpt.names(), num_experts=E)
    assert plan.moe_layers == [1, 2] and len(plan.experts) == 2 * E
    fc1, fc2 = tensors["model.text.blocks.2.mlp.fc1.weight"], tensors["model.text.blocks.2.mlp.fc2.weight"]
    got = [load_projection(ckpt, s) for s in plan.experts[(2, 1)]]
    for g_, want in zip(got, [fc1[1][:I], fc1[1][I:], fc2[1]]):
        torch.testing.assert_close(g_, want, rtol=0, atol=0)
    trunk = set(ckpt.names()) - plan.expert_names
    assert "model.text.blocks.0.mlp.fc1.weight" in trunk and "model.text.blocks.1.mlp.router.weight" in trunk
    assert "model.vision.blocks.0.mlp.fc1.weight" in trunk


def test_mlx_switch_mlp_is_read_per_expert_without_transpose(tmp_path):
    E, I, H = 3, 4, 8  # noqa: E741
    g = torch.Generator().manual_seed(1)
    tensors = {f"model.layers.0.mlp.switch_mlp.{p}.weight": torch.randn(E, *s, generator=g)
               for p, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    tensors["model.layers.0.mlp.gate.weight"] = torch.randn(E, H)
    config = {"model_type": "qwen3_moe", "num_experts": E, "num_hidden_layers": 1, "hidden_size": H,
              "moe_intermediate_size": I}
    ckpt = write_checkpoint(tmp_path, config, tensors)
    plan = map_experts(ckpt.config, ckpt.names())
    for src, p in zip(plan.experts[(0, 2)], ("gate_proj", "up_proj", "down_proj")):
        torch.testing.assert_close(load_projection(ckpt, src), tensors[f"model.layers.0.mlp.switch_mlp.{p}.weight"][2])


def test_gpt_oss_mxfp4_experts_are_stored_out_by_in(tmp_path):
    # MXFP4 packs along the input dimension: blocks [E, 2I, H/32, 16] dequantise to [E, 2I, H] (rows still
    # interleaved gate/up), where the bf16 release stores [E, H, 2I].
    from smoe.source import quantised as source_quant

    E, I, H = 2, 4, 64  # noqa: E741
    g = torch.Generator().manual_seed(2)

    def mxfp4(rows, cols):
        return (torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g),
                torch.randint(120, 130, (E, rows, cols // 32), dtype=torch.uint8, generator=g))

    (gu_b, gu_s), (d_b, d_s) = mxfp4(2 * I, H), mxfp4(H, I * 8)  # down's input padded to a block of 32
    base = "model.layers.0.mlp.experts."
    tensors = {base + "gate_up_proj_blocks": gu_b, base + "gate_up_proj_scales": gu_s,
               base + "down_proj_blocks": d_b, base + "down_proj_scales": d_s,
               base + "gate_up_proj_bias": torch.randn(E, 2 * I), base + "down_proj_bias": torch.randn(E, H),
               "model.layers.0.mlp.router.weight": torch.randn(E, H)}
    config = {"model_type": "gpt_oss", "num_local_experts": E, "num_hidden_layers": 1,
              "quantization_config": {"quant_method": "mxfp4"}}
    ckpt = write_checkpoint(tmp_path, config, tensors)
    plan = map_experts(ckpt.config, ckpt.names())
    gate_up = source_quant.dequant_mxfp4(gu_b[1], gu_s[1])
    down = source_quant.dequant_mxfp4(d_b[1], d_s[1])
    got = {s.role: load_projection(ckpt, s) for s in plan.experts[(0, 1)]}
    torch.testing.assert_close(got["gate"], gate_up[0::2], rtol=0, atol=0)
    torch.testing.assert_close(got["up"], gate_up[1::2], rtol=0, atol=0)
    torch.testing.assert_close(got["down"], down, rtol=0, atol=0)


# ----- config conventions and errors, on synthetic name lists -----------------------------------


def qwen_names(layers, experts, roles=("gate_proj", "up_proj", "down_proj"), prefix="model.layers"):
    names = [f"{prefix}.{layer}.mlp.experts.{e}.{r}.weight" for layer in layers for e in experts for r in roles]
    return names + [f"{prefix}.{layer}.mlp.gate.weight" for layer in layers] + ["model.embed_tokens.weight"]


QWEN = {"model_type": "qwen3_moe", "num_experts": 4, "num_hidden_layers": 2, "num_experts_per_tok": 2}


def test_matcher_counts_layers_times_experts_from_config():
    plan = map_experts(QWEN, qwen_names(range(2), range(4)))
    assert (plan.family, plan.moe_layers, plan.num_experts, plan.top_k) == ("qwen3_moe", [0, 1], 4, 2)
    assert len(plan.experts) == 8


def test_unknown_model_type_is_named_with_the_supported_list():
    with pytest.raises(SmoeError, match=r"'frobnitz_moe'.*qwen3_moe.*deepseek_v3"):
        map_experts({"model_type": "frobnitz_moe", "num_experts": 4}, qwen_names(range(2), range(4)))


def test_matcher_raises_when_an_expert_projection_is_missing():
    names = qwen_names(range(2), range(4))
    names.remove("model.layers.1.mlp.experts.2.up_proj.weight")
    with pytest.raises(SmoeError, match=r"1 expert projections missing \(first: layer 1 expert 2 up\)"):
        map_experts(QWEN, names)


def test_matcher_raises_when_a_whole_expert_is_missing():
    names = [n for n in qwen_names(range(2), range(4)) if ".experts.3." not in n or "layers.0." in n]
    with pytest.raises(SmoeError, match=r"3 expert projections missing \(first: layer 1 expert 3 gate"):
        map_experts(QWEN, names)


def test_matcher_raises_when_a_moe_layer_has_no_experts():
    with pytest.raises(SmoeError, match=r"layer 1 expert 0 gate"):
        map_experts(QWEN, qwen_names([0], range(4)))


def test_matcher_raises_when_config_promises_more_experts_than_stored():
    with pytest.raises(SmoeError, match=r"2 MoE layers x 6 experts.*missing"):
        map_experts({**QWEN, "num_experts": 6}, qwen_names(range(2), range(4)))


def test_matcher_raises_when_checkpoint_has_more_experts_than_config():
    with pytest.raises(SmoeError, match=r"beyond that \(expert ids up to 3\)"):
        map_experts({**QWEN, "num_experts": 2}, qwen_names(range(2), range(4)))


def test_matcher_raises_when_experts_sit_in_a_layer_the_config_calls_dense():
    with pytest.raises(SmoeError, match=r"layers 0 that should have none|layers 0, .*should have none"):
        map_experts({**QWEN, "mlp_only_layers": [0]}, qwen_names(range(2), range(4)))


def test_zero_experts_in_config_is_not_a_moe_model():
    with pytest.raises(SmoeError, match="not a mixture-of-experts"):
        map_experts({**QWEN, "num_experts": 0}, qwen_names(range(2), range(4)))


def test_fused_experts_without_numbers_ask_for_num_experts():
    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(SmoeError, match="--num-experts"):
        map_experts({"model_type": "qwen3_5_moe_text"}, names)
    assert len(map_experts({"model_type": "qwen3_5_moe_text"}, names, num_experts=5).experts) == 5


def test_no_config_counts_from_names_and_picks_the_family_by_naming():
    plan = map_experts({}, qwen_names(range(3), range(5)))
    assert (plan.family, plan.moe_layers, plan.num_experts) == ("qwen3_moe", [0, 1, 2], 5)
    mixtral = [f"model.layers.0.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(2) for i in (1, 2, 3)]
    assert map_experts({}, mixtral).family == "mixtral"
    with pytest.raises(SmoeError, match="no routed-expert tensors"):
        map_experts({}, ["model.layers.0.mlp.gate_proj.weight"])
    with pytest.raises(SmoeError, match="fit several families"):
        map_experts({}, qwen_names(range(1), range(2)) + mixtral)


def test_no_config_reports_a_gap_in_expert_ids():
    names = [n for n in qwen_names(range(2), range(4)) if ".experts.1." not in n or "layers.1." in n]
    with pytest.raises(SmoeError, match="layer 0 expert 1 gate"):
        map_experts({}, names)


@pytest.mark.parametrize("config,family", [
    ({"model_type": "kimi_k2", "n_routed_experts": 4, "num_hidden_layers": 2}, "deepseek_v3"),
    ({"model_type": "DeepseekOCR", "language_config": {"n_routed_experts": 4, "num_hidden_layers": 2}},
     "deepseek_v2"),
    ({"model_type": "deepseek-ocr", "n_routed_experts": 4, "num_hidden_layers": 2}, "deepseek_v2"),
    ({"model_type": "mistral3", "text_config": {"model_type": "mistral4", "n_routed_experts": 4,
                                                "num_hidden_layers": 2}}, "mistral4"),
    ({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": 4,
                                                   "num_hidden_layers": 2}}, "qwen3_5_moe"),
])
def test_aliases_and_nested_text_configs_resolve_to_a_family(config, family):
    plan = map_experts(config, qwen_names(range(2), range(4)))
    assert plan.family == family and len(plan.experts) == 8


def test_minimax_m1_uses_mixtral_naming():
    names = [f"model.layers.{layer}.block_sparse_moe.experts.{e}.w{i}.weight"
             for layer in range(2) for e in range(3) for i in (1, 2, 3)]
    plan = map_experts({"model_type": "minimax_m1", "num_local_experts": 3, "num_hidden_layers": 2}, names)
    assert plan.family == "mixtral" and [s.name.rsplit(".", 2)[1] for s in plan.experts[(0, 0)]] == ["w1", "w3", "w2"]


@pytest.mark.parametrize("extra,layers", [
    ({"first_k_dense_replace": 2}, [2, 3, 4, 5]),  # deepseek
    ({"first_k_dense_replace": 1, "moe_layer_freq": 2}, [2, 4]),
    ({"decoder_sparse_step": 2}, [1, 3, 5]),  # qwen
    ({"mlp_only_layers": [0, 5]}, [1, 2, 3, 4]),
    ({"expert_layer_period": 2, "expert_layer_offset": 1}, [1, 3, 5]),  # jamba
    ({"interleave_moe_layer_step": 2}, [1, 3, 5]),  # llama4
    ({"moe_layers": [0, 4]}, [0, 4]),
    ({"num_dense_layers": 2}, [2, 3, 4, 5]),  # lfm2_moe, afmoe
    ({"mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse", "sparse"]}, [1, 2, 4, 5]),
    ({"moe_layer_start_index": 1, "moe_layer_end_index": 4, "moe_layer_interval": 2}, [1, 3]),  # ernie
    ({"moe_layer_start_index": 2, "moe_layer_end_index": -1}, [2, 3, 4, 5]),
    ({"hybrid_override_pattern": "MEM*EE"}, [1, 4, 5]),  # nemotron_h as released
    ({"layers_block_type": ["mamba", "moe", "attention", "moe", "mlp", "moe"]}, [1, 3, 5]),
    ({"layer_types": ["linear_attention", "full_attention"] * 3}, [0, 1, 2, 3, 4, 5]),  # attention only
])
def test_config_conventions_for_which_layers_are_moe(extra, layers):
    config = {"model_type": "qwen3_moe", "num_experts": 2, "num_hidden_layers": 6, **extra}
    assert map_experts(config, qwen_names(layers, range(2))).moe_layers == layers


def test_top_k_and_expert_count_key_spellings():
    base = {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "num_experts": 2,
                                                    "top_k_experts": 1, "num_hidden_layers": 1}}
    names = [f"model.language_model.layers.0.experts.{e}.{r}.weight" for e in range(2)
             for r in ("gate_proj", "up_proj", "down_proj")]
    plan = map_experts(base, names)
    assert (plan.num_experts, plan.top_k) == (2, 1)
    dbrx = {"model_type": "dbrx", "d_model": 8, "n_layers": 1,
            "ffn_config": {"moe_num_experts": 3, "moe_top_k": 2, "ffn_hidden_size": 4}}
    plan = map_experts(dbrx, [f"transformer.blocks.0.ffn.experts.mlp.{w}" for w in ("w1", "v1", "w2")])
    assert (plan.num_experts, plan.top_k, plan.expert_shapes()["down"]) == (3, 2, (8, 4))


def test_multi_token_prediction_layer_numbered_after_the_decoder_counts_where_present():
    # DeepSeek-V3 stores its MTP layer as model.layers.61 (of 61), with routed experts
    config = {"model_type": "deepseek_v3", "n_routed_experts": 2, "num_hidden_layers": 3,
              "first_k_dense_replace": 1, "num_nextn_predict_layers": 1}
    assert map_experts(config, qwen_names([1, 2, 3], range(2))).moe_layers == [1, 2, 3]
    assert map_experts(config, qwen_names([1, 2], range(2))).moe_layers == [1, 2]
    with pytest.raises(SmoeError, match="should have none"):
        map_experts({**config, "num_nextn_predict_layers": 0}, qwen_names([1, 2, 3], range(2)))


def test_experts_of_a_separate_mtp_module_are_neither_counted_nor_trunk():
    config = {"model_type": "qwen3_next", "num_experts": 2, "num_hidden_layers": 2, "mtp_num_hidden_layers": 1}
    mtp = qwen_names([0], range(2), prefix="mtp.layers")
    plan = map_experts(config, qwen_names(range(2), range(2)) + mtp)
    assert plan.moe_layers == [0, 1] and len(plan.experts) == 4
    assert {n for n in mtp if ".experts." in n} <= plan.expert_names
    assert "mtp.layers.0.mlp.gate.weight" not in plan.expert_names


def test_experts_of_a_vision_tower_stay_in_the_trunk():
    names = qwen_names(range(2), range(4)) + qwen_names([0], range(2), prefix="model.vision.layers")
    plan = map_experts(QWEN, names)
    assert len(plan.experts) == 8
    assert not any("vision" in n for n in plan.expert_names)


def test_quantisation_leftovers_of_an_expert_are_not_trunk():
    names = qwen_names(range(2), range(4)) + ["model.layers.0.mlp.experts.1.up_proj.input_scale"]
    assert "model.layers.0.mlp.experts.1.up_proj.input_scale" in map_experts(QWEN, names).expert_names


def test_supported_families_cover_the_required_set():
    required = {"qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                "glm4_moe", "mixtral", "minimax", "phimoe", "jamba", "gpt_oss", "llama4", "granitemoe",
                "gemma4", "nemotron_h", "dbrx", "moondream3", "mistral4"}
    assert required <= set(families.supported_families())


def _discovering(monkeypatch, answer) -> None:
    """Families without a row answered by `answer` (config -> Family, a reason, or None) alone."""
    monkeypatch.setattr(families, "_DISCOVERERS", [answer])


def test_a_discoverer_s_reason_is_the_one_line_refusal(monkeypatch):
    _discovering(monkeypatch, lambda config: "its experts are rows of an embedding table")
    with pytest.raises(SmoeError, match=r"^unsupported model_type 'frobnitz_moe': its experts are rows of an "
                                        r"embedding table$"):
        map_experts({"model_type": "frobnitz_moe", "num_experts": 4}, qwen_names(range(2), range(4)))


def test_tensors_of_identity_experts_are_neither_experts_nor_trunk(monkeypatch):
    # LongCat: experts 0-3 routed, 4-5 identity ("zero"); transformers saves gate/up rows for the identity ones
    family = families.Family("frobnitz_moe", ("frobnitz_moe",), layouts.standard("mlp"),
                             identity_key="zero_expert_num")
    _discovering(monkeypatch, lambda config: family)
    names = qwen_names(range(2), range(4)) + qwen_names(range(2), [4, 5], roles=("gate_proj", "up_proj"))
    plan = map_experts({**QWEN, "model_type": "frobnitz_moe", "zero_expert_num": 2}, names)
    assert plan.num_experts == 4 and len(plan.experts) == 8
    assert {n for n in names if ".experts." in n} <= plan.expert_names
    with pytest.raises(SmoeError, match="experts beyond that"):  # without the key they are unexpected experts
        map_experts({**QWEN, "model_type": "frobnitz_moe"}, names)
