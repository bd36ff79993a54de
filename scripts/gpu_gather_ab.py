"""Experts from pinned host RAM: the GPU cache's misses copied by one gather kernel per wave
(smoe.runtime.cuda.gather) against one cudaMemcpyAsync per expert, alternating in this process on the synthetic
vault of `smoe bench decode --model M` (recorded Zipf routing, host tier holding every expert).

Usage (a CUDA machine, repository root): python3 scripts/gpu_gather_ab.py [MODEL] [LAYERS] [BUDGETS] [WORKDIR]
"""

import sys
from pathlib import Path

from smoe.bench.decode import MODELS, decode_run, hbm_gbps, pinned_copy_gbps, write_model_vault
from smoe.bench.runtime import skewed_routing
from smoe.runtime.cuda import gather
from smoe.runtime.model import OpenedVault
from smoe.source.description import describe_model

FORMS = {"copies": lambda: False, "gather": gather.available}


def main(model: str = "qwen3-30b-a3b", layers: int = 8, budgets: str = "0.5,0.25,0.1", workdir: str = "/tmp/bench"):
    cfg = dict(MODELS[model]) | {"num_hidden_layers": layers}
    vault = write_model_vault(Path(workdir) / f"{model}-shaped-q4-{layers}L", cfg, progress=False)
    d = describe_model(cfg)
    link, hbm = pinned_copy_gbps("cuda"), hbm_gbps("cuda")
    print(f"pinned copy {link:.1f} GB/s, HBM {hbm:.0f} GB/s")
    sm = OpenedVault(vault, dtype="bfloat16", kernel_path="dequant")
    routing = skewed_routing(layers, 32 + 64 + 8, seed=0, experts=d.routing.num_experts, top_k=d.routing.top_k)
    for budget in (float(b) for b in str(budgets).split(",")):
        for form in ("copies", "gather", "copies", "gather"):
            gather.available = FORMS[form]
            r = decode_run(sm, budget, "host", routing, 32, 64, 16)
            limit = 1 / (r["copied_bytes_per_token"] / (link * 1e9) + r["gpu_read_bytes_per_token"] / (hbm * 1e9))
            host = ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_token"].items())
            print(f"budget {100 * budget:4.0f}%  {form:6s}  {r['tok_s']:7.1f} tok/s  hit {100 * r['hit_rate']:5.1f}%  "
                  f"limit {limit:7.1f} tok/s ({100 * r['tok_s'] / limit:.0f}% of it)  host ms/token: {host}", flush=True)
    sm.close()


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
