"""Throughput of the encoders on one expert of Qwen3-235B-A22B's shape, and the projected time to encode
all of its routed experts (94 MoE layers x 128 experts; gate/up [1536, 4096], down [4096, 1536]).

    python scripts/bench_encoders.py [--device cpu|cuda] [--repeats 3]

Weights are Gaussian and each input's second moment comes from correlated random activations, so
the numbers measure the encoders' arithmetic, not a particular model.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from smoe.convert import encoders

LAYERS, EXPERTS, HIDDEN, INNER = 94, 128, 4096, 1536


def moment(n: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(n)
    x = torch.randn(4 * n, n, generator=g) @ (torch.eye(n) + torch.randn(n, n, generator=g) / n**0.5)
    return (x.t() @ x / x.shape[0]).to(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--encoders", default="grid,weighted,gptq")
    args = p.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    mats = {"gate": torch.randn(INNER, HIDDEN, generator=g), "up": torch.randn(INNER, HIDDEN, generator=g),
            "down": torch.randn(HIDDEN, INNER, generator=g)}
    mats = {r: (w * 0.02).to(dev) for r, w in mats.items()}
    moments = {"gate": moment(HIDDEN, dev), "down": moment(INNER, dev)}
    moments["up"] = moments["gate"]
    weights = sum(w.numel() for w in mats.values())
    results = {}
    for name in args.encoders.split(","):
        for bits in (4, 2):
            def one_expert():
                for role, w in mats.items():
                    encoders.encode(w, bits, name, moments[role])
                if dev.type == "cuda":
                    torch.cuda.synchronize()

            one_expert()  # warm-up: compilation, caches
            start = time.perf_counter()
            for _ in range(args.repeats):
                one_expert()
            seconds = (time.perf_counter() - start) / args.repeats
            results[f"{name}-Q{bits}"] = {
                "seconds_per_expert": round(seconds, 4), "mweights_per_s": round(weights / seconds / 1e6, 2),
                "projected_hours_235b": round(seconds * LAYERS * EXPERTS / 3600, 2)}
            print(name, bits, results[f"{name}-Q{bits}"], flush=True)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(json.dumps({"device": device, "expert_weights": weights, "results": results}, indent=1))


if __name__ == "__main__":
    main()
