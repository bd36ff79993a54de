"""`smoe bench decode`'s routings (Zipf and uniform), its cold disk rows and its disk measurement, on the CPU.

The benchmark's rows run here on a CPU "device" with a tiny vault of the benchmark's own builder; on a GPU
the same code runs with the real shapes (scripts/h200_llama.sh).
"""

import contextlib
import functools
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from smoe.bench import decode as bench_decode
from smoe.bench import main as bench_main
from smoe.bench.runtime import drop_page_cache, resident_fraction, routing_draw, skewed_routing, uniform_routing
from smoe.cli import commands as cli
from smoe.errors import SmoeError
from smoe.format.vault import Vault, align
from smoe.runtime.blobs import BlobReader
from smoe.runtime.cuda.cache import GpuExpertCache, blob_slot_bytes

# Qwen3-30B-A3B's config with tiny shapes, and enough experts (32, top 4) for the routings to differ
TINY = {"hidden_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "bos_token_id": 0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-decode")


@pytest.fixture(scope="module")
def tiny_vault(workdir):
    """The vault `bench_decode(..., config=TINY)` builds, built once for every test here."""
    model = "qwen3-30b-a3b"
    return bench_decode.write_model_vault(bench_decode.model_vault_dir(workdir, model, TINY),
                                          bench_decode.model_config(model, TINY), progress=False)


# --- the routings --------------------------------------------------------------------------------


def chi_square(routing: np.ndarray, experts: int) -> np.ndarray:
    """Pearson's statistic of each layer's expert counts against equal counts."""
    tokens, layers, k = routing.shape
    counts = np.stack([np.bincount(routing[:, layer].ravel(), minlength=experts) for layer in range(layers)])
    expected = tokens * k / experts
    return ((counts - expected) ** 2 / expected).sum(axis=1)


def test_uniform_routing_draws_k_distinct_experts_with_equal_frequency():
    experts, k = 32, 4
    routing = uniform_routing(3, 4000, seed=1, experts=experts, top_k=k)
    assert routing.shape == (4000, 3, k) and routing.dtype == np.int64
    assert all(len(set(row)) == k for row in routing.reshape(-1, k).tolist())  # distinct within a token's layer
    # 31 degrees of freedom: mean 31, sd 7.9; 80 is beyond 6 sd. The Zipf draw is far past it.
    assert (chi_square(routing, experts) < 80).all()
    assert (chi_square(skewed_routing(3, 1000, seed=1, experts=experts, top_k=k), experts) > 1000).all()
    counts = np.bincount(routing[:, 0].ravel(), minlength=experts)
    assert counts.min() > 0.8 * 500 and counts.max() < 1.2 * 500  # 4000 * 4 / 32 each
    assert (routing_draw("uniform", 3, 4000, seed=1, experts=experts, top_k=k) == routing).all()
    assert (routing_draw("zipf", 3, 50, experts=experts, top_k=k) == skewed_routing(3, 50, experts=experts, top_k=k)).all()


def test_uniform_routing_hits_the_cache_less_than_zipf_at_the_same_budget(tiny_vault):
    """The expert cache the benchmark times (on a CPU "device"), a quarter of the experts: Zipf's popular experts
    stay resident, uniform routing hits about as often as the budget's share."""
    hit_rates = {}
    with Vault(tiny_vault) as vault:
        for kind in ("zipf", "uniform"):
            cache = GpuExpertCache(vault, 16 * blob_slot_bytes(vault), "cpu", top_k=4, threads=2)  # 16 of 64 experts
            try:
                for token in routing_draw(kind, 2, 400, experts=32, top_k=4):
                    for layer, experts in enumerate(token.tolist()):
                        cache.offsets(layer, experts)
                hit_rates[kind] = cache.stats.hit_rate
            finally:
                cache.close()
    assert hit_rates["uniform"] < 0.35 < hit_rates["zipf"]  # uniform: about 0.25


