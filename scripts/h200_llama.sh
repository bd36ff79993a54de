#!/usr/bin/env bash
# smoe's GPU decoder against llama.cpp CUDA on the same synthetic models, in one run: the DeepSeek-V2-Lite-
# and Qwen3-30B-A3B-shaped vaults of `smoe bench decode` (experts from pinned host RAM for partial budgets)
# and their GGUF exports under llama-bench (-ngl 99; --n-cpu-moe for partial budgets).
# PART=prepare: start the llama.cpp build in the background (sources in LLAMA_SRC, default .dev/llama.cpp,
# llama-cpp-python's vendored tree with the other backends removed) and write the vaults and GGUFs;
# PART=bench: wait for the build, then both benchmarks. Each part starts from nothing if it must.
# PART=pack: wait for the build, then write llama-bench xz-compressed into $OUT in 15 MB pieces; copied into
# .dev/llama-bin/ and carried, a later call on a fresh machine unpacks them instead of building.
# TESTS="pytest arguments": the prepare part also runs these tests while the build finishes.
# MODELS="qwen3-30b-a3b" (default: both), BUDGETS (default 1,0.25,0.1), PREFILL="512,2048" (prompt lengths timed
# beside llama-bench -p; default none), PROFILE=1: the bench part first runs scripts/gpu_profile_prefill.py.
# Every decode row is timed under both recorded routings (--routing zipf,uniform), a partial budget's host rows with
# misses read in place and copied (HOST_MISSES, default in-place,copy). After each model's host-RAM rows
# and llama-bench, its partial budgets again with the experts read cold from the disk (--sources disk: page cache
# dropped and checked, O_DIRECT; the disk measured as the cache reads it), COLD_TOKENS timed tokens (default 16)
# after 16 of warm-up, within COLD_TIMEOUT_S (default 150) and before DEADLINE_S seconds of the call (default 590);
# COLD=0 leaves them out.
# Usage (on a CUDA machine, repository root): PART=prepare bash scripts/h200_llama.sh; PART=bench bash scripts/h200_llama.sh
# The llama.cpp sources (the ones llama-cpp-python 0.3.36 builds, as in constraints.txt), made on any machine:
#   pip download --no-deps --no-binary :all: llama_cpp_python==0.3.36 -d /tmp/src && tar xzf /tmp/src/*.tar.gz -C /tmp/src
#   cp -r /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp .dev/llama.cpp   # then remove ggml/src/ggml-{cann,sycl,
#   vulkan,metal,opencl,hexagon,webgpu,musa,hip,openvino,zdnn,zendnn,virtgpu,et}, tools/ui, docs, models, tests
#   (27 MB left, so the tree uploads to a machine with no network)
set -uo pipefail
source scripts/device_env.sh
src=${LLAMA_SRC:-.dev/llama.cpp}
build=/tmp/llama-build
packed=${LLAMA_PACKED:-.dev/llama-bin/llama-bench.txz}  # PART=pack's pieces, where a later call carries them
bench=$build/bin/llama-bench
work=/tmp/bench
qwen_layers=${QWEN_LAYERS:-8}
models=${MODELS:-deepseek-v2-lite qwen3-30b-a3b}

start_build() {
  [ -x "$bench" ] && return
  if ls $packed.* >/dev/null 2>&1; then  # a build packed by an earlier call (PART=pack), carried back
    mkdir -p $build/bin && cat $packed.* | xz -d | tar -x -C $build/bin && [ -x "$bench" ] && return
  fi
  pgrep -f "cmake --build $build" >/dev/null && return
  # static: one self-contained binary, which PART=pack can bring back for later machines
  setsid nohup bash -c "cmake -S $src -B $build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF && cmake --build $build --target llama-bench -j $(nproc)" > /tmp/llama-build.log 2>&1 < /dev/null &
}

