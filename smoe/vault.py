"""The vault: one aligned, checksummed blob per (layer, expert), an index, and the resident trunk.

The byte-level specification is docs/vault.md; this module is its only reader and writer.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from smoe import codec
from smoe.errors import SmoeError

MAGIC = b"SMOEVLT\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIIIQQQQ")  # magic, version, group, bits, alignment, data_offset, data_end, blobs, index hash
HEADER_SIZE = HEADER.size + 8  # + xxh64 of the header fields
DEFAULT_ALIGNMENT = 4096
SECTION_ALIGNMENT = 64  # codes / scales / biases start on 64-byte boundaries inside a blob
DATA_FILE = "experts.bin"
INDEX_FILE = "index.json"
TRUNK_FILE = "trunk.safetensors"

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def align(n: int, to: int) -> int:
    return -(-n // to) * to


def checksum(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass
class TensorEntry:
    """One quantised projection inside a blob; offsets are relative to the blob start."""

    role: str
    shape: list[int]
    bits: int
    codes_offset: int
    codes_nbytes: int
    scales_offset: int
    scales_nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class BiasEntry:
    """A per-expert bias kept at full precision inside the blob."""

    role: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class ExpertEntry:
    layer: int
    expert: int
    offset: int
    size: int
    checksum: str
    tensors: list[TensorEntry]
    biases: list[BiasEntry] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "layer": self.layer, "expert": self.expert, "offset": self.offset, "size": self.size,
            "checksum": self.checksum,
            "tensors": [vars(t) for t in self.tensors],
            "biases": [vars(b) for b in self.biases],
        }

    @classmethod
    def from_json(cls, d: dict) -> "ExpertEntry":
        return cls(
            d["layer"], d["expert"], d["offset"], d["size"], d["checksum"],
            [TensorEntry(**t) for t in d["tensors"]], [BiasEntry(**b) for b in d.get("biases", [])],
        )


@dataclass
class QuantisedTensor:
    role: str
    shape: tuple[int, ...]
    bits: int
    codes: torch.Tensor  # packed uint8 [G, 64*bits/8]
    scales: torch.Tensor  # fp16 [G]

    def decode(self, dtype=torch.float32) -> torch.Tensor:
        return codec.decode(self.codes, self.scales, self.bits, self.shape, dtype)


# --- blobs ---------------------------------------------------------------------------------------


def build_blob(tensors: list[QuantisedTensor], biases: dict[str, torch.Tensor] | None = None):
    """Lay out one expert: per projection codes then scales, then biases; returns (bytes, entries)."""
    parts, offset = [], 0
    tensor_entries, bias_entries = [], []

    def place(raw: bytes) -> int:
        nonlocal offset
        start = align(offset, SECTION_ALIGNMENT)
        parts.append(b"\0" * (start - offset))
        parts.append(raw)
        offset = start + len(raw)
        return start

    for t in tensors:
        codes = t.codes.contiguous().numpy().tobytes()
        scales = t.scales.to(torch.float16).contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
        c_off = place(codes)
        s_off = place(scales)
        tensor_entries.append(TensorEntry(t.role, list(t.shape), t.bits, c_off, len(codes), s_off, len(scales)))
    for role, b in (biases or {}).items():
        raw = tensor_bytes(b)
        bias_entries.append(BiasEntry(role, DTYPE_NAMES[b.dtype], list(b.shape), place(raw), len(raw)))
    return b"".join(parts), tensor_entries, bias_entries


def tensor_bytes(t: torch.Tensor) -> bytes:
    if t.dtype not in DTYPE_NAMES:
        t = t.to(torch.float32)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def parse_blob(entry: ExpertEntry, blob: bytes) -> tuple[list[QuantisedTensor], dict[str, torch.Tensor]]:
    buf = bytearray(blob)
    tensors = []
    for t in entry.tensors:
        codes = torch.frombuffer(buf, dtype=torch.uint8, offset=t.codes_offset, count=t.codes_nbytes)
        scales = torch.frombuffer(buf, dtype=torch.float16, offset=t.scales_offset, count=t.scales_nbytes // 2)
        tensors.append(QuantisedTensor(t.role, tuple(t.shape), t.bits, codes.view(-1, codec.GROUP_SIZE * t.bits // 8), scales))
    biases = {}
    for b in entry.biases:
        dtype = TORCH_DTYPES[b.dtype]
        count = b.nbytes // torch.empty(0, dtype=dtype).element_size()
        biases[b.role] = torch.frombuffer(buf, dtype=dtype, offset=b.offset, count=count).view(b.shape)
    return tensors, biases


# --- header --------------------------------------------------------------------------------------


def pack_header(bits: int, alignment: int, data_end: int, blobs: int, index_hash: int) -> bytes:
    fields = HEADER.pack(MAGIC, FORMAT_VERSION, codec.GROUP_SIZE, bits, alignment, alignment, data_end, blobs, index_hash)
    return fields + struct.pack("<Q", xxhash.xxh64_intdigest(fields))


def unpack_header(raw: bytes, path: Path) -> dict:
    if len(raw) < HEADER_SIZE:
        raise SmoeError(f"{path}: too short for a vault header (truncated?)")
    fields = raw[: HEADER.size]
    magic, version, group, bits, alignment, data_offset, data_end, blobs, index_hash = HEADER.unpack(fields)
    if magic != MAGIC:
        raise SmoeError(f"{path}: not an smoe vault (bad magic {magic!r})")
    if struct.unpack("<Q", raw[HEADER.size : HEADER_SIZE])[0] != xxhash.xxh64_intdigest(fields):
        raise SmoeError(f"{path}: header checksum mismatch (corrupt header)")
    if version != FORMAT_VERSION:
        raise SmoeError(f"{path}: vault format version {version}, this smoe reads version {FORMAT_VERSION}")
    if group != codec.GROUP_SIZE:
        raise SmoeError(f"{path}: group size {group} unsupported (expected {codec.GROUP_SIZE})")
    return {"bits": bits, "alignment": alignment, "data_offset": data_offset, "data_end": data_end,
            "blobs": blobs, "index_hash": index_hash}


# --- writing -------------------------------------------------------------------------------------


class VaultWriter:
    """Appends blobs to DIR/experts.bin; `finish` writes the index and then the header.

    Every blob appended is also journalled (one JSON line, after its bytes are flushed), so a run
    that dies can resume from the blobs already written and verified.
    """

    JOURNAL = "journal.jsonl"

    def __init__(self, directory: Path, bits: int, alignment: int = DEFAULT_ALIGNMENT):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bits = bits
        self.alignment = alignment
        self.entries: list[ExpertEntry] = self._resume()
        self.data = open(self.dir / DATA_FILE, "r+b" if (self.dir / DATA_FILE).exists() else "w+b")
        self.end = self._end_of_data()
        self.data.truncate(self.end)
        self.journal = open(self.dir / self.JOURNAL, "w")
        for e in self.entries:
            self.journal.write(json.dumps(e.to_json()) + "\n")
        self.journal.flush()

    def _end_of_data(self) -> int:
        if not self.entries:
            return self.alignment  # room for the header, written last
        last = self.entries[-1]
        return last.offset + last.size

    def _resume(self) -> list[ExpertEntry]:
        """Entries from the journal whose blobs are present and verify, in order, up to the first bad one."""
        journal, data = self.dir / self.JOURNAL, self.dir / DATA_FILE
        if not journal.exists() or not data.exists():
            return []
        good = []
        with open(data, "rb") as f:
            for line in journal.read_text().splitlines():
                try:
                    entry = ExpertEntry.from_json(json.loads(line))
                except (ValueError, KeyError, TypeError):
                    break
                if checksum(os.pread(f.fileno(), entry.size, entry.offset)) != entry.checksum:
                    break
                good.append(entry)
        return good

    def done(self) -> set[tuple[int, int]]:
        return {(e.layer, e.expert) for e in self.entries}

    def add(self, layer: int, expert: int, tensors: list[QuantisedTensor], biases=None) -> ExpertEntry:
        blob, t_entries, b_entries = build_blob(tensors, biases)
        offset = align(self.end, self.alignment)
        os.pwrite(self.data.fileno(), b"\0" * (offset - self.end) + blob, self.end)
        self.end = offset + len(blob)
        entry = ExpertEntry(layer, expert, offset, len(blob), checksum(blob), t_entries, b_entries)
        self.entries.append(entry)
        self.journal.write(json.dumps(entry.to_json()) + "\n")
        self.journal.flush()
        return entry

    def finish(self, meta: dict) -> None:
        """Pad the data to the alignment, write index.json, then the header that seals both."""
        data_end = align(self.end, self.alignment)
        os.pwrite(self.data.fileno(), b"\0" * (data_end - self.end), self.end)
        index = dict(meta)
        index.update({
            "format": "smoe-vault", "version": FORMAT_VERSION, "group_size": codec.GROUP_SIZE,
            "bits": self.bits, "alignment": self.alignment, "checksum": "xxh3_64",
            "experts": [e.to_json() for e in sorted(self.entries, key=lambda e: (e.layer, e.expert))],
        })
        raw_index = json.dumps(index, indent=1).encode()
        (self.dir / INDEX_FILE).write_bytes(raw_index)
        header = pack_header(self.bits, self.alignment, data_end, len(self.entries), xxhash.xxh64_intdigest(raw_index))
        os.pwrite(self.data.fileno(), header + b"\0" * (self.alignment - len(header)), 0)
        self.data.flush()
        os.fsync(self.data.fileno())
        self.close()
        (self.dir / self.JOURNAL).unlink()

    def close(self) -> None:
        self.data.close()
        self.journal.close()


# --- reading -------------------------------------------------------------------------------------


class Vault:
    """A vault directory opened for reading: header and index checked, blobs read with pread."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        data_path = self.dir / DATA_FILE
        if not self.dir.is_dir() or not data_path.exists() or not (self.dir / INDEX_FILE).exists():
            raise SmoeError(f"{self.dir}: not a vault (needs {DATA_FILE} and {INDEX_FILE})")
        self.fd = os.open(data_path, os.O_RDONLY)
        self.header = unpack_header(os.pread(self.fd, HEADER_SIZE, 0), data_path)
        raw_index = (self.dir / INDEX_FILE).read_bytes()
        if xxhash.xxh64_intdigest(raw_index) != self.header["index_hash"]:
            raise SmoeError(f"{self.dir / INDEX_FILE}: does not match {DATA_FILE} (index hash mismatch)")
        self.meta = json.loads(raw_index)
        size = os.fstat(self.fd).st_size
        if size < self.header["data_end"]:
            raise SmoeError(f"{data_path}: truncated ({size} bytes, header says {self.header['data_end']})")
        self.entries = {(e["layer"], e["expert"]): ExpertEntry.from_json(e) for e in self.meta["experts"]}

    @property
    def bits(self) -> int:
        return self.header["bits"]

    @property
    def alignment(self) -> int:
        return self.header["alignment"]

    @property
    def trunk_path(self) -> Path:
        return self.dir / TRUNK_FILE

    def entry(self, layer: int, expert: int) -> ExpertEntry:
        try:
            return self.entries[(layer, expert)]
        except KeyError:
            raise SmoeError(f"{self.dir}: no expert {expert} in layer {layer}") from None

    def read_blob(self, layer: int, expert: int) -> bytes:
        """One pread of the whole blob, checksum verified."""
        e = self.entry(layer, expert)
        blob = os.pread(self.fd, e.size, e.offset)
        self.check_blob(e, blob)
        return blob

    def check_blob(self, entry: ExpertEntry, blob) -> None:
        """A read of `entry`'s blob (bytes or a view, maybe longer: aligned reads) is whole and matches
        the index; else an error naming layer and expert."""
        where = f"{self.dir}: layer {entry.layer} expert {entry.expert}"
        if len(blob) < entry.size:
            raise SmoeError(f"{where}: blob truncated ({len(blob)} of {entry.size} bytes)")
        if checksum(blob[: entry.size]) != entry.checksum:
            raise SmoeError(f"{where}: checksum mismatch (corrupt blob)")

    def read_expert(self, layer: int, expert: int):
        """(quantised tensors in role order, biases) of one expert."""
        return parse_blob(self.entry(layer, expert), self.read_blob(layer, expert))

    def tensor_bits(self) -> dict[str, dict[int, int]]:
        """role -> {bits: number of expert tensors stored at that depth}."""
        counts: dict[str, dict[int, int]] = {}
        for e in self.entries.values():
            for t in e.tensors:
                counts.setdefault(t.role, {}).setdefault(t.bits, 0)
                counts[t.role][t.bits] += 1
        return counts

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- verification --------------------------------------------------------------------------------


