import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.vault import DATA_FILE, QuantisedTensor, Vault, VaultWriter
from smoe.runtime.cpu.store import ExpertStore, default_cache_bytes, mem_available

SHAPES = {"gate": (32, 64), "up": (32, 64), "down": (64, 32)}


def quantised_expert(seed: int, bits: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for role, shape in SHAPES.items():
        codes, scales = codec.encode(torch.randn(shape, generator=g), bits)
        out.append(QuantisedTensor(role, shape, bits, codes, scales))
    return out


def build_vault(path: Path, layers=2, experts=4, bits=4, alignment=4096, depth=None) -> Path:
    """A vault of small experts with a gate bias each; depth(layer, expert) overrides `bits`."""
    writer = VaultWriter(path, bits, alignment)
    for layer in range(layers):
        for expert in range(experts):
            b = depth(layer, expert) if depth else bits
            bias = {"gate": torch.full((32,), float(layer * 100 + expert), dtype=torch.bfloat16)}
            writer.add(layer, expert, quantised_expert(layer * 100 + expert, b), bias)
    writer.finish({"moe_layers": list(range(layers)), "num_experts": experts})
    return path


def section_bytes(tensors) -> int:
    return sum(t.codes.nbytes + t.scales.nbytes for t in tensors)


def keep(tensors, biases):
    """The parsed blob itself as the compute form, sized by its quantised sections."""
    return (tensors, biases), section_bytes(tensors)


def same_expert(got, want) -> bool:
    (t1, b1), (t2, b2) = got, want
    return (
        [(t.role, t.shape, t.bits) for t in t1] == [(t.role, t.shape, t.bits) for t in t2]
        and all(torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) for a, b in zip(t1, t2))
        and b1.keys() == b2.keys() and all(torch.equal(b1[k], b2[k]) for k in b1)
    )


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def vault(tmp_path):
    with Vault(build_vault(tmp_path / "v")) as v:
        yield v


def expert_size(vault) -> int:
    """Prepared bytes of one expert under `keep` (all experts of a one-depth vault are alike)."""
    return section_bytes(vault.read_expert(0, 0)[0])


def direct_io_dir(tmp_path: Path, request) -> Path:
    """A directory whose filesystem accepts O_DIRECT: tmp_path, else one next to the tests, else skip."""
    if hasattr(os, "O_DIRECT"):
        for base in (tmp_path, Path(__file__).parent):
            candidate = Path(tempfile.mkdtemp(dir=base, prefix=".store-direct-"))
            request.addfinalizer(lambda d=candidate: shutil.rmtree(d, ignore_errors=True))
            probe = candidate / "probe"
            probe.write_bytes(bytes(4096))
            try:
                os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
                return candidate
            except OSError:
                continue
    reason = "no filesystem here accepts O_DIRECT (tmpfs before Linux 6.6 refuses it)"
    print(reason)
    pytest.skip(reason)


def test_get_returns_the_same_tensors_as_vault_read_expert(vault):
    with ExpertStore(vault, 1 << 30, keep) as store:
        got = store.get(1, [3, 0, 2])
        assert list(got) == [3, 0, 2]
        for e, prepared in got.items():
            assert same_expert(prepared, vault.read_expert(1, e))
        assert float(got[2][1]["gate"][0]) == 102


def test_hits_misses_and_bytes_read_are_counted_exactly(vault):
    size = {e: vault.entry(0, e).size for e in range(4)}
    with ExpertStore(vault, 1 << 30, keep) as store:
        assert list(store.get(0, [0, 1, 0, 1])) == [0, 1]  # duplicates: one read each
        s = store.stats
        assert (s.hits, s.misses, s.bytes_read, s.evictions) == (0, 2, size[0] + size[1], 0)
        store.get(0, [0, 1, 2])
        assert (s.hits, s.misses, s.bytes_read) == (2, 3, size[0] + size[1] + size[2])
        assert s.hit_rate == pytest.approx(2 / 5)
        assert s.read_seconds > 0 and s.wait_seconds > 0
        assert store.used_bytes == 3 * expert_size(vault)
        d = s.as_dict()
        assert d["hits"] == 2 and d["misses"] == 3 and d["hit_rate"] == pytest.approx(0.4)


