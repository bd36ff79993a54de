import json
import os
import subprocess
import sys

import pytest
import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.safetensors_io import write_safetensors
from smoe.format.vault import DATA_FILE, INDEX_FILE, TRUNK_FILE, QuantisedTensor, Vault, VaultWriter, verify

SHAPES = {"gate": (32, 64), "up": (32, 64), "down": (64, 32)}


def quantised_expert(seed: int, bits: int = 4, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    out = []
    for role, shape in shapes.items():
        w = torch.randn(shape, generator=g)
        codes, scales = codec.encode(w, bits)
        out.append(QuantisedTensor(role, shape, bits, codes, scales))
    return out


def build_vault(path, layers=2, experts=3, bits=4, alignment=4096, biases=False):
    writer = VaultWriter(path, bits, alignment)
    written = {}
    for layer in range(layers):
        for expert in range(experts):
            tensors = quantised_expert(layer * 100 + expert, bits)
            b = {"gate": torch.full((32,), float(expert), dtype=torch.bfloat16)} if biases else None
            writer.add(layer, expert, tensors, b)
            written[(layer, expert)] = tensors
    write_safetensors(path / TRUNK_FILE, [("w", torch.float32, (2, 2))], lambda n: torch.eye(2))
    writer.finish({"moe_layers": list(range(layers)), "num_experts": experts})
    return written


def reseal_header(path, **fields):
    """Rewrite header fields and its checksum, as a buggy tool or an attacker could."""
    import struct

    import xxhash

    from smoe.format.vault import HEADER

    names = ("magic", "version", "group", "bits", "alignment", "data_offset", "data_end", "blobs", "index_hash")
    with open(path / DATA_FILE, "r+b") as f:
        values = dict(zip(names, HEADER.unpack(f.read(HEADER.size)))) | fields
        packed = HEADER.pack(*(values[n] for n in names))
        f.seek(0)
        f.write(packed + struct.pack("<Q", xxhash.xxh64_intdigest(packed)))


def reseal_index(path, edit):
    """Apply `edit` to index.json and bind the header to the new index again."""
    import xxhash

    index = json.loads((path / INDEX_FILE).read_text())
    edit(index)
    raw = json.dumps(index).encode()
    (path / INDEX_FILE).write_bytes(raw)
    reseal_header(path, index_hash=xxhash.xxh64_intdigest(raw))


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_vault_round_trips_codes_scales_and_biases(tmp_path):
    written = build_vault(tmp_path / "v", biases=True)
    with Vault(tmp_path / "v") as v:
        for key, tensors in written.items():
            got, biases = v.read_expert(*key)
            assert [t.role for t in got] == ["gate", "up", "down"]
            for a, b in zip(got, tensors):
                assert a.shape == b.shape and a.bits == b.bits
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
            assert float(biases["gate"][0]) == key[1]
    assert verify(tmp_path / "v") == []


@pytest.mark.parametrize("alignment", [4096, 16384])
def test_every_blob_starts_on_the_header_alignment(tmp_path, alignment):
    build_vault(tmp_path / "v", alignment=alignment)
    with Vault(tmp_path / "v") as v:
        assert v.alignment == alignment
        assert all(e.offset % alignment == 0 for e in v.entries.values())
        assert os.path.getsize(tmp_path / "v" / DATA_FILE) % alignment == 0


def test_flipping_any_byte_of_a_blob_fails_the_read_naming_layer_and_expert(tmp_path):
    build_vault(tmp_path / "v", layers=1, experts=2)
    with Vault(tmp_path / "v") as v:
        e = v.entry(0, 1)
    for offset in (e.offset, e.offset + e.size // 2, e.offset + e.size - 1):
        build_vault(tmp_path / f"c{offset}", layers=1, experts=2)
        flip_byte(tmp_path / f"c{offset}" / DATA_FILE, offset)
        with Vault(tmp_path / f"c{offset}") as v:
            v.read_blob(0, 0)  # the other expert still reads
            with pytest.raises(SmoeError, match="layer 0 expert 1: checksum mismatch"):
                v.read_blob(0, 1)
        assert any("layer 0 expert 1" in p for p in verify(tmp_path / f"c{offset}"))


def test_flipping_a_padding_byte_fails_verify(tmp_path):
    build_vault(tmp_path / "v", layers=1, experts=2)
    with Vault(tmp_path / "v") as v:
        e = v.entry(0, 0)
    flip_byte(tmp_path / "v" / DATA_FILE, e.offset + e.size + 10)
    assert any("padding" in p for p in verify(tmp_path / "v"))


def test_flipping_a_header_byte_is_a_clear_error(tmp_path):
    build_vault(tmp_path / "v")
    flip_byte(tmp_path / "v" / DATA_FILE, 17)
    with pytest.raises(SmoeError, match="header checksum mismatch"):
        Vault(tmp_path / "v")


def test_truncated_data_file_is_detected_on_open_and_by_verify(tmp_path):
    build_vault(tmp_path / "v")
    data = tmp_path / "v" / DATA_FILE
    os.truncate(data, os.path.getsize(data) - 5000)
    with pytest.raises(SmoeError, match="truncated"):
        Vault(tmp_path / "v")
    assert any("truncated" in p for p in verify(tmp_path / "v"))


def test_edited_index_does_not_match_the_data(tmp_path):
    build_vault(tmp_path / "v")
    index = json.loads((tmp_path / "v" / INDEX_FILE).read_text())
    index["experts"][0]["offset"] += 4096
    (tmp_path / "v" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(SmoeError, match="index hash mismatch"):
        Vault(tmp_path / "v")


def test_corrupt_trunk_fails_verify(tmp_path):
    build_vault(tmp_path / "v")
    flip_byte(tmp_path / "v" / TRUNK_FILE, os.path.getsize(tmp_path / "v" / TRUNK_FILE) - 1)
    assert any("trunk" in p for p in verify(tmp_path / "v"))


def test_a_directory_that_is_not_a_vault_is_a_clear_error(tmp_path):
    with pytest.raises(SmoeError, match="not a vault"):
        Vault(tmp_path)


def test_writer_resumes_after_the_last_verified_blob(tmp_path):
    path = tmp_path / "v"
    writer = VaultWriter(path, 4)
    for expert in range(3):
        writer.add(0, expert, quantised_expert(expert))
    writer.close()  # the run dies here: no index, no header
    last = writer.entries[-1]
    flip_byte(path / DATA_FILE, last.offset + 3)  # and its last blob was damaged
    resumed = VaultWriter(path, 4)
    assert resumed.done() == {(0, 0), (0, 1)}
    resumed.add(0, 2, quantised_expert(2))
    write_safetensors(path / TRUNK_FILE, [], lambda n: None)
    resumed.finish({"moe_layers": [0], "num_experts": 3})
    assert verify(path) == []
    with Vault(path) as v:
        assert torch.equal(v.read_expert(0, 2)[0][0].codes, quantised_expert(2)[0].codes)


def test_mixed_depths_are_recorded_per_tensor(tmp_path):
    path = tmp_path / "v"
    writer = VaultWriter(path, 4)
    q4 = quantised_expert(0, 4)
    q2 = quantised_expert(0, 2)
    writer.add(0, 0, [q4[0], q4[1], q2[2]])
    write_safetensors(path / TRUNK_FILE, [], lambda n: None)
    writer.finish({"moe_layers": [0], "num_experts": 1})
    with Vault(path) as v:
        assert v.tensor_bits() == {"gate": {4: 1}, "up": {4: 1}, "down": {2: 1}}
        down = v.read_expert(0, 0)[0][2]
        assert torch.equal(down.decode(), q2[2].decode())


def test_trunk_stream_writer_output_loads_with_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64), "c": torch.tensor(2.0)}
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    write_safetensors(tmp_path / "t.safetensors", specs, tensors.__getitem__)
    loaded = load_file(tmp_path / "t.safetensors")
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_verify_cli_exit_code_is_zero_only_for_a_sound_vault(tmp_path):
    build_vault(tmp_path / "v")
    ok = subprocess.run([sys.executable, "-m", "smoe.cli", "verify", str(tmp_path / "v")], capture_output=True, text=True)
    assert ok.returncode == 0 and "vault OK" in ok.stdout
    flip_byte(tmp_path / "v" / DATA_FILE, 4096 + 1)
    bad = subprocess.run([sys.executable, "-m", "smoe.cli", "verify", str(tmp_path / "v"), "--json"],
                         capture_output=True, text=True)
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert not report["ok"] and any("checksum mismatch" in p for p in report["problems"])


@pytest.mark.parametrize("version, message", [
    (5, "format version 5, this smoe reads versions 2, 3 and 4"),
    (1, "version 1, whose trunk and config files carry no checksum; this smoe reads versions 2, 3 and 4: quantize"),
])
def test_a_vault_of_another_format_version_is_refused_clearly(tmp_path, version, message):
    build_vault(tmp_path / "v")
    reseal_header(tmp_path / "v", version=version)
    with pytest.raises(SmoeError, match=message):
        Vault(tmp_path / "v")


def point_every_entry_at_the_first_blob(index):
    for e in index["experts"]:
        e["offset"] = index["experts"][0]["offset"]


def duplicate_the_first_entry(index):
    index["experts"][1] = index["experts"][0]


def swap_the_first_two_experts(index):
    first, second = index["experts"][:2]
    first["expert"], second["expert"] = second["expert"], first["expert"]


def set_entry(key, value, i=0):
    def edit(index):
        index["experts"][i][key] = value
    return edit


def set_tensor(key, value):
    def edit(index):
        index["experts"][0]["tensors"][0][key] = value
    return edit


def set_top(key, value):
    def edit(index):
        index[key] = value
    return edit


CRAFTED_INDEXES = {
    "every entry points at one blob": point_every_entry_at_the_first_blob,
    "an entry listed twice": duplicate_the_first_entry,
    "two entries' expert numbers swapped": swap_the_first_two_experts,
    "an entry missing": lambda index: index["experts"].pop(),
    "an offset as a float": set_entry("offset", 4096.0),
    "a misaligned offset": set_entry("offset", 4096 + 64),
    "an offset past the data": set_entry("offset", 1 << 40),
    "a negative offset": set_entry("offset", -4096),
    "a blob size too large": set_entry("size", 1 << 20),
    "a blob size too small": set_entry("size", 64),
    "a layer not in moe_layers": set_entry("layer", 7),
    "an expert past num_experts": set_entry("expert", 3),
    "a string layer": set_entry("layer", "0"),
    "a checksum that is not hex": set_entry("checksum", "zz" * 8),
    "an unknown entry key": set_entry("extra", 1),
    "depth 3": set_tensor("bits", 3),
    "depth as a string": set_tensor("bits", "4"),
    "depth as true": set_tensor("bits", True),
    "a shape that disagrees": set_tensor("shape", [32, 32]),
    "a shape with a float": set_tensor("shape", [32.0, 64]),
    "codes bytes that disagree": set_tensor("codes_nbytes", 16),
    "a scales offset inside the codes": set_tensor("scales_offset", 0),
    "roles swapped": lambda index: index["experts"][0]["tensors"].reverse(),
    "an unknown top-level key": set_top("surprise", 1),
    "roles missing": lambda index: index.pop("roles"),
    "num_experts huge": set_top("num_experts", 10**9),
    "num_experts as true": set_top("num_experts", True),
    "top_k above num_experts": set_top("top_k", 4),
    "top_k zero": set_top("top_k", 0),
    "duplicate moe_layers": set_top("moe_layers", [0, 0]),
    "a negative expert dimension": set_top("expert_shapes", {"gate": [-32, 64], "up": [32, 64], "down": [64, 32]}),
    "a file outside the vault": set_top("files", {"../model.safetensors": {"size": 1, "xxh3_64": "0" * 16}}),
    "another bits than the header": set_top("bits", 2),
    "an index of experts only": lambda index: (index.clear(), index.update({"experts": []})),
}


@pytest.mark.parametrize("case", CRAFTED_INDEXES)
def test_every_crafted_index_is_a_one_line_error_on_open_and_in_verify(tmp_path, case):
    build_vault(tmp_path / "v")
    reseal_index(tmp_path / "v", CRAFTED_INDEXES[case])
    with pytest.raises(SmoeError) as err:
        Vault(tmp_path / "v")
    assert "\n" not in str(err.value)
    problems = verify(tmp_path / "v")
    assert problems and all("\n" not in p for p in problems)


@pytest.mark.parametrize("raw", [b"[" * 100000 + b"]" * 100000, b"{not json", b"\xff\xfe", b"[]"])
def test_index_bytes_that_are_not_an_index_are_a_one_line_error(tmp_path, raw):
    import xxhash

    build_vault(tmp_path / "v")
    (tmp_path / "v" / INDEX_FILE).write_bytes(raw)
    reseal_header(tmp_path / "v", index_hash=xxhash.xxh64_intdigest(raw))
    with pytest.raises(SmoeError) as err:
        Vault(tmp_path / "v")
    assert "\n" not in str(err.value)


def test_an_index_larger_than_its_blobs_can_need_is_refused_before_it_is_read(tmp_path):
    build_vault(tmp_path / "v")
    reseal_index(tmp_path / "v", set_top("source", {"padding": "x" * (2 << 20)}))
    with pytest.raises(SmoeError, match="more than 6 blobs can need"):
        Vault(tmp_path / "v")


@pytest.mark.parametrize("fields", [{"blobs": 10**6}, {"alignment": 3000, "data_offset": 3000}, {"bits": 3},
                                    {"data_end": 4097}])
def test_a_resealed_header_with_impossible_values_is_refused(tmp_path, fields):
    build_vault(tmp_path / "v")
    reseal_header(tmp_path / "v", **fields)
    with pytest.raises(SmoeError, match="header"):
        Vault(tmp_path / "v")


def test_a_failed_open_keeps_no_file_descriptor(tmp_path):
    build_vault(tmp_path / "v")
    reseal_index(tmp_path / "v", point_every_entry_at_the_first_blob)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        with pytest.raises(SmoeError):
            Vault(tmp_path / "v")
    assert len(os.listdir("/proc/self/fd")) == before
