"""`smoe demo` end to end on the shipped model, then every command it printed, run as printed."""

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("demo")
    # one stream, unbuffered: the lines in the order a terminal shows them (each sample, then its statistics)
    proc = subprocess.run([sys.executable, "-m", "smoe.cli", "demo", "--workdir", str(work)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout
    return proc.stdout


def printed_commands(output: str) -> list[str]:
    """The steps' banner commands, then the suggested next ones."""
    steps = re.findall(r"^== (\S.*-m smoe\.cli .*)$", output, re.M)
    after = output[output.index("== next: try these yourself"):]
    return steps + re.findall(r"^  (\S.*-m smoe\.cli .*)$", after, re.M)


def eval_figures(output: str) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in re.findall(r"(ppl|KL|top-1) ([\d.]+)", line)}
            for line in re.findall(r"^tokens \d+ .*KL.*$", output, re.M)]


def test_the_demo_shows_measured_kl_on_held_out_text_deeper_for_q2(demo_run):
    q4, q2 = eval_figures(demo_run)
    assert "tokens 66907" in demo_run  # the whole of eval.txt
    assert 0 < q4["KL"] < q2["KL"] < 2 and q2["top-1"] < q4["top-1"] < 1
    assert q4["ppl"] < 40  # a trained model: random weights give about the vocabulary's size


def test_the_demo_generates_readable_text_after_an_untimed_warm_up(demo_run):
    samples = re.findall(r"^== [^\n]* generate [^\n]*\n\(an untimed 4-token run first[^\n]*\n(.*?)\n\[\d+ prompt tokens, TTFT",
                         demo_run, re.M | re.S)
    assert len(samples) == 2
    for text in samples:
        words = re.findall(r"\S+", text)
        assert len(words) >= 15 and sum(bool(re.fullmatch(r"[\"“‘(]?[A-Za-z’']+[.,;:!?”’\")]*", w)) for w in words) \
            >= 0.8 * len(words), text


def test_every_command_the_demo_prints_runs_as_printed(demo_run, tmp_path):
    commands = printed_commands(demo_run)
    assert [shlex.split(c)[3] for c in commands] == ["inspect", "quantize", "verify", "quantize", "verify", "generate",
                                                      "eval", "generate", "eval", "chat", "serve", "inspect"]
    for line in commands:
        argv = shlex.split(line)
        if argv[3] == "serve":
            check_serve_starts(argv)
            continue
        proc = subprocess.run(argv, cwd=ROOT, input="The sea was\n" if argv[3] == "chat" else None,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{line}\n{proc.stderr}"


def check_serve_starts(argv: list[str]) -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("port 8000 is taken on this machine: the printed `smoe serve` (default port) cannot listen")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "http://127.0.0.1:8000" in proc.stdout.readline()
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=10) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
