"""A vault whose checksums all match is still read with every check: the trunk's safetensors header,
the trunk's dtypes and values, every JSON file smoe reads (a key given twice), the tokenizer's presence.
Each case is sealed again after the edit (smoe.testing.vaults.reseal), so only these checks can catch it."""

import json
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from smoe.cli.commands import main
from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.format.vault import INDEX_FILE, TRUNK_FILE, Vault, verify
from smoe.quality.plan import load_plan
from smoe.quality.sensitivity import load_table
from smoe.source.checkpoint import Checkpoint
from smoe.testing import vaults


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sealed")
    return {"vault": vaults.tiny_vault(tmp, "qwen3_moe", seed=3), "model": tmp / "model"}


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("smoe: error:") and len(err.splitlines()) == 1, err
    return err


# --- the trunk's safetensors header ------------------------------------------------------------


def split(trunk: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", trunk[:8])
    return json.loads(trunk[8 : 8 + n]), trunk[8 + n :]


def joined(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def edited(edit):
    def make(trunk: bytes) -> bytes:
        header, data = split(trunk)
        by_offset = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
        edit(header, by_offset)
        return joined(header, data)
    return make


def shift(header, names, which, by):
    begin, end = header[names[which]]["data_offsets"]
    header[names[which]]["data_offsets"] = [begin + by, end + by]


def truncated_json(trunk: bytes) -> bytes:
    (n,) = struct.unpack("<Q", trunk[:8])
    return trunk[: 8 + n // 2] + b" " * (n - n // 2) + trunk[8 + n :]


def duplicate_name(trunk: bytes) -> bytes:
    header, data = split(trunk)
    first = next(k for k in header if k != "__metadata__")
    raw = json.dumps(header).encode()
    raw = b"{" + json.dumps(first).encode() + b":" + json.dumps(header[first]).encode() + b"," + raw[1:]
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def gap_after_the_first(trunk: bytes) -> bytes:
    """8 spare bytes after the first tensor, every later one moved past them: a file that reads, with a hole."""
    header, data = split(trunk)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    cut = header[names[0]]["data_offsets"][1]
    for name in names[1:]:
        shift(header, names, names.index(name), 8)
    return joined(header, data[:cut] + bytes(8) + data[cut:])


HEADER_CASES = {
    "truncated JSON": (truncated_json, "invalid JSON"),
    "overlapping offsets": (edited(lambda h, names: shift(h, names, 1, -8)), "an overlap"),
    "a gap between tensors": (gap_after_the_first, "a gap"),
    "offsets past the end": (edited(lambda h, names: shift(h, names, -1, 8)), "beyond the"),
    "unknown dtype": (edited(lambda h, names: h[names[0]].update(dtype="Q7")), "unknown dtype 'Q7'"),
    "a 2^40 header length": (lambda t: struct.pack("<Q", 1 << 40) + t[8:], "header length 1099511627776"),
    "an empty file": (lambda t: b"", "file is only 0 bytes"),
    "a tensor named twice": (duplicate_name, "appears twice"),
}
COMMANDS = {
    "generate": lambda v, out: ["generate", str(v), "-p", "hi", "--max-tokens", "1", "--json"],
    "dequantize": lambda v, out: ["dequantize", str(v), "-o", str(out)],
    "export": lambda v, out: ["export", str(v), "--to", "gguf", "-o", str(out), "-q"],
}


@pytest.mark.parametrize("case", HEADER_CASES)
def test_every_malformed_trunk_header_is_one_line(built, tmp_path, capsys, case):
    make, reason = HEADER_CASES[case]
    vault = copy(built["vault"], tmp_path / "v")
    vaults.reseal(vault, TRUNK_FILE, make((vault / TRUNK_FILE).read_bytes()))
    for command, argv in COMMANDS.items():
        out = tmp_path / f"out-{command}"
        assert main(argv(vault, out)) == 2, command
        err = one_line_error(capsys)
        assert f"{vault / TRUNK_FILE}: truncated or corrupt safetensors header" in err, (command, err)
        assert re.search(reason, err), (command, err)
        assert not out.exists(), command
    problems = verify(vault)
    assert len(problems) == 1 and TRUNK_FILE in problems[0] and re.search(reason, problems[0])
    with pytest.raises(SmoeError, match=reason):
        AutoModelForCausalLM.from_pretrained(vault)  # smoe's quantizer checks the trunk before transformers reads it


# --- JSON files: a key given twice --------------------------------------------------------------


def with_duplicate(raw: bytes) -> tuple[bytes, str]:
    """The object of `raw` with its first key given once more, first (Python's json would keep the
    original value, a reader that keeps the first would not)."""
    key, value = next(iter(json.loads(raw).items()))
    dup = {"hidden_size": 7}.get(key, "duplicate" if not isinstance(value, str) else value + "-duplicate")
    return b"{" + json.dumps(key).encode() + b":" + json.dumps(dup).encode() + b"," + raw.lstrip()[1:], key


def in_vault(name):
    def case(built, tmp):
        vault = copy(built["vault"], tmp / "v")
        raw, key = with_duplicate((vault / name).read_bytes())
        vaults.reseal(vault, name, raw)
        return lambda: Vault(vault), vault / name, key
    return case


def in_source(name):
    def case(built, tmp):
        model = copy(built["model"], tmp / "m")
        raw, key = with_duplicate((model / name).read_bytes())
        (model / name).write_bytes(raw)
        return lambda: sculpt(model, tmp / "out", progress=False), model / name, key
    return case


def in_safetensors_index(built, tmp):
    model = copy(built["model"], tmp / "m")
    names = load_file(model / TRUNK_FILE).keys()
    path = model / "model.safetensors.index.json"
    index = json.dumps({"weight_map": dict.fromkeys(names, TRUNK_FILE)})
    path.write_text('{"weight_map": {"x": "model.safetensors"}, ' + index[1:])
    return lambda: Checkpoint(model), path, "weight_map"


def in_plan(built, tmp):
    path = tmp / "plan.json"
    path.write_text('{"format": "smoe-plan", "format": "smoe-plan", "tensors": {}}')
    return lambda: load_plan(path), path, "format"


def in_sensitivity_table(built, tmp):
    path = tmp / "sensitivity.json"
    path.write_text('{"fingerprint": "f", "kl": {"0.gate_up.2": 0.1, "0.gate_up.2": 0.2}}')
    return lambda: load_table(path, "f"), path, "0.gate_up.2"


JSON_CASES = {
    **{f"vault {n}": in_vault(n) for n in ("config.json", "generation_config.json", "tokenizer_config.json",
                                           "tokenizer.json", INDEX_FILE)},
    **{f"source {n}": in_source(n) for n in ("config.json", "generation_config.json", "tokenizer_config.json")},
    "source model.safetensors.index.json": in_safetensors_index,
    "plan": in_plan,
    "sensitivity table": in_sensitivity_table,
}


@pytest.mark.parametrize("case", JSON_CASES)
def test_a_duplicate_json_key_is_refused_naming_it(built, tmp_path, case):
    read, path, key = JSON_CASES[case](built, tmp_path)
    with pytest.raises(SmoeError, match=re.escape(f"{path}: the key {key!r} appears twice")):
        read()
    assert not (tmp_path / "out").exists()


# --- trunk values, dtypes and the tokenizer -----------------------------------------------------


def with_trunk_tensor(vault, name, make):
    """The vault with trunk tensor `name` replaced by make(tensor), written by the safetensors library."""
    tensors = load_file(vault / TRUNK_FILE)
    tensors[name] = make(tensors[name])
    save_file(tensors, vault / TRUNK_FILE, metadata={"format": "pt"})
    vaults.reseal(vault, TRUNK_FILE, (vault / TRUNK_FILE).read_bytes())
    return vault


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_verify_finds_a_non_finite_trunk_tensor(built, tmp_path, value):
    def poison(t):
        t = t.clone()
        t.view(-1)[3] = value
        return t
    vault = with_trunk_tensor(copy(built["vault"], tmp_path / "v"), "model.norm.weight", poison)
    assert verify(vault) == [f"{vault / TRUNK_FILE}: trunk tensor model.norm.weight holds 1 non-finite values "
                             "(NaN or infinity)"]
    assert verify(built["vault"]) == []


TRUNK_DTYPE_CASES = {
    "an int8 norm weight": ("model.norm.weight", lambda t: t.to(torch.int8), "(int8|I8) in the vault"),
    "an int32 embedding": ("model.embed_tokens.weight", lambda t: t.to(torch.int32), "(int32|I32) in the vault"),
    "an fp8 norm weight": ("model.norm.weight", lambda t: t.to(torch.float8_e4m3fn), "F8_E4M3, a dtype no vault"),
}


@pytest.mark.parametrize("case", TRUNK_DTYPE_CASES)
def test_a_trunk_dtype_the_model_cannot_load_is_one_line(built, tmp_path, capsys, case):
    name, make, reason = TRUNK_DTYPE_CASES[case]
    vault = with_trunk_tensor(copy(built["vault"], tmp_path / "v"), name, make)
    for command in ("generate", "dequantize", "export"):
        assert main(COMMANDS[command](vault, tmp_path / command)) == 2, command
        err = one_line_error(capsys)
        assert name in err and re.search(reason, err), (command, err)


def test_a_vault_without_tokenizer_json_is_one_line(built, tmp_path, capsys):
    vault = copy(built["vault"], tmp_path / "v")
    vaults.reseal(vault, "tokenizer.json", None)
    assert main(COMMANDS["generate"](vault, None)) == 2
    assert "no tokenizer (none of tokenizer.json" in one_line_error(capsys)
