"""`smoe demo`: sculpt a built-in default model at both depths, inspect and verify the vaults."""

from __future__ import annotations

import os
from pathlib import Path

from smoe.errors import SmoeError
from smoe.inspect_model import format_report, inspect_path
from smoe.sculpt import sculpt
from smoe.vault import verify

SHARED_MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "qwen3-moe-28m"


def default_model(workdir: Path) -> tuple[Path, str]:
    """The shared trained model when present, else a tiny random Qwen3-MoE built here."""
    chosen = os.environ.get("SMOE_DEMO_MODEL")
    if chosen:
        return Path(chosen), f"{chosen} (from SMOE_DEMO_MODEL)"
    if (SHARED_MODEL / "model.safetensors").exists():
        return SHARED_MODEL, f"{SHARED_MODEL} (trained qwen3-moe-28m)"
    from smoe.tiny_models import save_tiny_model

    path = workdir / "tiny-qwen3-moe"
    if not (path / "config.json").exists():
        save_tiny_model("qwen3_moe", path, seed=0)
    return path, f"{path} (tiny random Qwen3-MoE built by smoe: ../shared/models is not present)"


def banner(text: str) -> None:
    print(f"\n== {text}")


def main(args) -> int:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model, description = default_model(workdir)
    banner(f"model: {description}")
    print(format_report(inspect_path(model)))
    for bits in (4, 2):
        out = workdir / f"vault-q{bits}"
        banner(f"smoe quantize {model} -o {out} --bits {bits}")
        report = sculpt(model, out, bits=bits, force=True)
        print(f"{report.experts} experts, {report.expert_bytes_in / 1e6:.1f} MB -> {report.expert_bytes_out / 1e6:.1f} MB "
              f"in {report.seconds:.1f} s")
        for role, snr in report.snr_db.items():
            print(f"  SMOE-Q{bits} {role:<5} SNR {snr:6.2f} dB (mean over experts)")
        banner(f"smoe verify {out}")
        problems = verify(out)
        if problems:
            raise SmoeError(f"{out}: verify found {len(problems)} problem(s): {problems[0]}")
        print("vault OK")
        banner(f"smoe inspect {out}")
        print(format_report(inspect_path(out)))
    return 0
