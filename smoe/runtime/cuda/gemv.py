"""A one-token step's trunk projections (x [1, K] times a matrix [N, K] of the model's dtype) in one Triton
kernel instead of cuBLAS.

At batch 1 a projection is a matrix-vector product bound by reading the matrix. cuBLAS picks GEMM tiles
for it (a split-K kernel plus its reduction for the o projection) that read a Qwen3-30B-A3B-shaped layer's
q/k/v and o matrices at 3.3 and 2.3 TB/s on the H200 alone (1.9-2.7 inside the decode graph) and take ~5 us for
the 0.5 MB router; this kernel reads them at 5.0 and 4.2 TB/s, the router in 1.7 us (BENCHMARKS.md). Here
each program reads BLOCK_N whole rows in BLOCK_K-wide steps, every load of a row issued before the first is
used (the K loop is unrolled), and sums in fp32: the same products as F.linear, summed in another order.
Inside the decoder's compiled blocks inductor captures the launch like its own kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smoe.runtime.cuda.kernels import INTERPRETED, triton
from smoe.switches import GPU_GEMV

MAX_K = 16384  # the K loop is unrolled: wider rows stay on F.linear
# read once (compiled blocks treat it as a constant); a script measuring both paths in one process sets it
# before building each decoder, whose graphs keep the kernels they were captured with
ENABLED = GPU_GEMV.on()

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, n, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              HAS_BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def tiles(n: int, k: int) -> tuple[int, int, int]:
    """(rows a program, row width a step, warps), the best of 18 tiles for each of Qwen3-30B-A3B's trunk matrices on
    the H200 (scripts/gpu_gemv_bench.py): q/k/v [5120, 2048] (8, 256, 4), o [2048, 4096] and the router [128, 2048]
    (4, 1024, 4), the LM head [151936, 2048] (4, 1024, 8). Many rows of a narrow matrix keep more programs in flight
    with short steps; a wide or short matrix takes long steps."""
    if n > 65536:
        return 4, min(1024, triton.next_power_of_2(k)), 8
    if n >= 4096 and k <= 2048:
        return 8, min(256, triton.next_power_of_2(k)), 4
    return 4, min(1024, triton.next_power_of_2(k)), 4


def covered(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel computes x @ w.T: one row, on the GPU (or the interpreter), contiguous matrices."""
    return (ENABLED and triton is not None and x.dim() == 2 and x.shape[0] == 1 and (x.is_cuda or INTERPRETED)
            and w.is_contiguous() and w.shape[1] <= MAX_K and x.dtype == w.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), in the kernel for one row (covered), else F.linear."""
    if not covered(x, w):
        return F.linear(x, w, bias)
    n, k = w.shape
    block_n, block_k, warps = tiles(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(n, block_n),)](x.contiguous(), w, bias if bias is not None else w, y, n, K=k,
                                      BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=warps)
    return y
