"""Every writer (quantize, dequantize, export) goes through one output writer: it never follows a link
it did not make, never truncates a file it did not create, never removes an input (also one reached
through a mount or a hard link) nor anything across a mount, and leaves no partial a rerun cannot
remove. Each table runs over the three commands and over the things a hostile directory can hold."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from export_models import exportable_vault

from smoe.cli.commands import main
from smoe.errors import SmoeError
from smoe.format.output import PARTIAL, Output, is_work_suffix, kept_partial, mount_points, resumable_tag, writing

# command -> argv for the inputs {"model", "vault"} and an output
COMMANDS = {
    "quantize": lambda i, out: ["quantize", i["model"], "-o", out, "-q"],
    "dequantize": lambda i, out: ["dequantize", i["vault"], "-o", out],
    "export": lambda i, out: ["export", i["vault"], "--to", "gguf", "-o", out, "-q"],
}
READS = {"quantize": "model", "dequantize": "vault", "export": "vault"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny exportable Qwen3-MoE and its vault, read (never written) by every test here."""
    vault = exportable_vault(tmp_path_factory.mktemp("inputs"), "qwen3_moe")
    return {"model": vault.parent / "qwen3_moe-model-32-gpt-2", "vault": vault}


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def precious(tmp_path) -> Path:
    """A directory of someone's files beside the output, which no writer may touch."""
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "f").write_text("precious")
    return tmp_path / "precious"


def snapshot(path: Path) -> dict:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def run(capsys, argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, *names) -> None:
    assert code == 2 and err.startswith("smoe: error:") and len(err.strip().splitlines()) == 1, err
    assert all(str(n) in err for n in names), err


# what a hostile directory holds at a work path: (work path suffix, how it is planted)
PLANTED_LINKS = {
    "symlink to a file at the lock": (".lock", lambda p, precious: p.symlink_to(precious / "f")),
    "symlink to a directory at the lock": (".lock", lambda p, precious: p.symlink_to(precious)),
    "symlink at a stale partial": (".partial-{dead}", lambda p, precious: p.symlink_to(precious)),
    "symlink at a resumable partial": (".partial-0123456789abcdef", lambda p, precious: p.symlink_to(precious)),
    "hard link at a stale partial": (".partial-{dead}", lambda p, precious: os.link(precious / "f", p)),
    "symlink at a stale old output": (".old-{dead}", lambda p, precious: p.symlink_to(precious)),
    "hard link at a stale old output": (".old-{dead}", lambda p, precious: os.link(precious / "f", p)),
}


@pytest.mark.parametrize("plant", PLANTED_LINKS, ids=lambda p: p.replace(" ", "-"))
@pytest.mark.parametrize("command", COMMANDS)
def test_no_writer_follows_a_planted_link(inputs, tmp_path, capsys, precious, command, plant):
    suffix, make = PLANTED_LINKS[plant]
    out = tmp_path / "out"
    planted = tmp_path / f"out{suffix.format(dead=dead_pid())}"
    make(planted, precious)
    before = snapshot(precious)
    code, err = run(capsys, COMMANDS[command](inputs, out))
    assert_refused(code, err, planted)
    assert snapshot(precious) == before and os.path.lexists(planted) and not out.exists()


