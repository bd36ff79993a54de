"""Reading expert blobs, shared by every device's expert cache: one pool of reader threads, pread or
O_DIRECT, the checksum check, and one statistics type.

A blob is contiguous and aligned, so an expert costs one read. Reads never go through mmap page
faults: a fault stalls the compute thread and cannot be overlapped; a pread on a pool thread can.
O_DIRECT skips the page cache (the cache above is the cache) but needs page-aligned buffers,
offsets and lengths.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

from smoe import numeric
from smoe.errors import SmoeError
from smoe.format.vault import DATA_FILE, ExpertEntry, Vault, align


@dataclass
class CacheStats:
    """Counters of one expert cache since it was opened.

    hits: experts served without a new read; misses: experts read from the vault (or, on a GPU cache
    with a host tier, copied up from host RAM: host_hits of them). bytes_read counts blob bytes (an
    O_DIRECT read moves up to alignment - 1 more); bytes_copied host -> GPU; bytes_in_place: blob bytes
    the GPU kernels read straight from pinned host RAM (smoe.runtime.cuda.placement). read_seconds is
    summed over the reading threads, so it can exceed wall time; wait_seconds is the caller's wall time
    blocked on reads.
    """

    hits: int = 0
    misses: int = 0
    host_hits: int = 0
    bytes_read: int = 0
    bytes_copied: int = 0
    bytes_in_place: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"hit_rate": self.hit_rate}


class BlobReader:
    """Checked reads of a vault's expert blobs on `threads` reader threads."""

    def __init__(self, vault: Vault, threads: int = 16, direct_io: bool = False, name: str = "smoe-read"):
        problem = numeric.THREADS.problem(threads)  # the CLI checked --threads; the Python API passes it here
        if problem:
            raise SmoeError(f"threads (parallel expert reads): {problem}")
        self.vault, self.threads = vault, threads
        self.direct_fd = open_direct(vault) if direct_io else None
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        # the entries read, in the order their reads finished, while a caller keeps a list here (`smoe bench
        # decode` reads a cold row's blobs again to measure the rate the disk allows for exactly those reads)
        self.log: list[ExpertEntry] | None = None

    def submit(self, fn, *args) -> Future:
        try:
            return self.pool.submit(fn, *args)
        except RuntimeError as err:  # the pool starts threads on demand, here; a refused one is only this message
            if "can't start new thread" not in str(err):
                raise
            raise SmoeError(f"cannot start an expert reader thread ({self.threads} asked for): the process "
                            f"limit on threads is reached (ulimit -u, or the container's pids limit); "
                            f"use fewer reader threads (--threads, threads= in smoe.load)") from None

    def read(self, entry: ExpertEntry) -> tuple[memoryview | bytes, float]:
        """(the checked blob, seconds spent reading and checking it), in a buffer of its own."""
        if self.direct_fd is None:
            return self._timed(entry, lambda: os.pread(self.vault.fd, entry.size, entry.offset))
        buf = mmap.mmap(-1, align(entry.size, self.vault.alignment))  # anonymous mmaps are page aligned
        return self.read_into(entry, memoryview(buf))

    def read_into(self, entry: ExpertEntry, buf: memoryview) -> tuple[memoryview, float]:
        """Read into `buf` (page aligned and holding the aligned length, for O_DIRECT); (blob view, seconds)."""
        if self.direct_fd is not None:
            got = lambda: buf[: os.preadv(self.direct_fd, [buf[: align(entry.size, self.vault.alignment)]], entry.offset)]
        else:
            got = lambda: buf[: os.preadv(self.vault.fd, [buf[: entry.size]], entry.offset)]
        return self._timed(entry, got)

    def _timed(self, entry: ExpertEntry, read) -> tuple:
        start = time.perf_counter()
        try:
            blob = read()
        except OSError as err:
            raise SmoeError(f"{self.vault.dir}: layer {entry.layer} expert {entry.expert}: read failed ({err})") from None
        self.vault.check_blob(entry, blob)
        if self.log is not None:
            self.log.append(entry)
        return blob[: entry.size], time.perf_counter() - start

    def close(self) -> None:
        """Stop the threads (queued reads are dropped) and close the O_DIRECT descriptor."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None


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
