"""Decode speed of the fast CPU decoder against the generic one on each tiny family the layer library covers
(smoe.testing.tiny_models), in one process: per family, one tiny vault, then rounds alternating the decoders,
each generating the same greedy tokens after a warm-up (numba's compile). fp32: on a CPU without bf16
instructions torch's bf16 linear takes milliseconds a call, which would measure torch rather than the decoders.

Usage (repository root, after make venv): .venv/bin/python scripts/tiny_fast_vs_generic.py [ROUNDS] [FAMILY...]
"""

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY
from smoe.runtime.weights import fast_decoder_gap
from smoe.source.description import describe_model
from smoe.testing.tiny_models import tiny_config, tiny_families
from smoe.testing.vaults import tiny_vault

TOKENS = 96


def decode_tok_s(sm: OpenedVault, decoder: str) -> float:
    prompt = list(range(3, 19))
    generate(sm, prompt, max_tokens=8, decoder=decoder, params=GREEDY)  # warm-up
    _, stats = generate(sm, prompt, max_tokens=TOKENS, decoder=decoder, params=GREEDY)
    return stats.as_dict()["decode_tok_s"]


def main(rounds: int = 3, *families: str) -> None:
    torch.set_num_threads(1)
    covered = [f for f in tiny_families() if fast_decoder_gap(describe_model(tiny_config(f).to_dict())) is None]
    for family in families or covered:
        with tempfile.TemporaryDirectory() as tmp:
            sm = OpenedVault(tiny_vault(Path(tmp), family), dtype="float32", cache_bytes=1 << 30)
            runs = {"fast": [], "generic": []}
            for _ in range(rounds):
                for decoder in runs:
                    runs[decoder].append(decode_tok_s(sm, decoder))
            sm.close()
        ratios = [f / g for f, g in zip(runs["fast"], runs["generic"])]
        print(f"{family:16s} fast {' / '.join(f'{v:.0f}' for v in runs['fast'])} tok/s, generic "
              f"{' / '.join(f'{v:.0f}' for v in runs['generic'])}; fast ÷ generic median {statistics.median(ratios):.2f}",
              flush=True)


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
