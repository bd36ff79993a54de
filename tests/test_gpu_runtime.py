"""The GPU runtime: expert cache slots, host tier, reads, and the segmented decoder.

Without a GPU the same code runs on a CPU "device" (plain memory, synchronous copies, experts by the
reference decode+matmul or, in a child process, the Triton interpreter); the CUDA tests at the end
run where there is a GPU (scripts/h200_runtime.sh runs them on an H200).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_layer_library import KIND_VARIANTS, sharpened

from smoe.errors import SmoeError
from smoe.format.vault import DATA_FILE, Vault
from smoe.quality.evaluate import load_reference
from smoe.runtime.cuda import gemv
from smoe.runtime.cuda.cache import GpuExpertCache, blob_slot_bytes, min_gpu_budget
from smoe.runtime.cuda.decode import GpuDecoder
from smoe.runtime.model import OpenedVault
from smoe.testing.vaults import (
    dequantised_reference,
    kernel_sized_vault,
    mixed_vault,
    tiny_model_dir,
    tiny_vault_and_reference,
    vault_of,
)

TOLERANCE = 1e-4  # fp32: the same weights, another summation order
CUDA = torch.cuda.is_available()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / a.float().abs().max())


def decode_in_pieces(dec: GpuDecoder, ids: list[int]) -> torch.Tensor:
    """Logits of every position: a prefill, single-token steps, then a second prefill."""
    pieces = [ids[:20], *[[t] for t in ids[20:28]], ids[28:]]
    return torch.cat([dec.forward(p).reshape(len(p), -1).cpu() for p in pieces])


# --- the cache -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vault(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu")
    return tiny_vault_and_reference(tmp, "qwen3_moe", seed=2)


def blob_in_slot(cache: GpuExpertCache, offset: int, layer: int, expert: int) -> bool:
    size = cache.vault.entry(layer, expert).size
    return bytes(cache.pool[offset: offset + size].cpu().numpy()) == cache.vault.read_blob(layer, expert)


def test_cache_slots_hold_the_vault_blobs_and_evict_least_recently_used(tiny_vault):
    vault_dir, _ = tiny_vault
    with Vault(vault_dir) as v:
        cache = GpuExpertCache(v, 3 * blob_slot_bytes(v), "cpu", top_k=2)
        layer = v.meta["moe_layers"][0]
        first = cache.offsets(layer, [0, 1])
        assert all(blob_in_slot(cache, off, layer, e) for off, e in zip(first, [0, 1]))
        assert cache.stats.misses == 2 and cache.stats.hits == 0
        cache.offsets(layer, [0])  # 0 is now the most recent: 1 goes first
        cache.offsets(layer, [2, 3])
        assert cache.resident(layer, 0) and not cache.resident(layer, 1)
        again = cache.offsets(layer, [3, 0, 3])  # repeats keep their order
        assert again[0] == again[2] and blob_in_slot(cache, again[1], layer, 0) and blob_in_slot(cache, again[0], layer, 3)
        assert cache.stats.hits == 3
        cache.close()


def test_host_tier_serves_experts_evicted_from_the_gpu(tiny_vault):
    vault_dir, _ = tiny_vault
    with Vault(vault_dir) as v:
        slot = blob_slot_bytes(v)
        cache = GpuExpertCache(v, 2 * slot, "cpu", top_k=2, host_bytes=len(v.entries) * slot)
        layer = v.meta["moe_layers"][0]
        cache.offsets(layer, [0, 1])
        cache.offsets(layer, [2, 3])  # evicts 0 and 1 from the GPU slots; the host tier keeps them
        read = cache.stats.bytes_read
        off = cache.offsets(layer, [0, 1])
        assert cache.stats.host_hits == 2 and cache.stats.bytes_read == read
        assert blob_in_slot(cache, off[0], layer, 0) and blob_in_slot(cache, off[1], layer, 1)
        cache.close()


def test_gpu_budget_below_one_tokens_experts_is_an_error_saying_the_minimum(tiny_vault):
    vault_dir, _ = tiny_vault
    with Vault(vault_dir) as v:
        need = min_gpu_budget(v, 2)
        with pytest.raises(SmoeError, match=f"at least .*{need:,} bytes"):
            GpuExpertCache(v, need - 1, "cpu", top_k=2)


def vault_with_a_corrupt_blob(vault_dir, tmp_path) -> tuple:
    """A copy of the vault with one byte of expert 1's blob in the first MoE layer flipped: (its path, that layer)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(vault_dir, bad)
    with Vault(bad) as v:
        layer = v.meta["moe_layers"][0]
        entry = v.entry(layer, 1)
    with open(bad / DATA_FILE, "r+b") as f:
        f.seek(entry.offset + 10)
        byte = f.read(1)
        f.seek(entry.offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    return bad, layer


def test_corrupt_blob_fails_naming_layer_and_expert_and_is_not_cached(tiny_vault, tmp_path):
    bad, layer = vault_with_a_corrupt_blob(tiny_vault[0], tmp_path)
    with Vault(bad) as v:
        cache = GpuExpertCache(v, 4 * blob_slot_bytes(v), "cpu", top_k=2)
        with pytest.raises(SmoeError, match=f"layer {layer} expert 1: checksum mismatch"):
            cache.offsets(layer, [0, 1])
        assert cache.resident(layer, 0) and not cache.resident(layer, 1)
        cache.close()


def test_filling_the_host_tier_with_a_corrupt_blob_fails_naming_it_and_keeps_only_good_blobs(tiny_vault, tmp_path):
    """What reading misses in place starts with: every expert into the host tier, each blob checked."""
    bad, layer = vault_with_a_corrupt_blob(tiny_vault[0], tmp_path)
    with Vault(bad) as v:
        cache = GpuExpertCache(v, 4 * blob_slot_bytes(v), "cpu", top_k=2, host_bytes=blob_slot_bytes(v) * len(v.entries))
        for _ in range(2):  # asked again, it fails again: the bad blob was not kept
            with pytest.raises(SmoeError, match=f"layer {layer} expert 1: checksum mismatch"):
                cache.fill_host()
            assert (layer, 1) not in cache.host_lru.slots and len(cache.host_lru.slots) == len(v.entries) - 1
        cache.close()


def test_direct_io_reads_the_same_bytes(tiny_vault):
    vault_dir, _ = tiny_vault
    with Vault(vault_dir) as v:
        try:
            cache = GpuExpertCache(v, 4 * blob_slot_bytes(v), "cpu", top_k=2, direct_io=True)
        except SmoeError as err:
            pytest.skip(f"this filesystem refuses O_DIRECT: {err}")
        layer = v.meta["moe_layers"][-1]
        off = cache.offsets(layer, [2, 0])
        assert blob_in_slot(cache, off[0], layer, 2) and blob_in_slot(cache, off[1], layer, 0)
        cache.close()


# --- the decoder ---------------------------------------------------------------------------------


def vault_and_reference(tmp_path, family: str, bits: int) -> tuple:
    """A tiny family's vault and reference, or a variant's of test_layer_library.KIND_VARIANTS (EXAONE-MoE's NoPE
    layers, HunYuan's q/k norm after rotary, Granite's multipliers, Mistral 4's query temperature, AFMoE's kinds),
    built with the values that make its kind matter and its attention sharpened."""
    if family not in KIND_VARIANTS:
        return tiny_vault_and_reference(tmp_path, family, bits, seed=2)
    family, architecture = KIND_VARIANTS[family]
    model = sharpened(tiny_model_dir(tmp_path, family, seed=3, architecture=architecture))
    vault = vault_of(model, tmp_path / "vault", bits)
    return vault, dequantised_reference(vault, tmp_path)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "dots1", "glm4_moe", "olmoe",
                                    "minimax_m2", "qwen2_moe", "gpt_oss", "ernie4_5_moe", *KIND_VARIANTS])
