"""Where a resident GPU decode step spends its time: the synthetic vault of `smoe bench decode --model M` (every
expert resident, whole-token CUDA graph), 16 steps under torch.profiler, kernels grouped by name.

Usage (a CUDA machine, repository root): python3 scripts/gpu_profile_decode.py [MODEL] [LAYERS] [WORKDIR]
"""

import sys
import time
from pathlib import Path

import torch

from smoe.bench.decode import MODELS, write_model_vault
from smoe.bench.replay import ReplayDecoder
from smoe.bench.runtime import skewed_routing
from smoe.runtime.cuda.cache import blob_slot_bytes
from smoe.runtime.model import OpenedVault
from smoe.source.description import describe_model


def main(model: str = "deepseek-v2-lite", layers: int = 27, workdir: str = "/tmp/bench") -> None:
    cfg = dict(MODELS[model]) | {"num_hidden_layers": layers}
    vault = write_model_vault(Path(workdir) / f"{model}-shaped-q4-{layers}L", cfg, progress=False)
    d = describe_model(cfg)
    sm = OpenedVault(vault, dtype="bfloat16", kernel_path="dequant")
    steps = 64
    routing = torch.from_numpy(skewed_routing(layers, steps, experts=d.routing.num_experts, top_k=d.routing.top_k))
    dec = ReplayDecoder(sm, torch.device("cuda"), blob_slot_bytes(sm.vault) * len(sm.vault.entries), steps + 8,
                        route_replay=routing)
    token = 0
    for t in range(32):  # compile, capture, warm
        dec.replay_step = t
        token = int(dec.forward([token]).argmax())
    torch.cuda.synchronize()
    start = time.perf_counter()
    for t in range(32, 48):
        dec.replay_step = t
        token = int(dec.forward([token]).argmax())
    torch.cuda.synchronize()
    print(f"{model} {layers} layers: {16 / (time.perf_counter() - start):.1f} tok/s resident, "
          f"whole-token graph {dec.whole_token is not None}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for t in range(48, 64):
            dec.replay_step = t
            token = int(dec.forward([token]).argmax())
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
