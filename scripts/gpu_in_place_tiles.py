"""Decode kernels' tiles for misses read in place: the synthetic vault of `smoe bench decode --model M` with the GPU
cache at each BUDGET percent, misses read in place from a pinned host tier holding every expert (Zipf replay), timed
under each tile configuration of the decode kernels in turn, the rounds alternating (A B C A B C) in one process.

A missed expert's codes cross the link inside _gate_up and _down, so how many programs read at once, and how much
each has in flight, sets the link's rate there; the tiles of kernels.MEASURED_TILES were measured on resident experts.

Usage (a CUDA machine, repository root): python3 scripts/gpu_in_place_tiles.py [MODEL] [LAYERS] [WORKDIR] [BUDGETS]
"""

import sys
from pathlib import Path

import torch

from smoe.bench.decode import MODELS, write_model_vault
from smoe.bench.replay import ReplayDecoder, replay
from smoe.bench.runtime import skewed_routing
from smoe.runtime.cuda import kernels
from smoe.runtime.cuda.cache import blob_slot_bytes
from smoe.runtime.model import OpenedVault
from smoe.source.description import describe_model

# (rows per program, groups per step, warps, stages, register prefetch) for _gate_up and _down
TILES = {
    "measured": None,  # kernels.MEASURED_TILES as it is
    "16 rows": kernels.DecodeConfig(gate_up=(16, 8, 4, 1, 1), down=(16, 4, 4, 1, 0)),
    "16 rows, prefetch down": kernels.DecodeConfig(gate_up=(16, 8, 4, 1, 1), down=(16, 4, 4, 1, 1)),
    "8 rows, 2 warps": kernels.DecodeConfig(gate_up=(8, 8, 2, 1, 1), down=(8, 4, 2, 1, 1)),
}


def rate(sm, budget: int, routing, tiles) -> float:
    everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
    original = kernels.decode_config
    if tiles is not None:
        kernels.decode_config = lambda layout: tiles
    dec = ReplayDecoder(sm, torch.device("cuda"), everything * budget // 100, 72, route_replay=routing,
                        host_cache_bytes=everything, in_place=True)
    try:
        dec.cache.fill_host()
        token, _ = replay(dec, range(32))
        return 32 / replay(dec, range(32, 64), token)[1]
    finally:
        kernels.decode_config = original
        dec.close()


def main(model: str = "qwen3-30b-a3b", layers: int = 8, workdir: str = "/tmp/bench", budgets: str = "25,10") -> None:
    cfg = dict(MODELS[model]) | {"num_hidden_layers": layers}
    vault = write_model_vault(Path(workdir) / f"{model}-shaped-q4-{layers}L", cfg, progress=False)
    d = describe_model(cfg)
    sm = OpenedVault(vault, dtype="bfloat16", kernel_path="dequant")
    routing = torch.from_numpy(skewed_routing(layers, 72, experts=d.routing.num_experts, top_k=d.routing.top_k))
    for budget in (int(b) for b in budgets.split(",")):
        rates = {name: [] for name in TILES}
        for _ in range(2):
            for name, tiles in TILES.items():
                rates[name].append(rate(sm, budget, routing, tiles))
        print(f"budget {budget}%: " + "; ".join(f"{name} {' / '.join(f'{r:.1f}' for r in rs)} tok/s"
                                                 for name, rs in rates.items()), flush=True)


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