@pytest.mark.parametrize("bits", [4, 2])
def test_segmented_decoder_matches_the_dequantised_reference_with_evictions(family, bits, tmp_path):
    vault, reference = vault_and_reference(tmp_path, family, bits)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    top_k = sm.vault.meta["top_k"]
    # two slots more than one token's experts, for the layers' 2 x 4 experts: evictions, and hits (one slot more
    # for the variants: AFMoE's sharpened router keeps to 2 experts a layer, all of which 4 slots hold)
    slots = top_k + (1 if family in KIND_VARIANTS else 2)
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, slots), max_positions=64)
    ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(3)).tolist()
    got = decode_in_pieces(dec, ids)
    want = load_reference(reference)(torch.tensor([ids]))[0]
    assert relative_error(want, got) < TOLERANCE
    stats = dec.cache.stats
    if family == "gpt_oss":  # 2 layers of 4 experts: hits outnumber misses, experts come back from the host tier
        assert stats.host_hits > 0 and stats.misses > 0
    elif family == "ernie4_5_moe":  # the experts its tiny model routes to fit the slots: each read once, hits after
        assert 0 < stats.misses <= len(sm.vault.entries) and stats.evictions == 0 and stats.hits > 0
    else:
        assert stats.misses > stats.hits > 0


GLM45_LAYOUT = dict(attention_bias=True, use_qk_norm=True)  # with glm4_moe's partial rotary and shared expert


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "glm4_moe-biases-qk-norm"])
def test_segmented_decoder_matches_the_dequantised_reference_on_a_mixed_plan(family, tmp_path):
    """Gate/up and down at different depths per layer (a bit plan's vault): one blob layout per layer; and
    GLM-4.5's attention (q/k/v biases, q/k norm, partial rotary) on the GPU decoder's block."""
    if family == "glm4_moe-biases-qk-norm":
        model = tiny_model_dir(tmp_path, "glm4_moe", seed=2, architecture=GLM45_LAYOUT)
        plan = {(layer, role): 2 if (layer, role) == (1, "down") else 4 for layer in (1, 2) for role in ("gate", "up", "down")}
        vault = vault_of(model, tmp_path / "vault", plan=plan)
    else:
        vault = mixed_vault(tmp_path, family, seed=2)
    reference = dequantised_reference(vault, tmp_path)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, sm.vault.meta["top_k"] + 2), max_positions=64)
    ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(3)).tolist()
    got = decode_in_pieces(dec, ids)
    assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], got) < TOLERANCE
    assert dec.cache.stats.misses > dec.cache.stats.hits > 0


