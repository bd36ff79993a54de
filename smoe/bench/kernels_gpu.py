"""`smoe bench kernels`: effective bandwidth of the Triton expert kernels, next to cuBLAS bf16 matvec and
torch's int4 kernel on the same shapes, in the same process.

One token's experts (20-80 MB) fit in an H200's 60 MB L2, so looping over the same experts would
measure the cache. Every variant therefore rotates over at least `pool_gb` of distinct experts: each
step takes the next k experts of a random permutation of the pool (random routing, no expert reused
until the pool is exhausted). Steps are captured in one CUDA graph and replayed (launch overhead of
Python stays out; the gaps between dependent kernels stay in), timed with CUDA events.

Effective bandwidth = bytes a step must read (codes + scales, or bf16 / int4 weights, plus the input
vector and the output) / time per step.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.runtime.cuda import kernels as kt
from smoe.testing.random import random_pool

SHAPES = {"qwen3-235b-a22b": (4096, 1536), "qwen3-30b-a3b": (2048, 768)}  # (hidden, expert inter)
TOP_K = 8
POOL_GB = 1.2


def synchronize():
    torch.cuda.synchronize()


def graph_seconds(step, steps: int, replays: int = 7) -> float:
    """Median seconds per step: `steps` calls of step(i) captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles, allocates
        for i in range(min(steps, 3)):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            step(i)
    graph.replay()
    synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / steps)
    del graph
    return statistics.median(times)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def rotation(n_experts: int, k: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, k] expert indices: consecutive k-slices of fresh random permutations of the pool."""
    gen = torch.Generator().manual_seed(seed)
    per = n_experts // k
    rows = []
    while len(rows) < steps:
        perm = torch.randperm(n_experts, generator=gen)[: per * k].view(per, k)
        rows.extend(perm)
    return torch.stack(rows[:steps])


def steps_for(step_bytes: float, pool_bytes: float) -> int:
    """Enough steps to pass over the pool at least three times."""
    return max(24, int(3 * pool_bytes / step_bytes) + 1)


# --- measurements --------------------------------------------------------------------------------


def bench_decode(hidden: int, inter: int, bits: int, device, pool_gb: float = POOL_GB, configs=None) -> dict:
    """Per-kernel and whole-decode timings of the SMOE kernels for one shape and depth.
    configs: optional lists of tiles (smoe.runtime.cuda.kernels.DecodeConfig) for gate_up and down to try;
    the fastest that matches the reference is kept."""
    pool, offsets, layout, size = random_pool(hidden, inter, bits, bits, device, pool_gb, least=TOP_K)
    n = offsets.numel()
    act = 2 * hidden * 2  # bf16 input and output vector
    code_gu = sum(codec.encoded_nbytes(inter * hidden, bits)) * 2
    code_d = sum(codec.encoded_nbytes(hidden * inter, bits))
    steps = steps_for(TOP_K * (code_gu + code_d), n * size)
    table = offsets[rotation(n, TOP_K, steps, seed=bits).to(device)].contiguous()
    route = torch.rand(steps, TOP_K, device=device)
    x = torch.randn(1, hidden, device=device).to(torch.bfloat16)
    y = torch.empty(1, hidden, device=device, dtype=torch.bfloat16)
    xp = kt.launch_prep(x, bits)
    hp = torch.randn(TOP_K, inter, device=device)
    default = kt.decode_config(layout)
    configs = configs or {"gate_up": [default.gate_up], "down": [default.down]}
    result = {"bits": bits, "hidden": hidden, "inter": inter, "k": TOP_K, "pool_gb": n * size / 1e9,
              "steps": steps, "experts_in_pool": n, "sweep": []}
    ref = kt.reference_forward(pool, layout, x.float(), table[:1], route[:1])
    best = {}
    for name, tiles_list in configs.items():
        for tiles in tiles_list:
            # every variant is checked against decode + matmul before it may be chosen
            check = kt.DecodeConfig(**{**vars(default), name: tiles})
            try:
                err = relative_error(kt.decode_forward(pool, layout, x, table[0], route[0], check), ref)
            except Exception as exc:  # a variant that does not compile (resources) is reported and skipped
                result["sweep"].append({"kernel": name, "tiles": list(tiles), "error": str(exc)[:300]})
                continue
            if name == "gate_up":
                def step(i, tiles=tiles):
                    kt.launch_gate_up(pool, layout, xp, table[i], route[i], tiles)
                nbytes = TOP_K * code_gu + hidden * 4
            else:
                def step(i, tiles=tiles):
                    kt.launch_down(pool, layout, hp, table[i], y, tiles)
                nbytes = TOP_K * code_d + TOP_K * inter * 4 + hidden * 2
            seconds = graph_seconds(step, steps)
            result["sweep"].append({"kernel": name, "tiles": list(tiles), "us": seconds * 1e6,
                                    "gbps": nbytes / seconds / 1e9, "rel_err": err})
            if err < 1e-2 and (name not in best or seconds < best[name][1]):
                best[name] = (tiles, seconds)
    config = kt.DecodeConfig(gate_up=best["gate_up"][0], down=best["down"][0])
    result["rel_err"] = relative_error(kt.decode_forward(pool, layout, x, table[0], route[0], config), ref)
    runs = [graph_seconds(lambda i: kt.decode_forward(pool, layout, x, table[i], route[i], config, out=y), steps)
            for _ in range(2)]  # twice: the spread between the two is the noise
    seconds = min(runs)
    total = TOP_K * (code_gu + code_d) + act
    result.update({"config": {"gate_up": list(config.gate_up), "down": list(config.down)},
                   "decode_us": seconds * 1e6, "decode_us_runs": [r * 1e6 for r in runs],
                   "bytes": total, "decode_gbps": total / seconds / 1e9,
                   "gate_up_us": best["gate_up"][1] * 1e6, "down_us": best["down"][1] * 1e6})
    pool = None  # frees the pool before the next shape allocates (closures above hold the name)
    return result


def bench_bf16(hidden: int, inter: int, device, pool_gb: float = POOL_GB) -> dict:
    """cuBLAS bf16 matvec on the same projections: per expert F.linear with gate|up ([2I, H]) and down
    ([H, I]), 2k calls per step; and the same bytes as one matvec per projection kind over k contiguous
    experts (the most favourable case for cuBLAS)."""
    per_expert = 3 * hidden * inter * 2
    n = max(TOP_K, int(pool_gb * 1e9 // per_expert))
    gu = torch.randn(n, 2 * inter, hidden, device=device, dtype=torch.bfloat16)
    dn = torch.randn(n, hidden, inter, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(1, inter, device=device, dtype=torch.bfloat16)
    steps = steps_for(TOP_K * per_expert, n * per_expert)
    table = rotation(n, TOP_K, steps, seed=1).tolist()

    def per_expert_step(i):
        for e in table[i]:
            F.linear(x, gu[e])
            F.linear(h, dn[e])

    gu_flat, dn_flat = gu.view(-1, hidden), dn.view(n * hidden, inter)
    starts = [(s % (n // TOP_K)) * TOP_K for s in range(steps)]

    def stacked_step(i):
        e0 = starts[i]
        F.linear(x, gu_flat[e0 * 2 * inter:(e0 + TOP_K) * 2 * inter])
        F.linear(h, dn_flat[e0 * hidden:(e0 + TOP_K) * hidden])

    nbytes = TOP_K * per_expert + 2 * hidden * 2
    a = graph_seconds(per_expert_step, steps)
    b = graph_seconds(stacked_step, steps)
    gu = dn = None  # frees them before the next shape allocates
    return {"per_expert_us": a * 1e6, "per_expert_gbps": nbytes / a / 1e9,
            "stacked_us": b * 1e6, "stacked_gbps": nbytes / b / 1e9, "bytes": nbytes, "pool_gb": n * per_expert / 1e9}


def int4_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm") and hasattr(torch, "_convert_weight_to_int4pack")


def int4_check(device) -> float:
    """Relative error of torch's int4 kernel against w = (q - 8) * scale + zero on a small matrix:
    shows that the baseline computes the matvec it is timed for."""
    n_out, n_in = 256, 512
    q = torch.randint(0, 16, (n_out, n_in), dtype=torch.int32, device=device)
    packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    scale = torch.rand(n_in // 64, n_out, device=device) * 0.05 + 0.01
    zero = torch.randn(n_in // 64, n_out, device=device) * 0.01
    sz = torch.stack([scale, zero], -1).to(torch.bfloat16)
    w = (q.float() - 8) * sz[..., 0].float().t().repeat_interleave(64, 1) + sz[..., 1].float().t().repeat_interleave(64, 1)
    x = torch.randn(1, n_in, device=device).to(torch.bfloat16)
    y = torch._weight_int4pack_mm(x, packed, 64, sz).float()
    ref = x.float() @ w.t()
    return float((y - ref).norm() / ref.norm())


def bench_int4(hidden: int, inter: int, device, pool_gb: float = POOL_GB) -> dict:
    """torch._weight_int4pack_mm (tinygemm, groups of 64) on gate|up [2I, H] and down [H, I] per expert."""
    if not int4_available():
        return {"error": "torch._weight_int4pack_mm not available"}
    shapes = ((2 * inter, hidden), (hidden, inter))
    packed_shapes = [torch._convert_weight_to_int4pack(torch.zeros(o, i // 2, dtype=torch.uint8, device=device), 8).shape
                     for o, i in shapes]
    per_expert = sum(o * i // 2 + (i // 64) * o * 4 for o, i in shapes)
    n = max(TOP_K, int(pool_gb * 1e9 // per_expert))
    packs = [torch.randint(-2**31, 2**31 - 1, (n, *ps), dtype=torch.int32, device=device) for ps in packed_shapes]
    sz = [(torch.rand(n, i // 64, o, 2, device=device) * 0.01).to(torch.bfloat16) for o, i in shapes]
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(1, inter, device=device, dtype=torch.bfloat16)
    steps = steps_for(TOP_K * per_expert, n * per_expert)
    table = rotation(n, TOP_K, steps, seed=2).tolist()

    def step(i):
        for e in table[i]:
            torch._weight_int4pack_mm(x, packs[0][e], 64, sz[0][e])
            torch._weight_int4pack_mm(h, packs[1][e], 64, sz[1][e])

    nbytes = TOP_K * per_expert + 2 * hidden * 2
    seconds = graph_seconds(step, steps)
    return {"us": seconds * 1e6, "gbps": nbytes / seconds / 1e9, "bytes": nbytes, "pool_gb": n * per_expert / 1e9,
            "check_rel_err": int4_check(device)}


def copy_gbps(device, gb: float = 2.0) -> float:
    """Device-to-device copy, bytes read + written per second: the memory ceiling of this GPU."""
    a = torch.empty(int(gb * 1e9 / 8), dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    seconds = graph_seconds(lambda i: b.copy_(a), 4)
    return 2 * a.numel() * 4 / seconds / 1e9


def bench_grouped(hidden: int, inter: int, bits: int, tokens: int, device, pool_gb: float = POOL_GB) -> dict:
    """Several tokens through the grouped kernels (eager: the pair sort synchronises once per call)."""
    pool, offsets, layout, size = random_pool(hidden, inter, bits, bits, device, pool_gb, seed=3, least=TOP_K)
    n = offsets.numel()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    times, distinct = [], []
    for i in range(12):
        sel = torch.stack([torch.randperm(n, generator=gen)[:TOP_K] for _ in range(tokens)]).to(device)
        w = torch.rand(tokens, TOP_K, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kt.experts_forward(pool, layout, x, offsets[sel], w, path="triton")
        end.record()
        end.synchronize()
        if i >= 2:  # the first calls compile
            times.append(start.elapsed_time(end) / 1e3)
            distinct.append(int(torch.unique(sel).numel()))
    seconds = statistics.median(times)
    nbytes = statistics.median(distinct) * size
    pool = None  # frees the pool before the next shape allocates (closures above hold the name)
    return {"bits": bits, "tokens": tokens, "us": seconds * 1e6, "distinct_experts": statistics.median(distinct),
            "gbps": nbytes / seconds / 1e9}


def bench_kernels(shapes=None, pool_gb: float = POOL_GB, configs=None) -> dict:
    """Every table of `smoe bench kernels`, for the GPU this process sees."""
    if not torch.cuda.is_available():
        raise SmoeError("smoe bench kernels measures the CUDA kernels: no CUDA device is available")
    device = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbps": copy_gbps(device),
              "shapes": {}}
    for name in shapes or SHAPES:
        hidden, inter = SHAPES[name]
        entry = {"hidden": hidden, "inter": inter,
                 "smoe": [bench_decode(hidden, inter, bits, device, pool_gb, (configs or {}).get((name, bits)))
                          for bits in (4, 2)],
                 "bf16": bench_bf16(hidden, inter, device, pool_gb), "int4": bench_int4(hidden, inter, device, pool_gb)}
        result["shapes"][name] = entry
        torch.cuda.empty_cache()
    return result


def format_result(r: dict) -> str:
    lines = [f"GPU: {r['gpu']}, torch {r['torch']}; device-to-device copy {r['copy_gbps']:.0f} GB/s (read + write)",
             f"decode, k = {TOP_K}, one token; effective GB/s = bytes a step reads and writes / time per step",
             f"{'shape':<16} {'variant':<34} {'us/token-layer':>14} {'GB/s':>7}"]
    for name, e in r["shapes"].items():
        for s in e["smoe"]:
            label = f"SMOE-Q{s['bits']} Triton (3 launches)"
            lines.append(f"{name:<16} {label:<34} {s['decode_us']:>14.1f} {s['decode_gbps']:>7.0f}")
            lines.append(f"{'':<16} {'  gate+up kernel / down kernel':<34} {s['gate_up_us']:>7.1f} /{s['down_us']:>5.1f}")
        b = e["bf16"]
        lines.append(f"{name:<16} {'bf16 cuBLAS, 2 matvecs per expert':<34} {b['per_expert_us']:>14.1f} "
                     f"{b['per_expert_gbps']:>7.0f}")
        lines.append(f"{name:<16} {'bf16 cuBLAS, k experts stacked':<34} {b['stacked_us']:>14.1f} {b['stacked_gbps']:>7.0f}")
        i = e["int4"]
        if "error" in i:
            lines.append(f"{name:<16} {'torch int4 (tinygemm)':<34} {i['error']}")
        else:
            lines.append(f"{name:<16} {'torch int4 (tinygemm), 2 per expert':<34} {i['us']:>14.1f} {i['gbps']:>7.0f}")
    return "\n".join(lines)
