"""The demo's model and text as shipped, and the commands the demo prints (its full run, and running every
command it prints, is tests/integration/test_demo_run.py)."""

import gzip
import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from smoe.cli import demo
from smoe.cli.commands import build_parser
from smoe.errors import SmoeError
from smoe.source.inspect import inspect_path
from smoe.testing.vaults import SHARED

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "TRAINING.md", "summary.json", "train_log.jsonl", "train.log", "expert_load.json", "eval.txt"]


def test_the_demo_model_ships_in_the_repository_and_not_in_the_wheel():
    assert demo.MODEL == ROOT / "models" / "smoe-demo-6m"
    assert [f for f in MODEL_FILES if not (demo.MODEL / f).is_file()] == []
    assert sum(f.stat().st_size for f in demo.MODEL.iterdir()) < 12.5e6
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '[tool.setuptools.packages.find]\ninclude = ["smoe*"]' in pyproject  # models/ is no package


def test_the_demo_model_is_a_trained_moe_whose_experts_are_most_of_it_and_fit_the_kernels():
    report = inspect_path(demo.MODEL)
    summary = json.loads((demo.MODEL / "summary.json").read_text())
    config = json.loads((demo.MODEL / "config.json").read_text())
    assert report["family"] == "qwen3_moe" and report["routed_experts_found"] == 4 * 16
    assert summary["params"]["expert"] / summary["params"]["total"] >= 0.7
    assert config["moe_intermediate_size"] % 64 == 0 and config["hidden_size"] % 64 == 0
    assert summary["valid_ppl"] < 40  # trained: a random model of this vocabulary scores about 2,048


def test_the_demo_eval_text_is_rebuilt_byte_for_byte_from_the_validation_books(tmp_path):
    if not (SHARED / "corpus" / "valid.txt.gz").exists():
        pytest.skip(f"{SHARED / 'corpus'} not present: the eval text's provenance is checked where the corpus is")
    out = tmp_path / "eval.txt"
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "demo_eval_text.py", "-o", out], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == (demo.MODEL / demo.EVAL_TEXT).read_bytes()
    assert hashlib.sha256(out.read_bytes()).hexdigest() in (ROOT / "models" / "README.md").read_text()


def test_no_passage_of_the_demo_eval_text_is_in_the_training_text():
    train = SHARED / "corpus" / "train.txt.gz"
    if not train.exists():
        pytest.skip(f"{train} not present: the training text is needed to show the eval text is outside it")
    with gzip.open(train, "rt", encoding="utf-8") as f:
        text = f.read()
    lines = [line for line in (demo.MODEL / demo.EVAL_TEXT).read_text().splitlines() if len(line) >= 60]
    probes = lines[:: max(1, len(lines) // 40)]
    assert len(probes) >= 40 and [p for p in probes if p in text] == []


@pytest.fixture
def demo_work(tiny_qwen_vault, tmp_path) -> Path:
    """A demo workdir whose two vaults are (links to) the tiny Q4 vault: the commands are built from them."""
    for bits in (4, 2):
        (tmp_path / f"vault-q{bits}").symlink_to(tiny_qwen_vault["vault"], target_is_directory=True)
    return tmp_path


def test_every_command_the_demo_runs_is_a_valid_smoe_command_line(demo_work, monkeypatch):
    monkeypatch.chdir(demo_work)
    model = demo_work / "model"
    model.mkdir()
    (model / demo.EVAL_TEXT).write_text("Text the model never saw.\n")
    steps = list(demo.steps(model, Path(".")))
    lines = [demo.command_line(argv) for argv in steps]
    program = demo.program()
    for line, argv in zip(lines, steps):
        words = shlex.split(line)
        assert words == program + argv and build_parser().parse_args(argv).command == argv[0]
    assert [argv[0] for argv in steps] == \
        ["inspect", "quantize", "verify", "quantize", "verify", "generate", "eval", "generate", "eval"]
    assert "-p 'The old man looked out over the sea and'" in lines[5]  # quoted as a shell reads it


def test_the_demo_cache_is_a_quarter_of_the_experts_and_never_below_one_tokens_need(tiny_qwen_vault):
    from smoe.runtime.model import OpenedVault

    sm = OpenedVault(tiny_qwen_vault["vault"])
    experts = sum(e.size for e in sm.vault.entries.values()) * sm.store.prepare_ratio()
    need = sm.store.min_budget(sm.vault.meta["top_k"])
    sm.close()
    gb = float(demo.quarter_gb(tiny_qwen_vault["vault"]))
    assert max(experts / 4, need) <= gb * 1e9 < max(experts / 4, need) + 1e3


@pytest.mark.parametrize("argv0, expected", [
    (".venv/bin/smoe", [".venv/bin/smoe"]),  # make demo: not on PATH, so the path that ran
    ("/elsewhere/bin/smoe", ["/elsewhere/bin/smoe"]),
])
def test_the_printed_program_is_the_one_that_ran(argv0, expected, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "argv", [argv0, "demo"])
    assert demo.program() == expected


def test_the_printed_program_is_plain_smoe_when_that_is_the_one_on_path(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    exe = tmp_path / "bin" / "smoe"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(sys, "argv", [str(exe), "demo"])
    assert demo.program() == ["smoe"]


def test_the_demo_without_its_model_says_where_the_model_ships(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "MODEL", tmp_path / "absent")
    monkeypatch.delenv("SMOE_DEMO_MODEL", raising=False)
    with pytest.raises(SmoeError, match="ships with smoe's source repository .* set SMOE_DEMO_MODEL=MODEL_DIR"):
        demo.demo_model()
    monkeypatch.setenv("SMOE_DEMO_MODEL", str(tmp_path / "mine"))
    assert demo.demo_model() == tmp_path / "mine"
