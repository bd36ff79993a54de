"""The sensitivity sweep and the vault's encoding fanned out over a Ray cluster (smoe.quality.fanout): a local
cluster of 2 CPU workers, driven from a child process (Ray's driver state stays out of the test process)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="ray is not installed: pip install 'smoe[ray]' (make test installs it)")

# Each scenario's facts as JSON; the tests below assert on them. Single-process references run on one thread,
# as each worker does.
SCENARIOS = r"""
import json, os, sys
from pathlib import Path
import ray, torch
from smoe.convert import calibrate
from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.quality import fanout
from smoe.quality.plan import plan_model
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir

root = Path(sys.argv[1])
model = tiny_model_dir(root, "qwen3_moe")
calib = root / "calib.txt"
calib.write_text((TOKENIZER_TEXT + "\n") * 40)
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
facts = {}

def single(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)

# the sweep
alone = single(lambda: plan_model(model, calib, root / "alone.json", budget_bits=3.0, encoder="gptq", tokens=256,
                                  progress=False)[0])
fanned = plan_model(model, calib, root / "fanned.json", budget_bits=3.0, encoder="gptq", tokens=256, progress=False,
                    cluster="local")[0]
tables = [json.loads((root / f"{n}.sensitivity.json").read_text())["kl"] for n in ("alone", "fanned")]
facts["sweep"] = {"trials": len(tables[0]), "same_table": tables[0] == tables[1],
                  "same_plan": alone["tensors"] == fanned["tensors"] and alone["predicted_kl"] == fanned["predicted_kl"]}

# the encoding
stats = calibrate.collect(model, calib, tokens=256, progress=False)
single(lambda: sculpt(model, root / "v-alone", encoder="gptq", calib=calib, calib_tokens=256, stats=stats,
                      progress=False))
sculpt(model, root / "v-fanned", encoder="gptq", calib=calib, calib_tokens=256, stats=stats, progress=False,
       encode_all=fanout.encoder_on("local", model))
facts["vault"] = {name: (root / "v-alone" / name).read_bytes() == (root / "v-fanned" / name).read_bytes()
                  for name in ("experts.bin", "index.json")}
# statistics collected as the encoding reaches each layer (models bigger than memory): each task takes its layer's
single(lambda: sculpt(model, root / "s-alone", encoder="gptq", calib=calib, calib_tokens=256, progress=False))
sculpt(model, root / "s-fanned", encoder="gptq", calib=calib, calib_tokens=256, progress=False,
       encode_all=fanout.encoder_on("local", model))
facts["streamed"] = {name: (root / "s-alone" / name).read_bytes() == (root / "s-fanned" / name).read_bytes()
                     for name in ("experts.bin", "index.json")}

# a worker lost on one trial
def dies_on_layer_one(meter, layer, unit, bits):
    if layer == 1:
        os._exit(1)  # the worker's process is gone, as when its node is lost
    return float(layer)

kept = {}
todo = [(0, "gate_up", 4), (0, "down", 4), (1, "gate_up", 4), (0, "gate_up", 2)]
try:
    fanout.measure_on_cluster("local", dict, (), dies_on_layer_one, todo, kept.__setitem__)
    facts["lost"] = {"error": None}
except SmoeError as err:
    facts["lost"] = {"error": str(err), "kept": [[list(t), v] for t, v in kept.items()]}
ray.shutdown()
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    run = subprocess.run([sys.executable, "-c", SCENARIOS, str(tmp_path_factory.mktemp("fanout"))], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_sweep_on_a_ray_cluster_equals_the_single_process_sweep(facts):
    """Each worker computes the single-process sweep's own measurement: every KL and so the plan are the same."""
    assert facts["sweep"] == {"trials": 8, "same_table": True, "same_plan": True}


def test_statistics_streamed_layer_by_layer_give_the_single_process_vault_on_a_ray_cluster(facts):
    assert facts["streamed"] == {"experts.bin": True, "index.json": True}


def test_a_vault_encoded_on_a_ray_cluster_is_the_single_process_vault(facts):
    """One task per MoE layer, each worker reading the checkpoint itself with the same calibration statistics:
    the same blobs in the same order, byte for byte."""
    assert facts["vault"] == {"experts.bin": True, "index.json": True}


def test_a_lost_worker_is_a_one_line_error_and_what_was_measured_is_kept(facts):
    lost = facts["lost"]
    # which trial the error names depends on which worker Ray reports lost first
    assert lost["error"] is not None and "\n" not in lost["error"]
    assert lost["error"].startswith("a Ray worker was lost measuring layer ")
    assert lost["error"].endswith("the sensitivity table keeps every value measured so far: run the same command "
                                  "again to resume")
    assert all(trial[0] == 0 and value == 0.0 for trial, value in lost["kept"])


@pytest.mark.parametrize("command", [["plan", "--budget", "3"], ["quantize"]])
def test_a_ray_address_that_does_not_answer_is_a_one_line_error_before_any_work(tmp_path, command):
    from smoe.testing.tiny_models import TOKENIZER_TEXT
    from smoe.testing.vaults import tiny_model_dir

    model = tiny_model_dir(tmp_path / "in", "qwen3_moe")
    calib = tmp_path / "in" / "calib.txt"
    calib.write_text((TOKENIZER_TEXT + "\n") * 40)
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "smoe.cli", command[0], str(model), *command[1:], "--calib", str(calib),
                        "--calib-tokens", "256", "-o", str(out / "result"), "--ray", "127.0.0.1:1", "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("smoe: error: --ray 127.0.0.1:1: no Ray cluster answers there")
    assert list(out.iterdir()) == []
