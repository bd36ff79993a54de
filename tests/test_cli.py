import subprocess
import sys

import pytest

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


def test_ctrl_c_during_startup_is_held_until_startup_returns_then_ends_the_command(capsys):
    """The parser's imports (torch's among them) are never cut short: a Ctrl-C that lands in them is
    raised once they return, and the command ends as interrupted before its body runs."""
    import os
    import signal

    from smoe.cli.interrupts import guarded

    steps = []

    def startup():
        os.kill(os.getpid(), signal.SIGINT)
        steps.append("startup ran to its end")  # a Python-level handler runs before this line if not held
        return "ready"

    assert guarded(startup, lambda ready: steps.append(ready) or 0) == 130
    assert steps == ["startup ran to its end"] and capsys.readouterr().err == "smoe: interrupted\n"
