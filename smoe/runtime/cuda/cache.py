"""Routed experts in fixed GPU slots, fed from disk and an optional host-RAM tier through pinned memory.

Three places an expert can be, fastest first:

* a GPU slot: one `pool` tensor cut into fixed slots (the largest blob, 64-byte aligned), LRU over
  (layer, expert); the Triton kernels read a blob straight from its slot by byte offset;
* a host slot: page-locked (pinned) memory, LRU as well. With `host_bytes` it is a cache of its own
  (`--cache-gb`); without, a small ring of staging slots. Pinned memory matters: the copy engine
  reads it at ~55 GB/s on an H200, pageable memory at ~7 GB/s;
* the vault: read by a thread pool of `os.pread` (or O_DIRECT `preadv` into the pinned slot, which
  is page aligned) and checksum-verified before any byte reaches the GPU.

Copies run on a side stream, so reads of later experts and copies of earlier ones overlap; the
compute stream waits for them with an event, never the host. A slot is reused only after the work
that read it is done: a GPU slot's copy waits for the compute stream as it is now (the kernels that
last read the slot were enqueued before), a host slot's reuse waits for its last copy's event.

When the host tier holds every expert, misses need not be copied at all: the kernels read them in place
over the link (offset_of gives either kind of address), and the GPU slots hold the experts moved there by
smoe.runtime.cuda.placement (place).

On a CPU "device" (tests without a GPU) the same code runs with plain memory and synchronous copies, the
GPU slots and the host tier in one buffer.
"""

from __future__ import annotations

import mmap
import time
from collections import OrderedDict
from concurrent.futures import as_completed

import torch

from smoe.errors import SmoeError
from smoe.format.vault import Vault, align
from smoe.runtime.blobs import BlobReader, CacheStats

SLOT_ALIGNMENT = 64  # the kernels read codes as 32-bit words: a blob must start on 64 bytes (kernels_triton)
STAGING_SLOTS = 32  # host slots when there is no host tier: enough to keep a layer's reads in flight


class SlotLRU:
    """Which (layer, expert) sits in which of `n` slots, least recently used first."""

    def __init__(self, n: int):
        self.slots: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.free = list(range(n - 1, -1, -1))

    def get(self, key) -> int | None:
        slot = self.slots.get(key)
        if slot is not None:
            self.slots.move_to_end(key)
        return slot

    def take(self, key, keep: set) -> int:
        """A slot for `key`: a free one, else the least recently used one not in `keep`."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k in self.slots if k not in keep), None)
            if victim is None:
                raise SmoeError("internal: every slot is in use by the current call")
            slot = self.slots.pop(victim)
        self.slots[key] = slot
        return slot

    def drop(self, key) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self.free.append(slot)


def blob_slot_bytes(vault: Vault) -> int:
    return align(max(e.size for e in vault.entries.values()), SLOT_ALIGNMENT)


def min_gpu_budget(vault: Vault, top_k: int) -> int:
    """Bytes of the smallest GPU cache that holds one token's experts of a layer."""
    return top_k * blob_slot_bytes(vault)


