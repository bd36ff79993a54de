"""Picking the torch device from a user's --device choice, and how many CPU threads torch runs.

`set_torch_threads` is the one thread rule of every entry point (the CLI's generate, chat, serve and eval,
`smoe.load`, `from_pretrained`): a count the caller asks for, else the one OMP_NUM_THREADS / MKL_NUM_THREADS
gave torch, else smoe's default (`default_torch_threads`). torch's thread count is process-wide.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import sys

import torch

from smoe.errors import SmoeError

MIN_CAPABILITY = (8, 0)  # the Triton expert kernels use bf16 and Ampere-or-later instructions
# Some of torch's CPU kernels (index_add_, say) keep about 4 KiB per thread on the calling thread's stack: 2,046
# threads overflow the default 8 MiB stack and the process dies with SIGSEGV. Twice that leaves room for the rest.
STACK_BYTES_PER_TORCH_THREAD = 8 << 10
UNLIMITED_STACK = 8 << 20  # what glibc gives a new thread when the stack limit is unlimited is no more than this


def resolve_device(device: str) -> torch.device:
    """auto: a supported CUDA GPU when there is one, else CPU; cuda without one is a clear error."""
    if device == "auto":
        return torch.device("cuda" if cuda_problem() is None else "cpu")
    if device == "cuda" and cuda_problem() is not None:
        raise SmoeError(f"--device cuda: {cuda_problem()} (use --device cpu or auto)")
    if device not in ("cpu", "cuda"):
        raise SmoeError(f"unknown device {device!r} (auto, cpu, cuda)")
    return torch.device(device)


def cuda_problem() -> str | None:
    """Why smoe cannot run on this machine's GPU, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]}) is not supported; "
                f"the GPU kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later")
    if importlib.util.find_spec("triton") is None:
        return "the GPU kernels need the triton package: pip install 'smoe[cuda]'"
    return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def torch_thread_limit() -> int:
    """The most CPU threads torch can run here: no more than the cores this process may use (more only
    wait for one), nor than a thread's stack can hold."""
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = UNLIMITED_STACK if stack == resource.RLIM_INFINITY else stack
    return max(1, min(usable_cores(), stack // STACK_BYTES_PER_TORCH_THREAD))


def default_torch_threads() -> int:
    """1 thread on machines of 2 usable cores or fewer, where batch-1 ops are too small to split and a second
    thread mostly waits (torch's own default, one per core, decodes several times slower there); else one per
    usable core. Never more than torch can run here."""
    cores = usable_cores()
    return min(1 if cores <= 2 else cores, torch_thread_limit())


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # what torch reads at start for its count


def set_torch_threads(requested: int | None = None, option: str = "torch_threads") -> int:
    """Set torch's CPU thread count for this process, and return it: `requested` (lowered to what torch can
    run here, with a warning naming `option`), else the count torch took from OMP_NUM_THREADS or
    MKL_NUM_THREADS when either is set (left as it is), else `default_torch_threads()`."""
    if requested is None and any(os.environ.get(name) for name in THREAD_VARIABLES):
        return torch.get_num_threads()
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise SmoeError(f"{option}: expected an integer ≥ 1, got {requested!r}")
    count = default_torch_threads() if requested is None else torch_threads(requested, option)
    torch.set_num_threads(count)
    return count


def torch_threads(requested: int, option: str = "--torch-threads") -> int:
    """`requested`, or as many CPU threads as torch can run on this machine when that is fewer (with a warning)."""
    allowed = torch_thread_limit()
    if requested > allowed:
        print(f"smoe: warning: {option} {requested} is more than this machine can use; using {allowed} (the cores "
              f"this process may run on, and at most one thread per 8 KiB of the stack limit, ulimit -s)",
              file=sys.stderr)
    return min(requested, allowed)
