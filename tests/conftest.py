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

SHARED_MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "qwen3-moe-28m"


@pytest.fixture(scope="session")
def serve_vault(tmp_path_factory) -> Path:
    """The shared trained model's vault at Q4, or a tiny random Qwen3-MoE's when ../shared is absent."""
    from smoe.convert.sculpt import sculpt
    from smoe.testing.tiny_models import save_tiny_model

    out = tmp_path_factory.mktemp("serve")
    model = SHARED_MODEL
    if not model.exists():
        print(f"{SHARED_MODEL} not present (the shared models live beside the repository): "
              "serving a tiny random Qwen3-MoE instead")
        model = out / "model"
        save_tiny_model("qwen3_moe", model, seed=2)
        # the tiny config's 128 positions end a reply before a test can stop it mid-stream
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 4096}))
    sculpt(model, out / "vault", bits=4, progress=False)
    return out / "vault"


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
