"""The model description, the one routing function and the one token->expert loop, held to the
families' transformers modules (which the generic decoder runs)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from smoe.errors import SmoeError
from smoe.hf.experts import is_experts_module
from smoe.hf.trunk import router_of
from smoe.moe.activation import activate
from smoe.moe.dispatch import expert_groups, routed_sum
from smoe.moe.routing import route
from smoe.runtime.cpu import kernels_numba
from smoe.runtime.model import OpenedVault
from smoe.runtime.weights import fast_decoder_gap
from smoe.source.description import EXTRAS, Routing, describe_model
from smoe.testing import vaults
from smoe.testing.tiny_models import tiny_config, tiny_families, tiny_model

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "real-checkpoints"  # beside a checkout
# routings only the family's own module computes (route refuses them, the generic decoder runs them)
CUSTOM = {"phimoe": "sparsemixer", "gemma4_text": "per-expert scales over a normalised router input"}
# group-limited families get two groups of two experts in their tiny model, so the groups matter
GROUPED = {"deepseek_v3": {}, "glm4_moe": {}, "dots1": {}, "exaone_moe": {}, "nemotron_h": {}, "mistral4": {},
           "deepseek_v2": {"topk_method": "group_limited_greedy"}}
# the tiny families the fast decoders (GPU and CPU alike) cover: q/k norm after rotary; multipliers; Mistral 4's
# temperature; AFMoE's output gate and norms and NoPE layers (EXAONE-MoE's tiny model slides on every layer: none of
# them is a NoPE full layer); hybrids, their mixer layers through the family's own modules
GPU = {"qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "dots1", "glm4_moe", "olmoe", "minimax_m2", "qwen2_moe",
       "gpt_oss", "exaone_moe", "hunyuan_v1_moe", "granitemoe", "granitemoeshared", "mistral4", "afmoe", "ernie4_5_moe",
       "lfm2_moe", "jamba", "granitemoehybrid"}
CPU = GPU | {"qwen3_next", "qwen3_5_moe_text"}  # Qwen3-Next's norms and query-borne gate: the CPU's alone


def description_of(family: str, **overrides):
    return describe_model(tiny_config(family).to_dict() | overrides)


def captured_routing(family: str, tmp_path: Path):
    """Run the generic decoder on a tiny vault of `family` (correction biases randomised) and return,
    per MoE layer call: (the MoE block's input, router weight, router bias, correction bias, the
    top-k ids and weights the family's own router gave the experts)."""
    overrides = {"n_group": 2, "topk_group": 1, **GROUPED[family]} if family in GROUPED else {}
    vault = vaults.vault_of(vaults.tiny_model_dir(tmp_path, family, seed=3, **overrides), tmp_path / "vault")
    sm = OpenedVault(vault, dtype="float32", decoder="generic")
    calls, parents = [], {}
    for _, module in sm.model.named_modules():
        for child in module.children():
            if is_experts_module(child):
                parents[child] = module
    generator = torch.Generator().manual_seed(4)
    for block in set(parents.values()):
        _, _, correction = router_of(block)
        assert (correction is not None) == sm.description.routing.correction_bias  # found where described
        if correction is not None:
            correction.copy_(torch.randn(correction.shape, generator=generator) * 0.05)
        block.register_forward_pre_hook(lambda m, args, kwargs: setattr(m, "smoe_input", (args or
                                        tuple(kwargs.values()))[0].reshape(-1, (args or tuple(kwargs.values()))[0].shape[-1])),
                                        with_kwargs=True)
    forward = sm.routed.forward

    def capture(module, hidden, top_i, top_w):
        block = parents[module]
        calls.append((block.smoe_input.clone(), *router_of(block), top_i.clone(), top_w.clone()))
        return forward(module, hidden, top_i, top_w)

    sm.routed.forward = capture
    ids = torch.randint(0, 100, (1, 24), generator=generator)
    sm.logits(ids)
    sm.close()
    return sm.description, calls


def sorted_by_expert(ids, weights):
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("family", tiny_families())
def test_route_picks_the_experts_and_weights_of_the_family_router(family, tmp_path):
    description, calls = captured_routing(family, tmp_path)
    if family in CUSTOM:
        assert description.routing.custom == CUSTOM[family]
        with pytest.raises(ValueError, match="family's own"):
            route(description.routing, torch.zeros(1, description.routing.num_experts))
        return
    assert description.routing.custom is None
    assert calls, "no MoE layer ran"
    for x, weight, bias, correction, top_i, top_w in calls:
        logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        if correction is not None:
            correction = correction.reshape(-1)
        ids, weights = route(description.routing, logits, correction if description.routing.correction_bias else None)
        want_ids, want_w = sorted_by_expert(top_i, top_w.float())
        got_ids, got_w = sorted_by_expert(ids, weights)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", sorted(GROUPED))
def test_group_limited_routing_is_read_from_the_config(family):
    routing = description_of(family, n_group=2, topk_group=1, **GROUPED[family]).routing
    assert (routing.n_group, routing.topk_group) == (2, 1)
    assert routing.group_score == ("max" if family == "deepseek_v2" else "top2")


@pytest.mark.parametrize("family", tiny_families())
def test_activate_computes_the_family_experts_activation(family):
    model = tiny_model(family)
    description = describe_model(model.config.get_text_config().to_dict())
    experts = [m for m in model.modules() if is_experts_module(m)]
    if not experts:  # dbrx, llama4: experts outside transformers' registry (smoe.hf.experts stands in)
        assert family in ("dbrx", "llama4_text")
        return
    module = experts[0]
    generator = torch.Generator().manual_seed(5)
    gate, up = torch.randn(2, 7, 24, generator=generator) * 4  # beyond gpt-oss's clamp limit
    if module.has_gate:
        gate_up = torch.cat([gate, up], -1) if module.is_concatenated else torch.stack([gate, up], -1).flatten(-2)
        want = module._apply_gate(gate_up)
        got = activate(description.experts, gate, up)
    else:
        want, got = module.act_fn(up), activate(description.experts, None, up)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", tiny_families())
def test_attention_geometry_matches_the_family_modules(family):
    model = tiny_model(family)
    d = describe_model(model.config.get_text_config().to_dict())
    a = d.attention
    attention = [m for m in model.modules() if isinstance(getattr(m, "q_proj", None), torch.nn.Linear)
                 or hasattr(m, "kv_a_proj_with_mqa")]
    if a.kind == "mla":
        assert attention and all(hasattr(m, "kv_a_proj_with_mqa") for m in attention)
        return
    if family == "dbrx":  # one fused Wqkv projection
        fused = [m.Wqkv for m in model.modules() if hasattr(m, "Wqkv")]
        assert fused and all(w.out_features == (a.heads + 2 * a.kv_heads) * a.head_dim for w in fused)
        return
    assert attention
    for m in attention:
        gated = 2 if "attention_gate" in d.extras and not hasattr(m, "gate_proj") else 1  # the gate rides on q_proj
        assert m.q_proj.out_features == gated * a.heads * a.head_dim
        assert m.k_proj.out_features == a.kv_heads * a.head_dim
        if a.qk_norm in ("head", "head_after_rotary"):
            norm = next(getattr(m, n) for n in ("q_norm", "query_layernorm", "q_layernorm") if hasattr(m, n))
            assert norm.weight.shape == (a.head_dim,)


def test_fast_decoders_cover_exactly_the_descriptions_their_layers_implement():
    for device, expected in (("cpu", CPU), ("cuda", GPU)):
        assert {f for f in tiny_families() if fast_decoder_gap(description_of(f), device) is None} == expected
    assert fast_decoder_gap(description_of("jamba"), "cuda") is None
    assert fast_decoder_gap(description_of("mixtral", sliding_window=4), "cuda") is None
    assert fast_decoder_gap(description_of("mixtral", sliding_window=4)) is None
    nope = description_of("exaone_moe", layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert nope.attention.nope_layers == (1,)
    assert fast_decoder_gap(nope) is None and fast_decoder_gap(nope, "cuda") is None
    assert fast_decoder_gap(description_of("afmoe", mup_enabled=True), "cuda") is None


def test_exaone_moe_without_layer_types_has_transformers_pattern_of_nope_full_layers():
    config = {k: v for k, v in tiny_config("exaone_moe").to_dict().items() if k != "layer_types"}
    d = describe_model(config | {"sliding_window": 4, "sliding_window_pattern": 2})
    assert (d.attention.sliding_layers, d.attention.nope_layers, d.extras) == ((0, 2), (1,), ("no_rope_layers",))
    assert describe_model(config | {"sliding_window": None}).attention.nope_layers == ()
    assert set(description_of("afmoe").extras) <= set(EXTRAS)


def test_fast_decoder_refuses_a_family_it_does_not_cover_with_the_reason(tmp_path):
    vault = vaults.tiny_vault(tmp_path, "llama4_text")
    with pytest.raises(SmoeError, match="routing weights on the experts' input"):
        OpenedVault(vault, decoder="fast")


def real_config(name: str) -> dict:
    path = FIXTURES / name / "config.json"
    if not path.exists():
        pytest.skip(f"fixture {name} not present: the tiny models above check the same routing kinds")
    return json.loads(path.read_text())


def test_released_deepseek_v3_style_config_describes_sigmoid_group_limited_routing():
    d = describe_model(real_config("kimi2-pcl-dsv3style"))
    assert d.family == "deepseek_v3" and d.attention.kind == "mla"
    r = d.routing
    assert (r.scoring, r.correction_bias, r.normalise, r.n_group, r.topk_group) == ("sigmoid", True, True, 8, 2)
    assert r.scale == pytest.approx(2.827) and r.normalise_eps == 1e-20


@pytest.mark.parametrize("name", ["mixtral-8x7b-dolphin-safetensors", "mixtral-8x22b-wizardlm2"])
def test_released_mixtral_configs_are_covered_by_the_fast_decoders(name):
    d = describe_model(real_config(name))
    assert (d.routing.scoring, d.routing.normalise, d.routing.top_k) == ("softmax", True, 2)
    assert fast_decoder_gap(d) is None


def test_unknown_family_is_refused_in_one_line():
    with pytest.raises(SmoeError, match="unsupported model_type"):
        describe_model({"model_type": "not_a_model"})


def test_group_limited_route_never_picks_outside_the_best_groups():
    routing = Routing(num_experts=8, top_k=2, scoring="sigmoid", n_group=4, topk_group=1)
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 6.0, -9.0, 0.0, 0.0]])
    ids, _ = route(routing, logits)  # group 0 (5+4) beats group 2 (6-9) though expert 4 is the best
    assert sorted(ids[0].tolist()) == [0, 1]


