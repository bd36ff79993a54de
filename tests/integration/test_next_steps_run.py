"""The README's `smoe quantize` and `smoe chat` lines for real MoE checkpoints, run as written on tiny random
models of the same families, placed in a Hugging Face cache under the same ids (where `hf download` puts the
real ones; nothing is downloaded here)."""

import os
import subprocess
import sys

import pytest
from test_demo_next_steps import FAMILIES, readme_next_steps
from test_first_run import hub_cache

from smoe.format.vault import Vault
from smoe.testing.vaults import tiny_model_dir


@pytest.mark.parametrize("hub_id", FAMILIES)
def test_the_readme_quantize_and_chat_lines_run_on_a_tiny_model_of_that_family(hub_id, tmp_path):
    model = tiny_model_dir(tmp_path / "tiny", FAMILIES[hub_id])
    hub_cache(tmp_path / "hub", hub_id, model)
    env = os.environ | {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    quantize, chat = readme_next_steps()[hub_id]
    smoe = [sys.executable, "-m", "smoe.cli"]
    proc = subprocess.run(smoe + quantize[1:], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with Vault(tmp_path / chat[2]) as vault:
        assert vault.meta["family"] == FAMILIES[hub_id]
    proc = subprocess.run(smoe + chat[1:], cwd=tmp_path, env=env, input="Hello there\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "prompt tokens" in proc.stderr  # one reply, with its stats line, before the input ended
