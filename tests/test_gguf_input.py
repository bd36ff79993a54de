"""A GGUF as the input of `smoe quantize` and `smoe inspect`: one `smoe export` wrote reads back to the vault's
own codes and greedy tokens; other quantised types are dequantised with a notice; a damaged file, an
architecture smoe does not read or a tokenizer it cannot rebuild is one line naming it."""

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from export_models import exportable_vault

from smoe.cli.commands import main
from smoe.export.writer import export
from smoe.format.vault import Vault
from smoe.runtime.model import OpenedVault
from smoe.source.gguf import GgufCheckpoint, expert_tensor_name, per_expert_name


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (vault, the GGUF `smoe export` wrote of it); qwen3_moe at Q4, mixtral at Q2."""
    tmp = tmp_path_factory.mktemp("gguf-in")
    out = {}
    for family, bits in (("qwen3_moe", 4), ("mixtral", 2)):
        vault = exportable_vault(tmp, family, bits)
        out[family] = vault, export(vault, "gguf", tmp / f"{family}.gguf")
    return out


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def smoe_cli(capsys):
    """The `smoe` command's own main(), in this process (tests/integration runs it as a subprocess)."""
    def run(*args) -> Run:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return Run(code, out.out, out.err)
    return run


def one_line_error(r) -> str:
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smoe: error: "), r.stderr
    return lines[0]


def same_blobs(a: Path, b: Path) -> bool:
    """Every expert of both vaults: the same roles, depths, codes and scales."""
    with Vault(a) as va, Vault(b) as vb:
        if set(va.entries) != set(vb.entries):
            return False
        return all(x.role == y.role and x.bits == y.bits and torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales)
                   for key in va.entries for x, y in zip(va.read_expert(*key)[0], vb.read_expert(*key)[0], strict=True))


def logits(vault: Path) -> torch.Tensor:
    """The streaming runtime's logits over a fixed sequence (its argmax at each position: the greedy choice)."""
    sm = OpenedVault(vault, dtype="float32")
    try:
        return sm.logits(torch.tensor([[5, 17, 42, 9, 100, 3, 250, 77]]))[0]
    finally:
        sm.close()