prepare() {
  python3 - "$work" "$qwen_layers" "$models" <<'PY'
import sys, time
from pathlib import Path
from smoe.bench.decode import MODELS, gguf_of, write_model_vault
work, qwen_layers = Path(sys.argv[1]), int(sys.argv[2])
for model, layers in (("deepseek-v2-lite", None), ("qwen3-30b-a3b", qwen_layers)):
    if model not in sys.argv[3].split():
        continue
    cfg = dict(MODELS[model]) | ({"num_hidden_layers": layers} if layers else {})
    start = time.time()
    vault = write_model_vault(work / f"{model}-shaped-q4-{cfg['num_hidden_layers']}L", cfg, progress=False)
    gguf = gguf_of(vault)
    print(f"{model}: vault and {gguf.stat().st_size / 1e9:.1f} GB GGUF in {time.time() - start:.0f} s", flush=True)
PY
}

start_build
if [ "${PART:-prepare}" = pack ]; then  # wait for the build (until WAIT_UNTIL_S), then xz it into $OUT in pieces
  while [ ! -x "$bench" ] && [ "$SECONDS" -lt "${WAIT_UNTIL_S:-560}" ] && pgrep -f "cmake --build $build" >/dev/null; do sleep 5; done
  [ -x "$bench" ] || { tail -5 /tmp/llama-build.log; exit 1; }
  tar -C $build/bin -cf - llama-bench | xz -T0 -6 | split -b 15M - "$OUT/llama-bench.txz."
  ls -l "$OUT"/llama-bench.txz.*
elif [ "${PART:-prepare}" = prepare ]; then
  prepare
  if [ -n "${TESTS:-}" ]; then  # the CUDA tests meanwhile (the build still running beside them)
    timeout 240 python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -6
  fi
  # the build's last minutes in this call too, so the bench call only benchmarks
  while [ ! -x "$bench" ] && [ "$SECONDS" -lt "${WAIT_UNTIL_S:-560}" ] && pgrep -f "cmake --build $build" >/dev/null; do sleep 5; done
  tail -2 /tmp/llama-build.log
else
  prepare
  while [ ! -x "$bench" ] && pgrep -f "cmake --build $build" >/dev/null; do sleep 5; done
  [ -x "$bench" ] || { tail -20 /tmp/llama-build.log; exit 1; }
  if [ -n "${PROFILE:-}" ]; then
    timeout 200 python3 scripts/gpu_profile_prefill.py qwen3-30b-a3b "$qwen_layers" "${PREFILL:-512,2048}" "$work"
  fi
  for run in "deepseek-v2-lite 27" "qwen3-30b-a3b $qwen_layers"; do
    set -- $run
    case " $models " in *" $1 "*) ;; *) continue ;; esac
    timeout 380 python3 -m smoe.cli bench decode --model "$1" --layers "$2" --workdir "$work" --budgets "${BUDGETS:-1,0.25,0.1}" \
      --prefill "${PREFILL:-}" --sources host --routing zipf,uniform --host-misses "${HOST_MISSES:-in-place,copy}" \
      --tokens 64 --warmup 32 --no-baseline \
      --llama-bench "$bench" --json > "$OUT/$1.json" \
      && python3 -c "import json, sys; from smoe.bench.decode import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$OUT/$1.json"
    # the cold rows: partial budgets only (a full budget reads nothing), in a call of their own so that a slow disk
    # costs only these rows
    partial=$(echo "${BUDGETS:-1,0.25,0.1}" | tr ',' '\n' | awk '$1 < 1' | paste -sd, -)
    cold_s=$(( ${DEADLINE_S:-590} - SECONDS ))  # what is left of the call (10 minutes a command on the device)
    cold_s=$(( cold_s < ${COLD_TIMEOUT_S:-150} ? cold_s : ${COLD_TIMEOUT_S:-150} ))
    if [ "${COLD:-1}" != 0 ] && [ -n "$partial" ] && [ "$cold_s" -lt 60 ]; then
      echo "$1: cold disk rows left out: $cold_s s left of the call"
    elif [ "${COLD:-1}" != 0 ] && [ -n "$partial" ]; then
      timeout "$cold_s" python3 -m smoe.cli bench decode --model "$1" --layers "$2" --workdir "$work" \
        --budgets "$partial" --sources disk --routing zipf,uniform --tokens "${COLD_TOKENS:-16}" --warmup 16 --no-baseline \
        --json > "$OUT/$1-cold.json" \
        && python3 -c "import json, sys; from smoe.bench.decode import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$OUT/$1-cold.json"
    fi
  done
fi
