"""Picking the torch device from a user's --device choice."""

from __future__ import annotations

import torch

from smoe.errors import SmoeError


def resolve_device(device: str) -> torch.device:
    """auto: CUDA when available, else CPU; cuda without a GPU is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SmoeError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if device not in ("cpu", "cuda"):
        raise SmoeError(f"unknown device {device!r} (auto, cpu, cuda)")
    return torch.device(device)
