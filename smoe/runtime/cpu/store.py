"""The expert store: whole expert blobs read on demand into an LRU cache with a byte budget.

A MoE layer needs only the experts its router picks, so experts are read from the vault when asked
for. All experts a layer needs for the current tokens are requested together and their misses are
read in parallel on a thread pool: one read per expert (a blob is contiguous and aligned), checksum
verified, parsed, and passed through `prepare`, which turns the quantised tensors into whatever form
the compute kernels want. The prepared objects are cached, least recently used evicted first.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, wait

import torch

from smoe.format.vault import ExpertEntry, QuantisedTensor, Vault, parse_blob
from smoe.runtime.blobs import BlobReader, CacheStats

Prepare = Callable[[list[QuantisedTensor], dict[str, torch.Tensor]], tuple[object, int]]
Key = tuple[int, int]  # (layer, expert)


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
        self.stats = CacheStats()
        self._cache: OrderedDict[Key, tuple[object, int]] = OrderedDict()  # oldest first
        self._pending: dict[Key, Future] = {}  # reads submitted and not finished
        self._lock = threading.Lock()  # guards _cache, _pending, used_bytes and stats
        self.reader = BlobReader(vault, threads, direct_io, name="smoe-store")
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
        future = self.reader.submit(self._read_and_cache, entry)
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
        blob, seconds = self.reader.read(entry)
        tensors, biases = parse_blob(entry, blob)
        obj, nbytes = self.prepare(tensors, biases)
        return obj, int(nbytes), seconds

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
        self.reader.close()
        with self._lock:
            self._cache.clear()
            self.used_bytes = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
