#!/usr/bin/env bash
# The measurements behind --device auto's rule (BENCHMARKS.md, "Choosing the device"): one vault decoded
# by each decoder on the GPU and on this machine's CPU, in one run.
# Usage (repository root, on a CUDA machine): bash scripts/h200_devices.sh VAULT [TOKENS]
set -uo pipefail
source scripts/device_env.sh
vault=$1 tokens=${2:-128}
for run in "cuda fast" "cuda generic" "cpu fast" "cpu fast" "cpu generic"; do  # cpu fast twice: the first compiles
  set -- $run
  python3 -m smoe.cli generate "$vault" -p "The old man looked out over the sea and" --max-tokens "$tokens" \
    --device "$1" --decoder "$2" --json 2>/dev/null |
    python3 -c "import json, sys; r = json.load(sys.stdin); s = r['stats']; print(f\"{r['device']:>6} {r['decoder']:>8}: decode {s['decode_tok_s']:8.1f} tok/s, prefill {s['prefill_tok_s']:8.1f} tok/s, {s['generated_tokens']} tokens\")"
done
python3 -m smoe.cli generate "$vault" -p "x" --max-tokens 2 --json 2>/dev/null |
  python3 -c "import json, sys; r = json.load(sys.stdin); print('--device auto picked', r['device'], r['decoder'])"
