"""Every file of a vault that a reader uses is covered by a checksum, checked when the vault is opened."""

import json
import os
import subprocess
import sys

import pytest
import torch

from smoe.cli.commands import main
from smoe.errors import SmoeError
from smoe.format.vault import (
    CONFIG_FILE,
    FORMAT_VERSION,
    INDEX_FILE,
    TRUNK_FILE,
    Vault,
    verify,
    version_notice,
)
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY
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
    sealed = raw["quantization_config"]
    assert sealed["smoe_quant_method"] == "smoe" and sealed["version"] == FORMAT_VERSION
    # keys transformers reads are absent, so that it refuses the vault whichever class names it (docs/vault.md)
    assert raw["model_type"] == "smoe_vault" and sealed["source_model_type"] == "qwen3_moe"
    assert "quant_method" not in sealed and "model_type" not in sealed
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


def keys_transformers_reads(sealed):
    sealed["quant_method"] = sealed.pop("smoe_quant_method")
    sealed["model_type"] = sealed.pop("source_model_type")


@pytest.mark.parametrize("edit, message", [
    (keys_transformers_reads, "needs version 4 and smoe_quant_method 'smoe'"),
    (lambda sealed: sealed.pop("source_model_type"), "the source's in quantization_config.source_model_type"),
    (lambda sealed: sealed.update(version=3), "needs version 4"),
])
def test_a_config_json_sealed_otherwise_than_its_format_version_says_is_refused(tiny_vault, tmp_path, edit, message):
    vault = copy_vault(tiny_vault, tmp_path / "v")
    config = json.loads((vault / CONFIG_FILE).read_text())
    edit(config["quantization_config"])
    vaults.reseal(vault, CONFIG_FILE, json.dumps(config).encode())
    with pytest.raises(SmoeError, match=message):
        Vault(vault)


def test_a_model_opens_from_a_sound_vault_and_runs(tiny_vault):
    sm = open_model(tiny_vault)
    try:
        assert torch.isfinite(sm.logits(torch.tensor([[1, 2, 3]]))).all()
    finally:
        sm.close()


# what `smoe verify` says transformers gets wrong with each older format
OLDER_FORMAT_RISKS = {2: "loads a version-2 vault with random experts",
                      3: "a model class named directly, as in Qwen3MoeForCausalLM.from_pretrained(VAULT), builds"}


@pytest.mark.parametrize("version", sorted(OLDER_FORMAT_RISKS))
def test_an_older_format_still_opens_to_the_same_model_and_verify_names_its_risk(tiny_vault, tmp_path, version,
                                                                                  capsys):
    old = vaults.as_format_version(copy_vault(tiny_vault, tmp_path / "old"), version)
    with Vault(old) as older, Vault(tiny_vault) as current:
        assert older.header["version"] == version and current.header["version"] == FORMAT_VERSION
        assert older.config == current.config and current.config["model_type"] == "qwen3_moe"
    tokens = {}
    for name, vault in (("old", old), ("current", tiny_vault)):
        model = open_model(vault)
        try:
            tokens[name] = generate(model, [1, 2, 3, 4], max_tokens=6, params=GREEDY)[0]
        finally:
            model.close()
    assert tokens["old"] == tokens["current"]
    assert version_notice(tiny_vault) is None
    capsys.readouterr()
    assert main(["verify", str(old)]) == 0
    out = capsys.readouterr().out
    assert "vault OK" in out and f"NOTE format version {version} (still read; quantize again for {FORMAT_VERSION}:" in out
    assert OLDER_FORMAT_RISKS[version] in out
