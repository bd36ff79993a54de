"""Resuming an interrupted sculpt: a blob is reused only when the bytes it was encoded from are unchanged.

An interrupted run is made by planting a NaN in a later expert: the sculpt stops there with the blobs
before it written and journalled, exactly the partial a killed run leaves (each blob's bytes, then its
journal line, are on disk before the next expert is read). The NaN is then taken out again.
"""

import json
from pathlib import Path

import pytest
import torch

from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.format.vault import TRUNK_FILE, Vault
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir

STOP_AT = (3, 2)  # qwen3_moe tiny: MoE layers 1 and 3, six experts each; the run stops before (3, 2)
WRITTEN = 6 + STOP_AT[1]
GPTQ = {"encoder": "gptq", "calib_tokens": 256}


@pytest.fixture
def model(tmp_path) -> Path:
    (tmp_path / "calib.txt").write_text((TOKENIZER_TEXT + "\n") * 40)
    return tiny_model_dir(tmp_path, "qwen3_moe", seed=4)


def expert(layer: int, index: int, role: str = "down") -> str:
    return f"model.layers.{layer}.mlp.experts.{index}.{role}_proj.weight"


def rewrite_in_place(model: Path, name: str, change) -> None:
    """Replace one fp32 tensor's data in model.safetensors; its header (name, dtype, shape, offsets)
    stays byte-identical, so every fingerprint of the headers is unchanged."""
    path = model / "model.safetensors"
    with open(path, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[name]
        assert entry["dtype"] == "F32"
        begin, end = entry["data_offsets"]
        f.seek(8 + header_len + begin)
        t = torch.frombuffer(bytearray(f.read(end - begin)), dtype=torch.float32).clone()
        f.seek(8 + header_len + begin)
        f.write(change(t).numpy().tobytes())


def interrupt(model: Path, out: Path, **kw) -> dict[tuple[int, int], str]:
    """Leave `out`'s partial as a run killed before expert STOP_AT; returns the journalled checksums."""
    name = expert(*STOP_AT)
    kept = {}
    rewrite_in_place(model, name, lambda t: kept.setdefault("t", t.clone()).index_fill(0, torch.tensor([5]), torch.nan))
    with pytest.raises(SmoeError, match="NaN"):
        finish(model, out, **kw)
    rewrite_in_place(model, name, lambda t: kept["t"])
    (journal,) = out.parent.glob(f"{out.name}.partial-*/journal.jsonl")
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(lines) == WRITTEN
    return {(e["layer"], e["expert"]): e["checksum"] for e in lines}


def finish(model: Path, out: Path, **kw):
    """Sculpt; with encoder arguments, calibrated on the text beside the model."""
    return sculpt(model, out, progress=False, calib=model.parent / "calib.txt" if kw else None, **kw)


def assert_same_vault(vault: Path, fresh: Path) -> None:
    """Every blob, the index entries and the trunk equal a fresh sculpt's, byte for byte."""
    with Vault(vault) as a, Vault(fresh) as b:
        assert a.entries == b.entries
        for key in a.entries:
            assert a.read_blob(*key) == b.read_blob(*key), key
    for name in (TRUNK_FILE, "config.json", "tokenizer.json"):
        assert (vault / name).read_bytes() == (fresh / name).read_bytes(), name


def test_resume_after_the_source_weights_changed_never_reuses_stale_blobs(model, tmp_path, capsys):
    journalled = interrupt(model, tmp_path / "vault")
    changed = (1, 3)
    rewrite_in_place(model, expert(*changed), torch.neg)
    report = finish(model, tmp_path / "vault")
    fresh = finish(model, tmp_path / "fresh")
    assert_same_vault(tmp_path / "vault", tmp_path / "fresh")
    with Vault(tmp_path / "fresh") as v:
        assert v.entry(*changed).checksum != journalled[changed]  # the stale blob would have differed
    assert report.resumed_experts == changed[1] and fresh.resumed_experts == 0
    notice = [line for line in capsys.readouterr().err.splitlines() if "re-encod" in line]
    assert len(notice) == 1 and "layer 1 expert 3" in notice[0]


def test_resume_with_calibration_after_the_trunk_changed_never_reuses_stale_blobs(model, tmp_path):
    journalled = interrupt(model, tmp_path / "vault", **GPTQ)
    # Attention weights are trunk: no expert's bytes change, but every MoE layer's calibration inputs do.
    rewrite_in_place(model, "model.layers.0.self_attn.o_proj.weight", lambda t: t * 3)
    report = finish(model, tmp_path / "vault", **GPTQ)
    finish(model, tmp_path / "fresh", **GPTQ)
    assert_same_vault(tmp_path / "vault", tmp_path / "fresh")
    with Vault(tmp_path / "fresh") as v:
        assert all(v.entry(*key).checksum != checksum for key, checksum in journalled.items())
    assert report.resumed_experts == 0


@pytest.mark.parametrize("encoder", [{}, GPTQ], ids=["grid", "gptq"])
def test_resume_of_unchanged_sources_reuses_every_journalled_blob(model, tmp_path, encoder):
    interrupt(model, tmp_path / "vault", **encoder)
    report = finish(model, tmp_path / "vault", **encoder)
    finish(model, tmp_path / "fresh", **encoder)
    assert report.resumed_experts == WRITTEN
    assert_same_vault(tmp_path / "vault", tmp_path / "fresh")


# what changes in the source between the interrupted run and the resume: (tensor or None for the config, change)
SOURCE_CHANGES = {
    "an expert's weights, headers unchanged": (expert(1, 3), torch.neg),
    "the trunk's weights": ("model.layers.0.self_attn.o_proj.weight", lambda t: t * 3),
    "the config": (None, lambda config: config | {"rms_norm_eps": config["rms_norm_eps"] * 2}),
}


@pytest.mark.parametrize("change", SOURCE_CHANGES, ids=lambda c: c.replace(" ", "-").replace(",", ""))
def test_a_stale_resume_after_the_source_changed_matches_a_fresh_sculpt(model, tmp_path, change):
    interrupt(model, tmp_path / "vault")
    name, how = SOURCE_CHANGES[change]
    if name is None:
        (model / "config.json").write_text(json.dumps(how(json.loads((model / "config.json").read_text()))))
    else:
        rewrite_in_place(model, name, how)
    finish(model, tmp_path / "vault")
    finish(model, tmp_path / "fresh")
    files = lambda d: {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
    assert files(tmp_path / "vault") == files(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "fresh", "model", "vault"]
