"""Sources the sculptor cannot read exactly are refused by name, before anything is written."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from smoe.convert.sculpt import sculpt, write_trunk_file
from smoe.errors import SmoeError
from smoe.format.vault import TRUNK_FILE
from smoe.source import quantised as sq
from smoe.source.checkpoint import Checkpoint
from smoe.source.matching import map_experts
from smoe.testing.vaults import tiny_model_dir

EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"  # qwen3_moe tiny
BIAS = "model.layers.0.mlp.experts.down_proj_bias"  # gpt_oss tiny, [E, out]
STORED = {torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3_moe", seed=5, name="qwen3_moe")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "gpt_oss", seed=5, name="gpt_oss")


def variant(src: Path, dst: Path, changes: dict) -> Path:
    """A copy of model `src` whose tensors `changes` maps to new values (a function of the old one, or None)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    for name, change in changes.items():
        tensors[name] = change(tensors.get(name))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return t > 0
    return t.to(dtype) if dtype.is_floating_point else (t * 50).round().abs().to(dtype)


def assert_refused(model: Path, out: Path, *fragments: str) -> None:
    """One line naming what is wrong, and nothing written: no vault, no partial."""
    with pytest.raises(SmoeError) as info:
        sculpt(model, out, progress=False)
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    assert not list(out.parent.glob(f"{out.name}*"))


# ----- tensors whose stored values are not their real values -------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.bool, torch.float8_e4m3fn,
                                   torch.float8_e5m2], ids=str)
def test_expert_tensors_that_need_scales_they_lack_are_refused_by_name_and_dtype(qwen, tmp_path, dtype):
    model = variant(qwen, tmp_path / "model", {EXPERT: lambda t: cast(t, dtype)})
    assert_refused(model, tmp_path / "vault", EXPERT, STORED[dtype], "no scales")


def test_expert_biases_stored_as_integers_are_refused_by_name_and_dtype(gpt_oss, tmp_path):
    model = variant(gpt_oss, tmp_path / "model", {BIAS: lambda t: cast(t, torch.int32)})
    assert_refused(model, tmp_path / "vault", BIAS, "I32")


def test_fp64_expert_biases_beyond_fp32_range_are_refused_instead_of_stored_as_inf(gpt_oss, tmp_path):
    model = variant(gpt_oss, tmp_path / "model", {BIAS: lambda t: t.double().index_fill(1, torch.tensor([3]), 1e300)})
    with pytest.raises(SmoeError, match=f"{BIAS}.*fp32 range"):
        sculpt(model, tmp_path / "vault", progress=False)
    assert not (tmp_path / "vault").exists()


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_trunk_weights_holding_integers_or_unscaled_fp8_are_refused(qwen, tmp_path, dtype):
    weight = "model.layers.0.self_attn.q_proj.weight"
    model = variant(qwen, tmp_path / "bad", {weight: lambda t: cast(t, dtype)})
    assert_refused(model, tmp_path / "vault", weight, STORED[dtype])


def test_integer_trunk_buffers_are_copied_as_stored(qwen, tmp_path):
    # what vision towers store (deepseek-ocr); the tiny Qwen3-MoE has no such buffer, so the trunk
    # writer is run on its own, past the check that the model built from config.json takes every tensor
    position_ids = torch.arange(128, dtype=torch.int64)[None]
    model = variant(qwen, tmp_path / "good", {"model.position_ids": lambda _: position_ids})
    ckpt = Checkpoint(model)
    write_trunk_file(ckpt, map_experts(ckpt.config, ckpt.names()), tmp_path / TRUNK_FILE, progress=False)
    assert torch.equal(load_file(tmp_path / TRUNK_FILE)["model.position_ids"], position_ids)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_trunk_buffers_the_trunk_file_cannot_hold_are_refused_before_any_expert_is_encoded(qwen, tmp_path, dtype):
    model = variant(qwen, tmp_path / "model", {"model.counter": lambda _: torch.arange(4).to(dtype)})
    assert_refused(model, tmp_path / "vault", "model.counter", STORED[dtype].lower())


# ----- quantised sources ---------------------------------------------------------------------------


def write_model(root: Path, tensors: dict, quantization: dict) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "toy", "quantization_config": quantization}))
    save_file(tensors, root / "model.safetensors")
    return root