@pytest.mark.parametrize("normalise", [True, False])
def test_compiled_top_k_equals_route(normalise):
    routing = Routing(num_experts=16, top_k=4, normalise=normalise)
    generator = torch.Generator().manual_seed(6)
    for _ in range(20):
        logits = torch.randn(16, generator=generator) * 3
        top_i, top_w = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.float32)
        kernels_numba.top_k(logits.numpy(), 4, normalise, top_i, top_w)
        ids, weights = route(routing, logits[None])
        assert top_i.tolist() == ids[0].tolist()
        np.testing.assert_allclose(top_w, weights[0].numpy(), rtol=1e-5)


def test_routed_sum_equals_the_token_by_token_sum_in_any_grouping():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(9, 8, generator=generator)
    top_i = torch.randint(0, 6, (9, 2), generator=generator)
    top_w = torch.rand(9, 2, generator=generator)
    mats = torch.randn(6, 8, 5, generator=generator)
    want = torch.stack([sum(top_w[t, s] * (x[t] @ mats[top_i[t, s]]) for s in range(2)) for t in range(9)])
    fetched = []

    def fetch(group):
        fetched.append(group)
        return {e: (lambda rows, e=e: rows @ mats[e]) for e in group}

    for per_group in (None, 1, 4):
        fetched.clear()
        torch.testing.assert_close(routed_sum(x, top_i, top_w, fetch, per_group=per_group), want)
        assert sorted(sum(fetched, [])) == sorted(set(top_i.flatten().tolist()))  # each expert fetched once
        assert all(len(g) <= (per_group or 6) for g in fetched)
    weighted_input = routed_sum(x, top_i, top_w, fetch, weight_input=True)  # linear experts: the same sum
    torch.testing.assert_close(weighted_input, want)


def test_routed_sum_leaves_out_ids_beyond_the_experts():
    x = torch.ones(2, 3)
    top_i, top_w = torch.tensor([[0, 4], [4, 4]]), torch.ones(2, 2)
    out = routed_sum(x, top_i, top_w, lambda g: {e: (lambda rows: rows * 2) for e in g}, num_experts=4)
    torch.testing.assert_close(out, torch.tensor([[2.0] * 3, [0.0] * 3]))


def test_expert_groups_keep_order_and_bound():
    assert expert_groups([3, 1, 7, 9, 2], 2) == [[3, 1], [7, 9], [2]]
    assert expert_groups([3], 0) == [[3]]