def test_prefill_wider_than_the_cache_runs_in_expert_groups(tiny_vault):
    vault, reference = tiny_vault
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, 2), max_positions=64)
    ids = list(range(3, 43))  # 40 tokens route to every expert of a layer, more than the 2 slots
    got = dec.forward(ids).cpu()
    want = load_reference(reference)(torch.tensor([ids]))[0]
    assert relative_error(want, got) < TOLERANCE
    assert dec.cache.stats.misses == len(sm.vault.entries)  # group by group: every expert read exactly once


def resident_decoder(vault, device: str) -> GpuDecoder:
    """A GPU decoder (fp32) whose cache holds every expert of `vault`."""
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    return GpuDecoder(sm, device, blob_slot_bytes(sm.vault) * len(sm.vault.entries), max_positions=64)


def test_decoder_with_every_expert_resident_uses_the_offset_table(tiny_vault):
    vault, reference = tiny_vault
    dec = resident_decoder(vault, "cpu")
    ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(4)).tolist()
    got = decode_in_pieces(dec, ids)
    assert dec.table is not None
    reads = dec.cache.stats.misses
    assert reads == len(dec.vault.entries)  # each expert read once, up front
    assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], got) < TOLERANCE


def prompts_then_pieces_match_the_reference(dec: GpuDecoder, reference) -> None:
    """Two sequences in turn, each a prompt that starts it (padded to a captured length: its first run eager and
    captured, its second replayed where graphs run), steps and a continued prompt, match the reference."""
    for seed in (4, 5):
        dec.reset()
        ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(seed)).tolist()
        got = decode_in_pieces(dec, ids)
        assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], got) < TOLERANCE


def test_a_resident_prompt_padded_to_a_captured_length_matches_the_reference_and_counts_only_its_tokens(tiny_vault):
    vault, reference = tiny_vault
    dec = resident_decoder(vault, "cpu")
    dec.forward(list(range(3, 23)))
    assert list(dec.prompts) == [32]  # 20 tokens padded to 32
    meta = dec.vault.meta
    assert dec.cache.stats.hits == 20 * meta["top_k"] * len(meta["moe_layers"])  # the padding's experts not counted
    prompts_then_pieces_match_the_reference(dec, reference)


# --- misses read in place from host RAM (smoe.runtime.cuda.placement) -----------------------------


def table_points_at_each_experts_bytes(dec: GpuDecoder) -> bool:
    """Every table entry not awaiting its copy holds the offset of that expert's blob (on a CPU device the pool
    holds the host tier, so both kinds of offset read back from it)."""
    busy = {key for _, keys in dec.placement.pending for key in keys}
    table = dec.placement.table.cpu()
    return all(blob_in_slot(dec.cache, int(table[key]), *key) for key in dec.vault.entries if key not in busy)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_misses_read_in_place_match_the_dequantised_reference_and_account_every_routed_expert(family, tmp_path):
    vault, reference = tiny_vault_and_reference(tmp_path, family, 4, seed=2)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    top_k = sm.vault.meta["top_k"]
    everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, top_k + 1), max_positions=64, host_cache_bytes=everything,
                     in_place=True)
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    pieces = [ids[:8], *[[t] for t in ids[8:30]], ids[30:]]  # a prompt, one-token steps (five looks), a prompt
    got = []
    for piece in pieces:
        got.append(dec.forward(piece).reshape(len(piece), -1).cpu())
        assert dec.placement is None if piece is pieces[0] else table_points_at_each_experts_bytes(dec)
    assert dec.placement is not None and dec.placement.tokens == 22
    assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], torch.cat(got)) < TOLERANCE
    before = dec.cache.stats.as_dict()
    for t in ids[:6]:  # one-token steps only: every routed expert a hit or a read in place, each read its blob's size
        dec.forward([t])
    dec.account()
    after = dec.cache.stats.as_dict()
    moe_layers = len(sm.vault.meta["moe_layers"])
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    assert hits + misses == 6 * top_k * moe_layers and misses > 0
    assert after["bytes_in_place"] - before["bytes_in_place"] == misses * sm.vault.entry(*min(sm.vault.entries)).size


