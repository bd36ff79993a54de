#!/usr/bin/env bash
# One H200 run for DeepSeek's MLA on the GPU's fast decoder. PART=check: the CUDA tests, the exactness check of
# a real vault (scripts/gpu_check_runtime.py) and greedy decode on each decoder and device; PART=bench: the
# DeepSeek-V2-Lite-shaped `smoe bench decode` (experts in pinned host RAM or on disk) with transformers bf16;
# PART=compare: the CUDA tests, that benchmark at 100% and 25%, then the Qwen3-30B-A3B-shaped one (6 layers) of
# an older tree (OLD_TREE, e.g. `git archive OLD smoe scripts` unpacked in .old/) and of this one.
# Usage (on a CUDA machine, repository root): PART=check bash scripts/h200_deepseek.sh VAULT
#                                             PART=bench bash scripts/h200_deepseek.sh [bench options...]
#                                             PART=compare bash scripts/h200_deepseek.sh OLD_TREE
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "${PART:-check}" = check ]; then
  vault=$1
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py tests/test_decoders.py 2>&1 | tail -8 | tee "$OUT/tests.txt"
  timeout 150 python3 scripts/gpu_check_runtime.py "$vault" 2>&1 | grep -v "Loading weights\|Writing" | tee "$OUT/check.txt"
  prompt="It was the best of times, it was the worst of times, it was the age of wisdom,"
  for run in "cuda fast" "cuda generic" "cpu fast" "cpu generic"; do
    set -- $run
    timeout 60 python3 -m smoe.cli generate "$vault" -p "$prompt" --max-tokens 128 --temperature 0 --device "$1" \
      --decoder "$2" --json > "$OUT/generate-$1-$2.json"
    python3 -c "import json, sys; j = json.load(open(sys.argv[1])); s = j['stats']; print(sys.argv[2], j['decoder'], j['device'], f\"decode {s['decode_tok_s']:.1f} tok/s prefill {s['prefill_tok_s']:.1f} tok/s\", repr(j['text'][:60]))" "$OUT/generate-$1-$2.json" "$run"
  done
elif [ "$PART" = compare ]; then
  old=$1
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -k "cuda" 2>&1 | tail -4
  timeout 200 python3 -m smoe.cli bench decode --model deepseek-v2-lite --workdir /tmp/bench --budgets 1,0.25 --tokens 64 \
    --warmup 32 --no-baseline --json > "$OUT/ds2.json" \
    && python3 -c "import json, sys; from smoe.bench.decode import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$OUT/ds2.json"
  site=$([ -d /tmp/site ] && echo /tmp/site)
  for tree in old new; do
    dir=$([ $tree = old ] && realpath "$old" || echo "$PWD")
    (cd "$dir" && PYTHONPATH="$dir${site:+:$site}" timeout 110 python3 -m smoe.cli bench decode --workdir /tmp/bench --layers 6 \
      --tokens 32 --warmup 16 --budgets 1,0.25 --no-baseline --json > "$OUT/qwen-$tree.json" 2>/dev/null)
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], [(r['budget_fraction'], r['source'], round(r['tok_s'], 1)) for r in d['rows']])" "$OUT/qwen-$tree.json" $tree
  done
else
  python3 -m smoe.cli bench decode --model deepseek-v2-lite --workdir /tmp/bench "$@" --json > "$OUT/bench_deepseek.json"
  python3 -c "import json, sys; from smoe.bench.decode import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$OUT/bench_deepseek.json"
fi
