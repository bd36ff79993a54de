"""Random experts in the vault's blob layout, for the GPU kernels' tests and benchmarks."""

from __future__ import annotations

import torch

from smoe.format import codec
from smoe.format.vault import ExpertEntry, QuantisedTensor, build_blob
from smoe.runtime.cuda.kernels import GROUP, SLOT_ALIGNMENT, ExpertLayout

POOL_SLOT = 256  # random_pool's experts sit in pool slots aligned to this many bytes


def layout_for_shape(hidden: int, inter: int, bits_gate_up: int, bits_down: int) -> tuple[ExpertLayout, int]:
    """The blob layout smoe.format.vault.build_blob produces for a gated expert, and the blob's size."""
    offsets, end = [], 0
    for rows, cols, bits in ((inter, hidden, bits_gate_up), (inter, hidden, bits_gate_up), (hidden, inter, bits_down)):
        for nbytes in codec.encoded_nbytes(rows * cols, bits):
            start = -(-end // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
            offsets.append(start)
            end = start + nbytes
    return ExpertLayout(hidden, inter, bits_gate_up, bits_down, *offsets), end


def random_blob(layout_shape: tuple[int, int], bits_gate_up: int, bits_down: int, seed: int,
                bias_dtype: torch.dtype | None = None):
    """A blob of one random expert (uniform codes, scales in [1e-3, 0.05); with bias_dtype, gate, up and
    down biases in [-0.5, 0.5)) in the vault's layout; returns (bytes, ExpertLayout). layout_shape: (hidden, inter)."""
    hidden, inter = layout_shape
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for role, shape, bits in (("gate", (inter, hidden), bits_gate_up), ("up", (inter, hidden), bits_gate_up),
                              ("down", (hidden, inter), bits_down)):
        groups = codec.num_groups(shape[0] * shape[1])
        codes = torch.randint(0, 2**bits, (groups, GROUP), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(groups, generator=gen) * 0.049 + 1e-3).to(torch.float16)
        tensors.append(QuantisedTensor(role, shape, bits, codec.pack_codes(codes, bits), scales))
    biases = None if bias_dtype is None else {
        role: (torch.rand(rows, generator=gen) - 0.5).to(bias_dtype) for role, rows in
        (("gate", inter), ("up", inter), ("down", hidden))}
    raw, entries, bias_entries = build_blob(tensors, biases)
    entry = ExpertEntry(0, 0, 0, len(raw), "", entries, bias_entries)
    return raw, ExpertLayout.from_entry(entry)


def random_pool(hidden: int, inter: int, bits_gu: int, bits_d: int, device, pool_gb: float | None = None,
                n_experts: int | None = None, seed: int = 0, least: int = 8):
    """A pool of random experts in the vault's blob layout (pool_gb of them, at least `least`, or
    n_experts): (pool, byte offsets [n], layout, blob bytes). Codes are random bytes (every bit
    pattern is a valid code); scales are drawn in [1e-3, 0.05)."""
    layout, size = layout_for_shape(hidden, inter, bits_gu, bits_d)
    slot = -(-size // POOL_SLOT) * POOL_SLOT
    n = n_experts or max(least, int(pool_gb * 1e9 // slot))
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = torch.randint(0, 256, (n * slot,), dtype=torch.uint8, device=device, generator=gen)
    halves = pool.view(n, slot).view(torch.float16)  # [n, slot / 2]
    for rows, cols, bits, s_off in ((inter, hidden, bits_gu, layout.gate_scales), (inter, hidden, bits_gu, layout.up_scales),
                                    (hidden, inter, bits_d, layout.down_scales)):
        count = rows * cols // GROUP
        scales = torch.rand(n, count, device=device, generator=gen) * 0.049 + 1e-3
        halves[:, s_off // 2: s_off // 2 + count] = scales.to(torch.float16)
    offsets = torch.arange(n, device=device, dtype=torch.int64) * slot
    return pool, offsets, layout, size
