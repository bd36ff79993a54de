"""Pack a bf16 Hugging Face model directory small enough to travel with the working tree to the GPU machine
(64 MiB), and unpack it there bit for bit.

bf16 words split into their high bytes (sign, exponent: xz shrinks them about 3x) and low bytes (mantissa: kept
as they are, xz gains nothing there). The 62 MB deepseek-v3-30m packs to 45 MB this way; xz of the whole file
gives 45.7.

Usage: python3 scripts/model_planes.py pack MODEL_DIR PACK_DIR
       python3 scripts/model_planes.py unpack PACK_DIR MODEL_DIR
"""

import hashlib
import lzma
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

WEIGHTS = "model.safetensors"


def pack(model: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and f.name != WEIGHTS:
            shutil.copy(f, dest / f.name)
    raw = np.fromfile(model / WEIGHTS, dtype=np.uint8)
    head = 8 + struct.unpack("<Q", raw[:8].tobytes())[0]
    assert head % 2 == 0, "the tensors must start on an even byte for the planes to hold whole bf16 words"
    data = raw[head:]
    (dest / "weights.head").write_bytes(raw[:head].tobytes())
    (dest / "weights.lo").write_bytes(data[0::2].tobytes())
    (dest / "weights.hi.xz").write_bytes(lzma.compress(data[1::2].tobytes(), preset=9))
    (dest / "weights.sha256").write_text(hashlib.sha256(raw.tobytes()).hexdigest())


def unpack(src: Path, model: Path) -> None:
    model.mkdir(parents=True)
    for f in src.iterdir():
        if not f.name.startswith("weights."):
            shutil.copy(f, model / f.name)
    lo = np.frombuffer((src / "weights.lo").read_bytes(), dtype=np.uint8)
    hi = np.frombuffer(lzma.decompress((src / "weights.hi.xz").read_bytes()), dtype=np.uint8)
    data = np.empty(2 * lo.size, dtype=np.uint8)
    data[0::2], data[1::2] = lo, hi
    out = (src / "weights.head").read_bytes() + data.tobytes()
    if hashlib.sha256(out).hexdigest() != (src / "weights.sha256").read_text().strip():
        sys.exit("model_planes: the unpacked weights do not match the packed checksum")
    (model / WEIGHTS).write_bytes(out)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        sys.exit(__doc__)
    (pack if sys.argv[1] == "pack" else unpack)(Path(sys.argv[2]), Path(sys.argv[3]))
