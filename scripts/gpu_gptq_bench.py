"""GPTQ one matrix at a time against a layer's experts at once (smoe.convert.gptq_batch), on one MoE layer of
Qwen3-235B-A22B's shapes (128 experts; gate and up 1536 x 4096, down 4096 x 1536), random weights and Hessians of
random activations (some input channels larger than others), SMOE-Q4. Prints one JSON line.

    python3 scripts/gpu_gptq_bench.py [--device cuda] [--hidden 4096] [--inter 1536] [--experts 128] [--sample 4]
"""

import argparse
import json
import time

import torch

from smoe.convert import encoders
from smoe.convert.gptq_batch import encode_gptq_many
from smoe.convert.sculpt import BATCH_EXPERTS
from smoe.format import codec

MODEL_LAYERS = 94  # Qwen3-235B-A22B


def matrices(experts: int, out: int, width: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    ws, hs = [], []
    for _ in range(experts):
        ws.append(torch.randn(out, width, generator=g, device=device) * 0.02)
        x = torch.randn(1024, width, generator=g, device=device) * (0.2 + torch.rand(width, generator=g, device=device) * 2)
        hs.append(x.t() @ x / 1024)
    return ws, hs


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def error(w, h, codes, scales, bits):
    d = (w - codec.decode(codes, scales, bits, tuple(w.shape), torch.float32).to(w.device)).double()
    return float(((d @ h.double()) * d).sum())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=1536)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--sample", type=int, default=4, help="experts encoded one matrix at a time (the rest extrapolated)")
    p.add_argument("--bits", type=int, default=4)
    args = p.parse_args()
    device = torch.device(args.device)
    shapes = {"gate": (args.inter, args.hidden), "up": (args.inter, args.hidden), "down": (args.hidden, args.inter)}
    one_s = many_s = 0.0
    same = total = 0
    ratios = []
    for r, (role, (out, width)) in enumerate(shapes.items()):
        for c0 in range(0, args.experts, BATCH_EXPERTS):
            ws, hs = matrices(min(BATCH_EXPERTS, args.experts - c0), out, width, device, seed=1000 * r + c0)
            names = [f"{role}{c0 + i}" for i in range(len(ws))]
            seconds, many = timed(lambda: encode_gptq_many(ws, hs, args.bits, names), device)
            many_s += seconds
            if c0 == 0:  # one matrix at a time, on the first `sample` experts of the first chunk
                for w, h, (codes, scales) in list(zip(ws, hs, many))[: args.sample]:
                    seconds, (c1, s1) = timed(lambda: encoders.encode(w, args.bits, "gptq", h), device)
                    one_s += seconds
                    groups = (codes.reshape(scales.numel(), -1) == c1.reshape(s1.numel(), -1)).all(dim=1) & (scales == s1)
                    same, total = same + int(groups.sum()), total + groups.numel()
                    ratios.append(error(w, h, codes, scales, args.bits) / error(w, h, c1, s1, args.bits))
    one_per_expert = one_s / args.sample
    many_per_expert = many_s / args.experts
    print(json.dumps({
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "shapes": {k: list(v) for k, v in shapes.items()}, "experts": args.experts, "bits": args.bits,
        "chunk": BATCH_EXPERTS, "sampled_one_at_a_time": args.sample,
        "seconds_per_expert_one_at_a_time": round(one_per_expert, 4),
        "seconds_per_expert_batched": round(many_per_expert, 4), "speedup": round(one_per_expert / many_per_expert, 2),
        "layer_seconds_batched": round(many_s, 2),
        "layer_seconds_one_at_a_time_extrapolated": round(one_per_expert * args.experts, 2),
        "model_hours_batched": round(many_s * MODEL_LAYERS / 3600, 3),
        "model_hours_one_at_a_time_extrapolated": round(one_per_expert * args.experts * MODEL_LAYERS / 3600, 3),
        "identical_groups_on_sample": round(same / total, 6), "weighted_error_ratio_on_sample":
            [round(min(ratios), 5), round(max(ratios), 5)],
    }))


if __name__ == "__main__":
    main()
