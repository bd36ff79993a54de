"""The expert store: whole expert blobs read on demand into an LRU cache with a byte budget.

A MoE layer needs only the experts its router picks, so experts are read from the vault when asked
for. All experts a layer needs for the current tokens are requested together and their misses are
read in parallel on a thread pool: one read per expert (a blob is contiguous and aligned), checksum
verified, parsed, and passed through `prepare`, which turns the quantised tensors into whatever form
the compute kernels want. The prepared objects are cached, least recently used evicted first.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from smoe.errors import SmoeError
from smoe.format.vault import DATA_FILE, ExpertEntry, QuantisedTensor, Vault, align, parse_blob

Prepare = Callable[[list[QuantisedTensor], dict[str, torch.Tensor]], tuple[object, int]]
Key = tuple[int, int]  # (layer, expert)


@dataclass
class StoreStats:
    """Counters since the store was opened.

    misses: blobs read (by get or prefetch); hits: experts get() served without a new read (cached,
    or already being read by a prefetch). bytes_read counts blob bytes (an O_DIRECT read moves up to
    alignment - 1 more per blob). read_seconds is summed over the reading threads (read and
    checksum), so it can exceed wall time; wait_seconds is wall time get() spent blocked on reads.
    """

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


class ExpertStore:
    """Experts of a vault, read on demand and kept in an LRU cache of at most `cache_bytes`.

    `prepare(tensors, biases) -> (object, nbytes)` builds the compute form of one expert and says
    how many bytes it holds; it runs in the reading threads. get() may be called from one thread at
    a time; prefetched reads run concurrently with it.
    """

    def __init__(self, vault: Vault, cache_bytes: int, prepare: Prepare, threads: int = 16, direct_io: bool = False):
        self.vault = vault
        self.cache_bytes = int(cache_bytes)
        self.used_bytes = 0
        self.prepare = prepare
        self.stats = StoreStats()
        self._cache: OrderedDict[Key, tuple[object, int]] = OrderedDict()  # oldest first
        self._pending: dict[Key, Future] = {}  # reads submitted and not finished
        self._lock = threading.Lock()  # guards _cache, _pending, used_bytes and stats
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="smoe-store")
        self._direct_fd = open_direct(vault) if direct_io else None
        self._ratio: float | None = None

    # --- asking for experts ----------------------------------------------------------------------

    def get(self, layer: int, experts: list[int]) -> dict[int, object]:
        """expert -> prepared object for every expert asked for; misses are read in parallel.

        If a read fails the other reads of the call still finish (and are cached) before the first
        error is raised.
        """
        wanted = list(dict.fromkeys(experts))
        ready, reads = {}, {}
        with self._lock:
            for e in wanted:
                key = (layer, e)
                if key in self._cache:
                    self._cache.move_to_end(key)
                    ready[e] = self._cache[key][0]
                    self.stats.hits += 1
                elif key in self._pending:  # a prefetch is reading it: wait for that read, not a second one
                    reads[e] = self._pending[key]
                    self.stats.hits += 1
                else:
                    reads[e] = self._submit(key)
        if reads:
            start = time.perf_counter()
            wait(reads.values())
            with self._lock:
                self.stats.wait_seconds += time.perf_counter() - start
            for e, future in reads.items():
                ready[e] = future.result()  # re-raises a failed read
        return {e: ready[e] for e in wanted}

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Start reading the misses among `experts` without waiting; a later get() picks them up."""
        with self._lock:
            for e in dict.fromkeys(experts):
                key = (layer, e)
                if key in self._cache:
                    self._cache.move_to_end(key)  # about to be used: keep it away from eviction
                elif key not in self._pending:
                    self._submit(key)

    def __contains__(self, key: Key) -> bool:
        """Whether (layer, expert) is cached now."""
        with self._lock:
            return tuple(key) in self._cache

    # --- sizes -----------------------------------------------------------------------------------

    def expert_nbytes(self, layer: int) -> int:
        """Estimated prepared bytes of the layer's largest expert (see `min_budget`)."""
        return self.min_budget(1, layers=[layer])

    def min_budget(self, top_k: int, layers: list[int] | None = None) -> int:
        """Estimated bytes of the `top_k` largest prepared experts of any one layer.

        An estimate: blob sizes times the prepared-bytes-per-blob-byte ratio of the first expert,
        which is read and prepared once for this (not counted in stats). Exact when every expert
        prepares to a size proportional to its blob, as with same-shaped experts at one depth.
        """
        sizes: dict[int, list[int]] = {}
        for (layer, _), entry in self.vault.entries.items():
            if layers is None or layer in layers:
                sizes.setdefault(layer, []).append(entry.size)
        if not sizes:
            return 0
        largest = max(sum(sorted(s, reverse=True)[:top_k]) for s in sizes.values())
        return math.ceil(largest * self.prepare_ratio())

    def prepare_ratio(self) -> float:
        """Prepared bytes per blob byte, measured on the first expert of the vault."""
        if self._ratio is None:
            entry = self.vault.entries[min(self.vault.entries)]
            _, nbytes, _ = self._load(entry)
            self._ratio = nbytes / entry.size
        return self._ratio

    # --- reading (runs in the pool's threads) ----------------------------------------------------

    def _submit(self, key: Key) -> Future:
        """Queue one read; the caller holds the lock, so the pending entry exists before it finishes."""
        entry = self.vault.entry(*key)  # an unknown expert fails here, in the caller's thread
        self.stats.misses += 1
        future = self._pool.submit(self._read_and_cache, entry)
        self._pending[key] = future
        return future

    def _read_and_cache(self, entry: ExpertEntry) -> object:
        key = (entry.layer, entry.expert)
        try:
            obj, nbytes, seconds = self._load(entry)
        except BaseException:
            with self._lock:
                del self._pending[key]
            raise
        with self._lock:
            del self._pending[key]
            self.stats.bytes_read += entry.size
            self.stats.read_seconds += seconds
            self._insert(key, obj, nbytes)
        return obj

    def _load(self, entry: ExpertEntry) -> tuple[object, int, float]:
        """(prepared object, its bytes, seconds spent reading and checking the blob)."""
        start = time.perf_counter()
        try:
            blob = self._read_direct(entry) if self._direct_fd is not None else self.vault.read_blob(entry.layer, entry.expert)
        except OSError as err:
            raise SmoeError(f"{self.vault.dir}: layer {entry.layer} expert {entry.expert}: read failed ({err})") from None
        seconds = time.perf_counter() - start
        tensors, biases = parse_blob(entry, blob)
        obj, nbytes = self.prepare(tensors, biases)
        return obj, int(nbytes), seconds

    def _read_direct(self, entry: ExpertEntry) -> memoryview:
        """One O_DIRECT read of the aligned blob into a page-aligned buffer, trimmed and checked.

        O_DIRECT bypasses the page cache (the store is the cache) but needs an aligned buffer, offset
        and length: anonymous mmaps are page aligned, blobs start on the vault's alignment.
        """
        buf = mmap.mmap(-1, align(entry.size, self.vault.alignment))
        got = os.preadv(self._direct_fd, [buf], entry.offset)
        blob = memoryview(buf)[: min(got, entry.size)]
        self.vault.check_blob(entry, blob)
        return blob  # parse_blob copies it, so the buffer is freed with the last view

    def _insert(self, key: Key, obj: object, nbytes: int) -> None:
        """Cache an expert, evicting the least recently used until it fits; the caller holds the lock.

        An expert bigger than the whole budget is not cached (and evicts nothing): get() returns it
        all the same.
        """
        if key in self._cache:
            self.used_bytes -= self._cache.pop(key)[1]
        if nbytes > self.cache_bytes:
            return
        while self.used_bytes + nbytes > self.cache_bytes:
            _, (_, freed) = self._cache.popitem(last=False)
            self.used_bytes -= freed
            self.stats.evictions += 1
        self._cache[key] = (obj, nbytes)
        self.used_bytes += nbytes

    # --- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the reading threads (queued prefetches are dropped) and free the cache."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        with self._lock:
            self._cache.clear()
            self.used_bytes = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_direct(vault: Vault) -> int:
    """A file descriptor on the vault's data opened with O_DIRECT, or a SmoeError saying why not."""
    path = vault.dir / DATA_FILE
    if vault.alignment % mmap.PAGESIZE:
        raise SmoeError(f"{path}: direct I/O needs blobs aligned to the page size ({mmap.PAGESIZE}), "
                        f"this vault aligns to {vault.alignment}")
    if not hasattr(os, "O_DIRECT"):
        raise SmoeError("direct I/O (O_DIRECT) is not available on this system")
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as err:  # some filesystems (tmpfs before Linux 6.6) refuse O_DIRECT
        raise SmoeError(f"{path}: this filesystem refuses direct I/O ({err.strerror})") from None


def default_cache_bytes(vault: Vault, prepare_ratio: float = 1.0) -> int:
    """Half the memory available now, capped at what all experts need.

    `prepare_ratio` is prepared bytes per blob byte (ExpertStore.prepare_ratio), for a cap that
    counts experts in their prepared form.
    """
    everything = sum(e.size for e in vault.entries.values()) * prepare_ratio
    return int(min(mem_available() // 2, everything))


def mem_available() -> int:
    """Bytes of memory available without swapping: MemAvailable, or free pages where /proc is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
