import subprocess
import sys
from types import SimpleNamespace

import pytest

from smoe.cli import demo
from smoe.format.vault import verify

COMMANDS = [[], ["quantize"], ["verify"], ["inspect"], ["test-quant"], ["bench"], ["bench", "quantize"],
            ["bench", "sculpt"], ["demo"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "smoe")
def test_every_command_has_help(command):
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", *command, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: smoe" in proc.stdout


def test_missing_arguments_are_a_usage_error_not_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", "quantize"], capture_output=True, text=True)
    assert proc.returncode == 2 and "required" in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_of_a_missing_path_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", "inspect", str(tmp_path / "nope")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("smoe: error:") and len(proc.stderr.strip().splitlines()) == 1


def test_demo_builds_its_own_model_when_the_shared_one_is_absent(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "SHARED_MODEL", tmp_path / "absent")
    monkeypatch.delenv("SMOE_DEMO_MODEL", raising=False)
    assert demo.main(SimpleNamespace(workdir=str(tmp_path / "demo"))) == 0
    out = capsys.readouterr().out
    assert "tiny random Qwen3-MoE built by smoe" in out
    assert out.count("vault OK") == 2 and "SMOE-Q2 gate" in out and "SMOE-Q4 down" in out
    assert out.count("says nothing about quality") == 2  # before the figures and after them
    assert out.count("timed after a 4-token warm-up") == 2
    for bits in (4, 2):
        assert verify(tmp_path / "demo" / f"vault-q{bits}") == []


@pytest.mark.parametrize("args, message", [
    (["runtime", "VAULT", "--budgets", "abc"], "expected fractions separated by commas"),
    (["runtime", "VAULT", "--budgets", "0,1"], "in (0, 1]"),
    (["decode", "--budgets", "2"], "in (0, 1]"),
])
def test_bench_options_out_of_range_are_one_line_errors(args, message, capsys):
    from smoe.cli.commands import main

    assert main(["bench", *args]) != 0
    err = capsys.readouterr().err
    assert err.startswith("smoe: error:") and message in err and "Traceback" not in err


def test_the_demo_looks_for_the_shared_models_beside_the_checkout():
    from pathlib import Path

    checkout = Path(__file__).resolve().parents[1]
    assert demo.SHARED == checkout.parent / "shared"
    assert demo.SHARED_MODEL == checkout.parent / "shared" / "models" / "qwen3-moe-28m"
