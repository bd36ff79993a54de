"""One device run for the Triton expert kernels: check them at real shapes, sweep their tile sizes, and
time them against cuBLAS bf16 matvec and torch's int4 kernel, everything rotating over >= 1 GB of
distinct experts.

Usage (on a CUDA machine, from the repository root):
    python3 scripts/h200_kernels.py [--out DIR] [--pool-gb 1.2] [--no-tests]
Writes DIR/kernels.json (all figures) and DIR/tests.txt; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from smoe.bench import kernels_gpu as bk  # noqa: E402

# (rows per program, groups per loop step, warps, pipeline stages, register prefetch)
GATE_UP_TILES = [(32, 8, 4, 3, 0), (32, 8, 4, 4, 0), (32, 8, 4, 2, 0), (16, 16, 4, 3, 0), (64, 8, 4, 3, 0),
                 (32, 16, 4, 3, 0), (32, 16, 8, 3, 0), (64, 4, 4, 3, 0), (32, 8, 4, 1, 0), (32, 8, 4, 1, 1),
                 (16, 8, 4, 3, 0)]
DOWN_TILES = [(32, 8, 4, 3, 0), (32, 8, 4, 2, 0), (64, 8, 4, 3, 0), (64, 8, 8, 3, 0), (32, 16, 4, 2, 0),
              (32, 4, 4, 3, 0), (16, 8, 4, 3, 0), (64, 4, 4, 3, 0), (32, 4, 4, 1, 0), (32, 8, 4, 1, 0),
              (16, 16, 4, 2, 0)]

def run_tests(out: Path) -> str:
    """The CUDA tests of tests/test_kernels_triton.py (real shapes), in a child process: a kernel fault
    there cannot spoil the timings' CUDA context."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_kernels_triton.py", "-k", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    (out / "tests.txt").write_text(proc.stdout + proc.stderr)
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "out/h200_kernels"))
    p.add_argument("--pool-gb", type=float, default=bk.POOL_GB)
    p.add_argument("--no-tests", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = {"date": time.strftime("%Y-%m-%d"), "command": "python3 scripts/h200_kernels.py"}
    if not args.no_tests:
        result["tests"] = run_tests(out)
        print("tests:", result["tests"], f"({time.time() - t0:.0f} s)", flush=True)
    configs = {(name, bits): {"gate_up": GATE_UP_TILES, "down": DOWN_TILES} for name in bk.SHAPES for bits in (4, 2)}
    result["shapes"] = {}
    for name in bk.SHAPES:
        try:
            r = bk.bench_kernels(shapes=[name], pool_gb=args.pool_gb, configs=configs)
            result.update({k: v for k, v in r.items() if k != "shapes"})
            result["shapes"].update(r["shapes"])
        except Exception:  # keep what was measured
            result[f"error {name}"] = traceback.format_exc()
            print(result[f"error {name}"], flush=True)
        (out / "kernels.json").write_text(json.dumps(result, indent=1))
    print(f"decode benchmarks done ({time.time() - t0:.0f} s)", flush=True)
    result["grouped"] = []
    for bits in (4, 2):
        for tokens in (16, 256):
            try:
                result["grouped"].append(bk.bench_grouped(4096, 1536, bits, tokens, torch.device("cuda"), args.pool_gb))
            except Exception:
                result["grouped"].append({"bits": bits, "tokens": tokens, "error": traceback.format_exc()})
    (out / "kernels.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "shapes"}, indent=1))
    for name, e in result.get("shapes", {}).items():
        for s in e["smoe"]:
            for row in s["sweep"]:
                if "error" in row:
                    print(f"sweep {name} Q{s['bits']} {row['kernel']:<8} tiles {row['tiles']}: {row['error']}")
                    continue
                print(f"sweep {name} Q{s['bits']} {row['kernel']:<8} tiles {row['tiles']}: {row['us']:7.1f} us "
                      f"{row['gbps']:6.0f} GB/s err {row['rel_err']:.1e}")
    if result["shapes"]:
        print(bk.format_result(result))
    for g in result["grouped"]:
        print("grouped 235b", g)
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
