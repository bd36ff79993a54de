import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from smoe.cli.demo import MODEL as TRAINED_MODEL
from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.vault import TRUNK_FILE, Vault, verify
from smoe.source.checkpoint import Checkpoint
from smoe.source.loading import load_projection
from smoe.source.matching import map_experts
from smoe.testing.tiny_models import tiny_families
from smoe.testing.vaults import SHARED_MODELS, tiny_model_dir, tiny_vault


def smoe_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3_moe", name="qwen3_moe")


def assert_vault_holds_the_encoded_experts(model_dir: Path, vault_dir: Path, bits: int, sample: int = 4):
    ckpt = Checkpoint(model_dir)
    plan = map_experts(ckpt.config, ckpt.names())
    assert verify(vault_dir) == []
    with Vault(vault_dir) as v:
        assert len(v.entries) == len(plan.experts)
        for key in sorted(plan.experts)[:: max(1, len(plan.experts) // sample)]:
            tensors, _ = v.read_expert(*key)
            for t, src in zip(tensors, plan.experts[key]):
                w = load_projection(ckpt, src)
                codes, scales = codec.encode(w, bits)
                assert t.role == src.role and t.shape == tuple(w.shape)
                assert torch.equal(t.codes, codes) and torch.equal(t.scales, scales)
    trunk = load_file(vault_dir / TRUNK_FILE)
    assert set(trunk) == set(ckpt.names()) - plan.expert_names
    for name in list(trunk)[:5]:
        assert torch.equal(trunk[name], ckpt.load(name))


@pytest.mark.parametrize("family", tiny_families())
def test_every_family_sculpts_to_a_vault_that_verifies(family, tmp_path):
    tiny_vault(tmp_path, family, seed=1)
    assert_vault_holds_the_encoded_experts(tmp_path / "model", tmp_path / "vault", 4, sample=2)
    assert (tmp_path / "vault" / "config.json").exists()


@pytest.mark.parametrize("model", [TRAINED_MODEL, *SHARED_MODELS.values()], ids=lambda p: p.name)
@pytest.mark.parametrize("bits", [4, 2])
def test_trained_models_sculpt_and_verify(model, bits, tmp_path):
    if not model.exists():
        pytest.skip(f"{model} not present (the shared models live beside the repository)")
    report = sculpt(model, tmp_path / "vault", bits=bits, progress=False)
    assert_vault_holds_the_encoded_experts(model, tmp_path / "vault", bits)
    assert 0.7 < report.expert_share < 0.8  # 4.7 M of 5.9 M parameters (shipped), 21.2 M of 28.4 M (shared)
    floor = 19.5 if bits == 4 else 9.0
    assert all(snr > floor for snr in report.snr_db.values()), report.snr_db
    for name in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "vault" / name).read_bytes() == (model / name).read_bytes()


def test_quantize_cli_prints_a_summary_with_expert_share_and_snr(tiny_qwen, tmp_path):
    proc = smoe_cli("quantize", tiny_qwen, "-o", tmp_path / "v", "--bits", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["bits"] == 2 and report["experts"] > 0 and set(report["snr_db"]) == {"gate", "up", "down"}
    proc = smoe_cli("quantize", tiny_qwen, "-o", tmp_path / "v2", "-q")
    assert proc.returncode == 0 and "experts are" in proc.stdout and "SNR" in proc.stdout


def test_existing_output_is_refused_without_force_and_replaced_with_it(tiny_qwen, tmp_path):
    out = tmp_path / "v"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier output, as --force replaces (test_output_writer: what not)
    (out / "keep.txt").write_text("mine")
    proc = smoe_cli("quantize", tiny_qwen, "-o", out, "-q")
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"
    assert smoe_cli("quantize", tiny_qwen, "-o", out, "-q", "--force").returncode == 0
    assert not (out / "keep.txt").exists() and verify(out) == []


def copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def poison(model: Path, value: float) -> None:
    tensors = load_file(model / "model.safetensors")
    name = next(n for n in sorted(tensors) if ".experts." in n or "experts" in n.split(".")[-2:])
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = value
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_weights_are_refused_and_leave_no_output(tiny_qwen, tmp_path, value):
    model = copy_model(tiny_qwen, tmp_path / "model")
    poison(model, value)
    proc = smoe_cli("quantize", model, "-o", tmp_path / "v", "-q")
    assert proc.returncode == 2 and "NaN or inf" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "v").exists()


def test_user_mistakes_get_one_line_errors(tiny_qwen, tmp_path):
    no_config = copy_model(tiny_qwen, tmp_path / "noconfig")
    (no_config / "config.json").unlink()
    unknown = copy_model(tiny_qwen, tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "not_a_family"
    (unknown / "config.json").write_text(json.dumps(config))
    wrong_count = copy_model(tiny_qwen, tmp_path / "count")
    config = json.loads((wrong_count / "config.json").read_text())
    for key in ("num_experts", "num_local_experts"):
        if key in config:
            config[key] += 1
    (wrong_count / "config.json").write_text(json.dumps(config))
    truncated = copy_model(tiny_qwen, tmp_path / "truncated")
    os.truncate(truncated / "model.safetensors", 1000)
    cases = {
        tmp_path / "missing": "",
        no_config: "config",
        unknown: "not_a_family",
        wrong_count: "missing",
        truncated: "truncated or corrupt",
    }
    for model, message in cases.items():
        proc = smoe_cli("quantize", model, "-o", tmp_path / f"out-{model.name}", "-q")
        assert proc.returncode == 2, (model, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("smoe: error:") and message in lines[0], (model, lines)
        assert not (tmp_path / f"out-{model.name}").exists()


def test_cuda_device_without_a_gpu_is_a_clear_error(tiny_qwen, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: this checks the no-GPU message")
    proc = smoe_cli("quantize", tiny_qwen, "-o", tmp_path / "v", "--device", "cuda")
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def big_tiny_model(path: Path) -> Path:
    """A tiny family with enough expert bytes that a sculpt takes a few seconds."""
    from transformers import AutoModelForCausalLM

    from smoe.testing.tiny_models import tiny_config

    config = tiny_config("qwen3_moe")
    config.hidden_size, config.moe_intermediate_size, config.num_hidden_layers = 512, 512, 4
    for key in ("num_experts", "num_local_experts"):
        if hasattr(config, key):
            setattr(config, key, 32)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_killed_sculpt_leaves_nothing_under_the_target_and_resumes(tmp_path):
    model = big_tiny_model(tmp_path / "model")
    out = tmp_path / "vault"
    proc = subprocess.Popen([sys.executable, "-m", "smoe.cli", "quantize", str(model), "-o", str(out), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    journal = None
    while time.time() < deadline and proc.poll() is None:
        journals = list(tmp_path.glob("vault.partial-*/journal.jsonl"))
        if journals and len(journals[0].read_text().splitlines()) >= 5:
            journal = journals[0]
            break
        time.sleep(0.02)
    assert journal is not None, "the sculpt finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    written = len(journal.read_text().splitlines())
    rerun = smoe_cli("quantize", model, "-o", out, "--json")
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads(rerun.stdout)["resumed_experts"] >= min(written, 5) - 1
    assert not list(tmp_path.glob("vault.partial-*"))
    assert_vault_holds_the_encoded_experts(model, out, 4)


def test_interrupted_sculpt_with_other_bits_starts_afresh(tmp_path, tiny_qwen):
    out = tmp_path / "vault"
    stale = tmp_path / "vault.partial-0123456789abcdef"
    stale.mkdir()
    (stale / "journal.jsonl").write_text("{}\n")
    report = sculpt(tiny_qwen, out, bits=2, progress=False)
    assert report.resumed_experts == 0 and not stale.exists() and verify(out) == []


def test_not_enough_disk_space_is_refused_before_writing(tiny_qwen, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(SmoeError, match="not enough disk space"):
        sculpt(tiny_qwen, tmp_path / "v", progress=False)
    assert not (tmp_path / "v").exists() and not list(tmp_path.glob("v.partial-*"))