def verify(path: str | Path, progress=None) -> list[str]:
    """Every check a reader relies on; returns the problems found (empty: the vault is sound)."""
    try:
        vault = Vault(path)
    except SmoeError as e:
        return [str(e)]
    with vault:
        problems = check_layout(vault)
        entries = sorted(vault.entries.values(), key=lambda e: e.offset)
        for e in progress(entries) if progress else entries:
            try:
                vault.read_blob(e.layer, e.expert)
            except SmoeError as err:
                problems.append(str(err))
        problems += check_padding(vault, entries)
        problems += check_trunk(vault)
    return problems


def check_layout(vault: Vault) -> list[str]:
    """Index against header and data: alignment, bounds, overlaps, section sizes, counts."""
    problems, h = [], vault.header
    if len(vault.entries) != h["blobs"] or len(vault.entries) != len(vault.meta["experts"]):
        problems.append(f"index lists {len(vault.meta['experts'])} blobs, header says {h['blobs']}")
    expected = len(vault.meta.get("moe_layers", [])) * vault.meta.get("num_experts", 0)
    if expected and expected != len(vault.entries):
        problems.append(f"index holds {len(vault.entries)} experts, model has {expected}")
    prev_end = h["data_offset"]
    for e in sorted(vault.entries.values(), key=lambda e: e.offset):
        where = f"layer {e.layer} expert {e.expert}"
        if e.offset % vault.alignment or e.offset < prev_end or e.offset + e.size > h["data_end"]:
            problems.append(f"{where}: blob at {e.offset}+{e.size} misaligned, overlapping or out of bounds")
        prev_end = e.offset + e.size
        for t in e.tensors:
            codes, scales = codec.encoded_nbytes(t.numel, t.bits)
            if (t.codes_nbytes, t.scales_nbytes) != (codes, scales) or max(
                t.codes_offset + t.codes_nbytes, t.scales_offset + t.scales_nbytes
            ) > e.size:
                problems.append(f"{where}: tensor {t.role} sections do not match shape {t.shape} at {t.bits} bits")
    return problems


