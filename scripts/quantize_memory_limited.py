"""Calibrated quantisation of checkpoints deeper than memory: `smoe quantize --calib` under a memory cgroup.

For each depth, builds (once, under WORKDIR) a synthetic Qwen3-MoE checkpoint with Qwen3-30B-A3B expert shapes
(2048 x 768, 16 experts per layer, random bf16), then runs `smoe quantize --calib` (GPTQ, the default calibrated
encoder, unless --encoder says otherwise) in a child process inside a memory cgroup, and prints per depth
the wall time, the peak RSS of the child and the cgroup's peak (page cache included) as one JSON line each.

    python scripts/quantize_memory_limited.py WORKDIR [--layers 8,16,32] [--limit-gb 3] [--tokens 4096]
"""

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from smoe.bench.main import SYNTH_EXPERTS, SYNTH_HIDDEN, SYNTH_INTER, write_synthetic_checkpoint

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TOKENIZER = SHARED / "models" / "qwen3-moe-28m"  # its ids (< 6144) fit the synthetic 8192-token vocabulary


def checkpoint(root: Path, layers: int) -> Path:
    model = root / f"model-{layers}"
    if not (model / "model.safetensors.index.json").exists():
        gb = layers * SYNTH_EXPERTS * 3 * SYNTH_HIDDEN * SYNTH_INTER * 2 / 1e9
        write_synthetic_checkpoint(model, gb)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(TOKENIZER / name, model / name)
    return model


def calibration_text(root: Path) -> Path:
    path = root / "calib.txt"
    if not path.exists():
        path.write_text(gzip.open(SHARED / "corpus" / "train.txt.gz", "rt").read())
    return path


RSS_OF_CHILD = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(code)")


def cgroup(name: str, limit: int) -> Path:
    """A fresh memory cgroup (v1 or v2) capped at `limit` bytes, page cache included."""
    v1 = Path("/sys/fs/cgroup/memory")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"{name}-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")).write_text(str(limit))
    return group


def peak_of(group: Path) -> int:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        if (group / name).exists():
            return int((group / name).read_text())
    return 0


def limited(cmd: list[str], name: str, limit: int) -> dict:
    """Run `cmd` inside a new cgroup: wall seconds, the process's own peak RSS, the cgroup's peak (which counts the
    page cache of every file read or written, reclaimed under the cap)."""
    group = cgroup(name, limit)
    join = lambda: (group / "cgroup.procs").write_text(str(os.getpid()))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RSS_OF_CHILD, *cmd], capture_output=True, text=True, preexec_fn=join)
    seconds = time.perf_counter() - start
    rss = int(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else 0
    return {"returncode": proc.returncode, "seconds": round(seconds, 1), "peak_rss_gb": round(rss / 1e9, 3),
            "cgroup_peak_gb": round(peak_of(group) / 1e9, 3),
            "stderr_tail": proc.stderr.strip()[-300:] if proc.returncode else ""}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--layers", default="8,16,32")
    p.add_argument("--limit-gb", type=float, default=3.0)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--encoder", default="gptq", help="the calibrated encoder (gptq, the default, or weighted)")
    args = p.parse_args()
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    text = calibration_text(root)
    for layers in map(int, args.layers.split(",")):
        model, out = checkpoint(root, layers), root / f"vault-{layers}"
        cmd = [sys.executable, "-m", "smoe.cli", "quantize", str(model), "-o", str(out), "--calib", str(text),
               "--calib-tokens", str(args.tokens), "--encoder", args.encoder, "--force", "-q"]
        row = {"layers": layers, "experts_per_layer": SYNTH_EXPERTS, "checkpoint_gb": round(sum(
            f.stat().st_size for f in model.glob("*.safetensors")) / 1e9, 2), "limit_gb": args.limit_gb,
            "calib_tokens": args.tokens, "encoder": args.encoder}
        row |= limited(cmd, f"smoe-quantize-{layers}", int(args.limit_gb * 1e9))
        print(json.dumps(row), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