# --- the page cache and the disk -----------------------------------------------------------------


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/mounts: the longest mount point above it)."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fstype = line.split()[1:3]
        if (str(path.resolve()).rstrip("/") + "/").startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def test_dropping_the_page_cache_leaves_a_written_file_non_resident(tmp_path):
    path = tmp_path / "file.bin"
    path.write_bytes(os.urandom(8 << 20))
    before = resident_fraction(path)
    if before is None:
        pytest.skip("this system has no mincore: page-cache residency cannot be measured")
    assert before > 0.99  # just written
    after = drop_page_cache(path)
    if after > 0.01 and filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {filesystem_type(tmp_path)}: its pages are the file, they cannot be dropped")
    assert after < 0.01
    path.read_bytes()
    assert resident_fraction(path) > 0.99  # read back: resident again, so the measure sees both states


def test_disk_measurement_reads_whole_blobs_on_the_given_threads_at_a_positive_rate(tiny_vault):
    with Vault(tiny_vault) as v:
        blobs, largest, alignment = len(v.entries), max(e.size for e in v.entries.values()), v.alignment
    disk = bench_decode.disk_read(tiny_vault, threads=3)
    assert disk["gbps"] > 0 and disk["threads"] == 3 and disk["reads"] == blobs == 64
    assert disk["request_bytes"] == align(largest, alignment)  # one request per blob, as the cache reads it
    assert disk["direct_io"] == bench_decode.direct_io_works(tiny_vault)
    if disk["direct_io"]:  # O_DIRECT reads whole aligned blocks from the disk whatever the page cache holds
        assert disk["cold"] and disk["bytes"] == blobs * align(largest, alignment)
    assert bench_decode.disk_gbps(tiny_vault, threads=2) > 0


