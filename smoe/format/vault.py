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

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.dtypes import FLOAT_NAMES, FLOATS, SAFETENSORS
from smoe.format.jsonfile import parse_json
from smoe.format.safetensors_io import WRITABLE, Stored, load_tensors, read_entries
from smoe.format.vault_index import SECTION_ALIGNMENT, align, blob_layout, check_index

MAGIC = b"SMOEVLT\x00"
FORMAT_VERSION = 4
READ_VERSIONS = (2, 3, 4)  # how config.json carries the source's model type differs (docs/vault.md)
READS = ", ".join(map(str, READ_VERSIONS[:-1])) + f" and {READ_VERSIONS[-1]}"
HEADER = struct.Struct("<8sIIIIQQQQ")  # magic, version, group, bits, alignment, data_offset, data_end, blobs, index hash
HEADER_SIZE = HEADER.size + 8  # + xxh64 of the header fields
DEFAULT_ALIGNMENT = 4096
MAX_ALIGNMENT = 1 << 20
DATA_FILE = "experts.bin"
INDEX_FILE = "index.json"
TRUNK_FILE = "model.safetensors"  # the name transformers' loaders look for
CONFIG_FILE = "config.json"
COPIED_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
# files a runtime or transformers would read if present: each must be covered by the index
READ_FILES = frozenset(COPIED_FILES) | {TRUNK_FILE, "model.safetensors.index.json"}
QUANT_METHOD = "smoe"  # the quant_method of a vault's quantization_config as smoe hands it to transformers
VAULT_MODEL_TYPE = "smoe_vault"  # config.json's model_type from version 3: unknown to transformers without smoe
# config.json's quantization_config keys, by version, for the quantisation method and the source's model type.
# From version 4 neither is a key transformers reads: a model class named directly finds no nested `model_type`
# to take as its whole config, and no `quant_method`, which it refuses before reading a weight.
SEALED_KEYS = {2: ("quant_method", None), 3: ("quant_method", "model_type"),
               4: ("smoe_quant_method", "source_model_type")}
MAX_INDEX_BYTES_PER_BLOB = 4096  # a generous bound on one entry of index.json (bounded memory on open)


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
    def from_json(cls, d: dict) -> ExpertEntry:
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
    """Lay out one expert (docs/vault.md "A blob"): returns (bytes, tensor entries, bias entries)."""
    sections = [(t.codes.contiguous().numpy().tobytes(),
                 t.scales.to(torch.float16).contiguous().view(torch.int16).numpy().astype("<i2").tobytes()) for t in tensors]
    bias_raw = [(role, b, tensor_bytes(b)) for role, b in (biases or {}).items()]
    t_offsets, b_offsets, size = blob_layout([(len(c), len(s)) for c, s in sections], [len(r) for _, _, r in bias_raw])
    blob = bytearray(size)
    tensor_entries, bias_entries = [], []
    for t, (codes, scales), (c_off, s_off) in zip(tensors, sections, t_offsets):
        blob[c_off : c_off + len(codes)] = codes
        blob[s_off : s_off + len(scales)] = scales
        tensor_entries.append(TensorEntry(t.role, list(t.shape), t.bits, c_off, len(codes), s_off, len(scales)))
    for (role, b, raw), offset in zip(bias_raw, b_offsets):
        blob[offset : offset + len(raw)] = raw
        bias_entries.append(BiasEntry(role, FLOAT_NAMES[b.dtype], list(b.shape), offset, len(raw)))
    return bytes(blob), tensor_entries, bias_entries


