"""One torch thread rule for every entry point: the CLI, `smoe.load` and `from_pretrained` end with the same count."""

import json
import os
import subprocess
import sys

import pytest
import torch

import smoe
from smoe.devices import default_torch_threads, set_torch_threads
from smoe.errors import SmoeError

# Each entry point in turn, torch's own count put back before the next, so that each starts as a fresh process does.
ENTRY_POINTS = """
import json, sys, torch
import smoe
from transformers import AutoModelForCausalLM
from smoe.cli import main

vault, start, counts = sys.argv[1], torch.get_num_threads(), {}
smoe.load(vault, dtype="float32")
counts["smoe.load"] = torch.get_num_threads()
torch.set_num_threads(start)
AutoModelForCausalLM.from_pretrained(vault, dtype=torch.float32)
counts["from_pretrained"] = torch.get_num_threads()
torch.set_num_threads(start)
main(["generate", vault, "-p", "the sea", "--max-tokens", "1", "--temperature", "0", "--decoder", "generic", "--json"])
counts["smoe generate"] = torch.get_num_threads()
print(json.dumps({"counts": counts, "start": start}))
"""


@pytest.fixture
def vault(tiny_qwen_vault):
    return tiny_qwen_vault["vault"]


@pytest.fixture
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def entry_point_counts(vault, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | env
    run = subprocess.run([sys.executable, "-c", ENTRY_POINTS, str(vault)], capture_output=True, text=True,
                         env=environ, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_smoe_load_and_from_pretrained_end_with_the_thread_count_the_cli_uses(vault):
    result = entry_point_counts(vault)
    assert set(result["counts"].values()) == {default_torch_threads()}, result


def test_an_explicit_torch_threads_argument_wins(vault, keep_torch_threads):
    chosen = 2 if default_torch_threads() == 1 else 1
    smoe.load(vault, dtype="float32", torch_threads=chosen)
    assert torch.get_num_threads() == chosen


def test_omp_num_threads_in_the_environment_is_left_as_torch_took_it(monkeypatch, keep_torch_threads):
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_torch_threads() == 2
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_torch_threads_argument_that_is_not_a_positive_integer_is_refused(bad, keep_torch_threads):
    with pytest.raises(SmoeError, match=r"torch_threads: expected an integer ≥ 1"):
        set_torch_threads(bad)
