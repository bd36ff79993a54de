"""smoe vs llama.cpp when the experts do not fit in memory: both under the same memory cgroup.

Builds (once, under WORKDIR) a synthetic Qwen3-MoE checkpoint with Qwen3-30B-A3B expert shapes and
random bf16 weights, sculpts it to SMOE-Q4, exports the vault to GGUF for llama.cpp, then runs
`smoe bench runtime` with both engines capped by one memory limit, cold.

    python scripts/cpu_memory_limited.py WORKDIR [--gb 12] [--limit-gb 1.6] [--tokens 32]
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from smoe.bench.main import write_synthetic_checkpoint
from smoe.convert.sculpt import sculpt
from smoe.export.writer import export

SHARED_TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "qwen3-moe-28m"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--gb", type=float, default=12.0, help="bf16 size of the synthetic checkpoint")
    p.add_argument("--limit-gb", type=float, default=1.6)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    root = Path(args.workdir)
    model, vault, gguf = root / "model", root / "vault-q4", root / "model-q4.gguf"
    if not (model / "model.safetensors.index.json").exists():
        write_synthetic_checkpoint(model, args.gb)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(SHARED_TOKENIZER / name, model / name)  # ids < 6144 fit the 8192 vocab
    if not (vault / "index.json").exists():
        sculpt(model, vault, bits=4, force=True)
    if not gguf.exists():
        export(vault, "gguf", gguf, force=True)
    cmd = [sys.executable, "-m", "smoe.cli", "bench", "runtime", str(vault), "--gguf", str(gguf), "--budgets", "0.1,0.25",
           "--tokens", str(args.tokens), "--memory-limit-gb", str(args.limit_gb)]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
