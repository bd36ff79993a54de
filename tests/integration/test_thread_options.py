"""Every value a thread option accepts runs: torch's CPU threads are bounded by what the machine can
take (more crash inside torch: 2,046 overflow an 8 MiB stack), with a warning; the expert reader's
pool takes its whole range, and the Python API refuses values outside it in one line."""

import subprocess
import sys

import pytest
import torch

import smoe
from smoe.devices import torch_thread_limit
from smoe.errors import SmoeError
from smoe.runtime.model import OpenedVault


def test_thread_options_never_crash_the_process(tiny_qwen_vault):
    """Every thread option of `generate` at the top of its range, in a process of its own (a crash inside
    torch would take the test runner with it)."""
    cmd = [sys.executable, "-m", "smoe.cli", "generate", str(tiny_qwen_vault["vault"]), "-p", "The sea",
           "--max-tokens", "2", "--torch-threads", "4096", "--threads", "4096"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [line for line in proc.stderr.splitlines() if line.startswith("smoe: warning:")]
    limit = torch_thread_limit()
    assert warned == ([] if limit >= 4096 else [
        f"smoe: warning: --torch-threads 4096 is more than this machine can use; using {limit} (the cores this "
        f"process may run on, and at most one thread per 8 KiB of the stack limit, ulimit -s)"])


def test_the_largest_reader_pool_reads_every_expert(tiny_qwen_vault):
    """--threads 4096, the top of its range, as the Python API takes it: a thread per read in flight."""
    model = smoe.load(tiny_qwen_vault["vault"], dtype="float32", threads=4096)
    try:
        out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        assert out.shape == (1, 5) and model.smoe_runtime.store.stats.misses > 0
    finally:
        model.smoe_runtime.close()


@pytest.mark.parametrize("threads", [0, -1, 4097, 2.5, "16"])
def test_reader_threads_out_of_range_are_refused_through_the_python_api(tiny_qwen_vault, threads):
    with pytest.raises(SmoeError, match=r"^threads \(parallel expert reads\): expected an integer in \[1, 4096\]"):
        smoe.load(tiny_qwen_vault["vault"], dtype="float32", threads=threads)


@pytest.mark.parametrize("cache_gb", [1e-300, 1e-12])
def test_a_cache_budget_under_a_byte_is_reported_as_the_bytes_it_gives(tiny_qwen_vault, cache_gb):
    """`--cache-gb 1e-300` is a cache of 0 bytes, and the error says so, not "--cache-gb 0"."""
    with pytest.raises(SmoeError, match=r"^an expert cache of 0 bytes \(--cache-gb\) is smaller than one token's"):
        OpenedVault(tiny_qwen_vault["vault"], dtype="float32", cache_bytes=int(cache_gb * 1e9))
