"""Decode speed of the three ways to run a vault on the CPU, each in a fresh process with the default threads:
`smoe generate --decoder generic`, `smoe.load(VAULT).generate(...)` and
`AutoModelForCausalLM.from_pretrained(VAULT).generate(...)`.

    python scripts/bench_api_threads.py VAULT [--rounds 5] [--tokens 64] [--prompt TEXT] [--dtype bfloat16]

The three run interleaved, round after round (a machine shared with other work slows all three alike);
greedy and in one compute dtype (`--dtype`, the CLI's default; from_pretrained's own default is the
config's dtype), so all three must give the same tokens. Decode tok/s is counted as `smoe generate` counts it: the
tokens after the first, over the time from the first to the last. Prints the medians and each one's ratio to
the CLI's, and the torch thread count every process ran with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ARMS = ("smoe generate", "smoe.load", "from_pretrained")


def api_arm(arm: str, vault: str, prompt: str, tokens: int, dtype: str) -> dict:
    """One generate through the Python API in this (fresh) process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    import smoe

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):  # first the prompt, then each new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    if arm == "smoe.load":
        model = smoe.load(vault, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(vault, dtype=getattr(torch, dtype))
    ids = AutoTokenizer.from_pretrained(vault)(prompt, return_tensors="pt")["input_ids"]
    clock = Clock()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                         do_sample=False, streamer=clock, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    first, last = clock.times[1], clock.times[-1]
    return {"tokens": new, "decode_tok_s": (len(new) - 1) / (last - first), "torch_threads": torch.get_num_threads()}


def cli_arm(vault: str, prompt: str, tokens: int, dtype: str) -> dict:
    run = subprocess.run([sys.executable, "-c", CLI, vault, prompt, str(tokens), dtype], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr)
    *_, generated, threads = run.stdout.strip().splitlines()
    result = json.loads(generated)
    return {"tokens": result["tokens"], "decode_tok_s": result["stats"]["decode_tok_s"],
            "torch_threads": int(threads)}


# `smoe generate` as the command runs it, then the torch thread count it ran with
CLI = """
import sys, torch
from smoe.cli import main
vault, prompt, tokens, dtype = sys.argv[1:]
status = main(["generate", vault, "-p", prompt, "--max-tokens", tokens, "--temperature", "0", "--decoder", "generic",
               "--dtype", dtype, "--json"])
print(torch.get_num_threads())
sys.exit(status)
"""


def run_arm(arm: str, args) -> dict:
    if arm == "smoe generate":
        return cli_arm(args.vault, args.prompt, args.tokens, args.dtype)
    run = subprocess.run([sys.executable, __file__, args.vault, "--arm", arm, "--prompt", args.prompt,
                          "--tokens", str(args.tokens), "--dtype", args.dtype], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("vault")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", default="The sea was")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--arm", choices=ARMS[1:], help=argparse.SUPPRESS)  # one API run, in the child process
    args = p.parse_args()
    if args.arm:
        print(json.dumps(api_arm(args.arm, args.vault, args.prompt, args.tokens, args.dtype)))
        return
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    tokens, threads = {}, {}
    for r in range(args.rounds):
        for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:  # a different arm first each round
            result = run_arm(arm, args)
            rates[arm].append(result["decode_tok_s"])
            tokens.setdefault(arm, result["tokens"])
            threads.setdefault(arm, set()).add(result["torch_threads"])
            print(f"round {r + 1} {arm:16s} {result['decode_tok_s']:7.1f} tok/s", file=sys.stderr)
    cli = statistics.median(rates[ARMS[0]])
    for arm in ARMS:
        median = statistics.median(rates[arm])
        print(f"{arm:16s} median {median:7.1f} tok/s  ratio to smoe generate {median / cli:.3f}  "
              f"runs {' '.join(f'{x:.1f}' for x in rates[arm])}  torch threads {sorted(threads[arm])}  "
              f"{len(tokens[arm])} tokens")
    same = all(tokens[arm] == tokens[ARMS[0]] for arm in ARMS)
    print("same greedy tokens in all three" if same else "TOKENS DIFFER between the three")


if __name__ == "__main__":
    main()
