"""`smoe demo`: the model shipped with smoe through the main commands: inspect it, quantize it at Q4 and Q2,
verify both vaults, generate from each with a cache of a quarter of the experts, measure each against the
source, and say what to try next.

Every step is the `smoe` command it prints, run through the command line's own entry point in this process:
each printed command runs as printed, and its output reads exactly as that command's does.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from smoe.errors import SmoeError
from smoe.switches import DEMO_MODEL

# The model lives in the source repository beside the package, not in the wheel (models/README.md).
CHECKOUT = Path(__file__).resolve().parents[2]
MODEL = CHECKOUT / "models" / "smoe-demo-6m"
EVAL_TEXT = "eval.txt"  # beside the model: text it never saw in training
PROMPT = "The old man looked out over the sea and"
GENERATED = 48
EVAL_TOKENS = 100_000  # more than eval.txt holds: the whole text is scored
WARMUP_TOKENS = 4  # a prompt and a few one-token steps run every decode kernel once

Run = Callable[[list[str]], int]


def main(args, run: Run) -> int:
    """Each step through `run` (the `smoe` entry point, given by the caller): the first failing one's status."""
    model = demo_model()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"smoe demo on {shown(model)}: every step below is the command shown, run here")
    for argv in steps(model, work):
        banner(argv)
        status = warm_up(run, argv) if argv[0] == "generate" else 0
        status = status or run(argv)
        if status:
            return status
    print_next_steps(work / "vault-q4")
    return 0


def demo_model() -> Path:
    chosen = DEMO_MODEL.value()
    if chosen:
        return Path(chosen)
    if not (MODEL / "model.safetensors").exists():
        raise SmoeError("the demo's model ships with smoe's source repository (models/smoe-demo-6m), not "
                        "with the installed package: run `smoe demo` in a clone, or set SMOE_DEMO_MODEL=MODEL_DIR")
    return MODEL


def steps(model: Path, work: Path) -> Iterator[list[str]]:
    """The demo's commands in order (a generator: each is built after the ones before it have run)."""
    vaults = {bits: work / f"vault-q{bits}" for bits in (4, 2)}
    yield ["inspect", shown(model)]
    for bits, vault in vaults.items():
        yield ["quantize", shown(model), "-o", shown(vault), "--bits", str(bits), "--force"]
        yield ["verify", shown(vault)]
    text = model / EVAL_TEXT
    for vault in vaults.values():
        yield ["generate", shown(vault), "-p", PROMPT, "--max-tokens", str(GENERATED), "--cache-gb", quarter_gb(vault)]
        if text.exists():
            yield ["eval", shown(vault), "--ref", shown(model), "--data", shown(text), "--tokens", str(EVAL_TOKENS)]
        else:
            print(f"\n(no {EVAL_TEXT} beside {shown(model)}: the eval step is left out)")


def warm_up(run: Run, argv: list[str]) -> int:
    """The generate command once, silently, for a few tokens: the first run after installing compiles the
    decode kernels (seconds), which would otherwise count as the shown command's time to first token."""
    print(f"(an untimed {WARMUP_TOKENS}-token run first: the first one after installing compiles the kernels)",
          flush=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = run([*argv, "--max-tokens", str(WARMUP_TOKENS)])
    if status:
        sys.stderr.write(out.getvalue())
    return status


def quarter_gb(vault: Path) -> str:
    """--cache-gb for a quarter of the vault's experts (in their compute form, as the cache counts them),
    rounded up to the kB, and at least what one token needs."""
    from smoe.runtime.model import OpenedVault

    sm = OpenedVault(vault)
    try:
        experts = sum(e.size for e in sm.vault.entries.values()) * sm.store.prepare_ratio()
        need = max(experts / 4, sm.store.min_budget(sm.vault.meta["top_k"] or 1))
    finally:
        sm.close()
    return f"{math.ceil(need / 1e3) / 1e6:.6f}"


def print_next_steps(vault: Path) -> None:
    print("\n== next: try these yourself")
    for argv, what in [
        (["chat", shown(vault)], "talk to it (it was trained on books, not conversations: it continues your text)"),
        (["serve", shown(vault)], "OpenAI- and Anthropic-compatible HTTP, a web chat at http://127.0.0.1:8000"),
        (["inspect", shown(vault)], "what a model costs to stream, and what fits in this machine's memory"),
    ]:
        print(f"  {command_line(argv)}\n      {what}")


def banner(argv: list[str]) -> None:
    print(f"\n== {command_line(argv)}", flush=True)


def command_line(argv: list[str]) -> str:
    return shlex.join([*program(), *argv])


def program() -> list[str]:
    """How to run smoe as this process was started: `smoe` when that is the one on PATH, else its path
    (`.venv/bin/smoe` under `make demo`), or `python -m smoe.cli`."""
    started = Path(sys.argv[0])
    if started.name == "smoe":
        on_path = shutil.which("smoe")
        return ["smoe"] if on_path and os.path.samefile(on_path, started) else [shown(started)]
    return [shown(Path(sys.executable)), "-m", "smoe.cli"]


def shown(path: Path) -> str:
    """A path as a user types it: relative to the current directory when inside it, else absolute."""
    path = Path(os.path.abspath(path))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
