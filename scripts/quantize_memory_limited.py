"""Calibrated quantisation of checkpoints deeper than memory: `smoe quantize --calib` under a memory cgroup.

For each depth, builds (once, under WORKDIR) a synthetic Qwen3-MoE checkpoint with Qwen3-30B-A3B expert shapes
(2048 x 768, 16 experts per layer, random bf16), then runs `smoe quantize --calib` (GPTQ, the default calibrated
encoder, unless --encoder says otherwise) in a child process inside a memory cgroup, and prints per depth
the wall time, the peak RSS of the child and the cgroup's peak (page cache included) as one JSON line each.
`--command plan` runs `smoe plan --budget 3` instead (its sensitivity sweep with the whole model loaded),
`--command plan-layer-by-layer` the same with `--layer-by-layer`.

    python scripts/quantize_memory_limited.py WORKDIR [--layers 8,16,32] [--limit-gb 3] [--tokens 4096]
        [--command quantize|plan|plan-layer-by-layer]
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

from smoe.bench.main import SYNTH_EXPERTS, write_synthetic_checkpoint

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TOKENIZER = SHARED / "models" / "qwen3-moe-28m"  # its ids (< 6144) fit the synthetic 8192-token vocabulary


def checkpoint(root: Path, layers: int, experts: int, tokenizer: Path) -> Path:
    model = root / f"model-{layers}x{experts}"
    if not (model / "model.safetensors.index.json").exists():
        write_synthetic_checkpoint(model, layers=layers, experts=experts, top_k=8 if experts >= 64 else 4)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer / name, model / name)
    return model


def calibration_text(root: Path, source: Path) -> Path:
    path = root / "calib.txt"
    if not path.exists():
        path.write_text(gzip.open(source, "rt").read() if source.suffix == ".gz" else source.read_text())
    return path


RSS_OF_CHILD = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(code)")


def cgroup(name: str, limit: int | None) -> Path | None:
    """A fresh memory cgroup (v1 or v2) capped at `limit` bytes, page cache included (None: no limit, no group)."""
    if limit is None:
        return None
    v1 = Path("/sys/fs/cgroup/memory")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"{name}-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")).write_text(str(limit))
    return group


def peak_of(group: Path | None) -> int:
    for name in () if group is None else ("memory.max_usage_in_bytes", "memory.peak"):
        if (group / name).exists():
            return int((group / name).read_text())
    return 0


def limited(cmd: list[str], name: str, limit: int | None) -> dict:
    """Run `cmd` inside a new cgroup: wall seconds, the process's own peak RSS, the cgroup's peak (which counts the
    page cache of every file read or written, reclaimed under the cap)."""
    group = cgroup(name, limit)
    join = None if group is None else lambda: (group / "cgroup.procs").write_text(str(os.getpid()))
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
    p.add_argument("--experts", type=int, default=SYNTH_EXPERTS, help="experts per layer (top-8 from 64 on, else 4)")
    p.add_argument("--device", default="cpu", help="where calibration and encoding run (cpu, cuda)")
    p.add_argument("--no-limit", action="store_true", help="no memory cgroup: peak RSS only")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER, help="a directory with tokenizer.json")
    p.add_argument("--text", type=Path, default=SHARED / "corpus" / "train.txt.gz", help="the calibration text")
    p.add_argument("--encoder", default="gptq", help="the encoder (gptq, the default, weighted, or for plans grid)")
    p.add_argument("--command", default="quantize", choices=("quantize", "plan", "plan-layer-by-layer"))
    args = p.parse_args()
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    text = calibration_text(root, args.text)
    for layers in map(int, args.layers.split(",")):
        model, out = checkpoint(root, layers, args.experts, args.tokenizer), root / f"vault-{layers}"
        if args.command == "quantize":
            cmd = [sys.executable, "-m", "smoe.cli", "quantize", str(model), "-o", str(out), "--calib", str(text),
                   "--calib-tokens", str(args.tokens), "--encoder", args.encoder, "--device", args.device, "--force",
                   "-q"]
        else:  # a fresh table each time: the sweep is what is measured
            out.mkdir(exist_ok=True)
            cmd = [sys.executable, "-m", "smoe.cli", "plan", str(model), "-o", str(out / "plan.json"), "--calib",
                   str(text), "--calib-tokens", str(args.tokens), "--encoder", args.encoder, "--budget", "3", "-q",
                   *(["--layer-by-layer"] if args.command == "plan-layer-by-layer" else [])]
        row = {"layers": layers, "experts_per_layer": args.experts, "device": args.device, "checkpoint_gb": round(sum(
            f.stat().st_size for f in model.glob("*.safetensors")) / 1e9, 2), "limit_gb": args.limit_gb,
            "calib_tokens": args.tokens, "encoder": args.encoder, "command": args.command}
        row |= limited(cmd, f"smoe-quantize-{layers}", None if args.no_limit else int(args.limit_gb * 1e9))
        print(json.dumps(row), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
