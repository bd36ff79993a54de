"""The sensitivity sweep run one decoder layer at a time (`smoe plan --layer-by-layer`) against the whole model."""

import json
import subprocess
import sys

import pytest

from smoe.convert import calibrate
from smoe.errors import SmoeError
from smoe.hf.layerwise import LayerByLayer
from smoe.quality.plan import plan_model
from smoe.quality.sensitivity import KLMeter, QuantisedModel, measure_layer_by_layer, measure_one
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir

CALIB_TEXT = (TOKENIZER_TEXT + "\n") * 40
TOKENS = 256


def model_with_text(tmp_path, family: str, **architecture):
    model = tiny_model_dir(tmp_path, family, architecture=architecture or None)
    (tmp_path / "calib.txt").write_text(CALIB_TEXT)
    return model, tmp_path / "calib.txt"


def sweeps(model, text):
    """(layer-by-layer KLs, whole-model KLs) of every trial of the grid encoder."""
    windows = calibrate.calibration_windows(model, text, TOKENS)
    qm = QuantisedModel(model, "grid")
    trials = [(layer, unit, bits) for layer, unit in qm.units() for bits in (2, 4)]
    layered = {}
    measure_layer_by_layer(qm, windows, trials, layered.__setitem__)
    meter = KLMeter(QuantisedModel(model, "grid"), windows)
    return layered, {trial: measure_one(meter, *trial) for trial in trials}


@pytest.mark.parametrize("family", [
    "deepseek_v3",  # MLA, a dense first layer, a shared expert
    "gpt_oss",  # sinks, sliding layers, expert biases
])
def test_a_layer_by_layer_sweep_gives_every_trial_the_whole_models_kl(tmp_path, family):
    model, text = model_with_text(tmp_path, family)
    layered, whole = sweeps(model, text)
    assert set(layered) == set(whole) and len(whole) >= 4
    for trial, value in whole.items():
        assert value > 0 and layered[trial] == pytest.approx(value, rel=1e-5), trial


def test_spilled_hidden_states_give_the_same_kls(tmp_path, monkeypatch):
    model, text = model_with_text(tmp_path, "qwen3_moe")
    windows = calibrate.calibration_windows(model, text, TOKENS)
    trials = [(layer, unit, 2) for layer, unit in QuantisedModel(model, "grid").units()]
    in_memory, on_disk = {}, {}
    measure_layer_by_layer(QuantisedModel(model, "grid"), windows, trials, in_memory.__setitem__)
    monkeypatch.setattr("smoe.hf.layerwise.IN_MEMORY_BYTES", 0)
    measure_layer_by_layer(QuantisedModel(model, "grid"), windows, trials, on_disk.__setitem__)
    assert on_disk == in_memory


def test_the_sweep_holds_one_decoder_layer_at_a_time_and_never_the_whole_model(tmp_path, monkeypatch):
    model, text = model_with_text(tmp_path, "qwen3_moe", num_hidden_layers=3)
    loaded_at_once = []
    load = LayerByLayer.load

    def watched(self, modules, layer):
        load(self, modules, layer)
        loaded_at_once.append(sum(any(not p.is_meta for p in m.parameters()) for m in self.layers))

    monkeypatch.setattr(LayerByLayer, "load", watched)
    monkeypatch.setattr(QuantisedModel, "loaded", property(lambda self: pytest.fail("the whole model was loaded")))
    qm = QuantisedModel(model, "grid")
    measure_layer_by_layer(qm, calibrate.calibration_windows(model, text, TOKENS),
                           [(layer, "down", 2) for layer, _ in qm.units()], lambda *_: None)
    assert loaded_at_once and max(loaded_at_once) == 1
    assert not qm.cache  # each layer's decoded weights dropped once the sweep is past it


def smoe_cli(*args):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True)


def test_plan_layer_by_layer_with_streamed_calibration_is_the_whole_models_plan(tmp_path):
    """The default (calibrated) encoder: its statistics streamed a layer at a time, the trials in one pass; a model
    whose forward would add a load-balancing loss of its routers' logits (none run when scoring)."""
    model, text = model_with_text(tmp_path, "qwen3_moe", output_router_logits=True)
    plans = {}
    for name, flags in (("whole", []), ("layered", ["--layer-by-layer"])):
        r = smoe_cli("plan", model, "--budget", "3.0", "--calib", text, "--calib-tokens", TOKENS, "-o",
                     tmp_path / f"{name}.json", "-q", *flags)
        assert r.returncode == 0, r.stderr
        plans[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert plans["layered"]["tensors"] == plans["whole"]["tensors"]
    assert plans["layered"]["predicted_kl"] == pytest.approx(plans["whole"]["predicted_kl"], rel=1e-5)
    assert (tmp_path / "whole.calibration.pt").is_file() and not (tmp_path / "layered.calibration.pt").exists()


@pytest.mark.parametrize("options, named", [({"cluster": "local"}, "--ray"), ({"groups": 2}, "--expert-groups"),
                                            ({"need_meter": True}, "smoe quantize --plan")])
def test_layer_by_layer_refuses_what_needs_the_whole_model_in_one_line(tmp_path, options, named):
    model, text = model_with_text(tmp_path, "qwen3_moe")
    with pytest.raises(SmoeError, match="layer-by-layer") as err:
        plan_model(model, text, tmp_path / "plan.json", 3.0, layer_by_layer=True, progress=False, **options)
    assert named in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "plan.json").exists()
