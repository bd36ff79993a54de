"""User mistakes and hostile environments give one line `smoe: error: …` (exit 2) and lose nothing."""

import os
import resource
import signal
import subprocess
import sys

import pytest

from smoe.format.vault import verify
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_vault


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp("errors"), "mixtral", seed=4).parent


def smoe(*args, stdin=None, limit_bytes=None):
    def limit():
        if limit_bytes is not None:  # a disk that fills: writes past the limit fail with EFBIG
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], input=stdin, capture_output=True,
                          preexec_fn=limit)


def one_line_error(r) -> str:
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1 and err.startswith("smoe: error:"), err
    return err


def test_a_prompt_that_is_not_utf8_is_a_one_line_error(tiny):
    r = subprocess.run([sys.executable, "-m", "smoe.cli", "generate", str(tiny / "vault"), "-p", b"ab\xffcd",
                        "--max-tokens", "2"], capture_output=True)
    assert "not valid UTF-8 (byte 0xff" in one_line_error(r)


def test_a_chat_line_that_is_not_utf8_costs_the_line_not_the_session(tiny):
    r = smoe("chat", tiny / "vault", "--max-tokens", "2", stdin=b"hi\xff\nhello\n")
    err = r.stderr.decode()
    assert r.returncode == 0 and "not valid UTF-8" in err and "Traceback" not in err
    assert err.count("prompt tokens") == 1  # the second line was answered


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
def test_a_data_file_that_is_not_utf8_text_is_a_one_line_error(tiny, tmp_path, gzipped):
    """eval's --data (and calibration, which reads text the same way) refuses a binary file given by mistake
    instead of scoring its bytes as replacement characters."""
    import gzip

    data = tmp_path / ("data.bin.gz" if gzipped else "data.bin")
    payload = (tiny / "vault" / "experts.bin").read_bytes()[:4096] + bytes([0xFF, 0xFE]) * 64
    data.write_bytes(gzip.compress(payload) if gzipped else payload)
    r = smoe("eval", tiny / "vault", "--ref", tiny / "model", "--data", data, "--tokens", "64", "--device", "cpu")
    assert f"{data}: not UTF-8 text" in one_line_error(r)


@pytest.mark.parametrize("args", [("verify", "{vault}", "--json"), ("inspect", "{vault}", "--json")])
def test_a_closed_output_pipe_ends_quietly(tiny, args):
    cmd = " ".join([sys.executable, "-m", "smoe.cli", *(a.format(vault=tiny / "vault") for a in args)])
    r = subprocess.run(["bash", "-c", f"{cmd} | true; echo rc=${{PIPESTATUS[0]}} >&2"], capture_output=True, text=True)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr and "rc=141" in r.stderr, r.stderr


def test_a_disk_that_fills_during_quantize_is_one_line_and_the_rerun_resumes(tiny, tmp_path):
    out = tmp_path / "vault"
    r = smoe("quantize", tiny / "model", "-o", out, "--quiet", limit_bytes=150_000)
    err = one_line_error(r)
    assert "File too large" in err and "the partial vault is kept" in err
    assert not out.exists()
    r = smoe("quantize", tiny / "model", "-o", out, "--quiet")
    assert r.returncode == 0, r.stderr.decode()
    assert verify(out) == []
    assert (out / "experts.bin").read_bytes() == (tiny / "vault" / "experts.bin").read_bytes()


def test_a_disk_that_fills_during_export_is_one_line_and_leaves_nothing(tiny, tmp_path):
    r = smoe("export", tiny / "vault", "--to", "mlx", "-o", tmp_path / "mlx", "-q", limit_bytes=100_000)
    err = one_line_error(r)
    assert "File too large" in err or "is the disk full" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", [("quantize", "{model}", "-o", "{out}", "-q"),
                                     ("dequantize", "{vault}", "-o", "{out}"),
                                     ("export", "{vault}", "--to", "mlx", "-o", "{out}", "-q")])
def test_a_second_writer_of_one_output_is_refused_naming_the_holder(tiny, tmp_path, command):
    from smoe.format.output import output_lock

    out = tmp_path / "out"
    args = [a.format(model=tiny / "model", vault=tiny / "vault", out=out) for a in command]
    with output_lock(out, "quantize"):
        r = smoe(*args)
    err = one_line_error(r)
    assert f"smoe quantize, pid {os.getpid()}" in err and not out.exists()
    assert smoe(*args).returncode == 0 and out.exists()  # the lock went with its holder
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_disk_that_fills_during_dequantize_is_one_line_and_leaves_nothing(tiny, tmp_path):
    r = smoe("dequantize", tiny / "vault", "-o", tmp_path / "hf", limit_bytes=100_000)
    assert "File too large" in one_line_error(r)
    assert os.listdir(tmp_path) == []


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no write reaches: by its mode for a normal user; as root (whom modes do not stop) a
    read-only bind mount, where mounting is allowed."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True).returncode:
        pytest.skip("running as root where bind mounts are not allowed: no directory is read-only to this process")
    yield path
    subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("command", [("quantize", "{model}", "-o", "{out}", "-q"),
                                     ("dequantize", "{vault}", "-o", "{out}"),
                                     ("export", "{vault}", "--to", "mlx", "-o", "{out}", "-q")])
def test_a_read_only_output_directory_is_one_line(tiny, read_only_dir, command):
    args = [a.format(model=tiny / "model", vault=tiny / "vault", out=read_only_dir / "out") for a in command]
    err = one_line_error(smoe(*args))
    assert "Read-only file system" in err or "Permission denied" in err
    assert os.listdir(read_only_dir) == []


def test_a_disk_that_fills_while_plan_keeps_its_statistics_is_one_line_and_leaves_no_temporary(tiny, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text((TOKENIZER_TEXT + "\n") * 40)
    r = smoe("plan", tiny / "model", "--budget", "3", "--calib", calib, "--calib-tokens", "256",
             "-o", tmp_path / "plan.json", "-q", limit_bytes=20_000)
    err = one_line_error(r)
    assert "calibration statistics could not be written" in err and "disk full" in err
    assert sorted(os.listdir(tmp_path)) == ["calib.txt"]


def test_eval_against_another_model_than_the_vaults_source_is_refused(tiny, tmp_path):
    from smoe.testing.vaults import tiny_model_dir

    other = tiny_model_dir(tmp_path, "qwen3_moe", seed=2)
    (tmp_path / "data.txt").write_text(TOKENIZER_TEXT)
    r = smoe("eval", tiny / "vault", "--ref", other, "--data", tmp_path / "data.txt", "--device", "cpu")
    assert "not the model the vault was made from: model_type 'qwen3_moe' (the vault's 'mixtral')" in one_line_error(r)
    r = smoe("eval", tiny / "vault", "--ref", tiny / "model", "--data", tmp_path / "data.txt", "--tokens", "64",
             "--device", "cpu")
    assert r.returncode == 0 and b"ppl" in r.stdout, r.stderr
