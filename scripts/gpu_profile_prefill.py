"""Where a resident GPU prefill spends its time, and what capturing it gains: a prompt padded to a captured length
and replayed as a CUDA graph (GpuDecoder's prompt graphs) against its layers run eagerly: the synthetic vault of
`smoe bench decode --model M`, every expert resident, prompts of each length timed in each form in this process,
alternating (median of 3 after one untimed run, which runs eagerly and captures), then one prompt of the last length
under torch.profiler in each form, kernels grouped by name.

Usage (a CUDA machine, repository root): python3 scripts/gpu_profile_prefill.py [MODEL] [LAYERS] [LENGTHS] [WORKDIR]
"""

import sys
from pathlib import Path

import torch

from smoe.bench.decode import MODELS, prompt_rates, write_model_vault
from smoe.runtime.cuda import decode as gpu_decode
from smoe.runtime.cuda.cache import blob_slot_bytes
from smoe.runtime.kv import grown_capacity
from smoe.runtime.model import OpenedVault


def timed(dec, ids, repeats: int = 3) -> float:
    return sorted(prompt_rates(dec, ids, repeats))[repeats // 2]


def main(model: str = "qwen3-30b-a3b", layers: int = 8, lengths: str = "512,2048,8192", workdir: str = "/tmp/bench"):
    cfg = dict(MODELS[model]) | {"num_hidden_layers": layers}
    vault = write_model_vault(Path(workdir) / f"{model}-shaped-q4-{layers}L", cfg, progress=False)
    sm = OpenedVault(vault, dtype="bfloat16", kernel_path="dequant")
    lengths = [int(n) for n in str(lengths).split(",")]
    vocab = sm.config.get_text_config().vocab_size
    for n in lengths:
        # a state with room for the prompt, as the runtime grows it (at least 1,024 positions)
        dec = gpu_decode.GpuDecoder(sm, torch.device("cuda"), blob_slot_bytes(sm.vault) * len(sm.vault.entries),
                                    grown_capacity(0, n, None))
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        rates = {}
        for form, captured in (("eager", False), ("captured", True), ("eager again", False), ("captured again", True)):
            dec.prompt_graphs = captured
            rates[form] = timed(dec, ids)
        print(f"{model} {layers} layers, prompt {n}: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()),
              flush=True)
        if n != lengths[-1]:
            dec.close()
    for captured in (False, True):
        dec.prompt_graphs = captured
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.reset()
            dec.forward(ids)
            torch.cuda.synchronize()
        print("captured" if captured else "eager")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=80))


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