def another_users_file(path: Path, _dead: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("a file of another user can only be made by root")
    path.write_text("smoe quantize, pid 1")
    os.chown(path, 65534, 65534)


# what may sit at `OUT.lock` when no one holds it: taken over (True) or refused (False)
LOCKS = {
    "a plain file of ours from a dead writer": (True, lambda p, dead: p.write_text(f"smoe export, pid {dead}")),
    "a hard link to a file of ours": (False, lambda p, dead: os.link(p.parent / "precious" / "f", p)),
    "a directory": (False, lambda p, dead: p.mkdir()),
    "a fifo": (False, lambda p, dead: os.mkfifo(p)),
    "a file of another user": (False, another_users_file),
}


@pytest.mark.parametrize("kind", LOCKS, ids=lambda k: k.replace(" ", "-"))
@pytest.mark.parametrize("command", COMMANDS)
def test_a_stale_lock_is_taken_over_only_when_it_is_a_plain_file_of_ours(inputs, tmp_path, capsys, precious,
                                                                         command, kind):
    taken, make = LOCKS[kind]
    out, lock = tmp_path / "out", tmp_path / "out.lock"
    make(lock, dead_pid())
    before = snapshot(precious)
    code, err = run(capsys, COMMANDS[command](inputs, out))
    if taken:
        assert code == 0, err
        assert out.exists() and not lock.exists()
    else:
        assert_refused(code, err, lock)
        assert os.path.lexists(lock) and not out.exists()
    assert snapshot(precious) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_a_rerun_removes_stale_partials_only_when_their_writer_is_dead(inputs, tmp_path, capsys, command):
    live = subprocess.Popen(["sleep", "60"])
    try:
        dead = dead_pid()
        (tmp_path / f"out.partial-{dead}").mkdir()
        (tmp_path / f"out.partial-{dead}" / "shard").write_text("half")
        (tmp_path / f"out.old-{dead}").write_text("replaced")
        (tmp_path / f"out.partial-{live.pid}").mkdir()
        mine = ["out.old-keep", "out.partial-2024-06-01"]  # names smoe never gives: the user's own copies
        for name in mine:
            (tmp_path / name).mkdir()
            (tmp_path / name / "f").write_text("mine")
        code, err = run(capsys, COMMANDS[command](inputs, tmp_path / "out"))
        assert code == 0, err
        assert sorted(os.listdir(tmp_path)) == sorted(["out", f"out.partial-{live.pid}", *mine])
        assert all((tmp_path / name / "f").read_text() == "mine" for name in mine)
    finally:
        live.kill()
        live.wait()


@pytest.fixture
def bind(tmp_path):
    """mount --bind SOURCE TARGET, unmounted after the test; bind mounts need root."""
    if os.geteuid() != 0:
        pytest.skip("bind mounts need root (the mount-point cases run as root)")
    mounted = []

    def mount(source: Path, target: Path) -> None:
        target.mkdir(parents=True)
        subprocess.run(["mount", "--bind", str(source), str(target)], check=True, capture_output=True)
        mounted.append(target)

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", str(target)], check=True)


# what the output (or a stale partial) holds of an input, and what the refusal names
REACHED = {
    "a bind mount of the input inside the output": ("out/inner", "input"),
    "a bind mount of the input inside a stale partial": ("out.partial-{dead}/inner", "input"),
    "a hard link of an input file inside the output": ("out/config.json", "input"),
    "a bind mount of another directory inside the output": ("out/inner", "mount"),
}


@pytest.mark.parametrize("way", REACHED, ids=lambda w: w.replace(" ", "-"))
@pytest.mark.parametrize("command", COMMANDS)
def test_force_never_removes_an_input_reachable_through_a_mount(inputs, tmp_path, capsys, precious, bind,
                                                                command, way):
    where, names = REACHED[way]
    source = Path(shutil.copytree(inputs[READS[command]], tmp_path / "input"))
    given = dict(inputs) | {READS[command]: source}
    reach = tmp_path / where.format(dead=dead_pid())
    reach.parent.mkdir(exist_ok=True)
    if "hard link" in way:
        os.link(source / "config.json", reach)
    else:
        bind(source if names == "input" else precious, reach)
    before = snapshot(source) | snapshot(precious)
    code, err = run(capsys, COMMANDS[command](given, tmp_path / "out") + ["--force"])
    assert_refused(code, err, source if names == "input" else "mount")
    assert snapshot(source) | snapshot(precious) == before
    assert "hard link" in way or str(reach) in mount_points()


def test_a_failed_removal_after_publishing_says_the_output_was_written(inputs, tmp_path, capsys):
    """The replaced output is removed only after the new one is in place: if that removal fails, the
    message says the output was written and where the old one is left."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "config.json").write_text("{}")  # an earlier output, as --force replaces
    (out / "sub" / "f").write_text("old")
    if os.geteuid() == 0:  # modes do not stop root; an immutable file does
        if subprocess.run(["chattr", "+i", str(out / "sub" / "f")], capture_output=True).returncode:
            pytest.skip("chattr +i is refused on this filesystem")
        undo = ["chattr", "-i"]
    else:
        (out / "sub").chmod(0o500)
        undo = ["chmod", "700"]
    try:
        code, err = run(capsys, COMMANDS["dequantize"](inputs, out) + ["--force"])
        (old,) = tmp_path.glob("out.old-*")
        assert_refused(code, err, out, "written", old)
        assert "partial" not in err and (out / "model.safetensors").is_file()
    finally:
        for p in (*tmp_path.glob("out.old-*/sub/f"), *tmp_path.glob("out.old-*/sub")):
            subprocess.run([*undo, str(p)], capture_output=True)


# what --force finds at the output path and refuses to replace: (command, how it is made, what the error says)
NOT_AN_EARLIER_OUTPUT = {
    "a directory of other files": ("dequantize", lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")),
                                   "without a config.json"),
    "a directory where a GGUF goes": ("export", lambda p: (p.mkdir(), (p / "config.json").write_text("{}")),
                                      "the output is one file"),
    "a file where a vault goes": ("quantize", lambda p: p.write_text("mine"), "the output is a directory"),
    "a fifo": ("export", os.mkfifo, "neither a file nor a directory"),
}


@pytest.mark.parametrize("case", NOT_AN_EARLIER_OUTPUT, ids=lambda c: c.replace(" ", "-"))
def test_force_replaces_only_an_earlier_output_of_the_same_kind(inputs, tmp_path, capsys, case):
    """--force is not `rm -rf`: what it finds at the output path is replaced only when it could be an
    earlier output of that command (a file for a GGUF; an empty directory or one with a config.json for a
    vault, a checkpoint or an MLX model); anything else is left as it is, with one line saying why."""
    command, make, why = NOT_AN_EARLIER_OUTPUT[case]
    out = tmp_path / "out"
    make(out)
    before = snapshot(tmp_path)
    code, err = run(capsys, COMMANDS[command](inputs, out) + ["--force"])
    assert_refused(code, err, out, why, "--force replaces only an earlier output")
    assert snapshot(tmp_path) == before


def test_an_output_that_appears_while_writing_is_not_replaced_without_force(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SmoeError, match="appeared while the output was written"):
        with writing(out, "export", [], force=False) as output:
            output.begin(make="file").write_text("new")
            out.write_text("someone else's")
            output.publish()
    assert out.read_text() == "someone else's" and os.listdir(tmp_path) == ["out"]


def smoe_process(*args) -> subprocess.Popen:
    """`smoe ARGS` as a terminal starts it: SIGINT at its default (a suite run in the background of a
    non-interactive shell inherits it ignored, and Python then never raises KeyboardInterrupt)."""
    return subprocess.Popen([sys.executable, "-m", "smoe.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def shell_status(returncode: int) -> int:
    """The status a shell shows for a child: 128 + N for one ended by signal N. Python 3.11 ends itself by
    SIGINT at exit when a KeyboardInterrupt passed through exec() of a string (dataclasses make their methods
    so), even one smoe handled after: a shell sees 130 either way."""
    return 128 - returncode if returncode < 0 else returncode


def remove_tree_entries(folder: Path) -> None:
    for p in folder.iterdir():
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def stop_when(proc: subprocess.Popen, ready, timeout: float = 300) -> bool:
    """SIGSTOP `proc` as soon as `ready()` holds, returning once it is stopped; False if it ended first."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if ready():
            proc.send_signal(signal.SIGSTOP)
            return wait_stopped(proc, deadline)
        time.sleep(0.001)
    return False


def wait_stopped(proc: subprocess.Popen, deadline: float) -> bool:
    """Whether proc reached the stopped state (signals are delivered asynchronously: until then it runs on)."""
    stat = Path(f"/proc/{proc.pid}/stat")
    while time.time() < deadline:
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
                return True
        except OSError:  # it ended
            return False
        time.sleep(0.001)
    return False


def export_stopped_mid_write(vault: Path, out: Path) -> subprocess.Popen:
    """A `smoe export` process stopped while its partial is on disk (retried if it finished first)."""
    for _ in range(3):
        for p in out.parent.glob(f"{out.name}*"):
            p.unlink()
        proc = smoe_process("export", vault, "--to", "gguf", "-o", out, "-q")
        if stop_when(proc, lambda: (out.parent / f"{out.name}.partial-{proc.pid}").exists()):
            return proc
        proc.wait()
    pytest.fail("the export finished each time before it could be stopped")


def test_a_killed_export_leaves_a_partial_the_rerun_removes(inputs, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    proc = export_stopped_mid_write(inputs["vault"], out)
    proc.kill()
    proc.wait()
    assert (tmp_path / f"m.gguf.partial-{proc.pid}").exists()
    code, err = run(capsys, COMMANDS["export"](inputs, out))
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_a_concurrent_export_is_refused_naming_the_holder(inputs, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    proc = export_stopped_mid_write(inputs["vault"], out)
    try:
        code, err = run(capsys, COMMANDS["export"](inputs, out))
        assert_refused(code, err, f"smoe export, pid {proc.pid}")
        assert (tmp_path / f"m.gguf.partial-{proc.pid}").exists()  # the holder's partial is left alone
    finally:
        proc.send_signal(signal.SIGCONT)
    assert proc.wait() == 0, proc.stderr.read()
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def loading_torch(proc) -> bool:
    """Whether the process has mapped torch's libraries (it imports torch while building its options)."""
    try:
        return "torch/lib" in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("when", ["while torch loads", "after 1 s"])
def test_ctrl_c_while_the_command_starts_is_one_line_with_status_130(inputs, tmp_path, when):
    """Interrupted while its modules load (an import cut short can leave a module half made, and the next
    import of it fails otherwise), a command says so in one line."""
    proc = smoe_process("quantize", inputs["model"], "-o", tmp_path / "vault", "-q")
    if when == "while torch loads":
        deadline = time.monotonic() + 60
        while not loading_torch(proc) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    else:
        time.sleep(float(when.split()[1]))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    assert shell_status(proc.returncode) == 130 and err.strip().splitlines()[-1].startswith("smoe: interrupted"), err
    assert "Traceback" not in err


def test_ctrl_c_before_any_blob_says_nothing_is_kept(inputs, tmp_path):
    """Interrupted while it holds the lock and has not journalled a blob, quantize keeps no partial
    and does not say it does."""
    out = tmp_path / "vault"
    lock = tmp_path / "vault.lock"
    for _ in range(3):  # on a loaded machine the run can pass its first blob before SIGSTOP lands: start again
        proc = smoe_process("quantize", inputs["model"], "-o", out, "-q")
        assert stop_when(proc, lambda: lock.exists() and b"pid" in lock.read_bytes()), proc.stderr.read()
        journals = [p for p in tmp_path.glob("vault.partial-*/journal.jsonl") if p.stat().st_size]
        if not journals and not out.exists():
            break
        proc.kill()
        proc.wait()
        remove_tree_entries(tmp_path)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate()
    assert shell_status(proc.returncode) == 130 and err.strip().splitlines()[-1] == "smoe: interrupted", err
    assert not journals and kept_partial(out) is None and sorted(os.listdir(tmp_path)) == []


def test_a_resumable_partial_is_named_only_in_the_form_its_cleanup_recognises(tmp_path):
    """The writer and the sweep of stale partials share one tag form, so a resumable partial is always
    recognised as smoe's (and a name of another form never is)."""
    tag = resumable_tag(hashlib.sha256(b"source").hexdigest())
    assert is_work_suffix(tag, PARTIAL) and not is_work_suffix(tag[:-1], PARTIAL)
    with pytest.raises(ValueError):
        resumable_tag("abc")
    output = Output(tmp_path / "vault", inputs=[], force=False)
    with pytest.raises(ValueError):
        output.begin(tag="2024-06-01")
