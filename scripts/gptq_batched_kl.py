"""GPTQ a layer's experts at once (what the sculptor runs on a GPU; here on the CPU) against GPTQ one matrix at a
time: one set of calibration statistics, a vault each way per depth, and each vault's KL on the evaluation text
(`smoe eval`'s protocol: the first 16,384 tokens of VALID in windows of 512, fp32), with the share of SMOE groups
(codes and scale) the two vaults have identical.

Usage: python scripts/gptq_batched_kl.py MODEL_DIR TRAIN_TEXT VALID_TEXT OUT_DIR [--bits 4,2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smoe.convert import calibrate  # noqa: E402
from smoe.convert.sculpt import encode_batched, encode_here, sculpt  # noqa: E402
from smoe.format.vault import Vault  # noqa: E402


def same_groups(a: Path, b: Path) -> float:
    same = total = 0
    with Vault(a) as one, Vault(b) as many:
        for key in sorted(one.entries):
            for x, y in zip(one.read_expert(*key)[0], many.read_expert(*key)[0]):
                groups = x.scales.numel()
                codes_x, codes_y = x.codes.reshape(groups, -1), y.codes.reshape(groups, -1)
                equal = (codes_x == codes_y).all(dim=1) & (x.scales.reshape(-1) == y.scales.reshape(-1))
                same, total = same + int(equal.sum()), total + groups
    return same / total


def kl(vault: Path, model: str, valid: str) -> float:
    out = subprocess.run([sys.executable, "-m", "smoe.cli", "eval", str(vault), "--ref", model, "--data", valid,
                          "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["kl"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("train")
    ap.add_argument("valid")
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", default="4,2")
    args = ap.parse_args()
    stats = calibrate.collect(args.model, args.train, calibrate.DEFAULT_TOKENS, progress=False)
    for bits in map(int, args.bits.split(",")):
        vaults = {}
        for name, encode in (("one-at-a-time", encode_here), ("batched", encode_batched)):
            vaults[name] = args.out / f"q{bits}-{name}"
            sculpt(args.model, vaults[name], force=True, bits=bits, encoder="gptq", calib=args.train, stats=stats,
                   progress=False, encode_all=encode, device="cpu")
        kls = {name: kl(v, args.model, args.valid) for name, v in vaults.items()}
        print(json.dumps({"bits": bits, "kl": kls, "ratio": kls["batched"] / kls["one-at-a-time"],
                          "identical_groups": same_groups(vaults["one-at-a-time"], vaults["batched"])}), flush=True)


if __name__ == "__main__":
    main()
