"""GPTQ one expert at a time (encoders.encode_gptq) against a layer's experts in batches (smoe.convert.gptq), on one
MoE layer of Qwen3-235B-A22B's shapes: 128 experts, gate and up [1536, 4096], down [4096, 1536].

    python3 scripts/gpu_gptq_bench.py [--device cuda] [--hidden 4096] [--inter 1536] [--experts 128] [--sample 2]
    python3 scripts/gpu_gptq_bench.py --device cpu --hidden 512 --inter 256 --experts 8     # a quick run on a CPU

Weights are random and rounded to bf16; each expert's Hessians are x xᵀ / tokens of its own random activations
(`--tokens` of them, some channels much larger than others). The batched encoder encodes every expert, in chunks
of smoe.convert.batched.CHUNK as the sculptor's encode_batched does; one at a time only the first `--sample` experts
are encoded, and their time is extrapolated to the layer (the output says so). Both encode the sampled experts from
the same inputs, so their codes and weighted errors tr((W-Ŵ)H(W-Ŵ)ᵀ) are compared there. Each arm is warmed up
first (kernel compilation, solver start-up). Prints a summary, then the same as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from smoe.convert import encoders
from smoe.convert.gptq import encode_gptq_batch
from smoe.convert.sculpt import BATCH_EXPERTS as CHUNK
from smoe.format import codec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=1536, help="the experts' intermediate width")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--sample", type=int, default=2, help="experts encoded one at a time (their time extrapolated)")
    p.add_argument("--chunk", type=int, default=CHUNK, help="experts encoded together")
    p.add_argument("--tokens", type=int, default=2048, help="activations per expert behind its Hessians")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--layers", type=int, default=94, help="MoE layers of the model, for the projection")
    args = p.parse_args()
    dev = torch.device(args.device)
    shapes = {"gate": (args.inter, args.hidden), "up": (args.inter, args.hidden), "down": (args.hidden, args.inter)}
    warm_up(dev, args.bits)
    batched_s, one_s, same, total, ratios = 0.0, 0.0, 0, 0, []
    for r, (role, (out_dim, in_dim)) in enumerate(shapes.items()):
        for c0 in range(0, args.experts, args.chunk):
            W, H = layer_inputs(min(args.chunk, args.experts - c0), out_dim, in_dim, args.tokens, dev, seed=97 * r + c0)
            seconds, (codes, scales) = timed(dev, encode_gptq_batch, W, H, args.bits)
            batched_s += seconds
            for e in range(max(0, min(args.sample - c0, W.shape[0]))):  # the first `sample` experts, one at a time
                seconds, (c1, s1) = timed(dev, encoders.encode_gptq, W[e], H[e], args.bits)
                one_s += seconds
                equal = (codes[e] == c1).all(dim=1) & (scales[e] == s1)
                same, total = same + int(equal.sum()), total + equal.numel()
                ratios.append(weighted_error(W[e], H[e], codes[e], scales[e], args.bits)
                              / weighted_error(W[e], H[e], c1, s1, args.bits))
            del W, H, codes, scales
    report(args, dev, shapes, batched_s, one_s, same / max(total, 1), ratios)


def layer_inputs(experts: int, out_dim: int, in_dim: int, tokens: int, dev, seed: int):
    """[E, out, in] bf16-valued weights and [E, in, in] Hessians, each expert's from its own activations: channel
    sizes spread log-normally, a few channels 20x the rest (as hidden states have)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    W = (torch.randn(experts, out_dim, in_dim, generator=g, device=dev) * 0.02).bfloat16().float()
    H = torch.empty(experts, in_dim, in_dim, device=dev)
    for e in range(experts):
        size = torch.exp(0.5 * torch.randn(in_dim, generator=g, device=dev))
        size[torch.randint(in_dim, (max(1, in_dim // 256),), generator=g, device=dev)] *= 20
        x = torch.randn(tokens, in_dim, generator=g, device=dev) * size
        torch.matmul(x.t(), x, out=H[e]).div_(tokens)
    return W, H


def warm_up(dev, bits: int) -> None:
    """Both arms once on a small layer: kernel compilation and solver start-up are not what is timed."""
    W, H = layer_inputs(2, 64, 128, 256, dev, seed=1)
    encode_gptq_batch(W, H, bits)
    encoders.encode_gptq(W[0], H[0], bits)
    synchronize(dev)


def timed(dev, fn, *args):
    synchronize(dev)
    start = time.perf_counter()
    out = fn(*args)
    synchronize(dev)
    return time.perf_counter() - start, out


def synchronize(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def weighted_error(w, h, codes, scales, bits) -> float:
    d = (w - codec.decode(codes, scales, bits, tuple(w.shape), torch.float32).to(w.device)).double()
    return float(((d @ h.double()) * d).sum())


def report(args, dev, shapes, batched_s: float, one_s: float, identical: float, ratios: list[float]) -> None:
    batched = batched_s / args.experts
    one = one_s / args.sample
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
        "shapes": {k: list(v) for k, v in shapes.items()}, "experts": args.experts, "chunk": args.chunk,
        "bits": args.bits, "tokens": args.tokens, "sampled_one_at_a_time": args.sample,
        "seconds_per_expert_one_at_a_time": round(one, 4), "seconds_per_expert_batched": round(batched, 4),
        "speedup": round(one / batched, 2), "layer_seconds_batched": round(batched_s, 2),
        "layer_seconds_one_at_a_time_extrapolated": round(one * args.experts, 2),
        "model_layers": args.layers, "model_hours_batched": round(batched_s * args.layers / 3600, 3),
        "model_hours_one_at_a_time_extrapolated": round(one * args.experts * args.layers / 3600, 3),
        "identical_groups_on_sample": round(identical, 6),
        "weighted_error_ratio_on_sample": [round(min(ratios), 5), round(max(ratios), 5)],
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 1) if dev.type == "cuda" else None,
    }
    print(f"{result['device']}, one layer of {args.experts} experts {result['shapes']}, Q{args.bits}")
    print(f"one at a time: {one:.3f} s per expert (timed on {args.sample} experts, extrapolated to the layer: "
          f"{one * args.experts:.1f} s; x {args.layers} layers: {result['model_hours_one_at_a_time_extrapolated']} h)")
    print(f"batched ({args.chunk} at once): {batched:.3f} s per expert (all {args.experts} timed: {batched_s:.1f} s "
          f"per layer; x {args.layers} layers: {result['model_hours_batched']} h)")
    print(f"speedup {one / batched:.1f}x; on the sampled experts: {100 * identical:.3f}% of groups identical, "
          f"weighted error batched / one at a time {min(ratios):.5f}..{max(ratios):.5f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
