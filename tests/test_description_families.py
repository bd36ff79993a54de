"""The descriptions of families smoe runs through transformers' own modules, held to those modules: the routing
`route` computes from them, the layers they say turn by rotary, and the gaps they leave the fast decoders."""

import pytest
import torch

from smoe.moe.routing import route
from smoe.runtime.weights import fast_decoder_gap
from smoe.source.description import describe_model
from smoe.testing.tiny_models import tiny_default_config

# Cohere2-MoE with a leading dense layer and a shared expert, its full layers rotated only where dense
COHERE2 = dict(num_hidden_layers=4, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                 "full_attention"],
               mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_shared_experts=1)


def assert_route_follows_the_biased_router(router, config) -> None:
    """route, from the description of `config`, picks the experts (in any order) and weights of `router`, a family's
    transformers router with a random correction bias."""
    generator = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=generator)
    router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=generator) * 0.1)
    x = torch.randn(64, config.hidden_size, generator=generator)
    logits, want_w, want_ids = router(x)
    ids, weights = route(describe_model(config.to_dict()).routing, logits, router.e_score_correction_bias)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(-1, order.indices), want_w.gather(-1, want_order.indices))


def cohere2_config(**changes):
    from transformers import Cohere2MoeConfig

    return Cohere2MoeConfig(**tiny_default_config("cohere2_moe").to_dict() | COHERE2 | changes)


@pytest.mark.parametrize("changes", [dict(expert_selection_fn="softmax"),
                                     dict(expert_selection_fn="sigmoid", norm_topk_prob=True),
                                     dict(expert_selection_fn="sigmoid", norm_topk_prob=False)])
def test_cohere2_moe_route_picks_the_experts_and_weights_of_its_router(changes):
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter

    config = cohere2_config(**changes)
    router = Cohere2MoeTopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=generator)
    x = torch.randn(64, config.hidden_size, generator=generator)
    logits, want_w, want_ids = router(x)
    ids, weights = route(describe_model(config.to_dict()).routing, logits)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pattern", [1, 2])
def test_cohere2_moe_layers_without_rotary_are_those_its_attention_leaves_unturned(pattern):
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeAttention

    config = cohere2_config(prefix_dense_sliding_window_pattern=pattern)
    turned = [i for i in range(4) if (a := Cohere2MoeAttention(config, i)).sliding_window is not None or a.force_rope]
    d = describe_model(config.to_dict())
    assert d.attention.nope_layers == tuple(i for i in range(4) if i not in turned) == ((0, 3) if pattern == 2 else (3,))


def test_cohere2_moe_keeps_to_the_generic_decoder_for_its_parallel_block_and_averaged_shared_expert():
    d = describe_model(cohere2_config(rms_norm_eps=1e-5).to_dict())
    assert fast_decoder_gap(d) == fast_decoder_gap(d, "cuda") == "parallel_block, shared_average"
    assert d.shared_experts == 1 and d.multipliers.logits == 16.0  # logits times logit_scale 0.0625


def test_mimo_v2_flash_route_picks_the_experts_and_weights_of_its_router():
    from transformers import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashTopkRouter

    config = MiMoV2FlashConfig(**tiny_default_config("mimo_v2_flash").to_dict() | dict(routed_scaling_factor=2.5))
    assert_route_follows_the_biased_router(MiMoV2FlashTopkRouter(config), config)


def test_mimo_v2_flash_keeps_to_the_generic_decoder_for_what_its_sliding_layers_and_values_add():
    from transformers import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashAttention

    config = MiMoV2FlashConfig(**tiny_default_config("mimo_v2_flash").to_dict() | dict(v_head_dim=8))
    sliding = MiMoV2FlashAttention(config, 1)
    assert sliding.k_proj.out_features == 2 * config.num_key_value_heads * config.head_dim and sliding.sinks is not None
    d = describe_model(config.to_dict())
    assert d.attention.sliding_layers == (1,) and not d.attention.sinks
    gaps = "rope_per_layer_type, sliding_kv_heads, sliding_sinks, value_head_dim, value_scale"
    assert fast_decoder_gap(d) == fast_decoder_gap(d, "cuda") == gaps


def glm_moe_dsa_config(**changes):
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(**tiny_default_config("glm_moe_dsa").to_dict() | changes)