def test_placement_moves_the_most_routed_experts_into_the_gpu_slots_and_then_only_hits(tiny_vault):
    import numpy as np

    from smoe.bench.replay import ReplayDecoder

    vault, _ = tiny_vault
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
    moe, top_k = sm.vault.meta["moe_layers"], sm.vault.meta["top_k"]
    layers = sm.config.get_text_config().num_hidden_layers
    experts = 1 + max(e for _, e in sm.vault.entries)
    favourites = [[(2 * layer + j) % experts for j in range(top_k)] for layer in range(layers)]
    replay = np.array([favourites] * 24)  # every token routes each layer to the same experts
    dec = ReplayDecoder(sm, "cpu", min_gpu_budget(sm.vault, len(moe) * top_k), max_positions=32,
                        host_cache_bytes=everything, route_replay=torch.from_numpy(replay), in_place=True)
    for step in range(12):  # three looks: the favourites move in
        dec.replay_step = step
        dec.forward([step + 2])
    assert {(layer, e) for layer in moe for e in favourites[layer]} == set(dec.cache.gpu.slots)
    dec.account()
    before = dec.cache.stats.as_dict()
    for step in range(12, 20):
        dec.replay_step = step
        dec.forward([step + 2])
    dec.account()
    after = dec.cache.stats.as_dict()
    assert after["misses"] == before["misses"] and after["hits"] - before["hits"] == 8 * len(moe) * top_k


@pytest.mark.parametrize("host", ["none", "too small"])
def test_misses_are_copied_when_no_host_tier_holds_every_expert(host, tiny_vault, tmp_path):
    if host == "none":
        vault, reference = tiny_vault
    else:  # more experts than the host tier's smallest size (its staging ring), a host tier of half of them
        model = tiny_model_dir(tmp_path, "qwen3_moe", seed=2, architecture={"num_experts": 24})
        vault = vault_of(model, tmp_path / "vault")
        reference = dequantised_reference(vault, tmp_path)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, 3), max_positions=64,
                     host_cache_bytes=0 if host == "none" else everything // 2, in_place=True)
    ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(4)).tolist()
    got = decode_in_pieces(dec, ids)
    assert dec.placement is None and dec.cache.stats.bytes_in_place == 0 and dec.cache.stats.misses > 0
    assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], got) < TOLERANCE


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_sequence_past_the_kv_capacity_grows_the_state_in_place(family, tmp_path):
    vault, reference = tiny_vault_and_reference(tmp_path, family, 4, seed=2)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, 2), max_positions=16)
    cache, layers = dec.cache, dec.layers
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    pieces = [ids[:8], *[[t] for t in ids[8:24]], ids[24:]]  # one-token steps grow it at position 16
    got = torch.cat([dec.forward(p).reshape(len(p), -1).cpu() for p in pieces])
    assert dec.max_positions >= 40 and dec.cache is cache and dec.layers is layers
    assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], got) < TOLERANCE


# hybrid families: mixer layers (short convolutions, Mamba) through the family's own transformers modules, their
# MoE blocks on the GPU expert cache (Jamba's tiny model given experts on every layer, its Mamba layer's included)
HYBRIDS = {"lfm2_moe": ({}, {"conv": [0, 2]}), "granitemoehybrid": ({}, {"linear_attention": [0]}),
           "jamba": (dict(expert_layer_period=1, expert_layer_offset=0), {"linear_attention": [0]})}


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_a_hybrid_family_runs_its_mixer_layers_through_its_own_modules_on_the_gpu_decoder(family, tmp_path):
    from smoe.runtime.model import pick_decoder

    architecture, named = HYBRIDS[family]
    vault = vault_of(tiny_model_dir(tmp_path, family, seed=2, architecture=architecture), tmp_path / "vault")
    reference = load_reference(dequantised_reference(vault, tmp_path))
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    sm.device = torch.device("cuda")  # as opened on a GPU: --decoder auto's rule and the report read the device
    assert pick_decoder(sm, "auto") == "fast" and sm.describe()["transformers_layers"] == named
    sm.device = torch.device("cpu")
    mixers = sm.description.attention.mixer_layers
    assert set(mixers) & set(sm.vault.meta["moe_layers"])  # a mixer layer with routed experts
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 100, (36,), generator=gen).tolist() for _ in range(2))
    want = reference(torch.tensor([a, b]))
    # one slot more than a token's experts: evictions, and a prompt's experts in groups
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, sm.vault.meta["top_k"] + 1), max_positions=64)
    assert [i for i, w in enumerate(dec.layers) if w is None] == list(mixers)
    first = decode_in_pieces(dec, a)
    assert relative_error(want[0], first) < TOLERANCE
    dec.reset()  # another sequence on the same state: the family's cache is made again
    assert relative_error(want[1], decode_in_pieces(dec, b)) < TOLERANCE
    dec.use(dec.new_state(64))  # and on a new state
    assert torch.equal(decode_in_pieces(dec, a), first)
    assert dec.cache.stats.misses > len(sm.vault.entries)  # experts evicted and read again
    with Vault(vault) as v:
        everything = blob_slot_bytes(v) * len(v.entries)
    resident = GpuDecoder(sm, "cpu", everything, max_positions=64)  # the whole token cut at the mixer layers
    got = decode_in_pieces(resident, b)
    assert resident.table is not None and resident.cache.stats.misses == len(sm.vault.entries)
    assert relative_error(want[1], got) < TOLERANCE


