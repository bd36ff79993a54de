"""`smoe demo`: sculpt a built-in default model at both depths, inspect and verify the vaults."""

from __future__ import annotations

import sys
from pathlib import Path

from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.format.vault import Vault, verify
from smoe.hf.tokenizer import load_tokenizer
from smoe.source.inspect import format_report, inspect_path
from smoe.switches import DEMO_MODEL

CHECKOUT = Path(__file__).resolve().parents[2]
# ../shared beside a source checkout; an installed smoe has none (site-packages/../shared is not it)
SHARED = CHECKOUT.parent / "shared" if (CHECKOUT / "pyproject.toml").exists() else None
SHARED_MODEL = SHARED / "models" / "qwen3-moe-28m" if SHARED else None
PROMPT = "The old man looked out over the sea and"
WARMUP_TOKENS = 4  # enough to compile every decode kernel once (prompt and one-token steps)
RANDOM_CAVEAT = ("note: this is a tiny model with random weights, so every figure below (SNR, KL, perplexity, "
                 "top-1, tok/s) shows only that the pipeline runs and says nothing about quality or speed on a "
                 "real model; {where}set SMOE_DEMO_MODEL=MODEL_DIR")


def default_model(workdir: Path) -> tuple[Path, str, bool]:
    """(model, description, whether it is random): the shared trained model when present, else a
    tiny random Qwen3-MoE built here."""
    chosen = DEMO_MODEL.value()
    if chosen:
        return Path(chosen), f"{chosen} (from SMOE_DEMO_MODEL)", False
    if SHARED_MODEL and (SHARED_MODEL / "model.safetensors").exists():
        return SHARED_MODEL, f"{SHARED_MODEL} (trained qwen3-moe-28m)", False
    from smoe.testing.tiny_models import save_tiny_model

    path = workdir / "tiny-qwen3-moe"
    if not (path / "config.json").exists():
        save_tiny_model("qwen3_moe", path, seed=0)
    return path, f"{path} (tiny random Qwen3-MoE built by smoe: no trained model given)", True


def banner(text: str) -> None:
    print(f"\n== {text}")


def main(args) -> int:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model, description, random_model = default_model(workdir)
    banner(f"model: {description}")
    caveat(random_model)
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
    for bits in (4, 2):
        out = workdir / f"vault-q{bits}"
        banner(f'smoe generate {out} -p "{PROMPT}" --max-tokens 48 --cache-gb (a quarter of the experts)')
        show_generation(out)
        banner(f"smoe eval {out} --ref {model} --data {eval_text(workdir)}")
        show_quality(out, model, eval_text(workdir))
    caveat(random_model)
    return 0


def caveat(random_model: bool) -> None:
    if random_model:
        print(RANDOM_CAVEAT.format(where=f"put the trained model at {SHARED_MODEL} or " if SHARED_MODEL else ""))


def show_generation(vault: Path) -> None:
    from smoe.runtime.generate import TextStreamer, generate
    from smoe.runtime.model import OpenedVault

    with Vault(vault) as v:
        quarter = sum(e.size for e in v.entries.values()) // 4
    sm = OpenedVault(vault, dtype="float32")
    sm.store.cache_bytes = max(int(quarter * sm.store.prepare_ratio()), sm.store.min_budget(sm.vault.meta["top_k"] or 1))
    tok = load_tokenizer(vault)
    ids = tok(PROMPT)["input_ids"]
    generate(sm, ids, max_tokens=WARMUP_TOKENS)  # untimed: the first run compiles the kernels (seconds, once per depth)
    print(PROMPT, end="")
    _, stats = generate(sm, ids, max_tokens=48, on_token=TextStreamer(tok, sys.stdout))
    print("\n" + stats.line() + f"  (timed after a {WARMUP_TOKENS}-token warm-up run that compiled the kernels)")
    sm.close()


def eval_text(workdir: Path) -> Path:
    """The shared validation text when present, else a built-in passage written to the workdir."""
    valid = SHARED / "corpus" / "valid.txt.gz" if SHARED else None
    if valid and valid.exists():
        return valid
    path = workdir / "eval.txt"
    path.write_text(FALLBACK_TEXT * 20)
    return path


def show_quality(vault: Path, model: Path, data: Path) -> None:
    from smoe.quality.evaluate import compare, load_reference
    from smoe.runtime.model import OpenedVault
    from smoe.source.text import token_stream

    sm = OpenedVault(vault, dtype="float32")
    ids = token_stream(load_tokenizer(vault), data, 16384)
    r = compare(sm.logits, load_reference(model), ids, progress=False)
    print(f"tokens {r['tokens']}  perplexity {r['ppl']:.3f} (bf16 reference {r['ref_ppl']:.3f})  "
          f"KL {r['kl']:.5f}  top-1 agreement {r['top1']:.4f}")
    sm.close()


FALLBACK_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, "
    "it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of "
    "Darkness, it was the spring of hope, it was the winter of despair. "
)
