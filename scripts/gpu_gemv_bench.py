"""A one-token step's trunk matrices (bf16, x of one row) through torch's F.linear (cuBLAS) against a Triton
matrix-vector kernel over a few tiles, alternating in one process: microseconds per call and the HBM rate
(the matrix's bytes over the time), each timed as a CUDA graph of 20 calls so that launches do not count.

Usage (a CUDA machine, repository root): python3 scripts/gpu_gemv_bench.py
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Qwen3-30B-A3B's trunk: q/k/v fused, o, router, LM head
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "lm_head": (151936, 2048)}
TILES = [(bn, bk, w) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)]


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, n, k: tl.constexpr, block_n: tl.constexpr, block_k: tl.constexpr):
    rows = tl.program_id(0) * block_n + tl.arange(0, block_n)
    acc = tl.zeros([block_n, block_k], tl.float32)
    for k0 in tl.static_range(0, k, block_k):
        cols = k0 + tl.arange(0, block_k)
        w = tl.load(w_ptr + rows[:, None] * k + cols[None, :], mask=rows[:, None] < n, other=0.0)
        acc += w.to(tl.float32) * tl.load(x_ptr + cols).to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < n)


def triton_gemv(x, w, tile):
    bn, bk, warps = tile
    n, k = w.shape
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _gemv[(triton.cdiv(n, bn),)](w, x, y, n, k, bn, bk, num_warps=warps)
    return y


def graph_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def main() -> None:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w).float()
        tol = 2e-2 * ref.abs().max()  # bf16 output: rounded at ~8 bits
        ok = [t for t in TILES if k % t[1] == 0 and (triton_gemv(x, w, t).float() - ref).abs().max() < tol]
        rounds = []
        for _ in range(2):
            torch_us = graph_us(lambda: F.linear(x, w))
            tiles = {t: graph_us(lambda t=t: triton_gemv(x, w, t)) for t in ok}
            rounds.append((torch_us, tiles))
        gb = n * k * 2 / 1e9
        torch_best = min(r[0] for r in rounds)
        best = min(ok, key=lambda t: min(r[1][t] for r in rounds))
        tri_best = min(r[1][best] for r in rounds)
        print(f"{name} [{n}x{k}] {gb * 1000:.1f} MB: torch {' / '.join(f'{r[0]:.2f}' for r in rounds)} us "
              f"({gb / torch_best * 1e6 / 1e3:.2f} TB/s); triton best {best} "
              f"{' / '.join(f'{r[1][best]:.2f}' for r in rounds)} us ({gb / tri_best * 1e6 / 1e3:.2f} TB/s); "
              f"torch / triton {torch_best / tri_best:.2f}", flush=True)


if __name__ == "__main__":
    main()
