"""Picking the torch device from a user's --device choice."""

from __future__ import annotations

import importlib.util

import torch

from smoe.errors import SmoeError

MIN_CAPABILITY = (8, 0)  # the Triton expert kernels use bf16 and Ampere-or-later instructions


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
        return "the GPU kernels need the triton package"
    return None