@pytest.mark.parametrize("changes", [dict(), dict(n_routed_experts=8, n_group=4, topk_group=2, norm_topk_prob=False)])
def test_glm_moe_dsa_route_picks_the_experts_and_weights_of_its_router(changes):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    config = glm_moe_dsa_config(**changes)
    assert_route_follows_the_biased_router(GlmMoeDsaTopkRouter(config), config)


@pytest.mark.parametrize("types", [["full"] * 3, ["full", "shared", "full"]])
def test_glm_moe_dsa_names_shared_indexer_layers_where_its_attention_reuses_a_choice(types):
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

    config = glm_moe_dsa_config(indexer_types=types)
    shared = any(GlmMoeDsaAttention(config, i).skip_topk for i in range(3))
    d = describe_model(config.to_dict())
    assert ("shared_indexer" in d.extras) == shared == ("shared" in types)
    gaps = f"indexer_interleaved_rotary, {'shared_indexer, ' if shared else ''}sparse_attention"
    assert d.attention.kind == "mla" and fast_decoder_gap(d) == fast_decoder_gap(d, "cuda") == gaps


def laguna_config(**changes):
    from transformers import LagunaConfig

    return LagunaConfig(**tiny_default_config("laguna").to_dict() | changes)


def test_laguna_route_picks_the_experts_and_weights_of_its_router():
    from transformers.models.laguna.modeling_laguna import LagunaTopKRouter

    config = laguna_config(num_experts=8)
    assert_route_follows_the_biased_router(LagunaTopKRouter(config), config)


def test_laguna_routed_scale_and_a_soft_capped_router_are_read():
    """The block scales the routed experts' output (the weights, for route) by moe_routed_scaling_factor; a router
    whose logits are soft-capped is left to its own module."""
    assert describe_model(laguna_config(moe_routed_scaling_factor=2.5).to_dict()).routing.scale == 2.5
    assert describe_model(laguna_config(moe_router_logit_softcapping=30.0).to_dict()).routing.custom is not None


def test_laguna_keeps_to_the_generic_decoder_for_its_gate_heads_per_layer_and_rotary_per_layer_type():
    from transformers.models.laguna.modeling_laguna import LagunaDecoderLayer

    config = laguna_config(layer_types=["full_attention", "sliding_attention"], num_attention_heads_per_layer=[4, 8],
                           sliding_window=16)
    heads = [LagunaDecoderLayer(config, i).self_attn.q_proj.out_features // config.head_dim for i in range(2)]
    d = describe_model(config.to_dict())
    assert heads == [4, 8] and d.attention.heads == 4 and d.attention.sliding_layers == (1,)
    gaps = "heads_per_layer, rope_per_layer_type, softplus_gate"
    assert fast_decoder_gap(d) == fast_decoder_gap(d, "cuda") == gaps
    assert "partial_rotary" in d.extras  # the full layers turn half of each head


# Step-3.7's text model: a full layer, then a sliding one with twice the query heads, the SwiGLU clamped on the
# experts of the MoE layer and on the dense one, scores scaled by 1 / sqrt(head_dim)
STEP3P7 = dict(layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=16,
               query_pre_attn_scalar=16,
               num_sliding_attention_heads=8, swiglu_limits=[None, None, 7.0], swiglu_limits_shared=[5.0, 0.0, None],
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})


def step3p7_config(**changes):
    """Step-3.7's tiny config, its text model's values changed (per_layer_config remade from them)."""
    from transformers import Step3p7Config

    config = tiny_default_config("step3p7").to_dict()
    text = {k: v for k, v in config["text_config"].items() if k != "per_layer_config"} | STEP3P7 | changes
    return Step3p7Config(**config | dict(text_config=text))


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_step3p7_route_picks_the_experts_and_weights_of_its_router(scale):
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TopKRouter

    config = step3p7_config(n_routed_experts=8, moe_router_scaling_factor=scale)
    router = Step3p7TopKRouter(config.text_config)
    generator = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=generator)
    router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=generator) * 0.1)
    x = torch.randn(64, config.text_config.hidden_size, generator=generator)
    logits, want_w, want_ids = router(x)
    routing = describe_model(config.to_dict()).routing
    ids, weights = route(routing, logits, router.e_score_correction_bias)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values) and routing.scale == scale  # the block scales the output
    torch.testing.assert_close(weights.gather(-1, order.indices) / scale, want_w.gather(-1, want_order.indices))


