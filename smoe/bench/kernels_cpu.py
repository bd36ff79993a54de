"""Timings of the CPU expert kernels, each next to plain F.linear on pre-decoded weights in the same process.

Run: python -m smoe.bench.kernels_cpu [--json] [--threads N]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from smoe.devices import torch_threads
from smoe.format import codec
from smoe.format.vault import QuantisedTensor
from smoe.runtime.cpu.kernels import (
    KERNEL_GROUP,
    choose_path,
    dense_weight,
    linear,
    prepare_expert,
    random_quantised,
    to_int4,
)

# (label, out, in): expert projections as stored, weight [out, in]
SHAPES = (
    ("qwen3-30b-a3b gate/up", 768, 2048),
    ("qwen3-30b-a3b down", 2048, 768),
    ("qwen3-235b gate/up", 1536, 4096),
    ("qwen3-235b down", 4096, 1536),
    ("small gate/up", 192, 384),
    ("small down", 384, 96),
)
TOKENS = (1, 4, 8, 32, 128, 256)
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
    """Per shape and T, ms per call of: F.linear on pre-decoded weights (the baseline, = the dequant
    path), the raw int4 kernel, the int4 path as `linear` runs it (kernel, or a dense temporary for
    many tokens), and decoding the codes on every call before F.linear."""
    rows = []
    for label, out, inp in shapes:
        t = random_quantised((out, inp), 4)
        int4 = prepare_expert([t], {}, dtype, "int4")
        dense = prepare_expert([t], {}, dtype, "dequant")
        codes = prepare_expert([t], {}, dtype, "codes")
        w = int4.weights["w"]
        for n in tokens:
            x = torch.randn(n, inp).to(dtype)
            ms = {
                "baseline": timed(lambda: linear(x, dense, "w")),
                "int4_path": timed(lambda: linear(x, int4, "w")),
                "codes_path": timed(lambda: linear(x, codes, "w")),
                "decode_per_call": timed(lambda: F.linear(x, t.decode(dtype))),
            }
            if not int4.fallbacks:
                ms["int4_kernel"] = timed(lambda: int4_kernel(x, w))
            row = {"shape": label, "out": out, "in": inp, "tokens": n, "dtype": str(dtype).removeprefix("torch.")}
            row["int4_fits"] = not int4.fallbacks
            row.update({f"{k}_ms": v * 1e3 for k, v in ms.items()})
            row.update({f"{k}_speedup": ms["baseline"] / v for k, v in ms.items() if k != "baseline"})
            rows.append(row)
    return rows


def bench_conversion(shapes=SHAPES[:4]) -> list[dict]:
    """Prepare-time cost per projection, as MB/s of stored blob (codes + scales) consumed; and the
    int4 form's decode back to dense bf16 (what `linear` does for many tokens), in weights/s."""
    rows = []
    for label, out, inp in shapes:
        for bits in codec.DEPTHS:
            t = random_quantised((out, inp), bits)
            blob = t.codes.numel() + 2 * t.scales.numel()
            w = to_int4(t, torch.bfloat16)
            seconds = {
                "int4_pack": timed(lambda: to_int4(t, torch.bfloat16)),
                "torch_converter": timed(lambda: torch_converter(t)),
                "decode_bf16": timed(lambda: t.decode(torch.bfloat16)),
                "copy_blob": timed(lambda: (t.codes.clone(), t.scales.clone())),
            }
            row = {"shape": label, "bits": bits, "blob_bytes": blob}
            row.update({f"{k}_MBps": blob / v / 1e6 for k, v in seconds.items()})
            row["int4_to_dense_Gweights_per_s"] = out * inp / timed(lambda: dense_weight(w, torch.bfloat16)) / 1e9
            rows.append(row)
    return rows


def int4_kernel(x: torch.Tensor, w) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, KERNEL_GROUP, w.scales_zeros)


def torch_converter(t: QuantisedTensor) -> torch.Tensor:
    """The portable alternative to our packer: unpack to int32, then torch's own converter."""
    q = codec.unpack_codes(t.codes, t.bits).to(torch.int32).view(t.shape)
    q = q if t.bits == 4 else 2 * q + 5
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)


def bench_cpu_kernels(json_out: bool = False, threads: int | None = None) -> dict:
    """All tables. `threads` pins torch to that many threads (default: as configured); on a shared or
    small VM one thread gives repeatable figures (waiting for a second one can stall for a tick).
    The numba packer and unpacker are single-threaded whatever this says."""
    if threads:
        torch.set_num_threads(torch_threads(threads, "--threads"))
    result = {
        "machine": machine_description(),
        "matmul_bf16": bench_matmul(torch.bfloat16),
        "matmul_slow_dtypes": [r for dt in SLOW_DTYPES for r in bench_matmul(dt, SHAPES[:1], SLOW_TOKENS)],
        "conversion": bench_conversion(),
        "auto": {f"{str(dt).removeprefix('torch.')} {label}": choose_path(dt, 4, shapes=[(out, inp)])
                 for dt in (torch.bfloat16, *SLOW_DTYPES) for label, out, inp in SHAPES},
    }
    print(json.dumps(result, indent=1) if json_out else format_result(result))
    return result


def machine_description() -> str:
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    build = f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"
    return f"{cpu}, {build}, {torch.get_num_threads()} torch threads"


def format_result(result: dict) -> str:
    lines = [result["machine"], "", "matmul, ms per call (x: baseline / method, above 1 is faster):"]
    lines.append(
        f"{'shape':22} {'dtype':8} {'T':>4} {'baseline':>9} {'kernel':>8} {'x':>5} {'int4 path':>9} {'x':>5}"
        f" {'dec+mm':>8} {'x':>5} {'codes':>8} {'x':>5}"
    )
    for r in result["matmul_bf16"] + result["matmul_slow_dtypes"]:
        kernel = f"{'-':>8} {'-':>5}"
        if r["int4_fits"]:
            kernel = f"{r['int4_kernel_ms']:8.3f} {r['int4_kernel_speedup']:5.2f}"
        note = "" if r["int4_fits"] else "  (int4 path keeps dequant: in % 64 != 0)"
        lines.append(
            f"{r['shape']:22} {r['dtype']:8} {r['tokens']:>4} {r['baseline_ms']:9.3f} {kernel} "
            f"{r['int4_path_ms']:9.3f} {r['int4_path_speedup']:5.2f} "
            f"{r['decode_per_call_ms']:8.3f} {r['decode_per_call_speedup']:5.2f} "
            f"{r['codes_path_ms']:8.3f} {r['codes_path_speedup']:5.2f}{note}"
        )
    lines += ["", "prepare-time conversion, MB/s of stored codes + scales; int4 -> dense bf16 in G weights/s:"]
    header = f"{'shape':22} {'bits':>4} {'int4 pack':>10} {'torch conv':>10} {'decode bf16':>11} {'copy':>8}"
    lines.append(header + f" {'unpack':>7}")
    for r in result["conversion"]:
        lines.append(
            f"{r['shape']:22} {r['bits']:>4} {r['int4_pack_MBps']:10.0f} {r['torch_converter_MBps']:10.0f} "
            f"{r['decode_bf16_MBps']:11.0f} {r['copy_blob_MBps']:8.0f} {r['int4_to_dense_Gweights_per_s']:7.2f}"
        )
    lines += ["", "auto path: " + ", ".join(f"{k}: {v}" for k, v in result["auto"].items())]
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    threads = int(args[args.index("--threads") + 1]) if "--threads" in args else None
    bench_cpu_kernels(json_out="--json" in args, threads=threads)
