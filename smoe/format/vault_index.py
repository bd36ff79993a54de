"""index.json's schema: every field a reader relies on, checked when a vault is opened.

A crafted or buggy index must give a one-line error, never an out-of-bounds read nor a silently
wrong expert. The blob layout is a function of the shapes and bits (`blob_layout`, which the writer
uses too), so each entry's offsets and sizes are compared with exactly what they must be, and the
blobs must tile the data region without overlapping, one per (layer, expert).
"""

from __future__ import annotations

import re

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.dtypes import FLOATS

SECTION_ALIGNMENT = 64  # codes / scales / biases start on 64-byte boundaries inside a blob
ROLE_SETS = (["gate", "up", "down"], ["up", "down"])
BIAS_DTYPE_BYTES = {n: t.itemsize for n, t in FLOATS.items()}
MAX_DIM = 1 << 24  # far above any real projection, far below sizes that overflow the arithmetic
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 14
HEX16 = re.compile(r"[0-9a-f]{16}\Z")
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")

REQUIRED = {
    "format": str, "version": int, "group_size": int, "bits": int, "alignment": int, "checksum": str,
    "moe_layers": list, "num_experts": int, "roles": list, "expert_shapes": dict, "files": dict, "experts": list,
}
OPTIONAL = {
    "smoe_version": str, "family": str, "model_type": str, "top_k": (int, type(None)), "encoder": str,
    "source": dict,
}
ENTRY_KEYS = {"layer", "expert", "offset", "size", "checksum", "tensors", "biases"}
TENSOR_KEYS = {"role", "shape", "bits", "codes_offset", "codes_nbytes", "scales_offset", "scales_nbytes"}
BIAS_KEYS = {"role", "dtype", "shape", "offset", "nbytes"}


def align(n: int, to: int) -> int:
    return -(-n // to) * to


def blob_layout(tensors: list[tuple[int, int]], biases: list[int]) -> tuple[list[tuple[int, int]], list[int], int]:
    """Where each section of a blob goes: tensors are (code bytes, scale bytes), biases byte counts.
    Returns ((codes offset, scales offset) per tensor, offset per bias, blob size)."""
    end, tensor_offsets, bias_offsets = 0, [], []

    def place(nbytes: int) -> int:
        nonlocal end
        start = align(end, SECTION_ALIGNMENT)
        end = start + nbytes
        return start

    for codes, scales in tensors:
        tensor_offsets.append((place(codes), place(scales)))
    for nbytes in biases:
        bias_offsets.append(place(nbytes))
    return tensor_offsets, bias_offsets, end


def check_index(index, header: dict, where: str) -> None:
    """Raise a SmoeError naming the first field of `index` (parsed index.json) that a reader cannot trust."""
    fail = lambda msg: SmoeError(f"{where}: {msg}")
    if not isinstance(index, dict):
        raise fail("not a JSON object")
    check_keys(index, REQUIRED, OPTIONAL, "index", fail)
    for key, expected in (("format", "smoe-vault"), ("group_size", codec.GROUP_SIZE), ("checksum", "xxh3_64"),
                          ("bits", header["bits"]), ("alignment", header["alignment"]),
                          ("version", header["version"])):
        if index[key] != expected:
            raise fail(f"{key} is {index[key]!r}, expected {expected!r}")
    layers = check_layers(index["moe_layers"], fail)
    experts = check_int(index["num_experts"], 1, MAX_EXPERTS, "num_experts", fail)
    if index.get("top_k") is not None:
        check_int(index["top_k"], 1, experts, "top_k", fail)
    roles = index["roles"]
    if roles not in ROLE_SETS:
        raise fail(f"roles {roles!r} are not one of {ROLE_SETS}")
    shapes = check_shapes(index["expert_shapes"], roles, fail)
    check_files(index["files"], fail)
    entries = index["experts"]
    if len(entries) != header["blobs"] or len(entries) != len(layers) * experts:
        raise fail(f"{len(entries)} expert entries; the header says {header['blobs']} blobs and "
                   f"moe_layers × num_experts is {len(layers) * experts}")
    previous = None
    for i, entry in enumerate(entries):
        check_entry(entry, f"experts[{i}]", set(layers), experts, roles, shapes, fail)
        key = (entry["layer"], entry["expert"])
        if previous is not None and key <= previous:  # smoe lists them by (layer, expert): an edit shows here
            raise fail(f"experts[{i}]: layer {key[0]} expert {key[1]} is listed twice or out of (layer, expert) "
                       f"order, after layer {previous[0]} expert {previous[1]}")
        previous = key
    check_tiling(entries, header, fail)


def check_keys(d: dict, required: dict, optional: dict, what: str, fail) -> None:
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise fail(f"{what}: unknown key {unknown[0]!r}")
    for key, types in required.items():
        if key not in d:
            raise fail(f"{what}: missing key {key!r}")
    for key, types in (required | optional).items():
        if key in d and not is_type(d[key], types):
            raise fail(f"{what}: {key} has type {type(d[key]).__name__}")


def is_type(value, types) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):  # JSON true/false are not counts
        return bool in types
    return isinstance(value, types)