def tensor_bytes(t: torch.Tensor) -> bytes:
    if t.dtype not in FLOAT_NAMES:
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
        dtype = FLOATS[b.dtype]
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
    if version == 1:
        raise SmoeError(f"{path}: vault format version 1, whose trunk and config files carry no checksum; "
                        f"this smoe reads versions {READS}: quantize the model again")
    if version not in READ_VERSIONS:
        raise SmoeError(f"{path}: vault format version {version}, this smoe reads versions {READS}")
    if group != codec.GROUP_SIZE:
        raise SmoeError(f"{path}: group size {group} unsupported (expected {codec.GROUP_SIZE})")
    aligned = SECTION_ALIGNMENT <= alignment <= MAX_ALIGNMENT and not alignment & (alignment - 1)
    if bits not in codec.DEPTHS or not aligned or data_offset != alignment:
        raise SmoeError(f"{path}: header gives bits {bits}, alignment {alignment}, data offset {data_offset} (expected "
                        f"bits in {codec.DEPTHS}, a power-of-two alignment up to {MAX_ALIGNMENT}, data offset = alignment)")
    if data_end % alignment or data_end < data_offset or blobs > (data_end - data_offset) // alignment:
        raise SmoeError(f"{path}: header's data end {data_end} and {blobs} blobs do not fit its alignment {alignment}")
    return {"version": version, "bits": bits, "alignment": alignment, "data_offset": data_offset,
            "data_end": data_end, "blobs": blobs, "index_hash": index_hash}


# --- writing -------------------------------------------------------------------------------------


class VaultWriter:
    """Appends blobs to DIR/experts.bin; `finish` writes the index and then the header.

    Every blob appended is also journalled (one JSON line, after its bytes are flushed), so a run
    that dies can resume from the blobs already written and verified. The journal line also keeps
    the caller's `source` digest of what the blob was encoded from; `sources` holds them on resume.
    """

    JOURNAL = "journal.jsonl"

    def __init__(self, directory: Path, bits: int, alignment: int = DEFAULT_ALIGNMENT):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bits = bits
        self.alignment = alignment
        self.sources: dict[tuple[int, int], str | None] = {}
        self.entries: list[ExpertEntry] = self._resume()
        self.data = open(self.dir / DATA_FILE, "r+b" if (self.dir / DATA_FILE).exists() else "w+b")
        self.journal = None
        self.keep(len(self.entries))

    def keep(self, count: int) -> None:
        """Drop every blob after the first `count` (data and journal): they are appended again."""
        for e in self.entries[count:]:
            self.sources.pop((e.layer, e.expert), None)
        del self.entries[count:]
        self.end = self._end_of_data()
        self.data.truncate(self.end)
        if self.journal is not None:
            self.journal.close()
        self.journal = open(self.dir / self.JOURNAL, "w")
        for e in self.entries:
            self._journal(e)

    def _journal(self, entry: ExpertEntry) -> None:
        line = entry.to_json() | {"source": self.sources.get((entry.layer, entry.expert))}
        self.journal.write(json.dumps(line) + "\n")
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
                    record = json.loads(line)
                    source = record.pop("source", None)
                    entry = ExpertEntry.from_json(record)
                except (ValueError, KeyError, TypeError):
                    break
                if checksum(os.pread(f.fileno(), entry.size, entry.offset)) != entry.checksum:
                    break
                good.append(entry)
                self.sources[(entry.layer, entry.expert)] = source
        return good

    def done(self) -> set[tuple[int, int]]:
        return {(e.layer, e.expert) for e in self.entries}

    def add(self, layer: int, expert: int, tensors: list[QuantisedTensor], biases=None,
            source: str | None = None) -> ExpertEntry:
        blob, t_entries, b_entries = build_blob(tensors, biases)
        offset = align(self.end, self.alignment)
        os.pwrite(self.data.fileno(), b"\0" * (offset - self.end) + blob, self.end)
        self.end = offset + len(blob)
        entry = ExpertEntry(layer, expert, offset, len(blob), checksum(blob), t_entries, b_entries)
        self.entries.append(entry)
        self.sources[(layer, expert)] = source
        self._journal(entry)
        return entry

    def finish(self, meta: dict) -> None:
        """Pad the data, seal config.json, list every other file of the directory with its checksum,
        write index.json, then the header that seals the index. The index is checked as a reader
        checks it before anything is sealed: a writer bug never yields a vault that fails to open."""
        data_end = align(self.end, self.alignment)
        os.pwrite(self.data.fileno(), b"\0" * (data_end - self.end), self.end)
        seal_config(self.dir, self.bits)
        index = layout_meta(self.entries) | dict(meta)
        index.update({
            "format": "smoe-vault", "version": FORMAT_VERSION, "group_size": codec.GROUP_SIZE,
            "bits": self.bits, "alignment": self.alignment, "checksum": "xxh3_64",
            "files": file_records(self.dir),
            "experts": [e.to_json() for e in sorted(self.entries, key=lambda e: (e.layer, e.expert))],
        })
        raw_index = json.dumps(index, indent=1).encode()
        header = pack_header(self.bits, self.alignment, data_end, len(self.entries), xxhash.xxh64_intdigest(raw_index))
        check_index(json.loads(raw_index), unpack_header(header, self.dir / DATA_FILE), str(self.dir / INDEX_FILE))
        (self.dir / INDEX_FILE).write_bytes(raw_index)
        os.pwrite(self.data.fileno(), header + b"\0" * (self.alignment - len(header)), 0)
        self.data.flush()
        os.fsync(self.data.fileno())
        self.close()
        (self.dir / self.JOURNAL).unlink()

    def close(self) -> None:
        self.data.close()
        self.journal.close()


