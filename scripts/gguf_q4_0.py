"""A llama.cpp Q4_0 GGUF of a vault, made by llama.cpp's own quantizer, as the CPU decode baseline.

    python scripts/gguf_q4_0.py VAULT_DIR OUT.gguf

Exports the vault with its trunk in f32 (`smoe export --to gguf --trunk-type f32`: experts as Q4_1,
exact), then lets llama.cpp (llama-cpp-python's `llama_model_quantize`) requantize every matrix to
MOSTLY_Q4_0, the usual Q4_0 recipe. The intermediate file is written next to OUT and removed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import llama_cpp


def main(vault: str, out: str) -> None:
    target = Path(out)
    source = target.with_name(target.stem + ".f32-trunk.gguf")
    partial = target.with_name(target.name + ".partial")
    subprocess.run([sys.executable, "-m", "smoe.cli", "export", vault, "--to", "gguf", "-o", str(source),
                    "--trunk-type", "f32", "--force", "-q"], check=True)
    try:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
            sys.exit(f"smoe: error: llama.cpp could not quantize {source}")
        partial.rename(target)  # no half-written output under the final name
    finally:
        source.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    print(f"{target}: {target.stat().st_size / 1e6:.1f} MB (llama.cpp Q4_0)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