def rewrite(src: Path, dst: Path, fields=None, tensors=None, arch: str | None = None) -> Path:
    """A copy of GGUF `src` with metadata fields replaced (None removes one), tensors replaced by
    name -> (numpy data, gguf type), and (`arch`) another architecture named, its keys renamed to it."""
    reader = gguf.GGUFReader(src)
    old = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch or old)
    fields = fields or {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = fields.get(key, f.contents())
        if value is None:
            continue
        kind = f.types[0]
        key = f"{arch}.{key.removeprefix(old + '.')}" if arch and key.startswith(old + ".") else key
        writer.add_key_value(key, value, kind, f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data, kind = (tensors or {}).get(t.name, (np.array(t.data), t.tensor_type))
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_an_exported_gguf_quantizes_back_to_the_vaults_own_codes_and_logits(smoe_cli, exported, tmp_path):
    for family, (vault, path) in exported.items():
        out = tmp_path / f"{family}-again"
        bits = Vault(vault).bits
        r = smoe_cli("quantize", path, "-o", out, "--bits", bits, "--quiet", "--json")
        assert r.returncode == 0, r.stderr
        assert "notice" not in r.stderr  # nothing was re-quantised
        assert json.loads(r.stdout)["family"] == family
        assert same_blobs(vault, out)
        assert torch.equal(logits(out), logits(vault))  # greedy tokens by `smoe generate`: tests/integration


def test_the_config_holds_what_the_vaults_config_says_of_the_model(exported):
    for vault, path in exported.values():
        want = json.loads((vault / "config.json").read_text())
        with GgufCheckpoint(path) as ckpt:
            got = ckpt.config
        for key, value in got.items():
            source = want["quantization_config"]["source_model_type"] if key == "model_type" else want.get(key)
            if key == "num_experts":
                source = want.get("num_experts", want.get("num_local_experts"))
            assert value == source, key


def test_the_config_agrees_with_transformers_gguf_loader_where_that_maps_a_key(exported):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, path = exported["qwen3_moe"]
    theirs = load_gguf_checkpoint(str(path))["config"]
    with GgufCheckpoint(path) as ckpt:
        ours = ckpt.config
    for key, value in theirs.items():
        if key in ours:
            assert ours[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    assert ours["rope_parameters"]["rope_theta"] == theirs["rope_theta"]
    # what transformers' loader leaves at Qwen3MoeConfig's default (768): the experts' own width
    assert ours["moe_intermediate_size"] == 32


def test_requantising_another_quantised_type_says_the_errors_compound(smoe_cli, exported, tmp_path):
    vault, path = exported["qwen3_moe"]
    experts, q8 = {}, gguf.GGMLQuantizationType.Q8_0
    with GgufCheckpoint(path) as ckpt:
        for layer in range(4):
            for role in ("gate", "up", "down"):
                stacked = np.stack([ckpt.load(per_expert_name("qwen3_moe", layer, e, role)).float().numpy() for e in range(6)])
                experts[expert_tensor_name(role, layer)] = gguf.quants.quantize(stacked, q8), q8
    requantised = rewrite(path, tmp_path / "q8.gguf", tensors=experts)
    r = smoe_cli("quantize", requantised, "-o", tmp_path / "v", "--quiet")
    assert r.returncode == 0, r.stderr
    notices = [line for line in r.stderr.splitlines() if line.startswith("smoe: notice:")]
    assert len(notices) == 1 and "Q8_0" in notices[0] and "compounds" in notices[0]
    # the weights the vault encoded are the Q8_0 ones: within Q4's error of the source vault's decode
    with Vault(vault) as a, Vault(tmp_path / "v") as b:
        x, y = a.read_expert(0, 0)[0][0].decode(), b.read_expert(0, 0)[0][0].decode()
        assert float((x - y).abs().max()) < 0.25 * float(x.abs().max())


def test_inspect_reads_a_gguf(smoe_cli, exported):
    _, path = exported["mixtral"]
    r = smoe_cli("inspect", path, "--json", "--disk-gbps", "1")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["family"], report["moe_layers"], report["experts_per_layer"], report["experts_per_token"]) == (
        "mixtral", 2, 4, 2)
    assert report["expert_shapes"] == {"gate": [32, 64], "up": [32, 64], "down": [64, 32]}
    assert report["routed_experts_found"] == 8


def test_a_truncated_gguf_is_one_line_naming_it(smoe_cli, exported, tmp_path):
    _, path = exported["qwen3_moe"]
    data = path.read_bytes()
    for cut in (100, len(data) - 1000):
        bad = tmp_path / f"cut-{cut}.gguf"
        bad.write_bytes(data[:cut])
        for command in ("inspect", "quantize"):
            line = one_line_error(smoe_cli(command, bad, *(["-o", tmp_path / "v"] if command == "quantize" else [])))
            assert str(bad) in line and ("truncated" in line or "corrupt" in line)


def test_a_file_named_gguf_that_is_not_one_is_one_line_naming_it(smoe_cli, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    line = one_line_error(smoe_cli("inspect", bad))
    assert "not a GGUF file" in line


def test_an_architecture_smoe_does_not_read_is_one_line_naming_it(smoe_cli, exported, tmp_path):
    _, path = exported["qwen3_moe"]
    line = one_line_error(smoe_cli("inspect", rewrite(path, tmp_path / "qwen2.gguf", arch="qwen2")))
    assert "'qwen2'" in line and "qwen3moe" in line


def test_a_dense_gguf_is_one_line_saying_so(smoe_cli, exported, tmp_path):
    _, path = exported["mixtral"]
    dense = rewrite(path, tmp_path / "dense.gguf", fields={"llama.expert_count": None})
    line = one_line_error(smoe_cli("inspect", dense))
    assert "expert_count" in line and "dense" in line


def test_a_tokenizer_smoe_cannot_rebuild_is_one_line_naming_it(smoe_cli, exported, tmp_path):
    _, path = exported["qwen3_moe"]
    broken = rewrite(path, tmp_path / "tok.gguf", fields={"tokenizer.ggml.merges": None, "tokenizer.ggml.model": "bert"})
    line = one_line_error(smoe_cli("quantize", broken, "-o", tmp_path / "v"))
    assert "tokenizer" in line and "'bert'" in line


def test_expert_slices_read_only_their_own_bytes(exported):
    _, path = exported["qwen3_moe"]
    with GgufCheckpoint(path) as ckpt:
        t = next(t for t in ckpt.reader.tensors if t.name == expert_tensor_name("down", 1))
        name = "model.layers.1.mlp.experts.3.down_proj.weight"
        assert ckpt.stored_nbytes(name) == int(t.n_bytes) // 6
        whole = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        assert torch.equal(ckpt.load(name).float(), torch.from_numpy(whole[3]).to(torch.bfloat16).float())
