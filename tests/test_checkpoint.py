"""Checkpoint: hand-parsed, validated safetensors headers; positioned reads; logical names of quantised sources."""

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from smoe.errors import SmoeError
from smoe.source import quantised as sq
from smoe.source.checkpoint import Checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "real-checkpoints"
CONFIG = {"model_type": "toy", "torch_dtype": "bfloat16"}

torch.manual_seed(0)


def write_model(root: Path, tensors: dict, config: dict | None = CONFIG, shards: int = 1) -> Path:
    """A model dir: config.json plus model.safetensors, or `shards` shards with our own index."""
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, root / "model.safetensors")
        return root
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, root / shard)
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(SmoeError) as info:
        Checkpoint(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    return message


# ----- plain safetensors -----

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.uint32, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_load_returns_the_saved_tensor_for_every_dtype(tmp_path, dtype):
    original = (torch.randn(3, 5, 7) * 20).to(dtype)
    ckpt = Checkpoint(write_model(tmp_path, {"w": original}))
    loaded = ckpt.load("w")
    assert loaded.dtype == dtype and loaded.shape == (3, 5, 7)
    assert torch.equal(loaded.view(torch.uint8), original.view(torch.uint8))


def test_single_file_reports_names_shapes_formats_and_sizes(tmp_path):
    tensors = {"b.weight": torch.randn(4, 6, dtype=torch.bfloat16), "a.bias": torch.randn(6),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    ckpt = Checkpoint(write_model(tmp_path, tensors))
    assert ckpt.has_weights and ckpt.config == CONFIG and ckpt.dir == tmp_path
    assert ckpt.names() == ["a.bias", "b.weight", "empty", "scalar"]
    assert ckpt.shape("b.weight") == (4, 6) and ckpt.shape("scalar") == ()
    assert ckpt.dtype("b.weight") == torch.bfloat16 and ckpt.dtype("a.bias") == torch.float32
    assert ckpt.source_format("b.weight") == "bf16" and ckpt.source_format("a.bias") == "fp32"
    assert ckpt.stored_nbytes("b.weight") == 48
    assert ckpt.total_nbytes() == 48 + 24 + 4
    assert ckpt.load("scalar").item() == 2.5 and ckpt.load("empty").shape == (0, 3)


def test_sharded_checkpoint_reads_each_tensor_from_its_shard(tmp_path):
    tensors = {f"layer.{i}.weight": torch.randn(2, 3) for i in range(5)}
    ckpt = Checkpoint(write_model(tmp_path, tensors, shards=3))
    assert ckpt.names() == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(ckpt.load(name), t)
    assert ckpt.total_nbytes() == 5 * 24


@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """Sizes of the positioned reads made after the fixture is set up."""
    sizes = []
    real_preadv = os.preadv

    def recording_preadv(fd, buffers, offset):
        sizes.append(sum(len(b) for b in buffers))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    return sizes


def test_load_with_index_reads_only_that_slice(tmp_path, bytes_read):
    fused = torch.randn(8, 16, 32, dtype=torch.bfloat16)
    ckpt = Checkpoint(write_model(tmp_path, {"experts": fused, "other": torch.randn(100)}))
    assert torch.equal(ckpt.load("experts", index=5), fused[5])
    assert sum(bytes_read) == 16 * 32 * 2
    with pytest.raises(IndexError):
        ckpt.load("experts", index=8)


def test_load_with_index_of_a_fused_quantised_tensor_reads_only_that_expert(tmp_path, bytes_read):
    tensors = mlx_parts("switch_mlp.down_proj", (4, 8, 64), 4, 32)
    ckpt = Checkpoint(write_model(tmp_path, tensors, {**CONFIG, "quantization": {"group_size": 32, "bits": 4}}))
    ckpt.load("switch_mlp.down_proj.weight", index=3)
    assert sum(bytes_read) == ckpt.stored_nbytes("switch_mlp.down_proj.weight") // 4


def test_data_truncated_after_opening_raises_on_load(tmp_path):
    path = write_model(tmp_path, {"w": torch.zeros(1000)}) / "model.safetensors"
    ckpt = Checkpoint(tmp_path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(SmoeError, match="truncated"):
        ckpt.load("w")


def test_unknown_tensor_name_raises(tmp_path):
    ckpt = Checkpoint(write_model(tmp_path, {"w": torch.zeros(1)}))
    with pytest.raises(SmoeError, match="no tensor named 'nope'"):
        ckpt.load("nope")


def test_close_releases_file_handles_and_reopens_on_demand(tmp_path):
    with Checkpoint(write_model(tmp_path, {"w": torch.arange(4.0)})) as ckpt:
        ckpt.load("w")
        assert ckpt._fds
    assert not ckpt._fds
    assert torch.equal(ckpt.load("w"), torch.arange(4.0))
    ckpt.close()


# ----- corrupt files -----


def test_truncated_header_raises_naming_the_file(tmp_path):
    path = write_model(tmp_path, {"w": torch.zeros(4)}) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:20])
    expect_error(tmp_path, str(path), "truncated or corrupt safetensors header")


def test_file_shorter_than_the_length_prefix_raises(tmp_path):
    write_model(tmp_path, {"w": torch.zeros(4)})
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    expect_error(tmp_path, "model.safetensors", "only 2 bytes")


def test_corrupt_header_json_raises_naming_the_file(tmp_path):
    write_model(tmp_path, {"w": torch.zeros(4)})
    write_raw(tmp_path / "model.safetensors", b'{"w": {"dtype": ', bytes(16))
    expect_error(tmp_path, "model.safetensors", "invalid JSON")


def test_data_offsets_beyond_end_of_file_raise(tmp_path):
    write_model(tmp_path, {"w": torch.zeros(4)})
    write_raw(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    expect_error(tmp_path, "model.safetensors", "beyond the")


def test_data_offsets_inconsistent_with_dtype_and_shape_raise(tmp_path):
    write_model(tmp_path, {"w": torch.zeros(4)})
    write_raw(tmp_path / "model.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(16))
    expect_error(tmp_path, "model.safetensors", "needs 16")


def test_unknown_dtype_in_header_raises(tmp_path):
    write_model(tmp_path, {"w": torch.zeros(4)})
    write_raw(tmp_path / "model.safetensors", {"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, bytes(1))
    expect_error(tmp_path, "model.safetensors", "unknown dtype 'Q7'")


# ----- directory layouts -----


def test_missing_config_raises(tmp_path):
    write_model(tmp_path, {"w": torch.zeros(1)}, config=None)
    expect_error(tmp_path, "no config.json")


def test_missing_path_raises(tmp_path):
    expect_error(tmp_path / "absent", "no such file or directory")


def test_a_path_that_is_neither_file_nor_directory_is_named_as_such(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    for path in (tmp_path / "pipe", Path(os.devnull)):
        expect_error(path, str(path), "not a regular file or directory")


def test_index_without_config_gives_an_empty_config(tmp_path):
    write_model(tmp_path, {"a": torch.zeros(1), "b": torch.zeros(2)}, config=None, shards=2)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.config == {} and ckpt.has_weights and ckpt.names() == ["a", "b"]


def test_index_only_dir_lists_names_without_weights(tmp_path):
    write_model(tmp_path, {"a": torch.zeros(1), "b": torch.zeros(2)}, shards=2)
    for shard in tmp_path.glob("*.safetensors"):
        shard.unlink()
    ckpt = Checkpoint(tmp_path)
    assert not ckpt.has_weights and ckpt.names() == ["a", "b"]
    assert ckpt.shape("a") is None and ckpt.stored_nbytes("a") is None and ckpt.dtype("a") is None
    assert ckpt.total_nbytes() == 12 and ckpt.source_format("a") == "bf16"
    with pytest.raises(SmoeError, match="no weight files"):
        ckpt.load("a")


def test_partly_missing_shards_raise(tmp_path):
    write_model(tmp_path, {"a": torch.zeros(1), "b": torch.zeros(2)}, shards=2)
    next(tmp_path.glob("*.safetensors")).unlink()
    expect_error(tmp_path, "1 of 2 shards", "missing")


def test_bare_config_file_has_no_weights(tmp_path):
    write_model(tmp_path, {"w": torch.zeros(1)})
    ckpt = Checkpoint(tmp_path / "config.json")
    assert ckpt.config == CONFIG and not ckpt.has_weights and ckpt.names() == []
    assert ckpt.total_nbytes() is None


def test_bin_index_gives_names_but_refuses_to_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    index = {"metadata": {"total_size": 8}, "weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    ckpt = Checkpoint(tmp_path)
    assert ckpt.names() == ["w"] and not ckpt.has_weights
    with pytest.raises(SmoeError, match="convert the checkpoint to safetensors first"):
        ckpt.load("w")


def test_single_bin_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    expect_error(tmp_path, "convert the checkpoint to safetensors first")


# ----- quantised sources -----


def mlx_parts(prefix: str, shape: tuple, bits: int, group_size: int) -> dict:
    *lead, in_f = shape
    return {
        f"{prefix}.weight": torch.randint(0, 2**31, (*lead, in_f * bits // 32), dtype=torch.int64).to(torch.uint32),
        f"{prefix}.scales": torch.rand(*lead, in_f // group_size, dtype=torch.bfloat16),
        f"{prefix}.biases": torch.randn(*lead, in_f // group_size, dtype=torch.bfloat16),
    }


def test_mlx_affine_parts_collapse_and_dequantise(tmp_path):
    tensors = {**mlx_parts("mlp.switch_mlp.up_proj", (4, 8, 128), 4, 64),
               **mlx_parts("mlp.gate", (8, 128), 8, 64), "norm.weight": torch.ones(8)}
    config = {**CONFIG, "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                                         "mlp.gate": {"group_size": 64, "bits": 8}}}
    ckpt = Checkpoint(write_model(tmp_path, tensors, config))
    name = "mlp.switch_mlp.up_proj.weight"
    assert ckpt.names() == ["mlp.gate.weight", name, "norm.weight"]
    assert ckpt.source_format(name) == "mlx_affine" and ckpt.source_format("norm.weight") == "fp32"
    assert ckpt.shape(name) == (4, 8, 128) and ckpt.shape("mlp.gate.weight") == (8, 128)
    parts = [tensors[f"mlp.switch_mlp.up_proj.{p}"] for p in ("weight", "scales", "biases")]
    assert ckpt.stored_nbytes(name) == sum(t.numel() * t.element_size() for t in parts)
    full = ckpt.load(name)
    assert torch.equal(full, sq.dequant_mlx_affine(*parts, 4, 64))
    assert torch.equal(ckpt.load(name, index=2), full[2])
    gate = [tensors[f"mlp.gate.{p}"] for p in ("weight", "scales", "biases")]
    assert torch.equal(ckpt.load("mlp.gate.weight"), sq.dequant_mlx_affine(*gate, 8, 64))


def test_mlx_scales_without_an_mlx_config_raise(tmp_path):
    write_model(tmp_path, mlx_parts("x", (8, 64), 4, 32))
    expect_error(tmp_path, "x.scales", "no MLX 'quantization'")


def compressed_parts(prefix: str, out_f: int, in_f: int, group_size: int = 32) -> dict:
    return {
        f"{prefix}.weight_packed": torch.randint(-2**31, 2**31, (out_f, in_f // 8), dtype=torch.int64).to(torch.int32),
        f"{prefix}.weight_scale": torch.rand(out_f, in_f // group_size, dtype=torch.bfloat16),
        f"{prefix}.weight_shape": torch.tensor([out_f, in_f]),
    }


COMPRESSED_CONFIG = {**CONFIG, "quantization_config": {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"format": "pack-quantized", "targets": ["Linear"], "weights": {
        "num_bits": 4, "group_size": 32, "symmetric": True, "strategy": "group", "type": "int"}}}}}


def test_compressed_tensors_parts_collapse_and_dequantise(tmp_path):
    tensors = {**compressed_parts("experts.0.down_proj", 16, 64), "router.weight": torch.randn(2, 16)}
    ckpt = Checkpoint(write_model(tmp_path, tensors, COMPRESSED_CONFIG))
    name = "experts.0.down_proj.weight"
    assert ckpt.names() == [name, "router.weight"]
    assert ckpt.source_format(name) == "compressed_int4" and ckpt.shape(name) == (16, 64)
    expected = sq.dequant_compressed_int(tensors[name + "_packed"], tensors[name + "_scale"], (16, 64), 4, 32)
    assert torch.equal(ckpt.load(name), expected)
    assert torch.equal(ckpt.load(name, index=3), expected[3])


def test_compressed_tensors_rows_load_alone_with_their_zero_points(tmp_path):
    tensors = compressed_parts("proj", 20, 64)
    tensors["proj.weight_zero_point"] = torch.randint(-2**31, 2**31, (3, 2), dtype=torch.int64).to(torch.int32)
    config = json.loads(json.dumps(COMPRESSED_CONFIG))
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    ckpt = Checkpoint(write_model(tmp_path, tensors, config))
    assert ckpt.names() == ["proj.weight"]
    full = ckpt.load("proj.weight")
    expected = sq.dequant_compressed_int(tensors["proj.weight_packed"], tensors["proj.weight_scale"], (20, 64), 4, 32,
                                         tensors["proj.weight_zero_point"])
    assert torch.equal(full, expected)
    for row in range(20):
        assert torch.equal(ckpt.load("proj.weight", index=row), full[row])


def test_fp8_block_parts_collapse_and_dequantise(tmp_path):
    weight = torch.randn(200, 300).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3)
    config = {**CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    tensors = {"experts.0.up_proj.weight": weight, "experts.0.up_proj.weight_scale_inv": scale_inv}
    ckpt = Checkpoint(write_model(tmp_path, tensors, config))
    name = "experts.0.up_proj.weight"
    assert ckpt.names() == [name] and ckpt.source_format(name) == "fp8_block"
    assert ckpt.shape(name) == (200, 300) and ckpt.stored_nbytes(name) == 200 * 300 + 6 * 4
    assert ckpt.dtype(name) == torch.bfloat16
    expected = sq.dequant_fp8_block(weight, scale_inv)
    assert torch.equal(ckpt.load(name), expected)
    for row in (0, 127, 128, 199):
        assert torch.equal(ckpt.load(name, index=row), expected[row])


def test_load_with_index_of_a_2d_fp8_tensor_reads_one_row_and_its_scale_row(tmp_path, bytes_read):
    tensors = {"w.weight": torch.randn(256, 384).to(torch.float8_e4m3fn), "w.weight_scale_inv": torch.rand(2, 3)}
    ckpt = Checkpoint(write_model(tmp_path, tensors))
    assert torch.equal(ckpt.load("w.weight", index=200), sq.dequant_fp8_block(*tensors.values())[200])
    assert sum(bytes_read) == 384 + 3 * 4


def test_mxfp4_parts_collapse_and_dequantise(tmp_path):
    blocks = torch.randint(0, 256, (4, 6, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 130, (4, 6, 2), dtype=torch.uint8)
    tensors = {"mlp.experts.gate_up_proj_blocks": blocks, "mlp.experts.gate_up_proj_scales": scales,
               "mlp.experts.gate_up_proj_bias": torch.randn(4, 6)}
    config = {**CONFIG, "quantization_config": {"quant_method": "mxfp4"}}
    ckpt = Checkpoint(write_model(tmp_path, tensors, config))
    name = "mlp.experts.gate_up_proj"
    assert ckpt.names() == [name, "mlp.experts.gate_up_proj_bias"]
    assert ckpt.source_format(name) == "mxfp4" and ckpt.shape(name) == (4, 6, 64)
    expected = sq.dequant_mxfp4(blocks, scales)
    assert torch.equal(ckpt.load(name), expected)
    assert torch.equal(ckpt.load(name, index=1), expected[1])


@pytest.mark.parametrize("quantization, fragment", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
    ({"group_size": 32, "bits": 4, "mode": "mxfp4"}, "'mlx mxfp4'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}}, "'compressed-tensors float-quantized'"),
])
def test_unsupported_source_quantisation_is_named(tmp_path, quantization, fragment):
    write_model(tmp_path, {"w": torch.zeros(1)}, {**CONFIG, "quantization_config": quantization})
    expect_error(tmp_path, "unsupported source quantisation", fragment)


def test_gptq_tensor_names_are_refused_even_without_a_config_entry(tmp_path):
    write_model(tmp_path, {"x.qweight": torch.zeros(2, dtype=torch.int32), "x.scales": torch.zeros(2)})
    expect_error(tmp_path, "unsupported source quantisation", "gptq/awq", "x.qweight")


def test_stray_weight_scale_of_an_unsupported_format_is_refused(tmp_path):
    tensors = {"x.weight": torch.zeros(2, 2, dtype=torch.int8), "x.weight_scale": torch.ones(2, 1)}
    write_model(tmp_path, tensors)
    expect_error(tmp_path, "unsupported source quantisation", "x.weight_scale")


# ----- real published index files (index-only mode) -----


def real(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.skip("../shared not present")
    return path


def test_real_compressed_tensors_index_collapses_packed_parts():
    ckpt = Checkpoint(real("gemma4-26b-a4b-int4"))
    names = ckpt.names()
    assert not ckpt.has_weights
    assert not [n for n in names if n.endswith((".weight_packed", ".weight_scale", ".weight_shape"))]
    assert "model.language_model.layers.0.router.per_expert_scale" in names
    name = "model.language_model.layers.0.experts.0.down_proj.weight"
    assert name in names and ckpt.source_format(name) == "compressed_int4"
    assert ckpt.source_format("model.language_model.layers.0.mlp.down_proj.weight") == "bf16"
    assert ckpt.shape(name) is None and ckpt.total_nbytes() == 17191252228


def test_real_mlx_index_collapses_scales_and_biases():
    ckpt = Checkpoint(real("mistral-small-4-mlx-4bit"))
    names = ckpt.names()
    assert not [n for n in names if n.endswith((".scales", ".biases"))]
    fused = "language_model.model.layers.0.mlp.switch_mlp.down_proj.weight"
    assert fused in names and ckpt.source_format(fused) == "mlx_affine"
    assert ckpt.source_format("language_model.model.layers.0.mlp.gate.weight") == "bf16"
    assert len(names) == 1483 - 2 * 434


def test_real_bin_index_lists_names_without_weights():
    ckpt = Checkpoint(real("mixtral-8x7b-dolphin-bin"))
    assert not ckpt.has_weights and "model.layers.0.block_sparse_moe.experts.0.w1.weight" in ckpt.names()
    with pytest.raises(SmoeError, match="convert the checkpoint to safetensors first"):
        ckpt.load("model.layers.0.block_sparse_moe.experts.0.w1.weight")


def test_real_index_without_config_has_empty_config():
    ckpt = Checkpoint(real("qwen3moe-30b-a3b-transgqa-noconfig"))
    assert ckpt.config == {} and "model.layers.0.mlp.experts.0.down_proj.weight" in ckpt.names()


def test_real_unsorted_index_gives_sorted_names():
    names = Checkpoint(real("minimax-m1")).names()
    assert names == sorted(names) and len(names) == 8243


def test_real_bare_config_file_has_no_names():
    ckpt = Checkpoint(real("mixtral-8x22b-wizardlm2") / "config.json")
    assert ckpt.config["model_type"] == "mixtral" and ckpt.names() == [] and not ckpt.has_weights
