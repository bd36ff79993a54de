import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smoe.cli.demo import MODEL as TRAINED_MODEL
from smoe.errors import SmoeError
from smoe.format.vault import DATA_FILE, Vault
from smoe.quality.evaluate import load_reference
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY
from smoe.testing.tiny_models import tiny_families
from smoe.testing.vaults import (
    SHARED,
    SHARED_MODELS,
    dequantised_reference,
    tiny_vault,
    tiny_vault_and_reference,
    vault_of,
)

SHARED_MODEL = SHARED_MODELS["qwen3_moe"]
TOLERANCE = 1e-4  # fp32: the same weights in a different summation order


def smoe_cli(*args):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True)


def small_budget(vault: Path) -> int:
    """About a quarter of the experts' prepared fp32 size: reads, hits and evictions all happen."""
    with Vault(vault) as v:
        shapes = v.meta["expert_shapes"].values()
        per_expert = 4 * sum(o * i for o, i in shapes)
        top_k = v.meta["top_k"] or 1
        return max(per_expert * top_k * 2, per_expert * v.meta["num_experts"] * len(v.meta["moe_layers"]) // 4)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("family", tiny_families())
def test_streaming_logits_match_the_dequantised_transformers_model(family, tmp_path):
    vault, reference = tiny_vault_and_reference(tmp_path, family, seed=2)
    sm = OpenedVault(vault, dtype="float32", cache_bytes=small_budget(vault), kernel_path="dequant")
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    assert relative_error(load_reference(reference)(ids), sm.logits(ids)) < TOLERANCE
    assert sm.store.stats.misses > 0


def greedy_reference(reference_logits, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of the reference (full recompute each step) and each step's top-1/top-2 margin."""
    ids, margins = list(prompt), []
    for _ in range(steps):
        logits = reference_logits(torch.tensor([ids]))[0, -1]
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


def assert_greedy_agrees(tokens: list[int], reference_logits, prompt: list[int]) -> None:
    """Greedy tokens equal the reference's up to the first step whose top-1/top-2 margin is below 1e-3."""
    expected, margins = greedy_reference(reference_logits, prompt, len(tokens))
    for i, (got, want) in enumerate(zip(tokens, expected)):
        if got != want:
            assert margins[i] < 1e-3, f"token {i} differs with a reference margin of {margins[i]}"
            break


@pytest.mark.parametrize("bits", [4, 2])
def test_trained_model_greedy_output_matches_the_reference_with_a_cache_below_the_experts(bits, tmp_path):
    dequantised_reference(vault_of(TRAINED_MODEL, tmp_path / "vault", bits), tmp_path)
    budget = small_budget(tmp_path / "vault")
    sm = OpenedVault(tmp_path / "vault", dtype="float32", cache_bytes=budget, kernel_path="dequant")
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tmp_path / "vault")("It was a dark and stormy night; the rain")["input_ids"]
    ref_logits = load_reference(tmp_path / "reference")
    assert relative_error(ref_logits(torch.tensor([prompt])), sm.logits(torch.tensor([prompt]))) < TOLERANCE
    tokens, stats = generate(sm, prompt, max_tokens=24, params=GREEDY)
    assert_greedy_agrees(tokens, ref_logits, prompt)
    assert stats.misses > 0 and stats.hits > 0 and sm.store.used_bytes <= budget


def test_cache_smaller_than_one_tokens_experts_is_an_error_saying_the_minimum(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", seed=2)
    with pytest.raises(SmoeError, match=r"at least .* GB \([\d,]+ bytes\) is needed"):
        OpenedVault(vault, dtype="float32", cache_bytes=1000)


def test_prompt_longer_than_the_context_is_an_error(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", seed=2)
    sm = OpenedVault(vault, dtype="float32")
    with pytest.raises(SmoeError, match="exceeds the model's context"):
        generate(sm, list(range(100)), max_tokens=100)


def test_corrupt_blob_stops_generation_naming_layer_and_expert(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", seed=2)
    with Vault(vault) as v:
        entries = list(v.entries.values())
    with open(vault / DATA_FILE, "r+b") as f:
        for e in entries:  # damage every blob: whichever expert the router picks first fails
            f.seek(e.offset + 1)
            f.write(b"\xff\xfe")
    with pytest.raises(SmoeError, match=r"layer \d+ expert \d+: checksum mismatch"):
        generate(OpenedVault(vault, dtype="float32"), [1, 2, 3], max_tokens=2)


def test_generate_cli_prints_text_tokens_and_stats_as_json(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", seed=2)
    (tmp_path / "model").rename(tmp_path / "model-used")  # the vault alone must be enough
    proc = smoe_cli("generate", vault, "-p", "the old man", "--max-tokens", "5", "--json", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "tokens", "sampling", "stats", "decoder", "device"} and len(out["tokens"]) <= 5
    assert {"prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "hits", "misses", "hit_rate", "bytes_read",
            "peak_rss_bytes"} <= set(out["stats"])
    assert (out["decoder"], out["device"]) == ("fast", "cpu")


def test_generate_json_names_the_decoder_that_ran_so_a_fallback_cannot_pass_for_the_fast_one(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", seed=2)
    runs = {}
    for decoder in ("fast", "generic"):
        proc = smoe_cli("generate", vault, "-p", "the old man", "--max-tokens", "4", "--json", "--dtype", "float32",
                        "--decoder", decoder, "--device", "cpu")
        assert proc.returncode == 0, proc.stderr
        runs[decoder] = json.loads(proc.stdout)
        assert runs[decoder]["decoder"] == decoder
        assert runs[decoder]["stats"]["misses"] > 0  # the experts came through the cache the stats describe
    proc = smoe_cli("generate", tiny_vault(tmp_path / "g", "llama4_text"), "-p", "x", "--max-tokens", "2", "--json",
                    "--decoder", "fast", "--device", "cpu")
    assert proc.returncode == 2 and proc.stderr.strip().endswith("(use --decoder generic)")


def test_generate_cli_streams_trained_model_text_and_a_stats_line(tmp_path):
    vault_of(TRAINED_MODEL, tmp_path / "vault")
    proc = smoe_cli("generate", tmp_path / "vault", "-p", "The sea was", "--max-tokens", "16", "--cache-gb", "0.01")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 10
    assert "prompt tokens" in proc.stderr and "cache hit rate" in proc.stderr and "decode" in proc.stderr
    proc = smoe_cli("generate", tmp_path / "vault", "-p", "The sea was", "--cache-gb", "0.000001")
    assert proc.returncode == 2 and "is needed" in proc.stderr and "Traceback" not in proc.stderr


def test_eval_reproduces_the_reference_perplexity_of_the_shared_model(tmp_path):
    valid = SHARED / "corpus" / "valid.txt.gz"
    if not SHARED_MODEL.exists() or not valid.exists():
        pytest.skip("../shared model or corpus not present")
    vault_of(SHARED_MODEL, tmp_path / "vault")
    proc = smoe_cli("eval", tmp_path / "vault", "--ref", SHARED_MODEL, "--data", valid, "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["tokens"] == 16384 and abs(r["ref_ppl"] - 36.670) < 0.001
    assert 0.005 < r["kl"] < 0.03 and r["top1"] > 0.88 and r["ppl"] > r["ref_ppl"]


def test_chat_answers_each_line_until_the_input_ends(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe", seed=2)
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", "chat", str(vault), "--max-tokens", "4", "--dtype", "float32"],
                          input="the old man\n\nthe sea\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("prompt tokens") == 2  # the empty line in between asked again, it did not quit


def test_lean_decode_path_matches_the_transformers_path_on_the_trained_model(tmp_path):
    vault_of(TRAINED_MODEL, tmp_path / "vault")
    check_lean_against_transformers(tmp_path / "vault")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lean_decode_path_matches_the_transformers_path_on_tiny_models(family, tmp_path):
    vault = tiny_vault(tmp_path, family, seed=2)
    check_lean_against_transformers(vault)


def check_lean_against_transformers(vault: Path) -> None:
    from smoe.runtime.generate import next_logits_function

    sm = OpenedVault(vault, dtype="float32", cache_bytes=small_budget(vault), kernel_path="dequant")
    assert sm.fast_decoder(64) is not None
    ids = torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    fast = next_logits_function(sm, 64, "fast")
    slow = next_logits_function(sm, 64, "generic")
    for chunk in (ids[:30], ids[30:31], ids[31:32], ids[32:40]):  # prefill, decode steps, a second prefill
        a, b = slow(chunk), fast(chunk)
        assert relative_error(a, b) < TOLERANCE
