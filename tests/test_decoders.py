"""An opened vault runs one decoder on one device with exactly one expert cache, and says which.

The device-independent half runs everywhere; the CUDA half (the generic decoder on the GPU for
every family, the GPU path building no CPU store, /metrics reading the GPU cache, --device auto's
rule) runs where there is a GPU (scripts/h200_runtime.sh runs it on an H200).
"""

import threading

import pytest
import torch

from smoe.format.vault import Vault
from smoe.hf.tokenizer import load_tokenizer
from smoe.quality.evaluate import load_reference
from smoe.runtime.cuda.decode import kernels_cover
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.serve.worker import Worker
from smoe.testing.tiny_models import tiny_families
from smoe.testing.vaults import kernel_sized_vault, tiny_vault, tiny_vault_and_reference

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on one by scripts/h200_runtime.sh)")
TOLERANCE = 1e-4  # fp32: the same weights, another summation order


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / a.float().abs().max())


def store_threads() -> int:
    return sum(t.name.startswith("smoe-store") for t in threading.enumerate())


def test_metrics_report_the_cache_the_decoder_reads(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", seed=2)
    sm = OpenedVault(vault, dtype="float32", device="cpu")
    try:
        generate(sm, [1, 2, 3], max_tokens=3)
        snapshot = Worker(sm, load_tokenizer(vault), "m").metrics_snapshot()
        assert snapshot["cache"] == sm.cache_stats() and snapshot["cache"]["misses"] > 0
        assert (snapshot["decoder"], snapshot["device"]) == ("fast", "cpu")
    finally:
        sm.close()


def test_the_triton_kernels_cover_only_vaults_whose_expert_widths_are_multiples_of_64(tmp_path):
    narrow = tiny_vault(tmp_path / "narrow", "qwen3_moe")  # 24-wide experts: the GPU would fall back
    wide, _ = kernel_sized_vault(tmp_path / "wide", "qwen3_moe")
    with Vault(narrow) as v:
        assert not kernels_cover(v)
    with Vault(wide) as v:
        assert kernels_cover(v)


@needs_cuda
@pytest.mark.parametrize("family", tiny_families())
def test_generic_decoder_on_cuda_matches_the_dequantised_model_for_every_family(family, tmp_path):
    vault, reference = tiny_vault_and_reference(tmp_path, family, seed=2)
    sm = OpenedVault(vault, dtype="float32", device="cuda", decoder="generic")
    try:
        assert sm.decoder == "generic" and sm.device.type == "cuda"
        assert all(p.device.type == "cuda" for p in sm.model.parameters())
        ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
        assert relative_error(load_reference(reference)(ids), sm.logits(ids)) < TOLERANCE
        stats = sm.cache_stats()
        assert stats["misses"] > 0 and stats["capacity_bytes"] > 0
    finally:
        sm.close()


@needs_cuda
def test_the_fast_gpu_path_builds_no_cpu_store_and_metrics_read_the_gpu_cache(tmp_path):
    vault, _ = kernel_sized_vault(tmp_path, "qwen3_moe")
    before = store_threads()
    sm = OpenedVault(vault, dtype="float32", device="cuda")
    try:
        assert sm.decoder == "fast" and sm.store is None and store_threads() == before
        generate(sm, [1, 2, 3], max_tokens=3)
        snapshot = Worker(sm, load_tokenizer(vault), "m").metrics_snapshot()
        assert snapshot["cache"] == sm.cache_stats() and snapshot["cache"]["hits"] + snapshot["cache"]["misses"] > 0
        assert snapshot["decoder"] == "fast" and snapshot["device"].startswith("cuda")
    finally:
        sm.close()


@needs_cuda
def test_device_auto_keeps_experts_the_kernels_cannot_run_on_the_cpu(tmp_path):
    narrow = tiny_vault(tmp_path / "narrow", "qwen3_moe")
    wide, _ = kernel_sized_vault(tmp_path / "wide", "qwen3_moe")
    for vault, device in ((narrow, "cpu"), (wide, "cuda")):
        sm = OpenedVault(vault, dtype="float32", device="auto")
        try:
            assert sm.device.type == device
        finally:
            sm.close()

