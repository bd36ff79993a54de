"""Where a GPU decode step spends its time: the synthetic vault of `smoe bench decode --model M` with the GPU
cache at BUDGET percent of the experts (100: every expert resident, whole-token CUDA graph; less: a pinned host
tier holding every expert, the misses read in place in a whole-token graph, or with SMOE_GPU_IN_PLACE=0 copied,
one graph per layer), 16 steps under torch.profiler, ops grouped by name, sorted by GPU time (whole-token graphs)
or by host time (per-layer graphs), with the replay's host seconds per phase.

Usage (a CUDA machine, repository root): python3 scripts/gpu_profile_decode.py [MODEL] [LAYERS] [WORKDIR] [BUDGET]
"""

import sys
from pathlib import Path

import torch

from smoe.bench.decode import MODELS, write_model_vault
from smoe.bench.replay import ReplayDecoder, replay
from smoe.bench.runtime import skewed_routing
from smoe.runtime.cuda.cache import blob_slot_bytes
from smoe.runtime.model import OpenedVault
from smoe.source.description import describe_model


def main(model: str = "deepseek-v2-lite", layers: int = 27, workdir: str = "/tmp/bench", budget: int = 100) -> None:
    cfg = dict(MODELS[model]) | {"num_hidden_layers": layers}
    vault = write_model_vault(Path(workdir) / f"{model}-shaped-q4-{layers}L", cfg, progress=False)
    d = describe_model(cfg)
    sm = OpenedVault(vault, dtype="bfloat16", kernel_path="dequant")
    steps = 64
    routing = torch.from_numpy(skewed_routing(layers, steps, experts=d.routing.num_experts, top_k=d.routing.top_k))
    everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
    dec = ReplayDecoder(sm, torch.device("cuda"), everything * budget // 100, steps + 8, route_replay=routing,
                        host_cache_bytes=everything if budget < 100 else 0)
    if budget < 100:
        dec.cache.fill_host()
    token, _ = replay(dec, range(32))  # compile, capture, warm
    token, seconds = replay(dec, range(32, 48), token)
    print(f"{model} {layers} layers, GPU cache {budget}%: {16 / seconds:.1f} tok/s, "
          f"whole-token graph {dec.whole_token is not None}")
    timing0 = dict(dec.timing)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for t in range(48, 64):
            dec.replay_step = t
            token = int(dec.forward([token]).argmax())
        torch.cuda.synchronize()
    print({k: f"{1000 * (v - timing0[k]) / 16:.3f} ms/token" for k, v in dec.timing.items()})
    order = "cuda_time_total" if dec.whole_token is not None else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=order, row_limit=40, max_name_column_width=90))


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
