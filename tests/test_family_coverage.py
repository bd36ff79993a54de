"""Families transformers has and smoe's table does not: found from transformers' own experts modules."""

import pytest

from smoe.source import families
from smoe.testing import coverage


@pytest.mark.parametrize("model_type", ["solar_open", "hy_v3"])
def test_a_family_without_a_row_runs_through_the_experts_module_transformers_builds(model_type, tmp_path):
    assert families._normalise_type(model_type) not in families._BY_TYPE
    row = coverage.check(model_type, tmp_path)
    assert row.passed, row.error
    assert row.decoder == "generic" and row.relative_error <= coverage.TOLERANCE


def test_a_family_whose_experts_are_not_one_fused_module_is_still_refused_by_name(tmp_path):
    row = coverage.check("jetmoe", tmp_path)
    assert row.stage == "quantize" and "unsupported model_type 'jetmoe'" in row.error


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
        families.config_number({"model_type": "hy_v4", "vocab_size": 8, "pad_token_id": 100}, "num_experts")
