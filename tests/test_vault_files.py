"""Every file of a vault that a reader uses is covered by a checksum, checked when the vault is opened."""

import json
import os
import subprocess
import sys

import pytest
import torch

from smoe.errors import SmoeError
from smoe.format.vault import (
    CONFIG_FILE,
    DATA_FILE,
    FORMAT_VERSION,
    HEADER,
    INDEX_FILE,
    TRUNK_FILE,
    Vault,
    checksum,
    verify,
    version_notice,
)
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.testing import vaults


@pytest.fixture(scope="module")
def tiny_vault(tmp_path_factory):
    return vaults.tiny_vault(tmp_path_factory.mktemp("files"), "qwen3_moe", seed=3)


def copy_vault(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def open_model(vault):
    return OpenedVault(vault, dtype="float32", cache_bytes=1 << 30)


def test_every_file_but_the_blobs_is_listed_with_its_checksum(tiny_vault):
    index = json.loads((tiny_vault / INDEX_FILE).read_text())
    on_disk = {p.name for p in tiny_vault.iterdir()} - {"experts.bin", INDEX_FILE}
    assert set(index["files"]) == on_disk and {TRUNK_FILE, CONFIG_FILE} <= on_disk


def test_config_names_smoe_as_its_quantization_method_and_the_model_sees_the_source_config(tiny_vault):
    raw = json.loads((tiny_vault / CONFIG_FILE).read_text())
    assert raw["quantization_config"]["quant_method"] == "smoe" and raw["quantization_config"]["version"] == FORMAT_VERSION
    with Vault(tiny_vault) as v:
        assert "quantization_config" not in v.config and v.config["num_experts_per_tok"] == raw["num_experts_per_tok"]


def test_a_flipped_trunk_byte_stops_the_model_from_opening_and_fails_verify(tiny_vault, tmp_path):
    vault = copy_vault(tiny_vault, tmp_path / "v")
    trunk = vault / TRUNK_FILE
    data = bytearray(trunk.read_bytes())
    data[-3] ^= 0x10  # tensor data, not the header: safetensors itself would not notice
    trunk.write_bytes(bytes(data))
    with pytest.raises(SmoeError, match="corrupt trunk"):
        open_model(vault)
    assert any("corrupt trunk" in p for p in verify(vault))


def test_an_edited_config_value_stops_the_model_from_opening_and_fails_verify(tiny_vault, tmp_path):
    vault = copy_vault(tiny_vault, tmp_path / "v")
    config = json.loads((vault / CONFIG_FILE).read_text())
    config["num_experts_per_tok"] += 1
    (vault / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    with pytest.raises(SmoeError, match="config.json.*(checksum mismatch|bytes as the index says)"):
        open_model(vault)
    assert verify(vault)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_flipped_byte_in_any_copied_file_fails_open_and_verify(tiny_vault, tmp_path, name):
    vault = copy_vault(tiny_vault, tmp_path / "v")
    if not (vault / name).exists():
        pytest.fail(f"the tiny model's vault should hold {name}")
    data = bytearray((vault / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (vault / name).write_bytes(bytes(data))
    with pytest.raises(SmoeError, match="checksum mismatch"):
        Vault(vault)
    assert any(name in p for p in verify(vault))


def test_a_tokenizer_file_added_after_quantizing_is_refused(tiny_vault, tmp_path):
    vault = copy_vault(tiny_vault, tmp_path / "v")
    (vault / "added_tokens.json").write_text('{"<evil>": 5}')
    with pytest.raises(SmoeError, match="not covered by the index"):
        Vault(vault)


def test_a_deleted_copied_file_is_refused(tiny_vault, tmp_path):
    vault = copy_vault(tiny_vault, tmp_path / "v")
    (vault / "tokenizer.json").unlink()
    with pytest.raises(SmoeError, match="missing"):
        Vault(vault)


def test_a_failed_model_open_keeps_no_file_descriptor_or_thread(tiny_vault, tmp_path):
    import threading

    vault = copy_vault(tiny_vault, tmp_path / "v")
    data = bytearray((vault / TRUNK_FILE).read_bytes())
    data[-3] ^= 0x10
    (vault / TRUNK_FILE).write_bytes(bytes(data))
    with pytest.raises(SmoeError):  # warm up: imports and caches open their own files once
        open_model(vault)
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(30):
        with pytest.raises(SmoeError):
            open_model(vault)
    assert len(os.listdir("/proc/self/fd")) == fds and threading.active_count() <= threads


def test_generate_on_an_edited_config_is_one_line_and_exit_2(tiny_vault, tmp_path):
    vault = copy_vault(tiny_vault, tmp_path / "v")
    config = json.loads((vault / CONFIG_FILE).read_text())
    (vault / CONFIG_FILE).write_text(json.dumps(config | {"num_experts_per_tok": 5}, indent=2) + "\n")
    r = subprocess.run([sys.executable, "-m", "smoe.cli", "generate", str(vault), "-p", "hello", "--max-tokens", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("smoe: error:"), r.stderr


def test_a_model_opens_from_a_sound_vault_and_runs(tiny_vault):
    sm = open_model(tiny_vault)
    try:
        assert torch.isfinite(sm.logits(torch.tensor([[1, 2, 3]]))).all()
    finally:
        sm.close()


def as_version_2(vault):
    """The vault as format version 2 wrote it: config.json keeps the source's model_type; index and header say 2."""
    import struct

    import xxhash

    config = json.loads((vault / CONFIG_FILE).read_text())
    config["model_type"] = config["quantization_config"].pop("model_type")
    config["quantization_config"]["version"] = 2
    raw = (json.dumps(config, indent=2) + "\n").encode()
    (vault / CONFIG_FILE).write_bytes(raw)
    index = json.loads((vault / INDEX_FILE).read_text())
    index["version"], index["files"][CONFIG_FILE] = 2, {"size": len(raw), "xxh3_64": checksum(raw)}
    raw_index = json.dumps(index, indent=1).encode()
    (vault / INDEX_FILE).write_bytes(raw_index)
    with open(vault / DATA_FILE, "r+b") as f:
        fields = list(HEADER.unpack(f.read(HEADER.size)))
        fields[1], fields[-1] = 2, xxhash.xxh64_intdigest(raw_index)
        packed = HEADER.pack(*fields)
        f.seek(0)
        f.write(packed + struct.pack("<Q", xxhash.xxh64_intdigest(packed)))
    return vault


def test_a_version_2_vault_still_opens_and_verify_names_its_format(tiny_vault, tmp_path):
    old = as_version_2(copy_vault(tiny_vault, tmp_path / "v2"))
    with Vault(old) as v2, Vault(tiny_vault) as v3:
        assert v2.config == v3.config and v3.config["model_type"] == "qwen3_moe"
    tokens = {}
    for name, vault in (("v2", old), ("v3", tiny_vault)):
        model = open_model(vault)
        try:
            tokens[name] = generate(model, [1, 2, 3, 4], max_tokens=6)[0]
        finally:
            model.close()
    assert tokens["v2"] == tokens["v3"]
    assert version_notice(tiny_vault) is None
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", "verify", str(old)], capture_output=True, text=True)
    assert proc.returncode == 0 and "vault OK" in proc.stdout, proc.stdout + proc.stderr
    assert f"NOTE format version 2 (still read; quantize again for {FORMAT_VERSION}:" in proc.stdout
