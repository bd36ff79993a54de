"""Counts padded to a few sizes, so compiled specialisations (numba, Triton, CUDA graphs) are reused."""

from __future__ import annotations

import math


def bucket(n: int, least: int = 1) -> int:
    """n rounded up to a power of two, at least `least`."""
    return max(least, 1 << math.ceil(math.log2(max(n, 1))))
