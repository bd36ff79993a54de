#!/usr/bin/env bash
# CPU decode of two commits in one run: each commit sculpts the shared model with its own code (vault
# formats may differ), then `smoe bench runtime` alternates between them ROUNDS times.
# Usage: [MODEL=DIR] bash scripts/compare_commits.sh OLD_COMMIT NEW_COMMIT [ROUNDS]   (from the repository root, after
# make venv; MODEL defaults to the shared qwen3-moe-28m)
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
work=$(mktemp -d /tmp/smoe-compare.XXXX)
py="$(pwd)/.venv/bin/python"
model=$(realpath "${MODEL:-../shared/models/qwen3-moe-28m}")  # MODEL=DIR: another model
for c in "$old" "$new"; do
  git worktree add -q --detach "$work/$c" "$c"
  # from inside the worktree: `python -m` puts the working directory first on the path
  (cd "$work/$c" && PYTHONPATH="$work/$c" "$py" -m smoe.cli quantize "$model" -o "$work/vault-$c" --bits 4 --quiet)
done
for r in $(seq "$rounds"); do
  for c in "$old" "$new"; do
    (cd "$work/$c" && PYTHONPATH="$work/$c" "$py" -m smoe.cli bench runtime "$work/vault-$c" --tokens 128 \
      --dtype bfloat16 --threads 1 --budgets 1,0.25 --json > "$work/round-$r-$c.json" 2>/dev/null)
  done
done
"$py" - "$work" "$old" "$new" "$rounds" <<'PY'
import json, statistics, sys
work, old, new, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
load = lambda r, c: json.load(open(f"{work}/round-{r}-{c}.json"))["rows"]
for i, row in enumerate(load(1, old)):
    olds = [load(r, old)[i]["decode_tok_s"] for r in range(1, rounds + 1)]
    news = [load(r, new)[i]["decode_tok_s"] for r in range(1, rounds + 1)]
    ratios = [n / o for n, o in zip(news, olds)]
    print(f"budget {row['budget_fraction']:.2f}: {old} " + " ".join(f"{x:.1f}" for x in olds) + f" | {new} "
          + " ".join(f"{x:.1f}" for x in news) + " tok/s | new/old per round " + " ".join(f"{x:.3f}" for x in ratios)
          + f", median {statistics.median(ratios):.3f}")
PY
for c in "$old" "$new"; do git worktree remove --force "$work/$c"; done