INTERPRETED = """
import sys, torch
from smoe.runtime.model import OpenedVault
from smoe.runtime.cuda import gemv
from smoe.runtime.cuda.decode import GpuDecoder
from smoe.runtime.cuda.cache import min_gpu_budget
assert gemv.ENABLED and gemv.covered(torch.zeros(1, 4), torch.zeros(2, 4)), "the one-row kernel is not used"
for vault, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    dec = GpuDecoder(sm, "cpu", 3 * min_gpu_budget(sm.vault, 2) // 2, max_positions=32, kernel_path="triton")
    ids = list(range(5, 17))
    logits = torch.cat([dec.forward(ids[:8]), *[dec.forward([t]) for t in ids[8:]]])
    assert dec.attention_kernel, "the attention kernel was not used throughout"
    torch.save(logits, out)
"""
# gpt-oss: expert biases, clamped SwiGLU, sinks, windows; Granite-MoE-Hybrid: a Mamba layer through its own module,
# its experts by the kernels too. SMOE_GPU_ATTENTION_KERNEL=1 and SMOE_GPU_GEMV=1 (the defaults): the one-token steps'
# attention by its kernel and their projections by the one-row kernel. With both off the Triton kernels left are the
# experts', which every family runs here; the torch ops that replace the other two are what the uninterpreted tests
# above run. One child process for all (the interpreter's start is most of a family's time).
INTERPRETED_FAMILIES = ["qwen3_moe", "gpt_oss", "granitemoehybrid"]


@pytest.fixture(scope="module")
def interpreted_logits(tmp_path_factory):
    """family -> (logits of the decoder through the interpreted kernels, the reference directory)."""
    dirs = {family: tmp_path_factory.mktemp(family) for family in INTERPRETED_FAMILIES}
    for family, d in dirs.items():
        kernel_sized_vault(d, family)
    env = dict(os.environ, TRITON_INTERPRET="1", SMOE_GPU_ATTENTION_KERNEL="1", SMOE_GPU_GEMV="1")
    args = [str(p) for d in dirs.values() for p in (d / "vault", d / "out.pt")]
    subprocess.run([sys.executable, "-c", INTERPRETED, *args], check=True, env=env, timeout=600)
    return {family: (torch.load(d / "out.pt"), d / "reference") for family, d in dirs.items()}


@pytest.mark.parametrize("family", INTERPRETED_FAMILIES)
def test_decoder_through_the_interpreted_triton_kernels_matches_the_reference(family, interpreted_logits):
    got, reference = interpreted_logits[family]
    want = load_reference(reference)(torch.tensor([list(range(5, 17))]))[0]
    assert relative_error(want, got) < 1e-4


# --- choosing the device -------------------------------------------------------------------------


def smoe_cli(*args):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True)


@pytest.mark.skipif(CUDA, reason="checks the machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_one_line_error(tiny_vault):
    vault, _ = tiny_vault
    r = smoe_cli("generate", vault, "-p", "the", "--max-tokens", "2", "--device", "cuda")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "smoe: error: --device cuda: no CUDA device is available" in r.stderr


@pytest.mark.skipif(CUDA, reason="checks the machine without a GPU")
def test_device_auto_without_a_gpu_runs_on_the_cpu(tiny_vault):
    vault, _ = tiny_vault
    r = smoe_cli("generate", vault, "-p", "the", "--max-tokens", "3", "--temperature", "0", "--device", "auto", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 3


# --- on a GPU ------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on one by scripts/h200_runtime.sh)")


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """torch.compile keeps at most 8 compiled variants of a function per process and, with fullgraph, fails past
    them: over a module of families the decoder's compiled blocks reached that and fell back to torch ops (one
    warning), which a process decoding one model does not reach. Each test starts from empty caches."""
    if CUDA:
        torch._dynamo.reset()
    yield


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "glm4_moe", "olmoe", "qwen2_moe",
                                    "minimax_m2", "dots1", "gpt_oss", "hunyuan_v1_moe", "granitemoe", "granitemoeshared",
                                    "afmoe"])  # EXAONE-MoE and Mistral 4: kernel_sized_vault does not build them yet
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("resident", [False, True])
def test_cuda_decoder_with_graphs_matches_the_reference_in_fp32(family, bits, resident, tmp_path):
    cuda_decoder_matches_the_reference(tmp_path, family, bits, resident)


def cuda_decoder_matches_the_reference(tmp_path, family: str, bits: int, resident: bool) -> GpuDecoder:
    """A kernel-sized vault decoded in pieces on the GPU in fp32 (every expert resident, or the smallest cache)
    matches the dequantised reference, its single-token steps replayed from captured graphs; the decoder."""
    vault, reference = kernel_sized_vault(tmp_path, family, bits)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    with Vault(vault) as v:
        budget = blob_slot_bytes(v) * len(v.entries) if resident else min_gpu_budget(v, v.meta["top_k"])
    dec = GpuDecoder(sm, "cuda", budget, max_positions=64)
    ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(3)).tolist()
    got = decode_in_pieces(dec, ids)
    # the single-token steps after the first replayed captured graphs
    assert (dec.whole_token if resident else dec.segments) is not None
    assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], got) < TOLERANCE
    return dec


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe", "qwen2_moe", "gpt_oss", "granitemoe"])
@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_cuda_one_token_attention_and_projections_match_the_reference_in_fp32_either_way(family, resident, kernels,
                                                                                         tmp_path, monkeypatch):
    """With SMOE_GPU_ATTENTION_KERNEL and SMOE_GPU_GEMV at 1 (the defaults) every one-token step's attention runs in
    the decode-attention kernels (per-head q/k norm, partial rotary, q/k/v bias, windows and sinks, an attention
    multiplier among these families) and its projections in the one-row kernel; at 0 as torch ops and cuBLAS."""
    monkeypatch.setenv("SMOE_GPU_ATTENTION_KERNEL", kernels)
    monkeypatch.setattr(gemv, "ENABLED", kernels == "1")
    dec = cuda_decoder_matches_the_reference(tmp_path, family, 4, resident)
    # no layer fell back to torch ops, or none used the kernel
    assert dec.attention_kernel == (kernels == "1") and all(w.kernel_attends for w in dec.layers)


