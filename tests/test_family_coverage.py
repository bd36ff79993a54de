"""Families transformers has and smoe's table does not: found from transformers' own experts modules."""

import pytest

from smoe.source import config_numbers, families
from smoe.testing import coverage


# solar_open and hy_v3 have a description rule (their computation is kinds the layer library has): fast
@pytest.mark.parametrize(("model_type", "decoder"), [("solar_open", "fast"), ("hy_v3", "fast"), ("beam", "generic")])
def test_a_family_without_a_row_runs_through_the_experts_module_transformers_builds(model_type, decoder, tmp_path):
    assert families.normalise_type(model_type) not in families.BY_TYPE
    row = coverage.check(model_type, tmp_path)
    assert row.passed, row.error
    assert row.decoder == decoder and row.relative_error <= coverage.TOLERANCE


# families without a row whose description the fast decoders cover (their kinds, or the combination transformers
# gives them, in smoe.source.description's rule): the GPU decoder's gap, None where the GPU's fast decoder covers
# them too (tests/test_layer_library.py holds one of each mechanism to transformers)
FAST_WITHOUT_A_ROW = {
    "qwen3_vl_moe": None, "qwen3_omni_moe_thinker": None, "glm4v_moe": None, "aria": None, "aria_text": None,
    "deepseek_ocr2": None, "flint": None, "lara_mini": None, "granitemoe_swa": None,
    "qwen3_5_moe": "norm_offset, attention gate in the query projection",
    "axk1": "a norm on the MoE block's output", "kolibri1": "experts chosen by logits + correction bias",
    "kimi_linear": "MLA layers without rotary", "flex_olmo": "no norms on the attention's and the MLP's inputs",
}


def test_families_without_a_row_whose_kinds_the_library_has_are_described_for_the_fast_decoders():
    from smoe.runtime.weights import fast_decoder_gap
    from smoe.source.description import describe_model
    from smoe.testing.tiny_models import tiny_default_config

    for model_type, gpu_gap in FAST_WITHOUT_A_ROW.items():
        d = describe_model(tiny_default_config(model_type).to_dict())
        assert (model_type, fast_decoder_gap(d), fast_decoder_gap(d, "cuda")) == (model_type, None, gpu_gap)


# what discovery says of each kind of experts it cannot read: a family refused by name, and why
REFUSALS = {
    "jetmoe": "its JetMoeParallelExperts modules are not fused experts",
    "doge": "transformers builds no routed ...Experts module for it",
    "ernie4_5_vl_moe": "its layers hold routed experts in 2 places (mlp.text_moe, mlp.vision_moe)",
}


@pytest.mark.parametrize("model_type", sorted(REFUSALS))
def test_a_family_whose_experts_are_not_one_fused_module_is_refused_by_name_saying_why(model_type, tmp_path):
    row = coverage.check(model_type, tmp_path)
    assert row.stage == "quantize" and f"unsupported model_type '{model_type}': {REFUSALS[model_type]}" in row.error
    assert model_type in coverage.LEFT_OUT


def test_the_walk_lists_every_family_with_a_row_that_transformers_knows():
    from transformers import CONFIG_MAPPING

    walked = set(coverage.moe_model_types())
    for family in ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "solar_open"):
        assert family in CONFIG_MAPPING and family in walked


def test_a_config_transformers_cannot_build_is_refused_by_name_not_a_traceback():
    import smoe.hf  # noqa: F401 - registers the discovery, as every command does
    from smoe.errors import SmoeError

    # hy_v4 is a family transformers has and smoe's table lacks; its padding token outside the vocabulary makes
    # transformers' own constructor fail
    with pytest.raises(SmoeError, match="unsupported model_type 'hy_v4'"):
        config_numbers.config_number({"model_type": "hy_v4", "vocab_size": 8, "pad_token_id": 100}, "num_experts")