def layout_meta(entries: list[ExpertEntry]) -> dict:
    """roles and expert_shapes as the blobs hold them (a caller's meta may give them too)."""
    if not entries:
        return {}
    tensors = entries[0].tensors
    return {"roles": [t.role for t in tensors], "expert_shapes": {t.role: list(t.shape) for t in tensors}}


def seal_config(directory: Path, bits: int) -> None:
    """Mark config.json as a vault's: `quantization_config` names smoe (a source's own no longer applies: the
    vault holds its tensors decoded) and the model type is `smoe_vault`, the source's kept in
    quantization_config, both under keys only smoe reads (SEALED_KEYS): transformers without smoe refuses the
    vault, through an Auto class or a model class named directly, instead of loading it wrong."""
    path = directory / CONFIG_FILE
    if path.exists():
        config = parse_json(path.read_bytes(), path)
        method_key, type_key = SEALED_KEYS[FORMAT_VERSION]
        config["quantization_config"] = {method_key: QUANT_METHOD, "format": "smoe-vault", "version": FORMAT_VERSION,
                                         "bits": bits, type_key: config.get("model_type")}
        config["model_type"] = VAULT_MODEL_TYPE
        path.write_text(json.dumps(config, indent=2) + "\n")


def file_records(directory: Path) -> dict[str, dict]:
    """Size and checksum of every file beside experts.bin and index.json."""
    skip = {DATA_FILE, INDEX_FILE, VaultWriter.JOURNAL}
    return {p.name: {"size": p.stat().st_size, "xxh3_64": file_checksum(p)}
            for p in sorted(directory.iterdir()) if p.is_file() and p.name not in skip}


# --- reading -------------------------------------------------------------------------------------


def quantize_hint(path: Path) -> str:
    """The command that makes a vault for `path`: from it, beside it, when it holds a model (never over it)."""
    if (path / "config.json").is_file():
        return f"smoe quantize {path} -o {path.parent / (path.name + '-q4')}"
    return f"smoe quantize MODEL_DIR -o {path}"


