"""The wheel built from this tree, installed into a clean venv: `smoe demo` and `smoe serve` run from it.

Every other test imports smoe from the source tree (the dev venv's editable install), so they cannot
see what only a wheel loses: a file that is not declared package data (the web chat page
smoe/serve/web/chat.html), a subpackage setuptools' find does not pick up, a console script that
points nowhere. This test builds the wheel with `python -m build` from a copy of the tree's files
(tracked and untracked-not-ignored, as `git ls-files` lists them, so setuptools' build/ and
smoe.egg-info land in the copy, never in the repository), installs it with CI's pins into a fresh
venv (not --system-site-packages: that venv would see the dev install), and from a directory
outside the repository runs the venv's `smoe demo`, `smoe quantize` and `smoe serve`, fetching the
chat page and one chat completion over a real socket. Real processes throughout, no mocks.

Installing torch and the rest into the fresh venv from the local package index (pip --no-compile)
takes 20-30 s on our 2-core machine; the whole file 95-120 s while other jobs share the cores.
"""

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHAT_PAGE = "smoe/serve/web/chat.html"
BUILD_LEFTOVERS = ("build", "dist", "smoe.egg-info")
TIMINGS: dict[str, float] = {}


def run(cmd, *, timeout: float, what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run cmd to completion, timed under TIMINGS[what]; fail with its output if it exits nonzero."""
    start = time.monotonic()
    try:
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what}: still running after {timeout} s: {' '.join(map(str, cmd))}\n{e.stdout}\n{e.stderr}")
    TIMINGS[what] = time.monotonic() - start
    print(f"{what}: {TIMINGS[what]:.1f} s", flush=True)
    if done.returncode != 0:
        pytest.fail(f"{what} exited {done.returncode}: {' '.join(map(str, cmd))}\n"
                    f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}")
    return done


def tree_files() -> list[str]:
    """The tree's files as git sees them: tracked ones still present, and untracked ones not ignored."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"cannot list the tree's files with git ls-files in {REPO}: {e}")
    names = sorted({n for n in listed.decode().split("\0") if n})
    return [n for n in names if os.path.lexists(REPO / n) and not (REPO / n).is_dir()]  # deleted; submodules


def leftovers() -> dict[str, float]:
    """Build outputs at the repository's top, by modification time: none may appear or change."""
    return {name: (REPO / name).stat().st_mtime for name in BUILD_LEFTOVERS if (REPO / name).exists()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src, dist = work / "src", work / "dist"
    files = tree_files()
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name, follow_symlinks=False)
    before = leftovers()
    try:
        import build  # noqa: F401  (the `test` extra installs it)
    except ImportError:
        pytest.fail(f"{sys.executable} has no `build`: install the test extra (`make` does), "
                    "or `pip install -c constraints.txt build`")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, src], timeout=300, what="build the wheel")
    assert leftovers() == before, f"building left {sorted(set(leftovers()) - set(before))} in {REPO}"
    wheels = sorted(dist.glob("*.whl"))
    assert [w.name for w in wheels] == [f"smoe-{version_of(src)}-py3-none-any.whl"], wheels
    return wheels[0]


