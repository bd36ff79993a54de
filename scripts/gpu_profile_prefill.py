"""Where a resident GPU prefill spends its time, and what two of its forms gain: attending over the prompt's own
positions (causal SDPA, flash attention for a whole prompt) over attending over the whole static cache under a mask
(the block's form before), and each MoE layer's offsets looked up in the device table without a host wait
(experts_resident) over asking the cache for the layer's distinct experts (experts_by_groups, one wait per layer):
the synthetic vault of `smoe bench decode --model M`, every expert resident, prompts of each length timed in each
form in this process, alternating (median of 3 after one untimed run), then one prompt of the last length under
torch.profiler, kernels grouped by name.

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

BLOCKS = dict(gpu_decode.EAGER_BLOCKS)


def masked_blocks(on: bool) -> None:
    """The eager blocks with their `end` dropped (on: every prompt attends over the whole cache under a mask)."""
    for kind, block in BLOCKS.items():
        gpu_decode.EAGER_BLOCKS[kind] = (lambda *a, block=block, end=None, **k: block(*a, **k)) if on else block


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
        forms = (("masked over the cache", True, False), ("causal over the prompt", False, False),
                 ("causal, one wait per layer", False, True), ("causal again", False, False),
                 ("one wait per layer again", False, True))
        for form, masked, waits in forms:
            masked_blocks(masked)
            if waits:  # the cache asked for each layer's distinct experts
                dec.experts_chunked = dec.experts_by_groups
            rates[form] = timed(dec, ids)
            dec.__dict__.pop("experts_chunked", None)
        masked_blocks(False)
        print(f"{model} {layers} layers, prompt {n}: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()),
              flush=True)
        if n != lengths[-1]:
            dec.close()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        dec.reset()
        dec.forward(ids)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=80))


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