def check_int(value, low: int, high: int, what: str, fail) -> int:
    if not is_type(value, int) or not low <= value <= high:
        raise fail(f"{what} is {value!r}, expected an integer in {low}..{high}")
    return value


def check_ints(values: list, what: str, fail) -> None:
    """Offsets, sizes and dimensions are JSON integers: 4096.0 would compare equal and then fail a read."""
    if not all(is_type(v, int) and v >= 0 for v in values):
        raise fail(f"{what}: offsets, sizes, bits and dimensions must be non-negative integers")


def list_or_empty(value) -> list:
    return value if isinstance(value, list) else []


def check_layers(layers: list, fail) -> list[int]:
    if not layers or len(layers) > MAX_LAYERS:
        raise fail(f"moe_layers lists {len(layers)} layers")
    for layer in layers:
        check_int(layer, 0, MAX_LAYERS, "a moe_layers entry", fail)
    if layers != sorted(set(layers)):
        raise fail("moe_layers are not distinct and ascending")
    return layers


def check_shapes(shapes: dict, roles: list[str], fail) -> dict[str, list[int]]:
    if sorted(shapes) != sorted(roles):
        raise fail(f"expert_shapes has roles {sorted(shapes)}, expected {sorted(roles)}")
    for role, shape in shapes.items():
        if not isinstance(shape, list) or len(shape) != 2:
            raise fail(f"expert_shapes[{role!r}] is not [out, in]")
        for dim in shape:
            check_int(dim, 1, MAX_DIM, f"expert_shapes[{role!r}]", fail)
    return shapes


def check_files(files: dict, fail) -> None:
    for name, record in files.items():
        if not FILE_NAME.match(name) or name in ("experts.bin", "index.json"):
            raise fail(f"files: {name!r} is not a file name a vault holds")
        if not isinstance(record, dict) or set(record) != {"size", "xxh3_64"}:
            raise fail(f"files[{name!r}] must be {{'size', 'xxh3_64'}}")
        check_int(record["size"], 0, 1 << 50, f"files[{name!r}].size", fail)
        if not isinstance(record["xxh3_64"], str) or not HEX16.match(record["xxh3_64"]):
            raise fail(f"files[{name!r}].xxh3_64 is not 16 hex digits")