# One family per mechanism; each row names what it needs beyond the discovery above.
MECHANISMS = {
    "qwen3_vl_moe": "a multimodal checkpoint: its text runs through the image-text-to-text class, towers in the trunk",
    "aria": "the release stores the experts fused under other names (fc1 / fc2), read as transformers renames them",
    "minimax_m3_vl": "the release stores experts per expert (block_sparse_moe.experts.E.w1) and the shared "
                     "expert's gate and up apart, which transformers' converter merges",
    "sarvam_moe": "the trunk's fused query_key_value, which transformers' converter splits into q, k and v",
    "deepseek_v4": "hash-routed layers (experts chosen by token id) count as MoE layers; a renaming transformers "
                   "takes back (.norm. on the final norm) is taken back here too",
    "step3p7": "an experts module outside transformers' registry, its SwiGLU clamped per layer (a bound that "
               "bites in the tiny model), streamed by a stand-in that clamps with the module's own bound",
    "longcat_flash": "identity (\"zero\") experts numbered after the routed ones: no weights in the vault, the "
                     "token itself weighted at run time, the rows transformers saves for them dropped",
    "muse_spark": "experts working in a latent width a config key states (moe_hidden_size), projected to and "
                  "from the hidden size in the trunk",
    "qwen4_exp_text": "a default config transformers cannot build (indexed attention without the indexer's "
                      "sizes), given the values its releases set",
    "dots3_note_text": "per-layer MLA overrides whose sizes must still sum to head_dim after the shrink",
    "dots3_note": "a tower whose sizes must equal the tower's and the text model's widths after the shrink",
}


@pytest.mark.parametrize("model_type", sorted(MECHANISMS))
def test_a_family_runs_through_transformers_own_conversions_and_classes(model_type, tmp_path):
    row = coverage.check(model_type, tmp_path)
    assert row.passed, f"{MECHANISMS[model_type]}: {row.error}"
    assert row.relative_error <= coverage.TOLERANCE


def test_the_released_layout_is_read_from_transformers_save_time_conversion():
    import torch

    from smoe.hf import discover
    from smoe.hf.model import skeleton
    from smoe.testing.tiny_models import tiny_default_config

    model = skeleton(tiny_default_config("kimi_linear"), torch.float32)
    module = next(n for n, m in model.named_modules() if type(m).__name__.endswith("Experts"))
    layout = discover.released_layout(model, module, transposed=False)
    assert {role: (s.template, s.transpose, s.parts) for role, s in layout.roles.items()} == {
        "gate": ("block_sparse_moe.experts.{e}.w1.weight", False, 1),
        "up": ("block_sparse_moe.experts.{e}.w3.weight", False, 1),
        "down": ("block_sparse_moe.experts.{e}.w2.weight", False, 1)}


def test_no_false_moe_family_is_walked():
    # classes shared with a dense family's module (llama's, gpt2's) are not routed experts
    walked = set(coverage.moe_model_types())
    assert not walked & {"exaone", "internlm3", "iquestcoder", "gpt-sw3", "data2vec-text", "glmga"}


# hybrid families: the library's kinds on the fast decoders (CPU and GPU), mixer layers through the family's own modules
HYBRIDS = {"lfm2_moe": "conv", "jamba": "linear_attention", "granitemoehybrid": "linear_attention"}  # as layer_types says


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_family_runs_fast_with_its_mixer_layers_through_its_own_modules(model_type, tmp_path):
    from smoe.runtime.weights import fast_decoder_gap

    row = coverage.check(model_type, tmp_path)
    assert row.passed, row.error
    assert row.decoder == "fast" and row.relative_error <= coverage.TOLERANCE
    assert row.gpu_decoder == "fast"  # the GPU's fast decoder runs them through the modules too
    sm = _opened(tmp_path / "vault")
    try:
        named = sm.describe()["transformers_layers"]
        assert set(named) == {HYBRIDS[model_type]} and named[HYBRIDS[model_type]]
        assert fast_decoder_gap(sm.description, "cuda") is None
    finally:
        sm.close()


def test_a_sequence_begun_again_starts_its_mixer_layers_from_a_new_state(tmp_path):
    import torch

    from smoe.runtime.decoder import SequenceStep, open_decoder

    assert coverage.check("lfm2_moe", tmp_path).passed
    sm = _opened(tmp_path / "vault")
    try:
        decoder = open_decoder(sm, "auto", 16)
        first = [decoder.forward([SequenceStep("a", [5, 6, 7], 0)])[0], decoder.forward([SequenceStep("a", [8], 3)])[0]]
        other = decoder.forward([SequenceStep("a", [9, 10, 11, 12], 0)])[0]  # the same name begun again
        again = [decoder.forward([SequenceStep("a", [5, 6, 7], 0)])[0], decoder.forward([SequenceStep("a", [8], 3)])[0]]
        assert not torch.equal(other[:3], first[0])
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    finally:
        sm.close()


def _opened(vault):
    from smoe.runtime.model import OpenedVault

    return OpenedVault(vault, dtype="float32")
