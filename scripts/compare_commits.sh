#!/usr/bin/env bash
# CPU decode of two commits in one run: each commit sculpts the shared model with its own code (vault
# formats may differ), then `smoe bench runtime` alternates between them ROUNDS times.
# Usage: bash scripts/compare_commits.sh OLD_COMMIT NEW_COMMIT [ROUNDS]   (from the repository root, after make venv)
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
work=$(mktemp -d /tmp/smoe-compare.XXXX)
py="$(pwd)/.venv/bin/python"
model=$(realpath ../shared/models/qwen3-moe-28m)
for c in "$old" "$new"; do
  git worktree add -q --detach "$work/$c" "$c"
  # from inside the worktree: `python -m` puts the working directory first on the path
  (cd "$work/$c" && PYTHONPATH="$work/$c" "$py" -m smoe.cli quantize "$model" -o "$work/vault-$c" --bits 4 --quiet)
done
for r in $(seq "$rounds"); do
  for c in "$old" "$new"; do
    line=$(cd "$work/$c" && PYTHONPATH="$work/$c" "$py" -m smoe.cli bench runtime \
      "$work/vault-$c" --tokens 128 --dtype bfloat16 --threads 1 --budgets 1,0.25 --json 2>/dev/null | tail -1)
    echo "round $r commit $c $line"
  done
done
for c in "$old" "$new"; do git worktree remove --force "$work/$c"; done