def check_entry(entry, where: str, layers: set[int], experts: int, roles: list[str], shapes: dict, fail) -> None:
    if not isinstance(entry, dict):
        raise fail(f"{where} is not an object")
    check_keys(entry, {k: object for k in ENTRY_KEYS}, {}, where, fail)
    for key in ("layer", "expert", "offset", "size"):
        check_int(entry[key], 0, 1 << 62, f"{where}.{key}", fail)
    if entry["layer"] not in layers or entry["expert"] >= experts:
        raise fail(f"{where}: layer {entry['layer']} expert {entry['expert']} is not in the model")
    where = f"layer {entry['layer']} expert {entry['expert']}"
    if not isinstance(entry["checksum"], str) or not HEX16.match(entry["checksum"]):
        raise fail(f"{where}: checksum is not 16 hex digits")
    tensors, biases = entry["tensors"], entry["biases"]
    if not isinstance(tensors, list) or not isinstance(biases, list):
        raise fail(f"{where}: tensors and biases must be lists")
    if [t.get("role") if isinstance(t, dict) else None for t in tensors] != roles:
        raise fail(f"{where}: tensors are not the roles {roles} in order")
    sections = [check_tensor(t, shapes[t["role"]], where, fail) for t in tensors]
    bias_bytes = [check_bias(b, roles, shapes, where, fail) for b in biases]
    if len({b["role"] for b in biases}) != len(biases):
        raise fail(f"{where}: a bias role is listed twice")
    tensor_offsets, bias_offsets, size = blob_layout(sections, bias_bytes)
    laid = [(t["codes_offset"], t["scales_offset"]) for t in tensors]
    if laid != tensor_offsets or [b["offset"] for b in biases] != bias_offsets or entry["size"] != size:
        raise fail(f"{where}: section offsets or blob size differ from the layout its shapes and bits imply")


def check_tensor(t: dict, shape: list[int], where: str, fail) -> tuple[int, int]:
    check_keys(t, {k: object for k in TENSOR_KEYS}, {}, f"{where} {t['role']}", fail)
    check_ints([t[k] for k in TENSOR_KEYS - {"role", "shape"}] + list_or_empty(t["shape"]), f"{where} {t['role']}", fail)
    if t["shape"] != shape:
        raise fail(f"{where} {t['role']}: shape {t['shape']!r}, expert_shapes says {shape}")
    if t["bits"] not in codec.DEPTHS or isinstance(t["bits"], bool):
        raise fail(f"{where} {t['role']}: bits {t['bits']!r}, expected one of {codec.DEPTHS}")
    codes, scales = codec.encoded_nbytes(shape[0] * shape[1], t["bits"])
    if (t["codes_nbytes"], t["scales_nbytes"]) != (codes, scales):
        raise fail(f"{where} {t['role']}: section sizes do not match shape {shape} at {t['bits']} bits")
    return codes, scales


def check_bias(b, roles: list[str], shapes: dict, where: str, fail) -> int:
    if not isinstance(b, dict):
        raise fail(f"{where}: a bias is not an object")
    check_keys(b, {k: object for k in BIAS_KEYS}, {}, f"{where} bias", fail)
    check_ints([b["offset"], b["nbytes"]] + list_or_empty(b["shape"]), f"{where} bias", fail)
    if b["role"] not in roles or b["dtype"] not in BIAS_DTYPE_BYTES or b["shape"] != [shapes[b["role"]][0]]:
        raise fail(f"{where}: bias {b['role']!r} ({b['dtype']!r}, {b['shape']!r}) does not fit the expert")
    nbytes = BIAS_DTYPE_BYTES[b["dtype"]] * b["shape"][0]
    if b["nbytes"] != nbytes:
        raise fail(f"{where}: bias {b['role']} holds {b['nbytes']!r} bytes, its shape and dtype imply {nbytes}")
    return nbytes


def check_tiling(entries: list[dict], header: dict, fail) -> None:
    """Blobs start on the alignment, lie inside the data region and never overlap."""
    end = header["data_offset"]
    for e in sorted(entries, key=lambda e: e["offset"]):
        where = f"layer {e['layer']} expert {e['expert']}"
        if e["offset"] % header["alignment"] or e["offset"] < end or e["offset"] + e["size"] > header["data_end"]:
            raise fail(f"{where}: blob at {e['offset']}+{e['size']} is misaligned, overlaps another "
                       "or lies outside the data")
        end = e["offset"] + e["size"]