def test_a_vault_in_memory_is_not_cold_even_with_direct_io(tmp_path):
    """tmpfs keeps its pages whatever the advice (and, on Linux 6.6 and later, accepts O_DIRECT reading them):
    the disk measurement says it is not cold instead of giving memory speed as the disk's."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_type(shm) != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm to put a vault in")
    vault = bench_decode.write_model_vault(Path(tempfile.mkdtemp(dir=shm)) / "v",
                                           bench_decode.model_config("qwen3-30b-a3b", TINY), progress=False)
    try:
        disk = bench_decode.disk_read(vault, threads=2)
        assert not disk["cold"] and disk["resident_after_drop"] > 0.99 and "page cache" in disk["cold_note"]
    finally:
        shutil.rmtree(vault.parent)


def test_a_disk_row_that_is_not_cold_says_so_instead_of_a_percentage():
    cold_state = bench_decode.cold_state
    assert cold_state(True, 0.0)["cold"] and cold_state(False, 0.0)["cold"] and cold_state(False, 0.0)["cold_note"] is None
    warm = cold_state(False, 0.6)
    assert not warm["cold"] and "60.0% of experts.bin's pages stayed in the page cache" in warm["cold_note"]
    # pages that cannot be dropped have no disk behind them (tmpfs): O_DIRECT there reads memory as well
    assert not cold_state(True, 1.0)["cold"] and "no disk behind it" in cold_state(True, 1.0)["cold_note"]
    assert cold_state(True, None)["cold"]  # no mincore: O_DIRECT still bypasses the page cache
    assert "cannot be inspected" in cold_state(False, None)["cold_note"]
    row = {"source": "disk", "routing": "uniform", "budget_fraction": 0.25, "tok_s": 2.0, "hit_rate": 0.25,
           "copied_bytes_per_token": 100e6, "disk_bytes_per_token": 100e6, "gpu_read_bytes_per_token": 1e9,
           "cache_wait_ms_per_token": 400.0} | warm
    disk = {"gbps": 1.0} | bench_decode.cold_state(False, 0.0)
    limits = {"disk_gbps": 1.0, "pinned_copy_gbps": 50.0, "hbm_gbps": 4000.0, "disk_read": disk}
    got = bench_decode.with_limits(row, limits)
    assert got["io_limit_tok_s"] == pytest.approx(10.0) and got["of_io_limit"] is None and got["of_limit"] is None
    text = bench_decode.format_row(got)
    assert "not cold" in text and "% of it)" not in text and "resident pages after drop: 60.0%" in text
    cold = bench_decode.with_limits(row | bench_decode.cold_state(True, 0.0), limits)
    assert cold["of_io_limit"] == pytest.approx(0.2)  # 2 tok/s of the 10 that 100 MB/tok at 1 GB/s allow
    assert "disk limit 10.0 tok/s (20% of it)" in bench_decode.format_row(cold)
    # a disk measurement that was not cold spoils every disk row's percentages
    spoiled = bench_decode.with_limits(row | bench_decode.cold_state(True, 0.0), limits | {"disk_read": disk | warm})
    assert spoiled["of_io_limit"] is None and spoiled["cold_note"].startswith("disk measurement not cold")


# --- the benchmark, end to end on the CPU --------------------------------------------------------


@pytest.fixture(scope="module")
def decode_run(workdir, tiny_vault):
    """`smoe bench decode --routing zipf,uniform --sources host,disk --json` through the CLI, its rows on a CPU
    "device" with the tiny shapes (the CLI itself asks for CUDA). One torch thread: at these sizes more threads
    only contend for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bench_decode, "bench_decode", functools.partial(bench_decode.bench_decode, device="cpu",
                                                                       config=TINY, measure_bytes=16 << 20))
            mp.setattr(bench_main, "machine_description", lambda device: "cpu (test)")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = cli.main(["bench", "decode", "--workdir", str(workdir), "--budgets", "1,0.25", "--tokens", "4",
                               "--repeats", "2", "--warmup", "8", "--threads", "2", "--no-baseline", "--routing", "zipf,uniform",
                               "--sources", "host,disk", "--host-misses", "in-place,copy", "--json"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return json.loads(out.getvalue())


def test_bench_decode_times_every_budget_source_and_miss_path_under_both_routings(decode_run):
    assert decode_run["routings"] == ["zipf", "uniform"]
    rows = {(r["budget_fraction"], r["source"], r["routing"], r["misses_read"]): r for r in decode_run["rows"]}
    assert sorted(rows) == sorted([(1.0, "host", routing, "none") for routing in ("zipf", "uniform")]
                                  + [(0.25, "host", routing, way) for routing in ("zipf", "uniform")
                                     for way in ("in place", "copied")]
                                  + [(0.25, "disk", routing, "copied") for routing in ("zipf", "uniform")])
    for key in [(0.25, "host"), (0.25, "disk")]:  # replayed routings: fewer hits under uniform routing
        for way in {k[3] for k in rows if k[:2] == key}:
            assert rows[key + ("uniform", way)]["hit_rate"] < rows[key + ("zipf", way)]["hit_rate"]
    for r in decode_run["rows"]:  # the fields of before, and the I/O limit of each row's own misses
        assert {"tok_s", "hit_rate", "limit_tok_s", "of_limit", "copied_bytes_per_token", "in_place_bytes_per_token",
                "disk_bytes_per_token", "host_ms_per_token", "io_limit_tok_s", "of_io_limit", "tok_s_sd"} <= set(r)
        assert r["repeats"] == 2 and r["tokens"] == 8  # two timed spans of 4, counted together
    host, disk = rows[(0.25, "host", "uniform", "copied")], rows[(0.25, "disk", "uniform", "copied")]
    in_place = rows[(0.25, "host", "uniform", "in place")]
    limits = decode_run["limits"]
    assert host["io_limit_tok_s"] == pytest.approx(limits["pinned_copy_gbps"] * 1e9 / host["copied_bytes_per_token"])
    assert disk["io_limit_tok_s"] == pytest.approx(limits["disk_gbps"] * 1e9 / disk["disk_bytes_per_token"])
    moved = in_place["copied_bytes_per_token"] + in_place["in_place_bytes_per_token"]  # both cross the link
    assert in_place["in_place_bytes_per_token"] > 0 and host["in_place_bytes_per_token"] == 0
    assert in_place["io_limit_tok_s"] == pytest.approx(limits["pinned_copy_gbps"] * 1e9 / moved)
    assert rows[(1.0, "host", "zipf", "none")]["io_limit_tok_s"] is None  # nothing moved
    assert limits["disk_read"]["threads"] == 2 and limits["disk_read"]["gbps"] > 0


def test_bench_decode_disk_rows_report_their_cold_state_and_share_of_the_disk_limit(decode_run):
    for r in decode_run["rows"]:
        if r["source"] != "disk":
            assert "cold" not in r
            continue
        assert {"direct_io", "resident_after_drop", "resident_after_row", "cold", "cold_note"} <= set(r)
        assert r["bytes_read"] > 0 and r["disk_bytes_per_token"] == r["bytes_read"] / r["tokens"]  # counted
        if r["cold"] and decode_run["limits"]["disk_read"]["cold"]:
            assert r["of_io_limit"] == pytest.approx(r["tok_s"] / r["io_limit_tok_s"])
        else:
            assert r["of_io_limit"] is None and r["cold_note"]


def test_a_disk_row_reads_its_own_blobs_again_cold_and_gives_the_share_of_their_rate(decode_run):
    disk_rows = [r for r in decode_run["rows"] if r["source"] == "disk"]
    assert disk_rows
    for r in disk_rows:
        again = r["reread"]
        # every blob the row read from the disk (its misses less those its pinned read buffers still held)
        assert again["reads"] == r["misses"] - r["host_hits"] > 0 and again["threads"] == 2
        assert again["bytes"] >= r["bytes_read"] and again["direct_io"] == r["direct_io"]
        assert again["limit_tok_s"] == pytest.approx(r["tokens"] / again["seconds"])
        if r["cold"] and again["cold"]:
            assert r["of_reread_limit"] == pytest.approx(r["tok_s"] / again["limit_tok_s"])
        else:
            assert r["of_reread_limit"] is None


def test_the_blob_reader_logs_what_it_read_only_while_a_list_is_kept(tiny_vault):
    with Vault(tiny_vault) as v:
        reader = BlobReader(v, threads=2)
        first, second, third = list(v.entries.values())[:3]
        reader.read(first)
        assert reader.log is None
        reader.log = []
        reader.read(second)
        reader.read_into(third, memoryview(bytearray(align(third.size, v.alignment))))
        assert reader.log == [second, third]
        entries, reader.log = reader.log, None
        reader.read(first)
        assert entries == [second, third]
        reader.close()


def test_bench_decode_prints_routing_labels_and_disk_limit_shares(decode_run):
    text = bench_decode.format_result(decode_run)
    lines = text.splitlines()
    assert "blob each, 2 in flight" in lines[0] and "resident pages after drop" in lines[0]
    rows = lines[1:]
    assert len(rows) == 8 and sum("uniform" in line for line in rows) == 4 and sum("zipf" in line for line in rows) == 4
    assert sum("(in place)" in line for line in rows) == 2
    disk_rows = [line for line in rows if " disk " in line]
    assert len(disk_rows) == 2 and all("resident pages after drop: " in line for line in disk_rows)
    assert all(("of it)" in line.split("disk limit")[1]) or "not cold" in line for line in disk_rows)
    assert all("its reads again, cold: " in line for line in disk_rows)
    assert all("link limit" in line for line in rows if " host " in line and "100.0%" not in line)


@pytest.mark.parametrize("routing", ["zipf,gaussian", "uniform,uniform", ""])
def test_bench_decode_routing_option_is_checked_before_any_work(tmp_path, routing, capsys):
    assert cli.main(["bench", "decode", "--workdir", str(tmp_path / "w"), "--no-baseline", "--routing", routing]) == 2
    err = capsys.readouterr().err
    assert f"--routing {routing!r}" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_bench_decode_keeps_asking_for_a_gpu_by_default(tmp_path):
    with pytest.raises(SmoeError, match="no CUDA device is available"):
        bench_decode.bench_decode(str(tmp_path), [1.0], 1, 0, routings=("uniform",))
