"""A Hugging Face model directory, read without memory-mapping.

Tensor bytes are read with positioned reads (os.preadv) at the offsets in the safetensors headers, so
only the bytes asked for enter process memory: a memory-mapped read would leave every touched page
resident and count against the bounded-RSS goal. Positioned reads keep no file offset, so one
Checkpoint may be shared between threads.

Quantised sources are presented under their logical names (see names()) and dequantised on load
through smoe.source.quantised.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from smoe.errors import SmoeError
from smoe.format.dtypes import SAFETENSORS, SAFETENSORS_NAMES, TORCH_NAMES
from smoe.format.jsonfile import read_json
from smoe.format.safetensors_io import Stored, pread_exact, read_entries, read_header
from smoe.source import quantised as source_quant

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
CONFIG = "config.json"

# Stored dtypes whose values are the tensor's real values; the others need scales to mean anything.
REAL_DTYPES = {"BF16", "F16", "F32", "F64"}
PLAIN_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64", "F8_E4M3": "fp8_e4m3"}
CONFIG_DTYPES = {name: PLAIN_FORMATS[SAFETENSORS_NAMES[t]] for name, t in TORCH_NAMES.items()}


# Tensor-name endings of quantisation formats we cannot dequantise, and what to call them.
UNSUPPORTED_PARTS = {
    ".qweight": "gptq/awq",
    ".qzeros": "gptq/awq",
    ".g_idx": "gptq",
    ".weight_g_idx": "compressed-tensors activation ordering",
    ".absmax": "bitsandbytes",
    ".quant_map": "bitsandbytes",
    ".SCB": "bitsandbytes",
}


FLOATS = {"F32", "F16", "BF16"}
INT32 = {"I32", "U32"}  # a packed bitstream: read as bytes, so either signedness holds the same bits
# The dtypes each quantised format stores its parts in: any other is a different format whose bytes
# would be reinterpreted, not read.
PART_DTYPES = {
    "mlx_affine": {"weight": INT32, "scales": FLOATS, "biases": FLOATS},
    "compressed": {"packed": INT32, "scale": FLOATS, "shape": {"I64", "I32", "I16", "I8", "U8"}, "zero_point": INT32},
    "fp8_block": {"weight": {"F8_E4M3", "F8_E5M2"}, "scale_inv": FLOATS | {"F8_E8M0"}},
    "mxfp4": {"blocks": {"U8"}, "scales": {"U8", "F8_E8M0"}},
}


@dataclass(frozen=True)
class _Logical:
    """One logical tensor: its format (None = stored as is) and stored parts by role."""

    format: str | None
    parts: dict[str, str]


class Checkpoint:
    """A model dir, an index-only dir, or a bare config.json file; see docs/ARCHITECTURE.md."""

    def __init__(self, path: str | Path):
        self._fds: dict[Path, int] = {}
        self._stored: dict[str, Stored] = {}
        self._index_total: int | None = None
        self._bin_weights = False
        self._shapes: dict[str, tuple[int, ...]] = {}
        path = Path(path)
        if path.is_file():
            self.dir = path.parent
            self.config = read_json(path)
            stored_names: list[str] = []
        elif path.is_dir():
            self.dir = path
            self.config = self._read_config()
            stored_names = self._scan_weights()
        elif path.exists():  # a device, a pipe or a socket: nothing a model is stored in
            raise SmoeError(f"{path}: not a regular file or directory (expected a model directory or its config.json)")
        else:
            raise SmoeError(f"{path}: no such file or directory")
        self.has_weights = bool(self._stored)
        self._quant = _Quant.from_config(self.config)
        self._logical = _collapse(stored_names, self._quant)
        if self.has_weights:
            self._check_part_dtypes()

    def _read_config(self) -> dict:
        if (self.dir / CONFIG).is_file():
            return read_json(self.inside(CONFIG))
        if (self.dir / SAFETENSORS_INDEX).is_file() or (self.dir / BIN_INDEX).is_file():
            return {}
        raise SmoeError(f"{self.dir}: no {CONFIG} (expected a Hugging Face model directory)")

    def _scan_weights(self) -> list[str]:
        """Find the weight files and read their headers (or the index); return the stored tensor names."""
        d = self.dir
        if (d / SAFETENSORS_INDEX).is_file():
            return self._scan_sharded()
        if (d / SAFETENSORS_SINGLE).is_file():
            self._stored = read_entries(self.inside(SAFETENSORS_SINGLE))
            return list(self._stored)
        if (d / BIN_INDEX).is_file():
            self._bin_weights = True
            weight_map, self._index_total = _read_index(self.inside(BIN_INDEX))
            return list(weight_map)
        if (d / BIN_SINGLE).is_file():
            raise SmoeError(f"{d}: weights are in {BIN_SINGLE}; convert the checkpoint to safetensors first")
        return []

    def _scan_sharded(self) -> list[str]:
        weight_map, self._index_total = _read_index(self.inside(SAFETENSORS_INDEX))
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            self.inside(shard, f"{SAFETENSORS_INDEX} lists shard")
        missing = [s for s in shards if not (self.dir / s).is_file()]
        if len(missing) == len(shards):
            return list(weight_map)  # index only: names without weights
        if missing:
            raise SmoeError(f"{self.dir}: {len(missing)} of {len(shards)} shards listed in {SAFETENSORS_INDEX} "
                            f"are missing (first: {missing[0]})")
        headers = {s: read_entries(self.dir / s) for s in shards}
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise SmoeError(f"{self.dir / shard}: has no tensor {name!r} "
                                f"although {SAFETENSORS_INDEX} lists it there")
            self._stored[name] = headers[shard][name]
        return list(weight_map)

    def inside(self, relative: str, what: str = "file") -> Path:
        """DIR/relative, refused unless it is inside the model directory, symlinks resolved: an index
        or a link must not make smoe read (or copy into a vault) a file from elsewhere."""
        rel = Path(relative)
        path = self.dir / rel
        if rel.is_absolute() or ".." in rel.parts:
            raise SmoeError(f"{self.dir}: {what} {relative!r} is outside the model directory (smoe reads only files in it)")
        real = path.resolve()
        if not (real.is_relative_to(self.dir.resolve()) or _in_hub_blobs(path, real)):
            raise SmoeError(f"{self.dir}: {what} {relative!r} is a link to {real}, outside the model directory "
                            f"(smoe reads only files in it)")
        return path

    @property
    def location(self) -> Path:
        """What the checkpoint was opened from, for the vault's record: its directory."""
        return self.dir

    def weight_files(self) -> list[Path]:
        """The safetensors files the tensors are read from."""
        return sorted({s.file for s in self._stored.values()})

    def weight_headers(self) -> list[tuple[str, bytes]]:
        """(file name relative to the directory, its safetensors header) of each weight file."""
        return [(str(path.relative_to(self.dir)), read_header(path)[0]) for path in self.weight_files()]

    def _check_part_dtypes(self) -> None:
        for name, logical in self._logical.items():
            fmt = "compressed" if (logical.format or "").startswith("compressed_int") else logical.format
            for role, stored in logical.parts.items():
                dtype = self._stored[stored].dtype
                allowed = PART_DTYPES.get(fmt, {}).get(role)
                if allowed is not None and dtype not in allowed:
                    raise SmoeError(f"tensor {stored}: the {role} part of {logical.format} tensor {name} is stored as "
                                    f"{dtype}, the format stores {'/'.join(sorted(allowed))} (refusing to reinterpret it)")

    def check_real_valued(self, name: str, what: str = "tensor") -> None:
        """Refuse a tensor whose stored values are not its real values: integers, bools or 8-bit floats
        with no scales are a quantised format smoe does not recognise, or one whose scales are missing."""
        logical = self._get(name)
        if logical.format or not self.has_weights:
            return
        dtype = self._stored[logical.parts["tensor"]].dtype
        if dtype in REAL_DTYPES:
            return
        if dtype.startswith("F8"):
            why = "8-bit floats with no scales (fp8 needs its weight_scale_inv and the config's weight_block_size)"
        else:
            why = "integers with no scales, not weights (a quantisation smoe does not recognise, or its scales are missing)"
        raise SmoeError(f"{what} {name} is stored as {dtype}: {why}; dequantise the checkpoint to bf16 first")

    # ----- queries -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Logical tensor names, sorted; quantisation parts collapsed into one name."""
        return sorted(self._logical)

    def source_format(self, name: str) -> str:
        """How the tensor is stored: bf16/fp16/fp32/... or mlx_affine, compressed_int4, fp8_block, mxfp4."""
        logical = self._get(name)
        if logical.format:
            return logical.format
        if self.has_weights:
            dtype = self._stored[logical.parts["tensor"]].dtype
            return PLAIN_FORMATS.get(dtype, dtype.lower())
        # Index only: the dtypes are unknown, so assume the one the config declares.
        for source in (self.config, self.config.get("text_config") or {}):
            declared = source.get("torch_dtype") or source.get("dtype")
            if declared:
                return CONFIG_DTYPES.get(declared, "unknown")
        return "unknown"

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Logical (dequantised) shape; None without weights."""
        logical = self._get(name)
        if not self.has_weights:
            return None
        parts = {role: self._stored[stored] for role, stored in logical.parts.items()}
        if logical.format == "mlx_affine":
            bits, _ = self._quant.mlx_params(name)
            packed = parts["weight"].shape
            return packed[:-1] + (packed[-1] * 32 // bits,)
        if logical.format == "mxfp4":
            blocks = parts["blocks"].shape
            return blocks[:-2] + (blocks[-2] * source_quant.MXFP4_BLOCK,)
        if logical.format and logical.format.startswith("compressed_int"):
            return self._compressed_shape(name, logical)
        first = "tensor" if logical.format is None else "weight"
        return parts[first].shape

    def dtype(self, name: str) -> torch.dtype | None:
        """The dtype load() returns: bf16 for quantised sources, else the stored dtype; None without weights."""
        logical = self._get(name)
        if not self.has_weights:
            return None
        if logical.format:
            return torch.bfloat16
        return SAFETENSORS[self._stored[logical.parts["tensor"]].dtype]

    def stored_nbytes(self, name: str) -> int | None:
        """Bytes of all stored parts of the tensor (from the headers; no data read)."""
        logical = self._get(name)
        if not self.has_weights:
            return None
        return sum(self._stored[stored].nbytes for stored in logical.parts.values())

    def smoe_codes(self, name: str, bits: int) -> None:
        """A safetensors checkpoint holds no SMOE codes to keep (a GGUF may: smoe.source.gguf)."""
        return None

    def total_nbytes(self) -> int | None:
        """Bytes of all stored tensors: from the headers, else the index's metadata total_size."""
        if self.has_weights:
            return sum(s.nbytes for s in self._stored.values())
        return self._index_total

    # ----- loading -------------------------------------------------------------------------------

    def load(self, name: str, index: int | None = None, digest=None) -> torch.Tensor:
        """The logical tensor (bf16 for quantised sources, else as stored); index=i: only the dim-0 slice [i],
        reading only that slice's bytes (and its rows of scales / zero points). `digest` (an xxhash object)
        is fed every byte read, so a caller can later prove the source unchanged."""
        logical = self._get(name)
        if not self.has_weights:
            if self._bin_weights:
                raise SmoeError(f"{self.dir}: weights are PyTorch .bin files; "
                                f"convert the checkpoint to safetensors first")
            raise SmoeError(f"{self.dir}: no weight files (index or config only); cannot load {name!r}")
        if logical.format is None:
            return self._read(logical.parts["tensor"], index, digest)
        try:
            return self._dequantise(name, logical, index, digest)
        except ValueError as e:
            raise SmoeError(f"{self.dir}: {name}: {e}") from None

    def _dequantise(self, name: str, logical: _Logical, index: int | None, digest=None) -> torch.Tensor:
        parts, fmt = logical.parts, logical.format
        # Row i of a 2-D FP8-block or compressed-tensors matrix shares its scale or zero-point row with
        # neighbouring rows: read the rows it needs and dequantise a one-row matrix.
        one_row = index is not None and fmt not in ("mlx_affine", "mxfp4") and len(self.shape(name)) == 2

        def read(role: str, row: int | None = index) -> torch.Tensor:
            t = self._read(parts[role], row, digest)
            return t.unsqueeze(0) if one_row else t

        if fmt == "mlx_affine":
            bits, group_size = self._quant.mlx_params(name)
            return source_quant.dequant_mlx_affine(read("weight"), read("scales"), read("biases"), bits, group_size)
        if fmt == "mxfp4":
            return source_quant.dequant_mxfp4(read("blocks"), read("scales"))
        if fmt == "fp8_block":
            block = self._quant.fp8_block
            scale_row = index // block[0] if one_row else index
            w = source_quant.dequant_fp8_block(read("weight"), read("scale_inv", scale_row), block)
            return w[0] if one_row else w
        bits = self._quant.int_bits
        shape = self._compressed_shape(name, logical)
        if digest is not None:
            digest.update(repr(shape).encode())  # read from the file once per process, so as current as the rest
        if index is not None:
            shape = (1, shape[1]) if one_row else shape[1:]
        zero_point = None
        if "zero_point" in parts:
            rows_per_word = 32 // bits
            zero_point = read("zero_point", index // rows_per_word if one_row else index)
            if one_row:
                zero_point = source_quant.packed_row_first(zero_point, bits, index % rows_per_word)
        w = source_quant.dequant_compressed_int(
            read("packed"), read("scale"), shape, bits, self._quant.int_group_size, zero_point
        )
        return w[0] if one_row else w

    def _compressed_shape(self, name: str, logical: _Logical) -> tuple[int, ...]:
        """compressed-tensors keeps the true shape as tensor data (weight_shape): a tiny read, cached."""
        if name not in self._shapes:
            self._shapes[name] = tuple(int(d) for d in self._read(logical.parts["shape"]).tolist())
        return self._shapes[name]

    def _read(self, stored_name: str, index: int | None = None, digest=None) -> torch.Tensor:
        """Read one stored tensor (or its dim-0 slice `index`) with positioned reads."""
        stored = self._stored[stored_name]
        shape, start, nbytes = stored.shape, stored.start, stored.nbytes
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise IndexError(f"{stored_name}: index {index} out of range for shape {shape}")
            nbytes //= shape[0]
            start += index * nbytes
            shape = shape[1:]
        dtype = SAFETENSORS[stored.dtype]
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        buf = self._pread(stored.file, start, nbytes)
        if digest is not None:
            digest.update(buf)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def _pread(self, file: Path, start: int, nbytes: int) -> bytearray:
        fd = self._fds.get(file)
        if fd is None:
            fd = os.open(file, os.O_RDONLY)
            # Another thread may have opened the same file meanwhile: keep one handle.
            kept = self._fds.setdefault(file, fd)
            if kept != fd:
                os.close(fd)
                fd = kept
        return pread_exact(fd, start, nbytes, file)

    def _get(self, name: str) -> _Logical:
        try:
            return self._logical[name]
        except KeyError:
            raise SmoeError(f"{self.dir}: no tensor named {name!r}") from None

    # ----- file handles --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the cached shard file handles (reopened on the next load)."""
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def open_checkpoint(path: str | Path):
    """The checkpoint at `path`: a GGUF file (smoe.source.gguf; trunk tensors under their llama.cpp names),
    else a Hugging Face model directory or config file. smoe.hf.gguf.open_source also names a GGUF's trunk
    and rebuilds its tokenizer, for quantizing."""
    from smoe.source.gguf import GgufCheckpoint, is_gguf

    return GgufCheckpoint(path) if is_gguf(path) else Checkpoint(path)


# ----- source quantisation config ----------------------------------------------------------------


@dataclass(frozen=True)
class _Quant:
    """The checkpoint's declared quantisation: what the names alone cannot tell (bits, group sizes)."""

    config: dict  # the quantization / quantization_config dict ({} when none)
    fp8_block: tuple[int, int] = (128, 128)
    int_bits: int = 4
    int_group_size: int | None = None

    @classmethod
    def from_config(cls, config: dict) -> "_Quant":
        qc = _quant_config(config)
        method = qc.get("quant_method")
        if not qc or _is_mlx(qc):
            return cls(qc)
        if method == "fp8":
            block = qc.get("weight_block_size")
            if not block:
                raise SmoeError("unsupported source quantisation 'fp8' without weight_block_size (per-tensor FP8)")
            return cls(qc, fp8_block=(int(block[0]), int(block[1])))
        if method == "compressed-tensors":
            bits, group_size = _compressed_params(qc)
            return cls(qc, int_bits=bits, int_group_size=group_size)
        if method in ("mxfp4", None):
            return cls(qc)  # mxfp4 needs no parameters; no method and not MLX: the names decide
        raise SmoeError(f"unsupported source quantisation {method!r} (supported: MLX affine, compressed-tensors "
                        f"pack-quantized, fp8 block, mxfp4); dequantise the checkpoint to bf16 first")

    def mlx_params(self, name: str) -> tuple[int, int]:
        """(bits, group_size) for one MLX tensor; MLX may override them per module in the same dict."""
        module = self.config.get(name.removesuffix(".weight"))
        params = module if isinstance(module, dict) else self.config
        return int(params["bits"]), int(params["group_size"])


def _quant_config(config: dict) -> dict:
    for source in (config, config.get("text_config") or {}):
        qc = source.get("quantization_config") or source.get("quantization")
        if isinstance(qc, dict):
            return qc
    return {}


def _is_mlx(qc: dict) -> bool:
    """MLX writes {"group_size", "bits", "mode"?} with no quant_method."""
    if "quant_method" in qc or "bits" not in qc or "group_size" not in qc:
        return False
    mode = qc.get("mode", "affine")
    if mode != "affine":
        raise SmoeError(f"unsupported source quantisation 'mlx {mode}' (only MLX affine is supported)")
    return True


def _compressed_params(qc: dict) -> tuple[int, int | None]:
    """(num_bits, group_size or None) shared by all compressed-tensors config groups."""
    bits, sizes = set(), set()
    for group in (qc.get("config_groups") or {}).values():
        fmt = group.get("format") or qc.get("format")
        weights = group.get("weights") or {}
        if fmt != "pack-quantized" or weights.get("type", "int") != "int":
            raise SmoeError(f"unsupported source quantisation 'compressed-tensors {fmt}' "
                            f"(only pack-quantized integer weights are supported)")
        bits.add(int(weights.get("num_bits", 4)))
        sizes.add(weights.get("group_size"))
    if len(bits) > 1:
        raise SmoeError(f"unsupported source quantisation 'compressed-tensors' with mixed bit widths {sorted(bits)}")
    return (bits.pop() if bits else 4), (sizes.pop() if len(sizes) == 1 else None)


# ----- logical names -----------------------------------------------------------------------------


def _collapse(stored_names: list[str], quant: _Quant) -> dict[str, _Logical]:
    """Group stored tensors into logical ones; every stored tensor belongs to exactly one."""
    names = set(stored_names)
    for name in names:
        for ending, fmt in UNSUPPORTED_PARTS.items():
            if name.endswith(ending):
                raise SmoeError(f"unsupported source quantisation {fmt!r} (tensor {name}); "
                                f"dequantise the checkpoint to bf16 first")
    logical: dict[str, _Logical] = {}
    for name in sorted(names):
        found = _quantised(name, names, quant)
        if found:
            logical_name, fmt, parts = found
            missing = [p for p in parts.values() if p not in names]
            if missing:
                raise SmoeError(f"{fmt} tensor {logical_name} lacks its part {missing[0]}")
            logical[logical_name] = _Logical(fmt, parts)
    claimed = {p for lg in logical.values() for p in lg.parts.values()}
    for name in names - claimed:
        if name.endswith(".weight_scale"):
            raise SmoeError(f"unsupported source quantisation: {name} scales a weight in a format not supported")
        if name in logical:
            raise SmoeError(f"tensor {name} is stored both plain and quantised")
        logical[name] = _Logical(None, {"tensor": name})
    return logical


def _quantised(name: str, names: set[str], quant: _Quant) -> tuple[str, str, dict[str, str]] | None:
    """If `name` is the anchor part of a quantised tensor: (logical name, format, parts by role)."""
    if name.endswith(".weight_packed"):
        stem = name.removesuffix("_packed")
        parts = {"packed": name, "scale": stem + "_scale", "shape": stem + "_shape"}
        if stem + "_zero_point" in names:
            parts["zero_point"] = stem + "_zero_point"
        return stem, f"compressed_int{quant.int_bits}", parts
    if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in names:
        base = name.removesuffix("_scale_inv")
        return base, "fp8_block", {"weight": base, "scale_inv": name}
    if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in names:
        base = name.removesuffix("_blocks")
        return base, "mxfp4", {"blocks": name, "scales": base + "_scales"}
    if name.endswith(".scales") and name.removesuffix(".scales") + ".weight" in names:
        stem = name.removesuffix(".scales")
        if not _is_mlx(quant.config):
            raise SmoeError(f"{name} looks MLX-quantised but the config has no MLX 'quantization' (bits, group_size)")
        return stem + ".weight", "mlx_affine", {"weight": stem + ".weight", "scales": name, "biases": stem + ".biases"}
    return None


# ----- files -------------------------------------------------------------------------------------


def _in_hub_blobs(link: Path, real: Path) -> bool:
    """A link into a Hugging Face hub cache's content store (models--ORG--NAME/blobs/SHA): how every
    file of a cache snapshot (and of an older `--local-dir` download) is stored."""
    return link.is_symlink() and real.parent.name == "blobs" and real.parent.parent.name.startswith("models--")


def _read_index(path: Path) -> tuple[dict[str, str], int | None]:
    """weight_map and metadata total_size of a *.index.json."""
    index = read_json(path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SmoeError(f"{path}: no weight_map mapping tensor names to files")
    total = (index.get("metadata") or {}).get("total_size")
    return weight_map, int(total) if total is not None else None