def check_padding(vault: Vault, entries: list[ExpertEntry]) -> list[str]:
    """Bytes between blobs must be zero: a flipped byte there is damage too."""
    problems, pos = [], HEADER_SIZE
    gaps = []
    for e in entries:
        gaps.append((pos, e.offset))
        pos = e.offset + e.size
    gaps.append((pos, vault.header["data_end"]))
    for start, stop in gaps:
        if stop > start and any(os.pread(vault.fd, stop - start, start)):
            problems.append(f"non-zero bytes in padding between offsets {start} and {stop}")
    return problems


def check_trunk(vault: Vault) -> list[str]:
    expected = vault.meta.get("trunk_checksum")
    if not vault.trunk_path.exists():
        return [f"{vault.trunk_path} missing"]
    if expected and file_checksum(vault.trunk_path) != expected:
        return [f"{vault.trunk_path}: checksum mismatch (corrupt trunk)"]
    return []


def file_checksum(path: Path, chunk: int = 1 << 24) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# --- trunk (a safetensors file written as a stream) ---------------------------------------------

SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], load, progress=None) -> None:
    """Stream tensors into one safetensors file without holding them all: header first, then data.

    `specs` gives (name, dtype, shape) of every tensor in advance; `load(name)` returns one at a time.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in specs:
        nbytes = torch.empty(0, dtype=dtype).element_size()
        for s in shape:
            nbytes *= s
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (align(len(raw), 8) - len(raw))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape in progress(specs) if progress else specs:
            t = load(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise SmoeError(f"trunk tensor {name}: got {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
