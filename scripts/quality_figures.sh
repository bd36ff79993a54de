#!/usr/bin/env bash
# The figures of QUALITY.md for one model: grid vs the default encoder at Q4 and Q2, and plans of
# 2.5 / 3.0 / 3.5 bits per weight, each vault evaluated with `smoe eval` defaults.
#   scripts/quality_figures.sh MODEL_DIR OUT_DIR [ENCODER]
set -euo pipefail
model=$1; out=$2; encoder=${3:-gptq}
corpus=$(dirname "$0")/../../shared/corpus
smoe=("${PYTHON:-python}" -m smoe.cli)
mkdir -p "$out"
run() { echo "+ $*" >&2; "$@"; }
evaluate() { run "${smoe[@]}" eval "$1" --ref "$model" --data "$corpus/valid.txt.gz" --json | tail -1 > "$1.eval.json"; cat "$1.eval.json"; }

for bits in 4 2; do
  run "${smoe[@]}" quantize "$model" -o "$out/grid-q$bits" --bits $bits --force -q
  evaluate "$out/grid-q$bits"
  run "${smoe[@]}" quantize "$model" -o "$out/$encoder-q$bits" --bits $bits --encoder $encoder \
      --calib "$corpus/train.txt.gz" --force -q
  evaluate "$out/$encoder-q$bits"
done
run "${smoe[@]}" quantize "$model" -o "$out/plan-3.0" --budget 3.0 --encoder $encoder --calib "$corpus/train.txt.gz" --force
evaluate "$out/plan-3.0"
for budget in 2.5 3.5; do
  run "${smoe[@]}" plan "$model" --budget $budget --encoder $encoder --calib "$corpus/train.txt.gz" \
      -o "$out/plan-$budget.json" --sensitivity "$out/plan-3.0.plan.sensitivity.json" -q
  run "${smoe[@]}" quantize "$model" -o "$out/plan-$budget" --plan "$out/plan-$budget.json" \
      --calib "$corpus/train.txt.gz" --force -q
  evaluate "$out/plan-$budget"
done
