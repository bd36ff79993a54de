"""What a new user meets on the first run: the demo's figures, names of depths, hub ids, help, errors, logs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smoe.convert.sculpt import SculptReport, sculpt
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.vault import Vault
from smoe.source.checkpoint import Checkpoint
from smoe.source.inspect import format_report, inspect_path
from smoe.source.matching import map_experts
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir


def smoe_cli(*args, env=None, stderr=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], stdout=subprocess.PIPE, stderr=stderr,
                          text=True, env=None if env is None else os.environ | env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("first-run"), "qwen3_moe").parent


# --- the depth of a vault, in words --------------------------------------------------------------


@pytest.mark.parametrize("weights, name", [
    ({4: 10}, "SMOE-Q4"), ({2: 7}, "SMOE-Q2"), ({4: 0, 2: 5}, "SMOE-Q2"),
    ({4: 1, 2: 3}, "mixed (25% Q4, 75% Q2)"), ({2: 1, 4: 1}, "mixed (50% Q4, 50% Q2)"),
])
def test_depth_name_is_single_only_when_every_weight_has_that_depth(weights, name):
    assert codec.depth_name(weights) == name


def test_quantize_summary_calls_a_mixed_vault_mixed(capsys):
    from smoe.cli.commands import print_sculpt_summary

    report = SculptReport(family="qwen3_moe", experts=12, expert_bytes_in=1, trunk_bytes=1, expert_bytes_out=1,
                          vault_bytes=1, seconds=0.1, bits=2, weights_by_bits={4: 1, 2: 2})
    print_sculpt_summary(report, "out")
    first = capsys.readouterr().out.splitlines()[0]
    assert "mixed (33% Q4, 67% Q2)" in first and "SMOE-Q2" not in first


def test_sculpt_and_inspect_name_a_mixed_vault_by_the_shares_it_holds(tiny, tmp_path):
    ckpt = Checkpoint(tiny / "model")
    moe = map_experts(ckpt.config, ckpt.names())
    depths = {(layer, role): 4 if role == "down" else 2 for layer in moe.moe_layers for role in moe.roles}
    report = sculpt(tiny / "model", tmp_path / "mixed", plan=depths, progress=False)
    assert report.depth == "mixed (33% Q4, 67% Q2)"  # down is a third of each expert's weights
    shown = inspect_path(tmp_path / "mixed")
    assert shown["depth"] == report.depth and f"depth                {report.depth}" in format_report(shown)
    assert sculpt(tiny / "model", tmp_path / "q4", progress=False).depth == inspect_path(tmp_path / "q4")["depth"] \
        == "SMOE-Q4"


# --- help and errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["quantize", "plan"])
def test_calib_tokens_help_names_the_default_the_calibration_uses(command):
    from smoe.cli.commands import build_parser
    from smoe.convert import calibrate

    sub = build_parser()._subparsers._group_actions[0].choices[command]
    action = next(a for a in sub._actions if "--calib-tokens" in a.option_strings)
    assert action.help == f"calibration tokens (default {calibrate.DEFAULT_TOKENS})"


def test_not_a_vault_error_says_to_quantize_first(tmp_path):
    with pytest.raises(SmoeError, match="make one with `smoe quantize MODEL_DIR -o "):
        Vault(tmp_path)


# --- hub ids -------------------------------------------------------------------------------------


def hub_cache(root: Path, repo: str, model: Path, revision: str = "0123abcd") -> Path:
    """`root` laid out as a Hugging Face hub cache holding `model` as `repo`: files in blobs/, links in the snapshot."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for i, f in enumerate(sorted(model.iterdir())):
        blob = repo_dir / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hub_id_in_the_local_cache_is_quantized_and_inspected(tiny, tmp_path):
    hub_cache(tmp_path / "hub", "tiny-org/tiny-moe", tiny / "model")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = smoe_cli("quantize", "tiny-org/tiny-moe", "-o", tmp_path / "vault", "-q", env=env)
    assert r.returncode == 0, r.stderr
    assert Vault(tmp_path / "vault").meta["family"] == "qwen3_moe"
    r = smoe_cli("inspect", "tiny-org/tiny-moe", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["source"] == "weights"


@pytest.mark.parametrize("command", [["quantize", "nobody/nothing", "-o", "OUT"], ["inspect", "nobody/nothing"],
                                     ["plan", "nobody/nothing", "--budget", "3", "--calib", "CALIB"]])
def test_a_hub_id_not_in_the_cache_is_one_line_saying_how_to_download_it(tmp_path, command):
    (tmp_path / "hub").mkdir()
    args = [str(tmp_path / a) if a in ("OUT", "CALIB") else a for a in command]
    r = smoe_cli(*args, env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("smoe: error: nobody/nothing:") and "`hf download nobody/nothing`" in r.stderr


# --- a plan remembers its calibration ------------------------------------------------------------


def planned(tiny, tmp_path) -> Path:
    """`smoe plan` of the tiny model on a calibration text, at tmp_path/plan.json: the text's path."""
    calib = tmp_path / "calib.txt"
    calib.write_text((TOKENIZER_TEXT + "\n") * 40)
    r = smoe_cli("plan", tiny / "model", "--budget", "3", "--calib", calib, "--calib-tokens", "256",
                 "-o", tmp_path / "plan.json", "-q")
    assert r.returncode == 0, r.stderr
    return calib


def test_quantize_with_a_plan_calibrates_on_the_plans_text_or_says_what_to_pass(tiny, tmp_path):
    calib = planned(tiny, tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["encoder"] == "gptq" and plan["calibration"]["file"] == str(calib.resolve())
    assert plan["calibration"]["tokens"] == 256
    r = smoe_cli("quantize", tiny / "model", "--plan", tmp_path / "plan.json", "-o", tmp_path / "v", "-q")
    assert r.returncode == 0, r.stderr
    assert f"calibrating the gptq encoder on the plan's text {calib.resolve()} (256 tokens)" in r.stderr
    assert Vault(tmp_path / "v").meta["encoder"] == "gptq"
    calib.write_text("other text " * 500)
    r = smoe_cli("quantize", tiny / "model", "--plan", tmp_path / "plan.json", "-o", tmp_path / "w", "-q")
    assert r.returncode == 2 and "pass --calib FILE --calib-tokens 256" in r.stderr and "--encoder grid" in r.stderr
    assert not (tmp_path / "w").exists()


# --- logs ----------------------------------------------------------------------------------------


def test_quantize_writes_no_carriage_returns_into_a_redirected_stderr(tiny, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text((TOKENIZER_TEXT + "\n") * 40)
    with open(tmp_path / "log", "w") as log:  # no -q: the bars decide for themselves
        r = smoe_cli("quantize", tiny / "model", "-o", tmp_path / "v", "--calib", calib, "--calib-tokens", "256",
                     stderr=log)
    assert r.returncode == 0
    assert "\r" not in (tmp_path / "log").read_text()


def test_progress_bars_still_draw_on_a_terminal(monkeypatch):
    import io

    from smoe.progress import bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert not bar(range(3), file=sys.stderr).disable
    assert bar(range(3), enabled=False, file=sys.stderr).disable


def test_quantize_with_a_plan_reuses_the_calibration_statistics_the_plan_measured_with(tiny, tmp_path):
    """`smoe plan` keeps its calibration statistics beside the plan; `quantize --plan` reads them back when they
    fit the model, text and token count (the same vault as calibrating again), and calibrates again when the
    file is unreadable."""
    import shutil

    planned(tiny, tmp_path)
    kept = tmp_path / "plan.calibration.pt"
    assert kept.is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(tmp_path / "plan.json", elsewhere / "plan.json")  # the same plan without its statistics
    vaults = {}
    for name, plan in (("reused", tmp_path / "plan.json"), ("fresh", elsewhere / "plan.json")):
        r = smoe_cli("quantize", tiny / "model", "--plan", plan, "-o", tmp_path / name, "-q")
        assert r.returncode == 0, r.stderr
        assert (f"reusing the calibration statistics in {kept}" in r.stderr) == (name == "reused")
        vaults[name] = (tmp_path / name / "experts.bin").read_bytes()
    assert vaults["reused"] == vaults["fresh"]
    saved = bytearray(kept.read_bytes())
    saved[len(saved) // 2] ^= 0x10  # one bit of one statistic: the file still loads, with another value
    for name, content in (("changed", bytes(saved)), ("unreadable", b"not statistics")):
        kept.write_bytes(content)
        r = smoe_cli("quantize", tiny / "model", "--plan", tmp_path / "plan.json", "-o", tmp_path / name, "-q")
        assert r.returncode == 0, r.stderr
        assert "reusing" not in r.stderr and (tmp_path / name / "experts.bin").read_bytes() == vaults["fresh"]


@pytest.mark.parametrize("existing", ["a directory", "another file", "an image where its heatmap goes"])
def test_plan_refuses_an_output_it_would_lose_before_any_work(tiny, tmp_path, existing):
    calib = tmp_path / "calib.txt"
    calib.write_text((TOKENIZER_TEXT + "\n") * 40)
    out = tmp_path / "out.json"
    taken = out.with_suffix(".png") if existing == "an image where its heatmap goes" else out
    taken.mkdir() if existing == "a directory" else taken.write_text("notes")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = smoe_cli("plan", tiny / "model", "--budget", "3", "--calib", calib, "-o", out, "-q")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(taken) in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written beside it
    assert taken.is_dir() if existing == "a directory" else taken.read_text() == "notes"


def test_a_plan_that_does_not_fit_the_model_is_refused_before_any_calibration(tiny, tmp_path):
    """A plan's depths are checked against the model first: a wrong one costs no calibration pass (on a
    large model, the longest step)."""
    planned(tiny, tmp_path)
    doc = json.loads((tmp_path / "plan.json").read_text())
    first = sorted(doc["tensors"])[0]
    doc["tensors"][first] = 3
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    r = smoe_cli("quantize", tiny / "model", "--plan", tmp_path / "plan.json", "-o", tmp_path / "vault", "-q")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"the plan gives {first} 3 bits" in r.stderr, r.stderr
    assert not (tmp_path / "vault").exists()
