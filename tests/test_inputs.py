"""No command deletes or overwrites its own input: an output that is, contains or lies inside an input
(symlinks resolved), or whose work paths (`<out>.partial-*`, `<out>.old-*`) would be one, is a one-line
error before anything is written or removed."""

import json
import shutil
from pathlib import Path

import pytest

from smoe.cli.commands import main
from smoe.testing.tiny_models import TOKENIZER_TEXT

# command -> argv for inputs {"model", "vault", "calib", "plan"} and an output; every writer, with --force
COMMANDS = {
    "quantize": lambda i, out: ["quantize", i["model"], "-o", out, "--force", "-q"],
    "quantize --calib": lambda i, out: ["quantize", i["model"], "--calib", i["calib"], "--calib-tokens", "64",
                                        "-o", out, "--force", "-q"],
    "quantize --plan": lambda i, out: ["quantize", i["model"], "--plan", i["plan"], "-o", out, "--force", "-q"],
    "dequantize": lambda i, out: ["dequantize", i["vault"], "-o", out, "--force"],
    "export gguf": lambda i, out: ["export", i["vault"], "--to", "gguf", "-o", out, "--force", "-q"],
    "export mlx": lambda i, out: ["export", i["vault"], "--to", "mlx", "-o", out, "--force", "-q"],
    "plan": lambda i, out: ["plan", i["model"], "--budget", "3", "--calib", i["calib"], "-o", out, "-q"],
}
# the inputs each command reads, any of which it must leave alone
READS = {
    "quantize": ("model",), "quantize --calib": ("model", "calib"), "quantize --plan": ("model", "plan"),
    "dequantize": ("vault",), "export gguf": ("vault",), "export mlx": ("vault",), "plan": ("model", "calib"),
}
DIRECTORIES = {"model", "vault"}
RELATIONS = ("is", "lies inside", "contains", "is a symlink to", "has a work path at")
CASES = [(c, i, r) for c, inputs in READS.items() for i in inputs for r in RELATIONS
         if not (r == "lies inside" and i not in DIRECTORIES)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_qwen_vault) -> dict[str, Path]:
    """A tiny model, its vault, a calibration text and a plan for the model (the tests copy them all)."""
    from smoe.quality.sensitivity import UNITS
    from smoe.source.checkpoint import Checkpoint
    from smoe.source.matching import map_experts

    root = tmp_path_factory.mktemp("sources")
    (root / "calib.txt").write_text(TOKENIZER_TEXT * 4)
    ckpt = Checkpoint(tiny_qwen_vault["model"])
    moe = map_experts(ckpt.config, ckpt.names())
    plan = {"format": "smoe-plan", "version": 1, "model_type": moe.model_type, "moe_layers": moe.moe_layers,
            "num_experts": moe.num_experts, "encoder": "grid",
            "expert_shapes": {r: list(s) for r, s in moe.expert_shapes().items()},
            "tensors": {f"{layer}.{u}": 4 for layer in moe.moe_layers for u in UNITS}}
    (root / "plan.json").write_text(json.dumps(plan))
    return tiny_qwen_vault | {"calib": root / "calib.txt", "plan": root / "plan.json"}


def place(sources: dict[str, Path], endangered: str, relation: str, tmp: Path) -> tuple[dict[str, str], Path]:
    """Copies of the inputs, the endangered one placed as `relation` needs; returns them and the output."""
    inputs = {}
    for name, src in sources.items():
        dst = tmp / "inputs" / src.name
        if name == endangered and relation == "contains":
            dst = tmp / "area" / "holder" / src.name
        if name == endangered and relation == "has a work path at":
            dst = tmp / "area" / ("out.partial-dequantize" if name in DIRECTORIES else "out.old-1")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst) if src.is_dir() else shutil.copyfile(src, dst)
        inputs[name] = str(dst)
    target = Path(inputs[endangered])
    out = {"is": target, "lies inside": target / "out", "contains": target.parent,
           "is a symlink to": tmp / "link", "has a work path at": tmp / "area" / "out"}[relation]
    if relation == "is a symlink to":
        out.symlink_to(target)
    return inputs, out


def snapshot(path: Path) -> dict[str, bytes]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): p.read_bytes() for p in files}


@pytest.mark.parametrize("command, endangered, relation", CASES, ids=lambda v: str(v).replace(" ", "-"))
def test_force_never_deletes_the_source(sources, tmp_path, capsys, command, endangered, relation):
    inputs, out = place(sources, endangered, relation, tmp_path)
    before = snapshot(Path(inputs[endangered]))
    code = main(COMMANDS[command](inputs, str(out)))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("smoe: error:") and len(err.strip().splitlines()) == 1, err
    assert inputs[endangered] in err
    assert snapshot(Path(inputs[endangered])) == before


def test_a_work_path_symlinked_to_the_source_is_refused(sources, tmp_path, capsys):
    """A stale `<out>.partial-*` that is a link to the model would be removed as the command's own."""
    inputs, _ = place(sources, "model", "is", tmp_path)
    (tmp_path / "out.partial-stale").symlink_to(inputs["model"])
    before = snapshot(Path(inputs["model"]))
    assert main(COMMANDS["quantize"](inputs, str(tmp_path / "out"))) == 2
    err = capsys.readouterr().err
    assert "out.partial-stale" in err and len(err.strip().splitlines()) == 1
    assert snapshot(Path(inputs["model"])) == before and not (tmp_path / "out").exists()


def test_an_output_beside_the_source_is_still_written(sources, tmp_path, capsys):
    """The check refuses overlap only: a sibling whose name merely starts like the source's is fine."""
    inputs, _ = place(sources, "vault", "is", tmp_path)
    out = Path(inputs["vault"] + "-dequantized")
    assert main(COMMANDS["dequantize"](inputs, str(out))) == 0
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.replace(" ", "-"))
def test_an_empty_output_path_is_a_one_line_error_not_the_working_directory(sources, tmp_path, capsys, monkeypatch,
                                                                              command):
    """`-o ""` would be "." (where the command runs): refused before anything is read or written."""
    inputs, _ = place(sources, "model", "is", tmp_path / "inputs")
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    assert main(COMMANDS[command](inputs, "")) == 2
    err = capsys.readouterr().err
    assert err == "smoe: error: the output path is empty (give -o PATH)\n", err
    assert snapshot(tmp_path) == before
