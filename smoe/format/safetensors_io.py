"""The safetensors file format as smoe reads and writes it, without the safetensors library: the one
checked reader of every safetensors file smoe reads (header length, JSON, dtypes, shapes and offsets
checked before any tensor is read; tensors then read with positioned reads), and a streaming writer
that puts the header first and then each tensor's bytes, one tensor in memory at a time."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from smoe.errors import SmoeError
from smoe.format import jsonfile
from smoe.format.dtypes import SAFETENSORS

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors library itself enforces
READ_CHUNK = 1 << 30  # one read(2) returns at most ~2 GiB on Linux
# The dtypes write_safetensors writes (a vault's trunk holds these).
WRITABLE = {SAFETENSORS[n]: n for n in ("BF16", "F16", "F32", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL")}


def corrupt_header(path: Path, reason: str) -> SmoeError:
    return SmoeError(f"{path}: truncated or corrupt safetensors header ({reason})")


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file, as its checked header places it."""

    file: Path
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


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


def read_entries(path: Path) -> dict[str, Stored]:
    """Every tensor of a safetensors file, its header checked as strictly as the safetensors library
    checks it (so that no file passing here fails there), and no tensor name given twice."""
    raw, size = read_header(path)
    if not raw.startswith(b"{"):
        raise corrupt_header(path, "header is not a JSON object")
    try:
        header = jsonfile.loads(raw)
    except jsonfile.DuplicateKey as e:
        raise corrupt_header(path, f"{e.key!r} appears twice") from None
    except (ValueError, RecursionError) as e:
        raise corrupt_header(path, f"invalid JSON: {str(e)[:80]}") from None
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise corrupt_header(path, "__metadata__ is not a map of strings")
    data_start = 8 + len(raw)
    entries = {name: _entry(path, name, entry, data_start) for name, entry in header.items()}
    _check_layout(path, entries, data_start, size)
    return entries


def _entry(path: Path, name: str, entry, data_start: int) -> Stored:
    """One header entry: known dtype, sane shape, offsets matching dtype x shape."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise corrupt_header(path, f"malformed entry for {name!r}") from None
    if not isinstance(dtype, str) or dtype not in SAFETENSORS:
        raise corrupt_header(path, f"unknown dtype {dtype!r} for {name!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise corrupt_header(path, f"bad shape {shape!r} for {name!r}")
    if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
        raise corrupt_header(path, f"bad data_offsets for {name!r}")
    needed = math.prod(shape) * SAFETENSORS[dtype].itemsize
    if end - begin != needed:
        raise corrupt_header(path, f"{name!r} has {end - begin} bytes, {dtype} {shape} needs {needed}")
    return Stored(path, dtype, tuple(shape), data_start + begin, end - begin)


def _check_layout(path: Path, entries: dict[str, Stored], data_start: int, size: int) -> None:
    """The tensors tile the data exactly, as the safetensors library requires: no overlap, no gap,
    nothing past the end of the file and nothing after the last tensor."""
    pos = data_start
    for name, s in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].nbytes)):
        if s.start + s.nbytes > size:
            raise corrupt_header(path, f"{name!r} ends at byte {s.start + s.nbytes}, beyond the {size}-byte file")
        if s.start != pos:
            raise corrupt_header(path, f"{name!r} starts at data offset {s.start - data_start}, expected "
                                       f"{pos - data_start} ({'an overlap' if s.start < pos else 'a gap'})")
        pos += s.nbytes
    if pos != size:
        raise corrupt_header(path, f"{size - pos} bytes after the last tensor")


def pread_exact(fd: int, start: int, nbytes: int, path: Path) -> bytearray:
    """`nbytes` from `start`, in reads the kernel takes whole (one read stops near 2 GiB)."""
    buf = bytearray(nbytes)
    pread_into(fd, memoryview(buf), start, path)
    return buf


def pread_into(fd: int, view: memoryview, start: int, path: Path) -> None:
    done, nbytes = 0, len(view)
    while done < nbytes:
        got = os.preadv(fd, [view[done:done + READ_CHUNK]], start + done)
        if got == 0:
            raise SmoeError(f"{path}: truncated: file ends before byte {start + nbytes}")
        done += got


def read_tensor(fd: int, stored: Stored) -> torch.Tensor:
    """The stored tensor in torch's own (SIMD-aligned) memory, as safetensors' loader gives it."""
    data = torch.empty(stored.nbytes, dtype=torch.uint8)
    if stored.nbytes:
        pread_into(fd, memoryview(data.numpy()).cast("B"), stored.start, stored.file)
    return data.view(SAFETENSORS[stored.dtype]).reshape(stored.shape)


def load_tensors(path: Path, entries: dict[str, Stored] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (its header checked by read_entries unless given)."""
    entries = read_entries(path) if entries is None else entries
    fd = os.open(path, os.O_RDONLY)
    try:
        return {name: read_tensor(fd, s) for name, s in entries.items()}
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