def test_step3p7_keeps_to_the_generic_decoder_for_its_gate_heads_clamps_and_rotary_per_layer_type():
    from transformers.models.step3p7.modeling_step3p7 import Step3p7DecoderLayer

    config = step3p7_config()
    layers = [Step3p7DecoderLayer(config.text_config, i) for i in range(3)]
    heads = [layer.self_attn.q_proj.out_features // config.text_config.head_dim for layer in layers]
    gates = [layer.self_attn.g_proj.out_features for layer in layers]
    limits = [layers[0].mlp.limit, layers[2].mlp.experts.limit, layers[2].mlp.shared_experts.limit]
    d = describe_model(config.to_dict())
    assert heads == gates == [4, 8, 4] and d.attention.sliding_layers == (1,) and d.shared_experts == 1
    assert limits == [5.0, 7.0, float("inf")]
    gaps = "heads_per_layer, rope_per_layer_type, sigmoid_gate, swiglu_limit"
    assert fast_decoder_gap(d) == gaps and fast_decoder_gap(d, "cuda") == f"{gaps}, norm_offset"
    assert {"norm_offset", "partial_rotary"} <= set(d.extras)


@pytest.mark.parametrize("changes,extra", [(dict(query_pre_attn_scalar=32), "multipliers"),
                                           (dict(mlp_bias=True), "mlp_bias"),
                                           (dict(swiglu_limits_shared=[0.0, 3.0, None]), "swiglu_limit"), ({}, None)])
def test_step3p7_names_what_its_config_switches_on(changes, extra):
    """A query scale other than head_dim's (the attention's own), MLP biases, a clamp on any layer; none without."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7Attention

    config = step3p7_config(**dict(swiglu_limits=None, swiglu_limits_shared=None) | changes)
    d = describe_model(config.to_dict())
    named = {"swiglu_limit", "multipliers", "mlp_bias"} & set(d.extras)
    assert named == ({extra} if extra else set())
    scaling = Step3p7Attention(config.text_config.per_layer_config[0], 0).scaling
    assert (d.multipliers.attention if d.multipliers else config.text_config.head_dim ** -0.5) == scaling


def glm5_next_config(**changes):
    """GLM-5.3's tiny config, its text model's values changed."""
    from transformers import Glm5NextConfig

    config = tiny_default_config("glm5_next").to_dict()
    return Glm5NextConfig(**config | dict(text_config=config["text_config"] | changes))


@pytest.mark.parametrize("changes", [dict(), dict(n_routed_experts=8, num_experts_per_tok=3, norm_topk_prob=False)])
def test_glm5_next_route_picks_the_experts_and_weights_of_its_router(changes):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

    config = glm5_next_config(**changes)
    router = Glm5NextTextTopkRouter(config.text_config)
    generator = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=generator)
    router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=generator) * 0.1)
    logits, want_w, want_ids = router(torch.randn(64, config.text_config.hidden_size, generator=generator))
    ids, weights = route(describe_model(config.to_dict()).routing, logits, router.e_score_correction_bias)
    order, want_order = ids.sort(-1), want_ids.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(-1, order.indices), want_w.gather(-1, want_order.indices))


@pytest.mark.parametrize("types", [["full"] * 4, ["full", "full", "shared", "full"]])
def test_glm5_next_describes_its_delta_attention_mla_layers_and_shared_indexers(types):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextDecoderLayer

    layer_types = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    config = glm5_next_config(num_hidden_layers=4, layer_types=layer_types, indexer_types=types,
                              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rms_norm_eps=1e-5)
    layers = [Glm5NextTextDecoderLayer(config.text_config, i) for i in range(4)]
    mla = [i for i, layer in enumerate(layers) if isinstance(layer.self_attn, Glm5NextTextAttention)]
    shared = any(layers[i].self_attn.skip_topk for i in mla)
    d = describe_model(config.to_dict())
    assert d.attention.kind == "mla" and d.attention.mixer_layers == (0, 3) and d.attention.nope_layers == tuple(mla)
    assert d.attention.latent_norm_eps == layers[1].self_attn.q_a_layernorm.variance_epsilon == 1e-5
    assert d.shared_experts == 1 and d.moe_layers == (1, 2, 3) and ("shared_indexer" in d.extras) == shared
    gaps = f"block_sparse_attention, hyper_connections, {'shared_indexer, ' if shared else ''}swiglu_gate_limit"
    assert fast_decoder_gap(d) == gaps and fast_decoder_gap(d, "cuda") == f"{gaps}, MLA layers without rotary"
