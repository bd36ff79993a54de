"""Where llama.cpp and smoe disagree most on a GGUF export with decoded weights, how close were the
router's k-th and (k+1)-th experts? Prints the worst positions with the smallest router-logit gap
over the layers there, and the median gap over all positions.

    .venv/bin/python scripts/export_router_gaps.py VAULT OUT.gguf
"""

import sys
from pathlib import Path

import numpy as np
import torch
from llama_cpp import Llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from export_models import prompt_ids  # noqa: E402

from smoe.export.writer import export  # noqa: E402
from smoe.runtime.model import OpenedVault  # noqa: E402


def main(vault: str, out: str) -> None:
    ids = prompt_ids(Path(vault))
    sm = OpenedVault(vault, dtype="float32")
    k = sm.vault.meta["top_k"]
    gaps = []

    def record_gap(module, inputs, _):
        logits = inputs[0].reshape(-1, inputs[0].shape[-1]) @ module.weight.float().T
        top = torch.topk(logits, k + 1, dim=-1).values
        gaps.append((top[:, k - 1] - top[:, k]).numpy())

    for name, module in sm.model.named_modules():
        if name.endswith(("mlp.gate", "block_sparse_moe.gate")):
            module.register_forward_hook(record_gap)
    ref = sm.logits(torch.tensor([ids]))[0].numpy()
    gap = np.min(np.stack(gaps), axis=0)
    export(vault, "gguf", out, force=True, trunk_type="f32", decoded_experts=True)
    llm = Llama(out, n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    diff = np.abs(ref - np.array(llm.scores[: len(ids)])).max(-1)
    worst = np.argsort(-diff)[:4]
    print(f"worst positions {worst.tolist()}: max |Δlogit| {[f'{d:.4f}' for d in diff[worst]]}, "
          f"smallest router gap there {[f'{g:.5f}' for g in gap[worst]]}")
    print(f"median router gap {np.median(gap):.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
