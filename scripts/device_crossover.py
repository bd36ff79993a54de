"""The measurements behind --device auto's rule (BENCHMARKS.md, "Choosing the device"): each vault opened
once per (device, decoder), warmed up (compiles, graph captures), then timed over the same greedy tokens.

Usage (repository root, on a CUDA machine): python3 scripts/device_crossover.py VAULT [VAULT ...]
"""

import sys
import time

import torch

from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY

PROMPT, WARMUP, TOKENS = [1, 2, 3, 4, 5, 6, 7, 8], 16, 96


def timed(vault: str, device: str, decoder: str) -> float:
    sm = OpenedVault(vault, dtype="bfloat16", device=device, decoder=decoder)
    try:
        generate(sm, PROMPT, max_tokens=WARMUP, params=GREEDY)
        if device == "cuda":
            torch.cuda.synchronize()
        _, stats = generate(sm, PROMPT, max_tokens=TOKENS, params=GREEDY)
        return stats.decode_tok_s
    finally:
        sm.close()


for vault in sys.argv[1:]:
    for device, decoder in (("cuda", "fast"), ("cuda", "generic"), ("cpu", "fast"), ("cpu", "generic")):
        start = time.perf_counter()
        try:
            rate = f"{timed(vault, device, decoder):8.1f} tok/s"
        except Exception as e:  # a pairing the vault does not support is reported, not fatal
            rate = f"error: {str(e)[:100]}"
        print(f"{vault}: {device:>4} {decoder:>7}: {rate}  ({time.perf_counter() - start:.0f} s with warm-up)", flush=True)