def version_of(src: Path) -> str:
    found = re.search(r'^__version__\s*=\s*"([^"]+)"', (src / "smoe" / "version.py").read_text(), re.M)
    assert found, "smoe/version.py has no __version__"
    return found.group(1)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed the way CI pins it (torch==2.13.0, the CPU wheel); removed after
    the module (it holds about 2 GB)."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", path], timeout=120, what="create the venv")
    # --no-compile: byte-compiling all of torch's modules would take longer than installing them (and
    # double the files to remove); the few the test imports compile on import
    run([path / "bin" / "python", "-m", "pip", "install", "-q", "--no-compile", "-c", REPO / "constraints.txt",
         "torch==2.13.0", wheel], timeout=400, what="pip install the wheel and its dependencies")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working directory from which the source tree is not importable."""
    path = tmp_path_factory.mktemp("outside")
    assert REPO not in path.resolve().parents, f"the temporary directory {path} is inside the repository"
    return path


def clean_env(venv: Path) -> dict[str, str]:
    """This environment without what would let the dev tree or its settings in: PYTHONPATH, user
    site-packages, the active venv, SMOE_* switches (the demo must pick its own model)."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SMOE_")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_wheel_holds_every_file_of_the_package_and_the_entry_point(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(f"smoe-{wheel.name.split('-')[1]}.dist-info/entry_points.txt").decode()
        page = z.read(CHAT_PAGE) if CHAT_PAGE in names else None
    source = {n for n in tree_files() if n.startswith("smoe/") and "__pycache__" not in n}
    missing = sorted(source - names)
    assert not missing, f"files of smoe/ the wheel leaves out (undeclared package data or subpackages): {missing}"
    assert page == (REPO / CHAT_PAGE).read_bytes()
    assert re.search(r"^smoe\s*=\s*smoe\.cli:main$", entry_points, re.M), entry_points


def test_smoe_imports_from_the_venv_not_the_source_tree(venv, outside):
    probe = ("import json, sys, sysconfig, smoe, smoe.serve.server as s, torch\n"
             "from importlib import resources\n"
             "page = resources.files('smoe.serve') / 'web' / 'chat.html'\n"
             "print(json.dumps({'smoe': smoe.__file__, 'server': s.__file__, 'page': str(page),\n"
             "  'purelib': sysconfig.get_paths()['purelib'], 'path': sys.path, 'cuda': torch.version.cuda}))")
    found = json.loads(run([venv / "bin" / "python", "-c", probe], cwd=outside, env=clean_env(venv),
                           timeout=120, what="import smoe in the venv").stdout)
    purelib = Path(found["purelib"]).resolve()
    for key in ("smoe", "server", "page"):
        where = Path(found[key]).resolve()
        assert purelib in where.parents, f"{key} comes from {where}, not the venv's {purelib}"
        assert REPO not in where.parents, f"{key} comes from the source tree: {where}"
    assert str(REPO) not in found["path"], found["path"]
    assert found["cuda"] is None, "torch==2.13.0 resolved to a CUDA build: the CPU wheel is what CI installs"
    script = (venv / "bin" / "smoe").read_text().splitlines()[0]
    assert script.startswith(f"#!{venv / 'bin' / 'python'}"), f"{venv}/bin/smoe runs {script}"


@pytest.fixture(scope="module")
def demo(venv, outside):
    """`smoe demo` from the wheel, which carries no model: on a copy of the repository's shipped model
    placed outside the tree, named by SMOE_DEMO_MODEL."""
    model, workdir = outside / "demo-model", outside / "demo"
    shutil.copytree(REPO / "models" / "smoe-demo-6m", model)
    env = {**clean_env(venv), "SMOE_DEMO_MODEL": str(model), "PYTHONUNBUFFERED": "1"}
    return run([venv / "bin" / "smoe", "demo", "--workdir", workdir], cwd=outside, env=env, timeout=900,
               what="smoe demo"), workdir


def test_demo_runs_from_the_installed_wheel(demo):
    done, workdir = demo
    out = done.stdout + done.stderr
    for bits in (4, 2):
        assert re.search(rf"^== smoe quantize \S+ -o \S*vault-q{bits} --bits {bits}", out, re.M), out
        assert (workdir / f"vault-q{bits}").is_dir()
    assert out.count("\nvault OK\n") == 2, out
    assert len(re.findall(r"decode \d+(\.\d+)? tok/s \(48 tokens\)", out)) == 2, out
    assert len(re.findall(r"^tokens \d+ +ppl \d+\.\d+ +ref ppl \d+\.\d+ +KL \d+\.\d+", out, re.M)) == 2, out


def test_the_wheels_demo_without_a_model_says_where_the_model_ships_in_one_line(venv, outside):
    done = subprocess.run([venv / "bin" / "smoe", "demo", "--workdir", outside / "no-model"], cwd=outside,
                          env=clean_env(venv), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("smoe: error: ") and "SMOE_DEMO_MODEL" in done.stderr, done.stderr
    assert not (outside / "no-model").exists()


@pytest.fixture(scope="module")
def vault(venv, outside) -> Path:
    """A tiny random Qwen3-MoE written by the wheel's smoe.testing, sculpted by the venv's `smoe quantize`."""
    env, py = clean_env(venv), venv / "bin" / "python"
    model, out = outside / "tiny-qwen3-moe", outside / "vault"
    write = f"import smoe.testing.tiny_models as t; t.save_tiny_model('qwen3_moe', {str(model)!r}, seed=1)"
    run([py, "-c", write], cwd=outside, env=env, timeout=180, what="write a tiny model")
    run([venv / "bin" / "smoe", "quantize", model, "-o", out, "--bits", "4"], cwd=outside, env=env,
        timeout=180, what="smoe quantize")
    assert "vault OK" in run([venv / "bin" / "smoe", "verify", out], cwd=outside, env=env, timeout=120,
                             what="smoe verify").stdout
    return out


def fetch(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=120) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def default_ctrl_c() -> None:
    """In the child: Ctrl-C as a terminal gives it. A shell runs a background job (CI, say) with SIGINT
    ignored and children inherit that, where uvicorn would restore "ignored" after its shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_serve_from_the_installed_wheel_serves_the_chat_page_and_a_completion(venv, outside, vault, wheel):
    log = outside / "serve.stderr"
    start = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen([str(venv / "bin" / "smoe"), "serve", str(vault), "--port", "0", "--dtype", "float32"],
                                cwd=outside, env=clean_env(venv), stdout=subprocess.PIPE, stderr=err, text=True,
                                preexec_fn=default_ctrl_c)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        line = proc.stdout.readline() if ready else ""
        found = re.search(r"http://(\S+):(\d+)", line)
        assert found, f"smoe serve did not say where it listens: {line!r}\n{log.read_text()}"
        url, host, port = found.group(0), found.group(1), int(found.group(2))
        TIMINGS["smoe serve start"] = time.monotonic() - start

        status, kind, page = fetch(url + "/")
        with zipfile.ZipFile(wheel) as z:
            assert page == z.read(CHAT_PAGE), "GET / is not the wheel's chat page"
        assert status == 200 and kind.startswith("text/html"), (status, kind)
        assert b"<html" in page.lower() and b"/v1/chat/completions" in page

        status, _, body = fetch(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                               "max_tokens": 8, "temperature": 0})
        reply = json.loads(body)
        assert status == 200 and reply["object"] == "chat.completion", reply
        choice = reply["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), reply
        assert choice["finish_reason"] in ("stop", "length"), reply
        assert 1 <= reply["usage"]["completion_tokens"] <= 8 and reply["usage"]["prompt_tokens"] > 0, reply

        proc.send_signal(signal.SIGINT)  # Ctrl-C, the way a user stops it
        assert proc.wait(timeout=30) == 130, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    stderr = log.read_text()
    assert "smoe: interrupted" in stderr and "Traceback" not in stderr, stderr
    assert "POST /v1/chat/completions 200" in stderr, stderr
    with pytest.raises(OSError):  # nothing listens there any more
        socket.create_connection((host, port), timeout=5).close()
    print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()), flush=True)