MISTYPED_PARTS = {
    # a dequantised DeepSeek checkpoint that kept its weight_scale_inv: scaling again would be wrong
    "bf16 weight with fp8 scales": ({"w.weight": torch.randn(256, 384).bfloat16(), "w.weight_scale_inv": torch.rand(2, 3)},
                                    {"quant_method": "fp8", "weight_block_size": [128, 128]}, "w.weight", "w.weight",
                                    "BF16"),
    # exponent bytes >= 128 read as negative int8
    "mxfp4 scales as int8": ({"e.up_blocks": torch.randint(0, 256, (2, 4, 2, 16), dtype=torch.uint8),
                              "e.up_scales": torch.randint(125, 135, (2, 4, 2), dtype=torch.uint8).view(torch.int8)},
                             {"quant_method": "mxfp4"}, "e.up", "e.up_scales", "I8"),
    # a bf16 weight beside stray MLX scales is not a packed bitstream
    "mlx weight as bf16": ({"m.weight": torch.randn(8, 16).bfloat16(), "m.scales": torch.rand(8, 2).bfloat16(),
                            "m.biases": torch.rand(8, 2).bfloat16()}, {"group_size": 32, "bits": 4}, "m.weight", "m.weight",
                           "BF16"),
}


@pytest.mark.parametrize("case", MISTYPED_PARTS)
def test_quantised_parts_in_a_dtype_their_format_does_not_store_are_refused(tmp_path, case):
    tensors, quantization, logical, part, dtype = MISTYPED_PARTS[case]
    with pytest.raises(SmoeError) as info:
        Checkpoint(write_model(tmp_path / "model", tensors, quantization)).load(logical)
    assert part in str(info.value) and f"stored as {dtype}" in str(info.value)


def test_mxfp4_scales_typed_e8m0_dequantise_by_their_exponent_bytes(tmp_path):
    blocks = torch.randint(0, 256, (2, 4, 2, 16), dtype=torch.uint8)
    exponents = torch.randint(120, 135, (2, 4, 2), dtype=torch.uint8)
    tensors = {"e.up_blocks": blocks, "e.up_scales": exponents.view(torch.float8_e8m0fnu)}
    ckpt = Checkpoint(write_model(tmp_path / "model", tensors, {"quant_method": "mxfp4"}))
    assert torch.equal(ckpt.load("e.up"), sq.dequant_mxfp4(blocks, exponents))


# ----- files outside the model directory -----------------------------------------------------------


def weights_at(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.randn(4, 8)}, path)
    return path


def indexed_model(root: Path, shard: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    return root


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_entries_pointing_outside_the_model_directory_are_refused(tmp_path, where):
    outside = weights_at(tmp_path / "outside.safetensors")
    shard = "../outside.safetensors" if where == "parent" else str(outside)
    with pytest.raises(SmoeError, match="outside the model directory") as info:
        Checkpoint(indexed_model(tmp_path / "model", shard))
    assert shard in str(info.value)


def test_links_resolving_outside_the_model_directory_are_refused_except_into_a_hub_cache(tmp_path):
    outside = weights_at(tmp_path / "elsewhere" / "x.safetensors")
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (single / "model.safetensors").symlink_to(outside)
    sharded = indexed_model(tmp_path / "sharded", "model-00001-of-00001.safetensors")
    (sharded / "model-00001-of-00001.safetensors").symlink_to(outside)
    for model in (single, sharded):
        with pytest.raises(SmoeError, match="outside the model directory") as info:
            Checkpoint(model)
        assert str(outside.resolve()) in str(info.value)
    # huggingface_hub's cache: snapshots/REV/* are relative links into the repository's blobs/
    repo = tmp_path / "hub" / "models--org--toy"
    blob = weights_at(repo / "blobs" / "0123abcd")
    (repo / "blobs" / "4567ef").write_text(json.dumps({"model_type": "toy"}))
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blob, snapshot))
    (snapshot / "config.json").symlink_to(os.path.relpath(repo / "blobs" / "4567ef", snapshot))
    assert torch.equal(Checkpoint(snapshot).load("w"), load_file(blob)["w"])


def test_a_tokenizer_file_linking_outside_the_model_directory_is_never_copied_into_a_vault(qwen, tmp_path):
    model = variant(qwen, tmp_path / "model", {})
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(secret)
    assert_refused(model, tmp_path / "vault", "tokenizer.json", "outside the model directory")
