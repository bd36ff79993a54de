"""Fixtures for the server tests: a vault to serve and real `smoe serve` processes on free loopback ports."""

import json
import re
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen_vault(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3-MoE (seed 0) and its Q4 vault, built once for the tests that only read or copy them."""
    from smoe.testing.vaults import tiny_vault  # imported here: collecting tests needs no torch

    vault = tiny_vault(tmp_path_factory.mktemp("tiny-qwen"), "qwen3_moe")
    return {"model": vault.parent / "model", "vault": vault}


# Qwen3's generation_config.json sampling fields, and the defaults smoe takes from them (min_p: llama.cpp's)
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


@pytest.fixture(scope="session")
def sampling_vaults(tiny_qwen_vault, tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3-MoE's vault ("plain": its generation_config.json sets no sampling field, as
    transformers' save_pretrained writes it) and a copy whose file sets QWEN3_SAMPLING ("qwen3"), sealed."""
    import shutil

    from smoe.testing.vaults import reseal

    plain = tiny_qwen_vault["vault"]
    qwen3 = tmp_path_factory.mktemp("sampling") / "qwen3"
    shutil.copytree(plain, qwen3)
    config = json.loads((plain / "generation_config.json").read_text())
    reseal(qwen3, "generation_config.json", json.dumps(config | QWEN3_SAMPLING).encode())
    return {"qwen3": qwen3, "plain": plain}


@pytest.fixture(scope="session")
def serve_vault(tmp_path_factory) -> Path:
    """The Q4 vault of the trained model shipped in models/ (its 4,096 positions outlast a reply a test stops
    mid-stream)."""
    from smoe.cli.demo import MODEL
    from smoe.testing.vaults import vault_of

    return vault_of(MODEL, tmp_path_factory.mktemp("serve") / "vault")


class Server:
    """`smoe serve VAULT --port 0` in a subprocess; `url` once it listens, its stderr in `log`."""

    def __init__(self, vault: Path, workdir: Path, args: tuple[str, ...]):
        self.log = workdir / "server.stderr"
        cmd = [sys.executable, "-m", "smoe.cli", "serve", str(vault), "--port", "0", "--dtype", "float32", *args]
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self._first_line(timeout=180)
        found = re.search(r"http://\S+", line)
        if not found:
            self.stop()
            raise RuntimeError(f"smoe serve did not start: {line!r}\n{self.log.read_text()}")
        self.url = found.group(0)
        self.host, self.port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(self.port)
        self.health = self.get_json("/health")

    def _first_line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else ""

    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def wait_idle(self, timeout: float = 30) -> dict:
        """Metrics once no request is waiting or running."""
        deadline = time.monotonic() + timeout
        while (m := self.get_json("/metrics"))["queued_or_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        return m

    def stderr(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(vault, *extra_args) -> a running Server, stopped at the end of the session."""
    servers = []

    def start(vault: Path, *args: str) -> Server:
        servers.append(Server(vault, tmp_path_factory.mktemp("server"), args))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