def bf16_greedy_tokens_are_the_references_where_its_margin_exceeds_bf16s_own_error(tmp_path, family: str,
                                                                                    device: str, resident: bool):
    """The decoder in bf16 (the default dtype; on CUDA its kernels and graphs) picks the fp32 reference's greedy token
    at every position whose top-two margin is more than twice what bf16 itself moves that position's logits (the
    reference run in bf16 against fp32): where that margin is smaller, bf16 may rightly pick either."""
    vault, reference = kernel_sized_vault(tmp_path, family, 4)
    sm = OpenedVault(vault, dtype="bfloat16", kernel_path="dequant")
    budget = blob_slot_bytes(sm.vault) * len(sm.vault.entries) if resident else min_gpu_budget(sm.vault, 2)
    ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(6)).tolist()
    got = decode_in_pieces(GpuDecoder(sm, device, budget, max_positions=64), ids)
    want = load_reference(reference)(torch.tensor([ids]))[0]
    own_error = (want - load_reference(reference, torch.bfloat16)(torch.tensor([ids]))[0]).abs().amax(dim=-1)
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * own_error
    assert int(clear.sum()) >= len(ids) // 4, "too few positions with a margin to compare"
    assert torch.equal(got.float().argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bf16_greedy_tokens_are_the_fp32_references_where_the_margin_exceeds_bf16s_own_error(family, tmp_path):
    bf16_greedy_tokens_are_the_references_where_its_margin_exceeds_bf16s_own_error(tmp_path, family, "cpu", False)


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
@pytest.mark.parametrize("resident", [False, True])
def test_cuda_bf16_greedy_tokens_are_the_fp32_references_where_the_margin_exceeds_bf16s_own_error(family, resident,
                                                                                                  tmp_path):
    bf16_greedy_tokens_are_the_references_where_its_margin_exceeds_bf16s_own_error(tmp_path, family, "cuda", resident)


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_cuda_resident_prompts_replayed_from_their_captured_graphs_match_the_reference_in_fp32(family, tmp_path):
    vault, reference = kernel_sized_vault(tmp_path, family, 4)
    dec = resident_decoder(vault, "cuda")
    prompts_then_pieces_match_the_reference(dec, reference)
    assert dec.prompts[32].graph is not None  # the second sequence's prompt of 20 tokens replayed it


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_cuda_decoder_reading_misses_in_place_matches_the_reference_in_fp32(family, tmp_path):
    """The kernels read missed experts from pinned host RAM through the whole-token graph; the placement moves
    experts into the GPU slots between tokens (copies in flight while graphs run)."""
    vault, reference = kernel_sized_vault(tmp_path, family, 4)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    with Vault(vault) as v:
        everything, budget = blob_slot_bytes(v) * len(v.entries), min_gpu_budget(v, v.meta["top_k"] + 1)
    dec = GpuDecoder(sm, "cuda", budget, max_positions=64, host_cache_bytes=everything, in_place=True)
    ids = torch.randint(0, 100, (36,), generator=torch.Generator().manual_seed(3)).tolist()
    pieces = [ids[:8], *[[t] for t in ids[8:30]], ids[30:]]
    got = torch.cat([dec.forward(p).reshape(len(p), -1).cpu() for p in pieces])
    assert relative_error(load_reference(reference)(torch.tensor([ids]))[0], got) < TOLERANCE
    dec.account()
    stats = dec.cache.stats
    assert dec.placement is not None and dec.whole_token is not None
    assert stats.bytes_in_place > 0 and stats.hits > 0  # misses read in place, and experts moved into the slots


# the hybrids' tiny models with expert widths of 64, so that the Triton kernels and with them the graphs run
KERNEL_WIDTHS = {"lfm2_moe": dict(moe_intermediate_size=64), "granitemoehybrid": dict(intermediate_size=64),
                 "jamba": dict(intermediate_size=64)}


@needs_cuda
@pytest.mark.parametrize("family", sorted(HYBRIDS))
@pytest.mark.parametrize("resident", [False, True])
def test_cuda_decoder_runs_a_hybrid_family_with_graphs_between_its_mixer_layers(family, resident, tmp_path):
    architecture, named = HYBRIDS[family]
    vault = vault_of(tiny_model_dir(tmp_path, family, seed=2, architecture=architecture | KERNEL_WIDTHS[family]),
                     tmp_path / "vault")
    reference = load_reference(dequantised_reference(vault, tmp_path))
    with Vault(vault) as v:
        budget = blob_slot_bytes(v) * len(v.entries) if resident else min_gpu_budget(v, v.meta["top_k"])
    sm = OpenedVault(vault, dtype="float32", device="cuda", gpu_cache_bytes=budget)
    try:
        assert sm.decoder == "fast" and sm.describe()["transformers_layers"] == named
        gen = torch.Generator().manual_seed(3)
        a, b = (torch.randint(0, 100, (36,), generator=gen).tolist() for _ in range(2))
        want = reference(torch.tensor([a, b]))
        dec = sm.fast_decoder(64)
        assert dec.graphs and relative_error(want[0], decode_in_pieces(dec, a)) < TOLERANCE
        # the single-token steps after the first replayed captured graphs, the mixer layers eagerly between them
        assert (dec.whole_token if resident else dec.segments) is not None
        dec.reset()  # another sequence: the graphs stay, the family's cache is made again
        assert relative_error(want[1], decode_in_pieces(dec, b)) < TOLERANCE
    finally:
        sm.close()


@needs_cuda
def test_cuda_out_of_memory_is_a_one_line_error_naming_the_option():
    from smoe.runtime.cuda.cache import allocate

    with pytest.raises(SmoeError, match="out of memory allocating the GPU expert cache .* smaller --gpu-cache-gb"):
        allocate(1 << 50, torch.device("cuda"), "GPU expert cache", "--gpu-cache-gb")


@needs_cuda
def test_cuda_generate_cli_streams_text_and_reports_gpu_cache_stats(tmp_path):
    vault, _ = kernel_sized_vault(tmp_path, "qwen3_moe")
    r = smoe_cli("generate", vault, "-p", "the sea", "--max-tokens", "8", "--temperature", "0", "--device", "cuda",
                 "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 8 and out["stats"]["hits"] + out["stats"]["misses"] > 0


# --- the decode benchmark's model, on the CPU ---------------------------------------------------

SMALL_30B_LIKE = {"hidden_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_experts": 8,
                  "num_experts_per_tok": 2, "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 32, "bos_token_id": 0, "eos_token_id": 1}


def test_benchmark_vault_has_the_config_shapes_and_replayed_routing_picks_the_experts(tmp_path):
    import numpy as np

    from smoe.bench.decode import QWEN3_30B, gpu_bytes_per_token, write_model_vault
    from smoe.bench.replay import ReplayDecoder

    cfg = dict(QWEN3_30B) | SMALL_30B_LIKE
    vault = write_model_vault(tmp_path / "v", cfg, progress=False)
    with Vault(vault) as v:
        assert len(v.entries) == 2 * 8 and v.meta["expert_shapes"]["down"] == [128, 64]
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    replay = np.array([[[3, 5], [7, 0]], [[1, 2], [4, 6]]])  # [steps, layers, k]
    # four slots: one token's experts of both layers stay resident
    dec = ReplayDecoder(sm, "cpu", 4 * blob_slot_bytes(sm.vault), max_positions=8, route_replay=torch.from_numpy(replay))
    for step in range(2):
        dec.replay_step = step
        dec.forward([step + 2])
        assert dec.static.top_i[0].tolist() == replay[step, -1].tolist()  # the last layer's experts
        assert all(dec.cache.resident(layer, e) for layer, e in enumerate(replay[step]) for e in e)
    blob = sm.vault.entry(0, 0).size
    trunk = sum(t.numel() * 4 for w in dec.layers for t in (w.qkv, w.qk_norm, w.o, w.router, w.input_norm, w.post_norm))
    kv = 2 * 2 * 2 * 5 * 32 * 4
    assert gpu_bytes_per_token(dec, 5) == dec.lm_head.numel() * 4 + trunk + 2 * 2 * blob + kv


@pytest.mark.skipif(CUDA, reason="checks the machine without a GPU")
def test_bench_decode_without_a_gpu_is_a_one_line_error(tmp_path):
    r = smoe_cli("bench", "decode", "--workdir", tmp_path, "--no-baseline")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "smoe: error: smoe bench decode measures the GPU runtime: no CUDA device is available" in r.stderr


@pytest.mark.parametrize("option,named", [(("--sources", "ram"), "--sources 'ram'"),
                                          (("--llama-bench", "/nonexistent/llama-bench"), "not an executable file"),
                                          (("--prefill", "512,x"), "--prefill '512,x'"),
                                          (("--prefill", "0"), "positive number of tokens"),
                                          (("--host-misses", "zero-copy"), "--host-misses 'zero-copy'")])
def test_bench_decode_options_are_checked_before_any_work(tmp_path, option, named):
    r = smoe_cli("bench", "decode", "--workdir", tmp_path / "w", "--no-baseline", *option)
    assert r.returncode == 2 and named in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()  # nothing written


SMALL_V2_LITE_LIKE = {"hidden_size": 128, "moe_intermediate_size": 64, "intermediate_size": 256, "num_hidden_layers": 3,
                      "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                      "n_shared_experts": 1, "vocab_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
                      "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
                      "head_dim": 16, "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 4096}


def test_deepseek_shaped_benchmark_vault_loads_every_trunk_tensor_and_decodes_on_the_fast_path(tmp_path):
    import numpy as np

    from smoe.bench.decode import DEEPSEEK_V2_LITE, gpu_bytes_per_token, write_model_vault
    from smoe.bench.replay import ReplayDecoder

    cfg = dict(DEEPSEEK_V2_LITE) | SMALL_V2_LITE_LIKE
    vault = write_model_vault(tmp_path / "v", cfg, progress=False)
    with Vault(vault) as v:
        assert len(v.entries) == 2 * 8 and v.meta["moe_layers"] == [1, 2]
        assert v.meta["expert_shapes"]["down"] == [128, 64]
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")  # every trunk tensor loads: none missing
    assert sm.decoder == "fast" and sm.description.attention.kind == "mla"
    replay = np.array([[[0, 0], [3, 5], [7, 0]], [[0, 0], [1, 2], [4, 6]]])  # [steps, layers, k]; layer 0 is dense
    dec = ReplayDecoder(sm, "cpu", 4 * blob_slot_bytes(sm.vault), max_positions=8, route_replay=torch.from_numpy(replay))
    for step in range(2):
        dec.replay_step = step
        assert torch.isfinite(dec.forward([step + 2])).all()
        assert all(dec.cache.resident(layer, e) for layer, e in enumerate(replay[step]) if layer for e in e)
    latents = 3 * (64 + 16) * 4  # per position: each layer's latent and rotary key, fp32
    assert gpu_bytes_per_token(dec, 6) - gpu_bytes_per_token(dec, 5) == latents


def test_mixtral_shaped_benchmark_vault_names_its_experts_as_the_fast_path_reads_them(tmp_path):
    from smoe.bench.decode import MIXTRAL_8X7B, write_model_vault

    small = {"hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 4096}
    vault = write_model_vault(tmp_path / "v", dict(MIXTRAL_8X7B) | small, progress=False)
    with Vault(vault) as v:
        assert len(v.entries) == 2 * 8 and v.meta["top_k"] == 2
        assert v.meta["expert_shapes"] == {"gate": [192, 128], "up": [192, 128], "down": [128, 192]}
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")  # every trunk tensor loads: none missing
    assert sm.decoder == "fast" and sm.description.family == "mixtral"
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, 2), max_positions=8)
    assert torch.isfinite(dec.forward([3, 4])).all()


def test_benchmark_gguf_is_the_vault_without_a_vocabulary_and_n_cpu_moe_leaves_the_budget_on_the_gpu(tmp_path):
    """What `smoe bench decode --llama-bench` gives llama-bench: the same vault as GGUF, token ids only, and
    the --n-cpu-moe that keeps about the budget's share of the MoE layers' experts on the GPU."""
    import gguf

    from smoe.bench.decode import DEEPSEEK_V2_LITE, cpu_moe_layers, gguf_of, write_model_vault

    vault = write_model_vault(tmp_path / "v", dict(DEEPSEEK_V2_LITE) | SMALL_V2_LITE_LIKE, progress=False)
    path = gguf_of(vault)
    fields = gguf.GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "none" and "tokenizer.ggml.tokens" not in fields
    assert fields["deepseek2.vocab_size"].contents() == 256
    assert fields["deepseek2.leading_dense_block_count"].contents() == 1
    mtime = path.stat().st_mtime_ns
    assert gguf_of(vault) == path and path.stat().st_mtime_ns == mtime  # written once, kept for reruns
    # layer 0 is dense: with 4 MoE layers, 75% on the GPU puts layers 0-1 on the CPU
    assert [cpu_moe_layers([1, 2, 3, 4], f) for f in (1, 0.75, 0.5, 0.25, 0.1)] == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_gpu_decoder_runs_sequence_states_of_different_capacities_in_turn(family, tmp_path):
    vault, reference = tiny_vault_and_reference(tmp_path, family, 4, seed=2)
    sm = OpenedVault(vault, dtype="float32", kernel_path="dequant")
    dec = GpuDecoder(sm, "cpu", min_gpu_budget(sm.vault, 2), max_positions=16)
    other = dec.new_state(40)
    assert other.capacity != dec.own.capacity
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randint(0, 100, (12,), generator=gen).tolist(), torch.randint(0, 100, (12,), generator=gen).tolist()
    got = {"a": [], "b": []}
    for start, end in ((0, 6), (6, 7), (7, 8), (8, 12)):  # the two sequences alternate, each on its own state
        for name, ids, state in (("a", a, None), ("b", b, other)):
            dec.use(state)
            got[name].append(dec.forward(ids[start:end]).reshape(end - start, -1).cpu())
    ref = load_reference(reference)
    for name, ids in (("a", a), ("b", b)):
        assert relative_error(ref(torch.tensor([ids]))[0], torch.cat(got[name])) < TOLERANCE
