#!/usr/bin/env bash
# One device run: check the CUDA encoder bit for bit, then time it and the GPU sculptor.
# Usage (on a CUDA machine, repository root): bash scripts/h200_codec.sh
set -uo pipefail
source scripts/device_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 scripts/gpu_check_codec.py 2>&1 | tee "$OUT/codec_check.txt"
python3 -m smoe.cli bench quantize --device cuda --mb 2048 --json | tee "$OUT/bench_quantize_cuda.json"
python3 -m smoe.cli bench quantize --device cuda --mb 2048
python3 -m smoe.cli bench sculpt --device cuda --gb 4 --workdir /tmp --json | tee "$OUT/bench_sculpt_cuda.json"