class GpuExpertCache:
    """get_offsets(layer, experts) -> byte offsets of the experts' blobs in `pool`, reading misses."""

    def __init__(self, vault: Vault, gpu_bytes: int, device: torch.device, top_k: int, host_bytes: int = 0,
                 threads: int = 16, direct_io: bool = False):
        self.vault, self.device = vault, torch.device(device)
        self.slot_bytes = blob_slot_bytes(vault)
        self.n_slots = min(int(gpu_bytes) // self.slot_bytes, len(vault.entries))
        if self.n_slots < top_k:
            need = min_gpu_budget(vault, top_k)
            raise SmoeError(f"a GPU expert cache of {int(gpu_bytes):,} bytes (--gpu-cache-gb) is smaller than one "
                            f"token's {top_k} experts of a layer: at least {need / 1e9:.4g} GB ({need:,} bytes) is needed")
        self.cuda = self.device.type == "cuda"
        self.host_tier = host_bytes > 0
        n_host = min(int(host_bytes) // self.slot_bytes, len(vault.entries)) if self.host_tier else 0
        n_host = max(n_host, min(STAGING_SLOTS, len(vault.entries)))
        # host slots start on page boundaries and hold a whole aligned read, for O_DIRECT
        host_slot = align(self.slot_bytes, max(vault.alignment, mmap.PAGESIZE))
        gpu_part = self.n_slots * self.slot_bytes
        if self.cuda:
            self.pool = allocate(gpu_part, self.device, "GPU expert cache", "--gpu-cache-gb")
            self.host = allocate(n_host * host_slot, torch.device("cpu"), "host expert cache", "--cache-gb",
                                 pinned=True).view(n_host, host_slot)
        else:  # one buffer, GPU slots first: a host slot's offset from the pool's start is valid, as in-place reads need
            start = align(gpu_part, host_slot)
            self.pool = allocate(start + n_host * host_slot, self.device, "expert cache", "--gpu-cache-gb")
            self.host = self.pool[start:].view(n_host, host_slot)
        self.gpu = SlotLRU(self.n_slots)
        self.host_lru = SlotLRU(n_host)
        # one view per slot, made once: slicing per copy costs more host time than the copy call itself
        self.gpu_views = list(self.pool[:gpu_part].view(self.n_slots, self.slot_bytes).unbind(0))
        self.host_views = [self.host[i, :self.slot_bytes] for i in range(n_host)]
        self.host_events: list = [None] * n_host  # the last copy out of each host slot
        self.copied_from: list[int] = []  # host slots copied since the last mark_copies
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = CacheStats()
        self.reader = BlobReader(vault, threads, direct_io, name="smoe-gpu-read")

    # --- asking for experts ----------------------------------------------------------------------

    def offsets(self, layer: int, experts: list[int]) -> list[int]:
        """Byte offsets in `pool` of the experts' blobs (in the order asked), after reading the misses.
        The compute stream is made to wait for the copies; the host does not."""
        wanted = list(dict.fromkeys(experts))
        if len(wanted) > self.n_slots:
            raise SmoeError(f"layer {layer}: {len(wanted)} experts asked at once, the GPU cache holds {self.n_slots}")
        keep = {(layer, e) for e in wanted}
        slots, missing = {}, []
        for e in wanted:
            slot = self.gpu.get((layer, e))
            if slot is None:
                missing.append(e)
            else:
                slots[e] = slot
                self.stats.hits += 1
        if missing:
            slots.update(self.fill(layer, missing, keep))
        return [slots[e] * self.slot_bytes for e in experts]

    def fill(self, layer: int, experts: list[int], keep: set) -> dict[int, int]:
        """Bring missing experts into GPU slots; returns expert -> GPU slot."""
        placed, wave = {}, len(self.host)  # a wave stages at most one expert per host slot
        if self.stream is None:
            for start in range(0, len(experts), wave):
                placed.update(self.fill_wave(layer, experts[start:start + wave], keep))
            return placed
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # kernels enqueued so far may still read the slots about to be overwritten
        with torch.cuda.stream(self.stream):  # the copies below go to the side stream
            for start in range(0, len(experts), wave):
                placed.update(self.fill_wave(layer, experts[start:start + wave], keep))
        compute.wait_stream(self.stream)
        return placed

    def fill_wave(self, layer: int, experts: list[int], keep: set) -> dict[int, int]:
        placed, reads = {}, {}
        staged = {(layer, e) for e in experts}  # host slots of this wave stay until their copies are issued
        for e in experts:
            key = (layer, e)
            gslot = self.gpu.take(key, keep)
            placed[e] = gslot
            self.stats.misses += 1
            hslot = self.host_lru.get(key)
            if hslot is not None:  # in the host tier: copy it up
                self.stats.host_hits += 1
                self.copy_up(hslot, gslot)
                continue
            hslot = self.host_lru.take(key, staged)
            self.wait_host_slot(hslot)
            entry = self.vault.entry(layer, e)
            reads[self.reader.submit(self.read_into, entry, hslot)] = (key, hslot, gslot, entry)
        start = time.perf_counter()
        failure = None
        for future in as_completed(reads):
            key, hslot, gslot, entry = reads[future]
            try:
                self.stats.read_seconds += future.result()
            except BaseException as err:  # keep the caches consistent: the slot holds nothing valid
                self.host_lru.drop(key)
                self.gpu.drop(key)
                failure = failure or err
                continue
            self.stats.bytes_read += entry.size
            self.copy_up(hslot, gslot)
        self.stats.wait_seconds += time.perf_counter() - start
        self.mark_copies()
        if failure is not None:
            raise failure
        return placed

    def copy_up(self, hslot: int, gslot: int) -> None:
        """Host slot -> GPU slot, whole slots (a blob and its padding), on the side stream (see fill). One copy
        per expert: one gather kernel per wave reading the mapped pinned slots measured slower (BENCHMARKS.md)."""
        self.gpu_views[gslot].copy_(self.host_views[hslot], non_blocking=self.stream is not None)
        if self.stream is not None:
            self.copied_from.append(hslot)
        self.stats.bytes_copied += self.slot_bytes

    def mark_copies(self) -> None:
        """One event after a wave's copies guards every host slot they read from."""
        if self.stream is not None and self.copied_from:
            event = torch.cuda.Event()
            event.record(self.stream)
            for hslot in self.copied_from:
                self.host_events[hslot] = event
            self.copied_from = []

    def wait_host_slot(self, hslot: int) -> None:
        event = self.host_events[hslot]
        if event is not None:
            event.synchronize()
            self.host_events[hslot] = None

    # --- every expert in host RAM: misses read in place (smoe.runtime.cuda.placement) -------------

    def holds_all_in_host(self) -> bool:
        """Whether the host tier has room for every expert of the vault."""
        return self.host_tier and len(self.host) >= len(self.vault.entries)

    def fill_host(self) -> None:
        """Read every expert the host tier lacks into it, until it is full ("experts in host RAM")."""
        keys = [key for key in sorted(self.vault.entries) if key not in self.host_lru.slots]
        keys = keys[: len(self.host) - len(self.host_lru.slots)]
        reads = [self.reader.submit(self.read_into, self.vault.entries[key], self.host_lru.take(key, set()))
                 for key in keys]
        failure = None
        for key, future in zip(keys, reads):
            try:
                future.result()
                self.stats.bytes_read += self.vault.entries[key].size
            except BaseException as err:  # the slot holds nothing valid: forget it, report the first failure
                self.host_lru.drop(key)
                failure = failure or err
        if failure is not None:
            raise failure

    def offset_of(self, key) -> int:
        """The byte offset from `pool`'s start at which the kernels find expert `key`: its GPU slot, else its
        host slot (pinned memory the GPU reads over the link: with unified addressing a host pointer is a device
        pointer, so the difference of the two addresses is a valid offset). The expert must be in one of them."""
        slot = self.gpu.slots.get(key)
        if slot is not None:
            return slot * self.slot_bytes
        return self.host_views[self.host_lru.slots[key]].data_ptr() - self.pool.data_ptr()

    def place(self, incoming, outgoing) -> list:
        """GPU slots for the experts `incoming` (in the host tier), freed from the experts `outgoing` (resident)
        first; copies on the side stream after the compute stream's work so far (the last reads of the freed
        slots). Returns the event after the copies (None on a CPU device, where they are done)."""
        for key in outgoing:
            self.gpu.drop(key)
            self.stats.evictions += 1
        copies = [(self.host_lru.slots[key], self.gpu.take(key, set())) for key in incoming]
        if self.stream is None:
            for hslot, gslot in copies:
                self.copy_up(hslot, gslot)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for hslot, gslot in copies:
                self.copy_up(hslot, gslot)
            self.copied_from = []  # host-tier slots of resident experts are never reused: no guard needed
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    # --- reading (runs in the reader threads) ----------------------------------------------------

    def read_into(self, entry, hslot: int) -> float:
        """Read the blob into host slot `hslot` and check it; returns seconds."""
        return self.reader.read_into(entry, memoryview(self.host[hslot].numpy()))[1]

    # --- lifetime --------------------------------------------------------------------------------

    def resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.gpu.slots

    def close(self) -> None:
        self.reader.close()


def allocate(nbytes: int, device: torch.device, what: str, option: str, pinned: bool = False) -> torch.Tensor:
    """uint8 buffer; running out of memory is a one-line error naming the option that sizes it."""
    try:
        if device.type == "cpu" and not pinned:  # page aligned (O_DIRECT), as pinned memory is
            return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if "out of memory" not in str(err).lower() and not isinstance(err, torch.OutOfMemoryError):
            raise
        raise SmoeError(f"out of memory allocating the {what} ({nbytes / 1e9:.3g} GB); use a smaller {option}") from None
