"""Every value a thread option accepts runs: torch's CPU threads are bounded by what the machine can
take (more crash inside torch: 2,046 overflow an 8 MiB stack), with a warning; the expert reader's
pool takes its whole range, and the Python API refuses values outside it in one line. A process that
may start no more threads is told so in one line."""

import os
import shutil
import subprocess
import sys
import tempfile

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


# generate once (every module imported, as root), then again under a user's process limit that leaves room for one
# more thread: root is exempt from RLIMIT_NPROC, so the process takes another user id first
UNDER_THREAD_LIMIT = """
import os, resource, sys
from smoe.cli import main
vault = sys.argv[1]
args = ["generate", vault, "-p", "The sea", "--max-tokens", "2", "--temperature", "0"]
main(args + ["--threads", "1"])
tasks = len(os.listdir("/proc/self/task"))
resource.setrlimit(resource.RLIMIT_NPROC, (tasks + 1, tasks + 1))
os.setresgid(48213, 48213, 0)
os.setresuid(48213, 48213, 0)
sys.exit(main(args + ["--threads", "16"]))
"""


@pytest.mark.skipif(not hasattr(os, "setresuid") or os.geteuid() != 0,
                    reason="taking another user id needs root (RLIMIT_NPROC does not bind root itself)")
def test_a_reader_thread_the_process_limit_refuses_is_one_line(tiny_qwen_vault):
    with tempfile.TemporaryDirectory() as readable:  # the other user must read the vault
        os.chmod(readable, 0o755)
        vault = shutil.copytree(tiny_qwen_vault["vault"], os.path.join(readable, "vault"))
        proc = subprocess.run([sys.executable, "-c", UNDER_THREAD_LIMIT, vault], capture_output=True, text=True,
                              timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last == ("smoe: error: cannot start an expert reader thread (16 asked for): the process limit on threads "
                    "is reached (ulimit -u, or the container's pids limit); use fewer reader threads (--threads, threads= in "
                    "smoe.load)")
