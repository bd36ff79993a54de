"""Copying a wave of expert blobs from pinned host slots into GPU slots in one kernel launch.

Each cudaMemcpyAsync costs the host ~20 us and the expert cache issues one per missed expert, per layer, while
the next layer waits: at 25% of Qwen3-30B-A3B's experts on the GPU the host spent more time issuing copies
than the link spent carrying them (BENCHMARKS.md). Pinned host memory is mapped into the GPU's address space
(unified addressing), so one kernel can read every missed expert's slot over the link and write it into its
GPU slot: one launch per wave, whatever the number of experts.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the cache then copies expert by expert
    triton = None

WORDS_PER_PROGRAM = 4096  # 16 KB per program: a few hundred programs per expert keep the link busy


if triton is not None:

    @triton.jit
    def _gather(src, dst, src_rows, dst_rows, src_stride, dst_stride, words, BLOCK: tl.constexpr):
        pid, chunk = tl.program_id(0), tl.program_id(1)
        src_row = tl.load(src_rows + pid).to(tl.int64)
        dst_row = tl.load(dst_rows + pid).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        keep = offs < words
        values = tl.load(src + src_row * src_stride + offs, mask=keep)
        tl.store(dst + dst_row * dst_stride + offs, values, mask=keep)


def available() -> bool:
    return triton is not None


def gather_slots(host: torch.Tensor, pool: torch.Tensor, pairs: list[tuple[int, int]], slot_bytes: int) -> None:
    """pool's slot g := host's slot h for each (h, g) in pairs, `slot_bytes` bytes each, on the current stream.
    host: [host slots, host slot bytes] uint8, pinned; pool: the GPU slots, slot_bytes apart."""
    rows = torch.tensor(pairs, dtype=torch.int64, pin_memory=pool.is_cuda).to(pool.device, non_blocking=True)
    words = slot_bytes // 4
    src, dst = host.view(torch.int32), pool.view(torch.int32)
    grid = (len(pairs), triton.cdiv(words, WORDS_PER_PROGRAM))
    _gather[grid](src, dst, rows[:, 0].contiguous(), rows[:, 1].contiguous(), host.shape[1] // 4, words, words,
                  BLOCK=WORDS_PER_PROGRAM)