def test_lru_evicts_the_least_recently_used_first_and_keeps_within_the_budget(vault):
    one = expert_size(vault)
    with ExpertStore(vault, 2 * one + one // 2, keep) as store:
        store.get(0, [0])
        kept = store.get(0, [1])[1]
        store.get(0, [0])  # 0 is now more recent than 1
        store.get(0, [2])  # evicts 1
        assert (0, 0) in store and (0, 2) in store and (0, 1) not in store
        assert store.used_bytes == 2 * one <= store.cache_bytes and store.stats.evictions == 1
        assert same_expert(kept, vault.read_expert(0, 1))  # what was returned outlives its eviction
        store.get(0, [3])  # evicts 0, the oldest now
        assert (0, 0) not in store and (0, 2) in store and (0, 3) in store
        misses = store.stats.misses
        store.get(0, [1])
        assert store.stats.misses == misses + 1


def test_a_call_needing_more_than_the_budget_returns_everything_and_stays_within_it(vault):
    one = expert_size(vault)
    with ExpertStore(vault, one, keep) as store:
        got = store.get(1, [0, 1, 2, 3])
        assert all(same_expert(got[e], vault.read_expert(1, e)) for e in range(4))
        assert store.used_bytes == one
        assert sum((1, e) in store for e in range(4)) == 1


def test_a_budget_of_zero_still_serves_and_caches_nothing(vault):
    with ExpertStore(vault, 0, keep) as store:
        for _ in range(2):
            got = store.get(0, [1, 2])
            assert same_expert(got[1], vault.read_expert(0, 1))
        assert store.stats.misses == 4 and store.stats.hits == 0
        assert store.used_bytes == 0 and store.stats.evictions == 0


def test_a_flipped_byte_fails_get_naming_layer_and_expert_while_other_experts_still_read(tmp_path):
    path = build_vault(tmp_path / "v")
    with Vault(path) as v:
        bad = v.entry(1, 2)
    flip_byte(path / DATA_FILE, bad.offset + bad.size // 2)
    with Vault(path) as v, ExpertStore(v, 1 << 30, keep) as store:
        with pytest.raises(SmoeError, match="layer 1 expert 2: checksum mismatch"):
            store.get(1, [1, 2, 3])
        assert (1, 1) in store and (1, 3) in store  # the call's other reads finished and were kept
        assert same_expert(store.get(1, [0])[0], v.read_expert(1, 0))
        with pytest.raises(SmoeError, match="layer 1 expert 2"):
            store.get(1, [2])  # not cached as a failure: read again, fails again


@pytest.mark.parametrize("alignment", [4096, 16384])
def test_direct_io_reads_return_identical_data(tmp_path, request, alignment):
    path = build_vault(direct_io_dir(tmp_path, request) / "v", alignment=alignment)
    with Vault(path) as v, ExpertStore(v, 1 << 30, keep, direct_io=True) as store:
        got = store.get(0, [0, 1, 2, 3])
        assert all(same_expert(got[e], v.read_expert(0, e)) for e in range(4))
        assert store.stats.bytes_read == sum(v.entry(0, e).size for e in range(4))


def test_direct_io_checks_checksums_too(tmp_path, request):
    path = build_vault(direct_io_dir(tmp_path, request) / "v")
    with Vault(path) as v:
        bad = v.entry(0, 3)
    flip_byte(path / DATA_FILE, bad.offset)
    with Vault(path) as v, ExpertStore(v, 1 << 30, keep, direct_io=True) as store:
        with pytest.raises(SmoeError, match="layer 0 expert 3: checksum mismatch"):
            store.get(0, [2, 3])


def test_eight_misses_requested_together_are_read_on_eight_threads_at_once(tmp_path):
    path = build_vault(tmp_path / "v", layers=1, experts=8)
    together = threading.Barrier(8, timeout=10)  # breaks unless all 8 prepares run at the same time
    threads = []

    def record(tensors, biases):
        threads.append(threading.get_ident())
        together.wait()
        return keep(tensors, biases)

    with Vault(path) as v, ExpertStore(v, 1 << 30, record, threads=16) as store:
        got = store.get(0, list(range(8)))
    assert len(got) == 8 and store.stats.misses == 8
    assert len(set(threads)) == 8 and threading.get_ident() not in threads


def test_prefetch_then_get_reads_each_blob_once(vault):
    gate = threading.Event()

    def slow(tensors, biases):
        gate.wait(timeout=10)
        return keep(tensors, biases)

    with ExpertStore(vault, 1 << 30, slow) as store:
        start = time.perf_counter()
        store.prefetch(0, [0, 1])
        assert time.perf_counter() - start < 1  # did not wait for the reads
        assert (0, 0) not in store
        threading.Timer(0.1, gate.set).start()
        got = store.get(0, [0, 1])  # waits on the prefetch's reads
        assert same_expert(got[1], vault.read_expert(0, 1))
        s = store.stats
        assert (s.misses, s.hits, s.bytes_read) == (2, 2, vault.entry(0, 0).size + vault.entry(0, 1).size)
        assert s.wait_seconds > 0.05
        store.prefetch(0, [1, 2])  # 1 is cached: only 2 is read
        store.get(0, [2])
        assert (s.misses, s.hits) == (3, 3)


def test_a_data_file_truncated_before_opening_is_refused(tmp_path):
    path = build_vault(tmp_path / "v")
    os.truncate(path / DATA_FILE, os.path.getsize(path / DATA_FILE) - 4096)
    with pytest.raises(SmoeError, match="truncated"):
        Vault(path)


@pytest.mark.parametrize("direct_io", [False, True])
def test_a_data_file_truncated_under_an_open_store_fails_get_naming_the_expert(tmp_path, request, direct_io):
    base = direct_io_dir(tmp_path, request) if direct_io else tmp_path
    path = build_vault(base / "v")
    with Vault(path) as v, ExpertStore(v, 1 << 30, keep, direct_io=direct_io) as store:
        last = v.entry(1, 3)
        os.truncate(path / DATA_FILE, last.offset + last.size // 2)
        with pytest.raises(SmoeError, match=r"layer 1 expert 3: blob truncated"):
            store.get(1, [3])
        assert same_expert(store.get(1, [0])[0], v.read_expert(1, 0))


def test_min_budget_is_the_top_k_largest_prepared_experts_of_the_worst_layer(tmp_path):
    # layer 1 holds one Q4 expert among Q2 ones; the prepared form is twice the blob
    path = build_vault(tmp_path / "v", bits=2, depth=lambda layer, expert: 4 if (layer, expert) == (1, 2) else 2)
    double = lambda t, b: ((t, b), 2 * (section_bytes(t) + sum(x.nbytes for x in b.values())))
    with Vault(path) as v, ExpertStore(v, 0, double) as store:
        q2, q4 = v.entry(0, 0).size, v.entry(1, 2).size
        assert q4 > q2
        assert store.prepare_ratio() == 2.0  # sections and bias fill the blob: no padding at these shapes
        assert store.min_budget(1) == 2 * q4
        assert store.min_budget(2) == 2 * (q4 + q2)
        assert store.expert_nbytes(0) == 2 * q2 and store.expert_nbytes(1) == 2 * q4
        assert store.stats.misses == 0 and store.stats.bytes_read == 0  # the measurement is not traffic


def test_default_cache_bytes_is_at_most_half_the_available_memory_and_what_all_experts_need(vault):
    everything = sum(e.size for e in vault.entries.values())
    assert default_cache_bytes(vault) == min(everything, mem_available() // 2) > 0
    assert default_cache_bytes(vault, prepare_ratio=3.0) <= 3 * everything
    assert mem_available() > 0


def test_direct_io_on_a_vault_aligned_below_the_page_size_is_refused(tmp_path):
    path = build_vault(tmp_path / "v", alignment=64)
    with Vault(path) as v, pytest.raises(SmoeError, match="page size"):
        ExpertStore(v, 0, keep, direct_io=True)
