#!/usr/bin/env bash
# One H200 run: GPU decode and kernel benchmarks of an older tree (OLD, e.g. `git archive OLD smoe scripts`
# unpacked in .old/) and of this one, alternating in the same run, then the CUDA tests.
# Usage (repository root, on a CUDA machine): bash scripts/h200_compare.sh [OLD_TREE_DIR]
set -uo pipefail
source scripts/device_env.sh
old=${1:-.old}
site=$([ -d /tmp/site ] && echo /tmp/site)  # wheels device_env.sh installed, if any
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
decode="bench decode --workdir /tmp/bench --layers 8 --tokens 32 --warmup 16 --budgets 1,0.25 --no-baseline --json"
kernels="bench kernels --shape qwen3-30b-a3b --json"
for round in 1 2; do
  for tree in old new; do
    dir=$([ $tree = old ] && echo "$old" || echo "$PWD")
    (cd "$dir" && PYTHONPATH="$dir${site:+:$site}" timeout 150 python3 -m smoe.cli $decode > "$OUT/decode-$tree-$round.json")
    (cd "$dir" && PYTHONPATH="$dir${site:+:$site}" timeout 90 python3 -m smoe.cli $kernels > "$OUT/kernels-$tree-$round.json")
  done
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def rows(kind, tree, r):
    try:
        doc = json.load(open(f"{out}/{kind}-{tree}-{r}.json"))
    except (OSError, ValueError):
        return {}
    if kind == "decode":
        return {f"budget {x['budget_fraction']:.2f} {x['source']} tok/s": x["tok_s"] for x in doc["rows"]}
    return {f"{name} SMOE-Q{s['bits']} {k}": s[k] for name, e in doc["shapes"].items() for s in e["smoe"]
            for k in ("decode_us", "gate_up_us", "down_us")}
for kind in ("decode", "kernels"):
    for r in (1, 2):
        old, new = rows(kind, "old", r), rows(kind, "new", r)
        for key in old:
            if key in new:
                better = new[key] / old[key] if kind == "decode" else old[key] / new[key]
                print(f"{kind} round {r} {key}: old {old[key]:.2f} new {new[key]:.2f} new/old speed {better:.3f}")
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_decoders.py tests/test_gpu_runtime.py tests/test_from_pretrained.py \
  tests/test_hf_internals.py -k "not import_contracts" 2>&1 | tail -15 | tee "$OUT/tests.txt"
