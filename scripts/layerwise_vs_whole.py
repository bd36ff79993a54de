"""Layer-by-layer calibration against the whole source model loaded at once, on one checkpoint: the share of
identical SMOE groups between the two GPTQ vaults and their KL against the source (`smoe eval` defaults).

    python scripts/layerwise_vs_whole.py MODEL_DIR CALIB_TEXT EVAL_TEXT WORKDIR [--bits 4] [--tokens 65536]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from smoe.convert import calibrate
from smoe.convert.sculpt import sculpt
from smoe.format.vault import Vault
from smoe.hf.experts import experts_input_sizes


def whole_model_stats(model_dir, text, tokens: int) -> calibrate.CalibrationStats:
    """The statistics recorded with the whole model loaded by transformers, one window at a time."""
    model, modules = calibrate.load_source_model(model_dir, calibrate.IMPLEMENTATION)
    some = next(iter(modules.values()))
    windows = calibrate.calibration_windows(model_dir, text, tokens)
    stats = calibrate.CalibrationStats(num_experts=some.num_experts, tokens=sum(w.shape[1] for w in windows),
                                       text_hash=calibrate.file_hash(text))
    recorder = calibrate.Recorder(stats, experts_input_sizes(some))
    for module in modules.values():
        module.smoe_recorder = recorder
    with torch.inference_mode():
        for window in windows:
            model(input_ids=window, use_cache=False)
    return stats


def identical_groups(a: Path, b: Path) -> float:
    """Share of (tensor, group) whose codes and scale are equal in the two vaults."""
    va, vb = Vault(a), Vault(b)
    same = total = 0
    for key in sorted(va.entries):
        for ta, tb in zip(va.read_expert(*key)[0], vb.read_expert(*key)[0]):
            per_group = ta.codes.reshape(ta.scales.numel(), -1)
            equal = (per_group == tb.codes.reshape(tb.scales.numel(), -1)).all(dim=1) & (ta.scales == tb.scales)
            same, total = same + int(equal.sum()), total + equal.numel()
    return same / total


def kl(vault: Path, model: str, text: str) -> float:
    out = subprocess.run([sys.executable, "-m", "smoe.cli", "eval", str(vault), "--ref", model, "--data", text, "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["kl"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("calib")
    p.add_argument("eval")
    p.add_argument("workdir")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--tokens", type=int, default=calibrate.DEFAULT_TOKENS)
    args = p.parse_args()
    root = Path(args.workdir)
    vaults, seconds = {}, {}
    for name, collect in (("whole", whole_model_stats), ("layered", lambda m, t, n: calibrate.collect(m, t, n, False))):
        start = time.perf_counter()
        stats = collect(args.model, args.calib, args.tokens)
        seconds[name] = round(time.perf_counter() - start, 1)
        vaults[name] = root / f"{name}-q{args.bits}"
        sculpt(args.model, vaults[name], force=True, bits=args.bits, calib=args.calib, calib_tokens=args.tokens,
               stats=stats, progress=False)
    kls = {name: kl(v, args.model, args.eval) for name, v in vaults.items()}
    print(json.dumps({"model": args.model, "bits": args.bits, "tokens": args.tokens, "calibration_seconds": seconds,
                      "identical_groups": identical_groups(vaults["whole"], vaults["layered"]), "kl": kls,
                      "kl_ratio": kls["layered"] / kls["whole"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
