# Sourced by the device scripts: wheels carried in .whl/ (if any) on the path, unbuffered output, $OUT.
# The wheels (the versions in .venv): pip download --no-deps -d .whl pydantic pydantic-core annotated-types
# typing-inspection gguf llguidance fastapi starlette uvicorn opentelemetry-api annotated-doc
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
