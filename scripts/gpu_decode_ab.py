"""A resident decode step (every expert on the GPU, one graph per token) under each setting of the environment
switches given, the rounds alternating (A B A B ...) in one process: tok/s of the greedy loop as `smoe bench
decode` times it (wall, the host's readback of each token's logits included), tok/s of the token's graph
replayed back to back (the GPU's own time per token, launches overlapped), and, once per setting, the token's
kernels under torch.profiler (GPU microseconds per token, by kernel).

Usage (a CUDA machine, repository root):
  python3 scripts/gpu_decode_ab.py MODEL LAYERS WORKDIR "SWITCH=V[,SWITCH=V] | SWITCH=V ..." [ROUNDS]
e.g. python3 scripts/gpu_decode_ab.py qwen3-30b-a3b 8 /tmp/bench "SMOE_GPU_ATTENTION_KERNEL=0|SMOE_GPU_ATTENTION_KERNEL=1"
"""

import os
import sys
import time
from pathlib import Path

import torch

from smoe.bench.decode import MODELS, write_model_vault
from smoe.bench.replay import ReplayDecoder, replay
from smoe.bench.runtime import skewed_routing
from smoe.runtime.cuda import gemv
from smoe.runtime.cuda.cache import blob_slot_bytes
from smoe.runtime.model import OpenedVault
from smoe.source.description import describe_model
from smoe.switches import GPU_GEMV


def decoder(sm, routing, setting: dict):
    """A resident ReplayDecoder built under `setting` (the switches are read when a decoder is built), warmed up."""
    saved = {k: os.environ.get(k) for k in setting}
    os.environ.update(setting)
    gemv.ENABLED = GPU_GEMV.on()  # read at import; the graphs keep the kernels they are captured with
    try:
        everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
        dec = ReplayDecoder(sm, torch.device("cuda"), everything, 256, route_replay=routing)  # room for every round
        token, _ = replay(dec, range(32))  # compile, capture, warm
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return dec, token


def graph_rate(dec, tokens: int = 64) -> float:
    """Tokens per second of the whole-token graph replayed back to back (no host readback between tokens)."""
    (graph,) = dec.whole_token
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(tokens):
        graph.replay()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def kernels(dec, token: int, steps: int = 16) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for t in range(48, 48 + steps):
            dec.replay_step = t
            token = int(dec.forward([token]).argmax())
        torch.cuda.synchronize()
    rows = [(e.device_time_total / steps, e.count // steps, e.key) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"  {us:8.1f} us  x{n:<4d} {name[:100]}" for us, n, name in rows[:30]]
    return f"  GPU time {total:.1f} us per token over {len(rows)} kernel kinds\n" + "\n".join(lines)


def main(model: str, layers: int, workdir: str, settings: str, rounds: int = 3) -> None:
    cfg = dict(MODELS[model]) | {"num_hidden_layers": layers}
    vault = write_model_vault(Path(workdir) / f"{model}-shaped-q4-{layers}L", cfg, progress=False)
    d = describe_model(cfg)
    sm = OpenedVault(vault, dtype="bfloat16", kernel_path="dequant")
    routing = torch.from_numpy(skewed_routing(layers, 72, experts=d.routing.num_experts, top_k=d.routing.top_k))
    parsed = {s: dict(kv.split("=", 1) for kv in s.split(",") if kv) for s in settings.split("|")}
    decs = {s: decoder(sm, routing, setting) for s, setting in parsed.items()}
    results = {s: ([], []) for s in parsed}
    for _ in range(rounds):
        for s, (dec, token) in decs.items():
            token, seconds = replay(dec, range(32, 72), token)
            results[s][0].append(40 / seconds)
            results[s][1].append(graph_rate(dec))
            decs[s] = (dec, token)
    for s, (wall, graph) in results.items():
        print(f"{s or 'defaults'}: greedy loop {' / '.join(f'{r:.1f}' for r in wall)} tok/s; "
              f"graph back to back {' / '.join(f'{r:.1f}' for r in graph)} tok/s", flush=True)
    for s, (dec, token) in decs.items():
        print(f"{s or 'defaults'} kernels:\n{kernels(dec, token)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], *(int(a) for a in sys.argv[5:]))
