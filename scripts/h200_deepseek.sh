#!/usr/bin/env bash
# One H200 run for DeepSeek's MLA on the GPU's fast decoder. PART=check: the CUDA tests, the exactness check of
# a real vault (scripts/gpu_check_runtime.py) and greedy decode on each decoder and device; PART=bench: the
# DeepSeek-V2-Lite-shaped `smoe bench decode` (experts in pinned host RAM or on disk) with transformers bf16;
# PART=compare: the CUDA tests, that benchmark at 100% and 25%, then the Qwen3-30B-A3B-shaped one (6 layers) of
# an older tree (OLD_TREE, e.g. `git archive OLD smoe scripts` unpacked in .old/) and of this one;
# PART=shared: the shared deepseek-v3-30m (packed by scripts/model_planes.py with valid.txt.gz and a plan.json
# beside it) quantised here at Q4, Q2 and the plan, each evaluated and generated on the GPU's fast decoder, then
# chat and serve; PART=mixtral: the Mixtral-8x7B-shaped `smoe bench decode` (4 layers) of OLD_TREE and of this
# tree, old, new, new, old.
# Usage (on a CUDA machine, repository root): PART=check bash scripts/h200_deepseek.sh VAULT
#                                             PART=shared bash scripts/h200_deepseek.sh PACK_DIR
#                                             PART=mixtral bash scripts/h200_deepseek.sh OLD_TREE
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
elif [ "$PART" = shared ]; then
  pack=$(realpath "$1") ds=/tmp/ds-src
  [ -d $ds ] || python3 scripts/model_planes.py unpack "$pack" $ds
  for v in q4 q2 mixed; do
    case $v in q4) opt="--bits 4";; q2) opt="--bits 2";; mixed) opt="--plan $pack/plan.json --encoder grid";; esac
    [ -d /tmp/ds-$v ] || python3 -m smoe.cli quantize $ds -o /tmp/ds-$v $opt -q > /dev/null
    timeout 120 python3 -m smoe.cli eval /tmp/ds-$v --ref $ds --data "$pack/valid.txt.gz" --device cuda --decoder fast \
      --json > "$OUT/eval-$v.json" 2> "$OUT/eval-$v.err"
    python3 -c "import json, sys; j = json.load(open(sys.argv[1])); print(sys.argv[2], 'eval', j['decoder'], j['device'], 'KL', round(j['kl'], 6), 'ppl', round(j['ppl'], 3), 'top-1', round(j['top1'], 4))" "$OUT/eval-$v.json" $v
    timeout 60 python3 -m smoe.cli generate /tmp/ds-$v -p "It was the best of times, it was the worst of times," --max-tokens 64 \
      --temperature 0 --device cuda --decoder fast --json > "$OUT/generate-$v.json"
    python3 -c "import json, sys; j = json.load(open(sys.argv[1])); s = j['stats']; print(sys.argv[2], 'generate', j['decoder'], j['device'], f\"decode {s['decode_tok_s']:.1f} tok/s\", repr(j['text'][:50]))" "$OUT/generate-$v.json" $v
  done
  printf "Once upon a time\n" | timeout 60 python3 -m smoe.cli chat /tmp/ds-q4 --device cuda --decoder fast -n 16 --temperature 0 2>&1 | tail -3
  python3 -m smoe.cli serve /tmp/ds-q2 --device cuda --decoder fast --port 8765 > "$OUT/serve.log" 2>&1 &
  for i in $(seq 60); do curl -s localhost:8765/health > /dev/null && break; sleep 1; done
  curl -s localhost:8765/v1/chat/completions -H 'content-type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16, "temperature": 0}'; echo
  curl -s localhost:8765/metrics | grep -o "\"decoder\":\"[a-z]*\",\"device\":\"[a-z]*\""
  kill %1
elif [ "$PART" = mixtral ]; then
  old=$(realpath "$1")
  python3 -c "import json; from smoe.bench.decode import MIXTRAL_8X7B; print(json.dumps(MIXTRAL_8X7B))" > /tmp/mixtral.json
  site=$([ -d /tmp/site ] && echo /tmp/site)
  n=0
  for tree in old new new old; do
    n=$((n + 1))
    if [ $tree = old ]; then  # the older tree has no Mixtral preset: give it the same config
      (cd "$old" && PYTHONPATH="$old${site:+:$site}" timeout 200 python3 -c "import json, sys; import smoe.bench.decode as d; d.MODELS['mixtral-8x7b'] = json.load(open('/tmp/mixtral.json')); print(json.dumps(d.bench_decode('/tmp/bench-old', [1.0, 0.25], 32, 16, baseline=False, layers=4, model='mixtral-8x7b')))" > "$OUT/mixtral-$n-$tree.json" 2>/dev/null)
    else
      timeout 200 python3 -m smoe.cli bench decode --model mixtral-8x7b --workdir /tmp/bench-new --layers 4 --tokens 32 --warmup 16 \
        --budgets 1,0.25 --no-baseline --json > "$OUT/mixtral-$n-$tree.json" 2>/dev/null
    fi
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], [(r['budget_fraction'], r['source'], round(r['tok_s'], 1)) for r in d['rows']])" "$OUT/mixtral-$n-$tree.json" $tree
  done
else
  python3 -m smoe.cli bench decode --model deepseek-v2-lite --workdir /tmp/bench "$@" --json > "$OUT/bench_deepseek.json"
  python3 -c "import json, sys; from smoe.bench.decode import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$OUT/bench_deepseek.json"
fi
