"""The two halves of the safetensors file format SMOE needs without the safetensors library: the
raw header (8-byte little-endian length, then JSON) read with its length checked, and a streaming
writer that puts the header first and then each tensor's bytes, one tensor in memory at a time."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from smoe.errors import SmoeError
from smoe.format.dtypes import SAFETENSORS

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors library itself enforces
# The dtypes write_safetensors writes (a vault's trunk holds these).
WRITABLE = {SAFETENSORS[n]: n for n in ("BF16", "F16", "F32", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL")}


def corrupt_header(path: Path, reason: str) -> SmoeError:
    return SmoeError(f"{path}: truncated or corrupt safetensors header ({reason})")


def read_header(path: Path) -> tuple[bytes, int]:
    """The header's raw JSON bytes and the file's size; raises when the length cannot be right."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise corrupt_header(path, f"file is only {size} bytes")
        (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise corrupt_header(path, f"header length {header_len} exceeds the {size}-byte file "
                                       f"or the {MAX_HEADER_BYTES}-byte limit")
        return os.pread(fd, header_len, 8), size
    finally:
        os.close(fd)


def write_stream(path: Path, tensors, metadata: dict, write_data) -> None:
    """The header from (name, safetensors dtype, shape, nbytes) of every tensor, in file order, then
    `write_data(f)` writes their bytes in that order."""
    header, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        write_data(f)


def write_safetensors(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], load, progress=None) -> None:
    """Stream tensors into one safetensors file without holding them all: header first, then data.

    `specs` gives (name, dtype, shape) of every tensor in advance; `load(name)` returns one at a time.
    """
    entries = []
    for name, dtype, shape in specs:
        nbytes = torch.empty(0, dtype=dtype).element_size()
        for s in shape:
            nbytes *= s
        entries.append((name, WRITABLE[dtype], shape, nbytes))

    def write_data(f) -> None:
        for name, dtype, shape in progress(specs) if progress else specs:
            t = load(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise SmoeError(f"trunk tensor {name}: got {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    write_stream(path, entries, {"format": "pt"}, write_data)
