#!/usr/bin/env bash
# One device run: the GPU runtime's exactness checks, its tests, and `smoe bench decode`.
# Usage (on a CUDA machine, repository root, with the demo vaults built by `make demo`):
#   bash scripts/h200_runtime.sh [bench options...]
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "${SKIP_CHECKS:-0}" != 1 ]; then
  python3 scripts/gpu_check_runtime.py out/demo/vault-q4 out/demo/vault-q2 2>&1 | grep -v "Loading weights\|Writing" | tee "$OUT/runtime_check.txt"
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -k cuda 2>&1 | tail -5 | tee "$OUT/runtime_tests.txt"
  python3 -m smoe.cli generate out/demo/vault-q4 -p "The old man" --max-tokens 32 --temperature 0 --device cuda --gpu-cache-gb 0.005 2>&1 | tail -3
fi
python3 -m smoe.cli bench decode --workdir /tmp/bench "$@" --json > "$OUT/bench_decode.json"
python3 -c "import json, sys; from smoe.bench.decode import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$OUT/bench_decode.json"
