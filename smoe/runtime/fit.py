"""`smoe inspect`'s "will it fit?": the memory running a model takes on this machine's CPU, and the speed
its disk allows, for a vault or for a checkpoint at each depth it could be quantised to.

Sizes are the runtime's own: experts in the form the CPU expert store prepares them, the minimum
cache as opening computes it (ExpertStore.min_budget), the trunk at the compute dtype, the KV cache
as the decoder that would run holds it. Speeds are disk-bound ceilings: a token reads the experts it
misses, and with a share f of all experts cached, uniform routing misses 1 - f of them.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.dtypes import TORCH_NAMES
from smoe.format.vault import DATA_FILE, QuantisedTensor, Vault, align
from smoe.runtime.cpu import kernels as kernels_cpu
from smoe.runtime.cpu.store import ExpertStore, mem_available
from smoe.runtime.layers import ACT
from smoe.runtime.weights import fast_decoder_gap
from smoe.source.checkpoint import open_checkpoint
from smoe.source.description import ModelDescription, describe_model
from smoe.source.inspect import DEFAULT_DISK_GBPS, DEPTHS, human_bytes

SHARES = (0.25, 0.5, 1.0)
MEASURE_BYTES = 256 * 2**20  # enough to leave the drive's latency behind, little enough to take well under a second
MEASURE_THREADS = 16  # the runtime's default parallel expert reads (--threads)


# --- disk --------------------------------------------------------------------------------------------


def read_bandwidth(path: Path, block: int, budget: int = MEASURE_BYTES, threads: int = MEASURE_THREADS) -> dict:
    """GB/s reading `path` in blocks of `block` bytes (an expert's blob) spread over the file, on `threads`
    threads as the expert store reads, with O_DIRECT so that the page cache does not answer."""
    size = path.stat().st_size
    block = min(align(max(block, 1), mmap.PAGESIZE), align(size, mmap.PAGESIZE))
    slots = max(size // block, 1)
    count = max(1, min(budget // block, slots))
    offsets = [(k * slots // count) * block for k in range(count)]
    try:
        fd, how = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), "O_DIRECT"
    except OSError:  # a file system without O_DIRECT (tmpfs)
        fd, how = os.open(path, os.O_RDONLY), "buffered (no O_DIRECT here: the page cache may answer)"
    local = threading.local()

    def read(offset: int) -> int:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
        return os.preadv(fd, [local.buf], offset)

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            start = time.perf_counter()
            done = sum(pool.map(read, offsets))
            seconds = time.perf_counter() - start
    except OSError as e:
        raise SmoeError(f"{path}: cannot read it to measure the disk ({e.strerror})") from e
    finally:
        os.close(fd)
    return {"gbps": done / seconds / 1e9, "from": f"measured: {human_bytes(done)} of {path.name} in blocks of "
            f"{human_bytes(block)}, {how}, {threads} threads"}


def disk_speed(path: Path, report: dict, given: float | None) -> dict:
    """--disk-gbps when given; else measured on the vault's experts.bin or the checkpoint's largest weight
    file; where there is nothing to read (an index or a bare config), DEFAULT_DISK_GBPS, said so."""
    if given is not None:
        return {"gbps": given, "from": "--disk-gbps"}
    if report["source"] == "vault":
        return read_bandwidth(path / DATA_FILE, report["expert_bytes"]["vault"])
    files = open_checkpoint(path).weight_files() if report["source"] == "weights" else []
    if not files or not report["expert_bytes"].get("q4"):
        return {"gbps": DEFAULT_DISK_GBPS, "from": "assumed, a PCIe 4 NVMe drive (no weight files here to measure "
                "on): pass --disk-gbps"}
    return read_bandwidth(max(files, key=lambda f: f.stat().st_size), report["expert_bytes"]["q4"])


# --- memory ------------------------------------------------------------------------------------------


def prepared_expert_bytes(shapes: dict[str, tuple[int, int]], bits: int, dtype: torch.dtype) -> int:
    """Bytes one expert holds in the CPU store's compute form (one prepared all-zero expert of these shapes)."""
    tensors = []
    for role, (o, i) in shapes.items():
        groups = codec.num_groups(o * i)
        codes = torch.zeros(groups, codec.packed_group_bytes(bits), dtype=torch.uint8)
        tensors.append(QuantisedTensor(role, (o, i), bits, codes, torch.ones(groups, dtype=torch.float16)))
    return kernels_cpu.prepare_expert(tensors, {}, dtype, "auto", fuse=True).nbytes


def vault_cache_sizes(path: Path, dtype: torch.dtype) -> dict:
    """The vault's minimum cache, as opening refuses a smaller one, and all its experts, prepared."""
    with Vault(path) as vault:
        prepare = lambda tensors, biases: (p := kernels_cpu.prepare_expert(tensors, biases, dtype, "auto",
                                                                           fuse=True), p.nbytes)
        store = ExpertStore(vault, 0, prepare, threads=1)
        try:
            minimum = store.min_budget(vault.meta.get("top_k") or 1)
            everything = store.prepare_ratio() * sum(e.size for e in vault.entries.values())
        finally:
            store.close()
    return {"min_cache_bytes": minimum, "all_experts_bytes": round(everything)}


def checkpoint_cache_sizes(report: dict, bits: int, dtype: torch.dtype) -> dict:
    """The same for a checkpoint quantised at `bits`: its experts all have one shape."""
    shapes = {r: tuple(s) for r, s in report["expert_shapes"].items()}
    one = prepared_expert_bytes(shapes, bits, dtype)
    return {"min_cache_bytes": one * (report["experts_per_token"] or 1),
            "all_experts_bytes": one * report["moe_layers"] * report["experts_per_layer"]}


def kv_cache(config: dict, positions: int | None, dtype: torch.dtype) -> dict:
    """KV-cache bytes at `positions` as the CPU decoder that `--decoder auto` picks holds it: the fast
    decoder keeps K and V in fp32 for every layer at full length, the generic one (transformers' cache) at
    the compute dtype, sliding layers within their window, MLA layers as their latent."""
    try:
        description = describe_model(config)
    except SmoeError as e:
        return {"bytes": None, "why": str(e)}
    a = description.attention
    if not positions:
        return {"bytes": None, "why": "the config gives no context length: pass --ctx"}
    if a.kind == "mla":
        return mla_kv_cache(description, positions, dtype)
    if a.kind != "gqa":
        return {"bytes": None, "why": f"not estimated for {a.kind} attention"}
    per_position = 2 * a.kv_heads * a.head_dim
    if fast_decoder_gap(description) is None:
        layers = description.num_layers
        return {"bytes": per_position * ACT.itemsize * positions * layers, "positions": positions,
                "decoder": "fast"}
    attending = [i for i in range(description.num_layers) if i not in a.mixer_layers]
    held = sum(min(positions, a.sliding_window) if i in a.sliding_layers else positions for i in attending)
    return {"bytes": per_position * dtype.itemsize * held, "positions": positions, "decoder": "generic"}


def mla_kv_cache(d: ModelDescription, positions: int, dtype: torch.dtype) -> dict:
    """MLA's cache: per layer and position, the compressed K/V latent and the rotary key all heads share.
    The fast CPU decoder keeps them in fp32 (smoe.runtime.kv.Latents) and never expands K and V; the generic
    decoder's transformers modules cache the same two at the compute dtype and expand K and V per head at
    each step, never keeping them."""
    a = d.attention
    if d.model_type == "deepseek_v32":  # keeps its indexer's keys besides, and K/V expanded in some releases
        return {"bytes": None, "why": "not estimated for DeepSeek-V3.2's sparse attention"}
    if not a.latent_dim:
        return {"bytes": None, "why": "the config gives no kv_lora_rank"}
    per_position = a.latent_dim + a.rope_key_dim
    fast = fast_decoder_gap(d) is None
    return {"bytes": per_position * (ACT if fast else dtype).itemsize * positions * d.num_layers,
            "positions": positions, "decoder": "fast" if fast else "generic"}


# --- the report ----------------------------------------------------------------------------------------


def fit_report(path: Path, report: dict, config: dict, disk: dict, ctx: int | None = None,
               dtype: str = "bfloat16") -> dict:
    """Trunk, KV cache, free RAM and, per depth, the cache sizes with the disk-bound tok/s of each (at
    `disk`, from disk_speed) and the --cache-gb that fits."""
    torch_dtype = TORCH_NAMES[dtype]
    params = (report.get("trunk") or {}).get("params")
    trunk = params * torch_dtype.itemsize if params is not None else None
    positions = ctx or report.get("context_length")
    kv = kv_cache(config, positions, torch_dtype)
    available = mem_available()
    room = available - trunk - (kv["bytes"] or 0) if trunk is not None else None
    labels = ["vault"] if report["source"] == "vault" else [d for d, bits in DEPTHS.items() if bits]
    depths = {}
    for label in labels:
        per_token = report["bytes_per_token_uncached"].get(label)
        if not per_token:  # the config gives no expert sizes or no top-k
            continue
        sizes = (vault_cache_sizes(path, torch_dtype) if label == "vault"
                 else checkpoint_cache_sizes(report, DEPTHS[label], torch_dtype))
        depths[label] = sizes | {"read_bytes_per_token": per_token,
                                 "caches": cache_rows(sizes, per_token, disk["gbps"]),
                                 "cache_gb_that_fits": fitting_cache(room, sizes)}
    return {"dtype": dtype, "disk": disk, "trunk_resident_bytes": trunk, "kv_cache": kv,
            "available_ram_bytes": available, "room_for_cache_bytes": room, "depths": depths}


def cache_rows(sizes: dict, read_per_token: int, gbps: float) -> list[dict]:
    """The minimum cache and SHARES of all experts, each with its disk-bound tok/s (None once nothing is read)."""
    everything = sizes["all_experts_bytes"]
    rows = [("minimum", sizes["min_cache_bytes"])] + [(f"{100 * s:.0f}%", s * everything) for s in SHARES]
    out = []
    for label, nbytes in rows:
        missed = max(0.0, 1 - nbytes / everything) * read_per_token if everything else read_per_token
        tps = gbps * 1e9 / missed if missed else None
        out.append({"cache": label, "bytes": round(nbytes), "tokens_per_second": tps})
    return out


def fitting_cache(room: int | None, sizes: dict) -> float | None:
    """--cache-gb that fits beside the trunk and the KV cache (at most every expert); None when not even
    the minimum does, or the trunk's size is unknown."""
    if room is None or room < sizes["min_cache_bytes"]:
        return None
    return min(room, sizes["all_experts_bytes"]) / 1e9


def format_fit(f: dict) -> str:
    gb = human_bytes
    disk = f"{f['disk']['gbps']:.3g} GB/s"
    kv = f["kv_cache"]
    kv_line = (f"{gb(kv['bytes'])} at {kv['positions']:,} positions ({kv['decoder']} decoder)" if kv["bytes"] is not None
               else f"unknown ({kv['why']})")
    room = "unknown (the trunk's size is unknown)" if f["room_for_cache_bytes"] is None else \
        gb(max(f["room_for_cache_bytes"], 0)) + ("" if kv["bytes"] is not None else " (KV cache not counted)")
    lines = [
        f"will it fit          (CPU, {f['dtype']})",
        f"  disk               {disk} ({f['disk']['from']})",
        f"  trunk resident     {gb(f['trunk_resident_bytes'])}",
        f"  KV cache           {kv_line}",
        f"  available RAM      {gb(f['available_ram_bytes'])}; left for the expert cache {room}",
        f"{'':21}{'cache':>12}{'tok/s':>10}   (disk-bound ceiling; uniform routing)",
    ]
    for label, d in f["depths"].items():
        fits = (f"--cache-gb {d['cache_gb_that_fits']:.4g} fits" if d["cache_gb_that_fits"] is not None
                else "fit unknown" if f["room_for_cache_bytes"] is None else "does not fit: not even the minimum cache")
        lines.append(f"  {label:<19}{'':22}   {fits}")
        for row in d["caches"]:
            tps = f"{row['tokens_per_second']:>10,.1f}" if row["tokens_per_second"] else f"{'no reads':>10}"
            lines.append(f"    {row['cache']:<17}{gb(row['bytes']):>12}{tps}")
    return "\n".join(lines)
