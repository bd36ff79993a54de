"""Timings of the CPU expert kernels, each next to plain F.linear on pre-decoded weights in the same process.

Run: python -m smoe.bench_kernels_cpu [--json] [--threads N]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from smoe import codec
from smoe.kernels_cpu import choose_path, linear, prepare_expert, random_quantised, to_int4
from smoe.vault import QuantisedTensor

# (label, out, in): expert projections as stored, weight [out, in]
SHAPES = (
    ("qwen3-30b-a3b gate/up", 768, 2048),
    ("qwen3-30b-a3b down", 2048, 768),
    ("qwen3-235b gate/up", 1536, 4096),
    ("qwen3-235b down", 4096, 1536),
    ("small gate/up", 96, 384),
    ("small down", 384, 96),
)
TOKENS = (1, 4, 32, 256)
# fp16/fp32 go through the kernel's scalar loop: timed on one shape and few tokens only (it is slow).
SLOW_DTYPES = (torch.float32, torch.float16)
SLOW_TOKENS = (1, 32)


def timed(fn, min_seconds: float = 0.2, min_runs: int = 5) -> float:
    """Median seconds per call, over batches of calls lasting about 20 ms each, after a warm-up."""
    fn()
    start = time.perf_counter()
    fn()
    per_call = max(time.perf_counter() - start, 1e-7)
    batch = max(1, int(0.02 / per_call))
    samples = []
    deadline = time.perf_counter() + min_seconds
    while len(samples) < min_runs or time.perf_counter() < deadline:
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t) / batch)
    return sorted(samples)[len(samples) // 2]


def bench_matmul(dtype=torch.bfloat16, shapes=SHAPES, tokens=TOKENS) -> list[dict]:
    """Per shape and T: int4 kernel, decode-per-call + F.linear, and F.linear on pre-decoded weights."""
    rows = []
    for label, out, inp in shapes:
        t = random_quantised((out, inp), 4)
        int4 = prepare_expert([t], {}, dtype, "int4")
        dense = prepare_expert([t], {}, dtype, "dequant")
        for n in tokens:
            x = torch.randn(n, inp).to(dtype)
            base = timed(lambda: linear(x, dense, "w"))
            kernel = timed(lambda: linear(x, int4, "w"))
            per_call = timed(lambda: F.linear(x, codec.decode(t.codes, t.scales, 4, t.shape, dtype)))
            rows.append({
                "shape": label, "out": out, "in": inp, "tokens": n, "dtype": str(dtype).removeprefix("torch."),
                "int4_fits": not int4.fallbacks,
                "baseline_ms": base * 1e3, "int4_ms": kernel * 1e3, "decode_per_call_ms": per_call * 1e3,
                "int4_speedup": base / kernel, "decode_per_call_speedup": base / per_call,
            })  # fmt: skip
    return rows


def bench_conversion(shapes=SHAPES[:4]) -> list[dict]:
    """Prepare-time cost per projection, as MB/s of stored blob (codes + scales) consumed."""
    rows = []
    for label, out, inp in shapes:
        for bits in codec.DEPTHS:
            t = random_quantised((out, inp), bits)
            blob = t.codes.numel() + 2 * t.scales.numel()
            timings = {
                "int4_pack": timed(lambda: to_int4(t, torch.bfloat16)),
                "torch_converter": timed(lambda: torch_converter(t)),
                "decode_bf16": timed(lambda: t.decode(torch.bfloat16)),
                "copy_blob": timed(lambda: (t.codes.clone(), t.scales.clone())),
            }
            row = {"shape": label, "bits": bits, "blob_bytes": blob}
            row.update({f"{k}_MBps": blob / v / 1e6 for k, v in timings.items()})
            rows.append(row)
    return rows


def torch_converter(t: QuantisedTensor) -> torch.Tensor:
    """The portable alternative to our packer: unpack to int32, then torch's own converter."""
    q = codec.unpack_codes(t.codes, t.bits).to(torch.int32).view(t.shape)
    q = q if t.bits == 4 else 2 * q + 5
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)


def bench_cpu_kernels(json_out: bool = False, threads: int | None = None) -> dict:
    """All tables. `threads` pins torch and numba to that many threads (default: as configured);
    on a shared or small VM one thread gives repeatable figures (waking a second one can stall).
    The int4 packer is single-threaded whatever this says."""
    if threads:
        torch.set_num_threads(threads)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads",
        "matmul_bf16": bench_matmul(torch.bfloat16),
        "matmul_slow_dtypes": [r for dt in SLOW_DTYPES for r in bench_matmul(dt, SHAPES[:1], SLOW_TOKENS)],
        "conversion": bench_conversion(),
        "auto": {str(dt).removeprefix("torch."): choose_path(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)},
    }
    print(json.dumps(result, indent=1) if json_out else format_result(result))
    return result


def format_result(result: dict) -> str:
    lines = [result["machine"], "", "matmul (ms per call; speedup = baseline / method):"]
    lines.append(f"{'shape':24} {'dtype':8} {'T':>4} {'baseline':>9} {'int4':>8} {'x':>6} {'dec+mm':>8} {'x':>6}")
    for r in result["matmul_bf16"] + result["matmul_slow_dtypes"]:
        note = "" if r["int4_fits"] else "  (int4 falls back to dequant)"
        lines.append(
            f"{r['shape']:24} {r['dtype']:8} {r['tokens']:>4} {r['baseline_ms']:9.3f} {r['int4_ms']:8.3f} "
            f"{r['int4_speedup']:6.2f} {r['decode_per_call_ms']:8.3f} {r['decode_per_call_speedup']:6.2f}{note}"
        )
    lines += ["", "prepare-time conversion (MB/s of stored codes + scales):"]
    lines.append(f"{'shape':24} {'bits':>4} {'int4 pack':>10} {'torch conv':>10} {'decode bf16':>11} {'copy':>8}")
    for r in result["conversion"]:
        lines.append(
            f"{r['shape']:24} {r['bits']:>4} {r['int4_pack_MBps']:10.0f} {r['torch_converter_MBps']:10.0f} "
            f"{r['decode_bf16_MBps']:11.0f} {r['copy_blob_MBps']:8.0f}"
        )
    lines += ["", "auto path: " + ", ".join(f"{k}: {v}" for k, v in result["auto"].items())]
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    bench_cpu_kernels(json_out="--json" in args, threads=int(args[args.index("--threads") + 1]) if "--threads" in args else None)
