"""The SMOE-Q2/Q4 numbers every codec implementation shares: group size, depths, the 64 scale
candidates, the code midpoint. Kept apart from smoe.format.codec so that the search backends
(numba, Triton) and the codec that dispatches to them import one common module, not each other."""

from __future__ import annotations

import torch

from smoe.errors import SmoeError

GROUP_SIZE = 64
DEPTHS = (2, 4)
FP16_MAX = 65504.0
# float64 linspace rounded once to fp32, so every search backend uses the very same 64 factors.
CANDIDATE_FACTORS = torch.linspace(0.1, 1.0, 64, dtype=torch.float64).to(torch.float32)


def half_range(bits: int) -> float:
    """h: the code midpoint, (2**bits - 1) / 2."""
    check_bits(bits)
    return (2**bits - 1) / 2


def check_bits(bits: int) -> None:
    if bits not in DEPTHS:
        raise SmoeError(f"unsupported depth {bits} bits: SMOE supports {DEPTHS}")


def packed_group_bytes(bits: int) -> int:
    return GROUP_SIZE * bits // 8
