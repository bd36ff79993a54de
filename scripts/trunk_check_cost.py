"""What checking the trunk's checksum costs when a vault is opened, at a real model's trunk size.

Counts the trunk (every parameter outside the routed experts) of a config on the meta device, writes
a file of that size, and times `Vault.check_trunk`'s hash over it twice (the second from the page
cache). Usage: python scripts/trunk_check_cost.py CONFIG.json DIR
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from smoe.format.vault import file_checksum


def trunk_bytes(config_path: Path) -> tuple[int, int]:
    config = AutoConfig.for_model(**json.loads(config_path.read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() * 2 for p in model.parameters())
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n)
    return total - experts, total


def main() -> None:
    config, out = Path(sys.argv[1]), Path(sys.argv[2])
    trunk, total = trunk_bytes(config)
    print(f"trunk {trunk / 1e9:.2f} GB of {total / 1e9:.1f} GB (bf16)")
    path = out / "trunk-sized.bin"
    block = os.urandom(1 << 24)
    with open(path, "wb") as f:
        for _ in range(trunk // len(block) + 1):
            f.write(block)
    for run in ("first read after writing", "second read (page cache)"):
        start = time.perf_counter()
        file_checksum(path)
        s = time.perf_counter() - start
        print(f"{run}: {s:.2f} s, {path.stat().st_size / s / 1e9:.2f} GB/s")
    path.unlink()


if __name__ == "__main__":
    main()
