#!/usr/bin/env bash
# One device run: check the CUDA encoder bit for bit, then time it and the GPU sculptor.
# Usage (on a CUDA machine, repository root): bash scripts/h200_codec.sh
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 scripts/gpu_check_codec.py 2>&1 | tee "$OUT/codec_check.txt"
python3 -m smoe.cli bench quantize --device cuda --mb 2048 --json | tee "$OUT/bench_quantize_cuda.json"
python3 -m smoe.cli bench quantize --device cuda --mb 2048
python3 -m smoe.cli bench sculpt --device cuda --gb 4 --workdir /tmp --json | tee "$OUT/bench_sculpt_cuda.json"