class Vault:
    """A vault directory opened for reading. Opening checks the header, every field of the index
    (smoe/format/vault_index.py) and the checksum of every listed file but the trunk (`check_trunk`, which
    reads it whole, is for the paths that load it); each blob is checked when it is read."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        data_path = self.dir / DATA_FILE
        if not self.dir.is_dir() or not data_path.is_file() or not (self.dir / INDEX_FILE).is_file():
            raise SmoeError(f"{self.dir}: not a vault (needs {DATA_FILE} and {INDEX_FILE}; make one with "
                            f"`{quantize_hint(self.dir)}`)")
        self.fd = os.open(data_path, os.O_RDONLY)
        try:
            self._open(data_path)
        except BaseException:  # a failed open keeps no descriptor: callers may retry in a loop
            os.close(self.fd)
            raise

    def _open(self, data_path: Path) -> None:
        self.header = unpack_header(os.pread(self.fd, HEADER_SIZE, 0), data_path)
        size = os.fstat(self.fd).st_size
        if size < self.header["data_end"]:
            raise SmoeError(f"{data_path}: truncated ({size} bytes, header says {self.header['data_end']})")
        self.meta = read_index(self.dir / INDEX_FILE, self.header)
        self.entries = {(e["layer"], e["expert"]): ExpertEntry.from_json(e) for e in self.meta["experts"]}
        self.config = check_files(self.dir, self.meta["files"], self.header["version"])

    @property
    def bits(self) -> int:
        return self.header["bits"]

    @property
    def alignment(self) -> int:
        return self.header["alignment"]

    @property
    def trunk_path(self) -> Path:
        return self.dir / TRUNK_FILE

    def check_trunk(self) -> dict[str, Stored]:
        """The trunk file against its checksum: one sequential read (measured in BENCHMARKS.md), made
        once when a model is opened, never per token; then its safetensors header, every tensor in a
        dtype a vault's trunk holds. Returns the trunk's tensors by name, as the header places them."""
        record = self.meta["files"].get(TRUNK_FILE)
        if record is None:
            raise SmoeError(f"{self.dir}: no {TRUNK_FILE} (the trunk) in the vault")
        if file_checksum(self.trunk_path) != record["xxh3_64"]:
            raise SmoeError(f"{self.trunk_path}: checksum mismatch (corrupt trunk)")
        entries = read_entries(self.trunk_path)
        for name, stored in entries.items():
            if SAFETENSORS[stored.dtype] not in WRITABLE:
                raise SmoeError(f"{self.trunk_path}: trunk tensor {name} is {stored.dtype}, a dtype no vault's trunk holds")
        return entries

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


def read_index(path: Path, header: dict) -> dict:
    """index.json, bound to the header by its hash and checked field by field, read with a size bound."""
    limit = (1 << 20) + MAX_INDEX_BYTES_PER_BLOB * header["blobs"]
    if path.stat().st_size > limit:
        raise SmoeError(f"{path}: {path.stat().st_size:,} bytes, more than {header['blobs']} blobs can need")
    raw = path.read_bytes()
    if xxhash.xxh64_intdigest(raw) != header["index_hash"]:
        raise SmoeError(f"{path}: does not match {DATA_FILE} (index hash mismatch)")
    index = parse_json(raw, path)
    check_index(index, header, str(path))
    return index


def check_files(directory: Path, files: dict, version: int = FORMAT_VERSION) -> dict | None:
    """Every listed file is present at its size and every one but the trunk matches its checksum;
    no file a reader would pick up is unlisted. Returns config.json as the model's configuration
    (without the vault's quantization_config), or None when the vault has none."""
    for name in sorted(READ_FILES - set(files)):
        if (directory / name).exists():
            raise SmoeError(f"{directory / name}: not covered by the index's checksums (added after quantizing?)")
    config = None
    for name, record in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != record["size"]:
            raise SmoeError(f"{path}: missing or not {record['size']:,} bytes as the index says")
        if name == TRUNK_FILE:
            continue
        raw = path.read_bytes()
        if checksum(raw) != record["xxh3_64"]:
            raise SmoeError(f"{path}: checksum mismatch (changed or corrupt since quantizing)")
        if name.endswith(".json") and name != CONFIG_FILE:
            parse_json(raw, path)  # before transformers reads it: a key given twice is refused here
        if name == CONFIG_FILE:
            config = parse_config(raw, path, version)
    return config


def parse_config(raw: bytes, path: Path, version: int = FORMAT_VERSION) -> dict:
    """The model's configuration: config.json without the vault's quantization_config, its model type the source's."""
    config = parse_json(raw, path)
    config = source_model_config(config, path, version)
    config.pop("quantization_config")
    return config


def source_model_config(config, path, version: int | None = None) -> dict:
    """A vault's config.json (parsed) as the source model's, its quantization_config as smoe's quantizer reads it
    (`quant_method: smoe`). `version` is the header's; without it (transformers' AutoConfig reads config.json
    alone), quantization_config's. From version 3 config.json's model type is `smoe_vault` and the source's is in
    quantization_config; version 2 kept the source's in place."""
    sealed = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(sealed, dict):
        raise SmoeError(f"{path}: not a vault's config (no quantization_config)")
    version = sealed.get("version") if version is None else version
    if version not in READ_VERSIONS:
        raise SmoeError(f"{path}: vault format version {version!r}, this smoe reads versions {READS}")
    method_key, type_key = SEALED_KEYS[version]
    if sealed.get("version") != version or sealed.get(method_key) != QUANT_METHOD:
        raise SmoeError(f"{path}: not a vault's config of format version {version} (its quantization_config "
                        f"needs version {version} and {method_key} {QUANT_METHOD!r})")
    quantization = {k: v for k, v in sealed.items() if k not in (method_key, type_key)} | {"quant_method": QUANT_METHOD}
    if type_key is None:
        return config | {"quantization_config": quantization}
    if config.get("model_type") != VAULT_MODEL_TYPE or not isinstance(sealed.get(type_key), str):
        raise SmoeError(f"{path}: a version-{version} vault's config has model_type {VAULT_MODEL_TYPE!r} and the "
                        f"source's in quantization_config.{type_key} (found {config.get('model_type')!r}, "
                        f"{sealed.get(type_key)!r})")
    return config | {"model_type": sealed[type_key], "quantization_config": quantization}


# what transformers gets wrong with a vault of an older format, which version 4 it refuses
OLDER_VERSION_RISKS = {
    2: "transformers without `import smoe` loads a version-2 vault with random experts",
    3: "a model class named directly, as in Qwen3MoeForCausalLM.from_pretrained(VAULT), builds that class's "
       "default-size model from a version-3 vault, with or without `import smoe`",
}


def version_notice(path: str | Path) -> str | None:
    """A line on the format of a vault whose header is sound when that format is an older one still read."""
    with open(Path(path) / DATA_FILE, "rb") as f:
        version = unpack_header(f.read(HEADER_SIZE), Path(path) / DATA_FILE)["version"]
    if version == FORMAT_VERSION:
        return None
    return (f"format version {version} (still read; quantize again for {FORMAT_VERSION}: "
            f"{OLDER_VERSION_RISKS[version]}, version {FORMAT_VERSION} it refuses)")


# --- verification --------------------------------------------------------------------------------


def verify(path: str | Path, progress=None) -> list[str]:
    """Every check a reader relies on; returns the problems found (empty: the vault is sound).
    Opening checks the header, the index and the small files; then every blob, padding and the trunk."""
    try:
        vault = Vault(path)
    except SmoeError as e:
        return [str(e)]
    with vault:
        problems = []
        entries = sorted(vault.entries.values(), key=lambda e: e.offset)
        for e in progress(entries) if progress else entries:
            try:
                vault.read_blob(e.layer, e.expert)
            except SmoeError as err:
                problems.append(str(err))
        problems += check_padding(vault, entries)
        try:
            problems += nonfinite_trunk_tensors(vault.trunk_path, vault.check_trunk())
        except SmoeError as err:
            problems.append(str(err))
    return problems


def nonfinite_trunk_tensors(path: Path, entries: dict[str, Stored]) -> list[str]:
    """A NaN or infinity in a trunk tensor (a norm weight, say) runs without a word and emits nonsense:
    name each one. Read one tensor at a time."""
    problems = []
    for name, stored in entries.items():
        (tensor,) = load_tensors(path, {name: stored}).values()
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            problems.append(f"{path}: trunk tensor {name} holds {bad} non-finite values (NaN or infinity)")
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


def file_checksum(path: Path, chunk: int = 1 << 24) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
