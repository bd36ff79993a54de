"""The sensitivity sweep fanned out over a Ray cluster (smoe.quality.fanout): a local cluster of 2 CPU workers."""

import json
import os
import subprocess
import sys

import pytest
import torch

from smoe.errors import SmoeError
from smoe.quality.plan import plan_model
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'smoe[ray]' (make test installs it)")
fanout = pytest.importorskip("smoe.quality.fanout")


@pytest.fixture(scope="module")
def cluster():
    """One local cluster of 2 CPU workers for the module (starting one takes tens of seconds here)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield "local"
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fanout")
    model = tiny_model_dir(root, "qwen3_moe")
    (root / "calib.txt").write_text((TOKENIZER_TEXT + "\n") * 40)
    return model, root / "calib.txt"


def test_a_sweep_on_a_ray_cluster_equals_the_single_process_sweep(cluster, tiny, tmp_path):
    """Each worker computes the single-process sweep's own measurement (on one thread, as each worker runs):
    every KL and so the plan are the same numbers."""
    model, calib = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone, _, _, _ = plan_model(model, calib, tmp_path / "alone.json", budget_bits=3.0, encoder="gptq", tokens=256,
                                    progress=False)
    finally:
        torch.set_num_threads(threads)
    fanned, _, _, _ = plan_model(model, calib, tmp_path / "fanned.json", budget_bits=3.0, encoder="gptq", tokens=256,
                                 progress=False, cluster=cluster)
    tables = [json.loads((tmp_path / f"{name}.sensitivity.json").read_text())["kl"] for name in ("alone", "fanned")]
    assert len(tables[0]) == 8 and tables[0] == tables[1]
    assert alone["tensors"] == fanned["tensors"] and alone["predicted_kl"] == fanned["predicted_kl"]


def dies_on_layer_one(meter, layer: int, unit: str, bits: int) -> float:
    if layer == 1:
        os._exit(1)  # the worker's process is gone, as when its node is lost
    return float(layer)


def test_a_lost_worker_is_a_one_line_error_and_what_was_measured_is_kept(cluster):
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    kept = {}
    todo = [(0, "gate_up", 4), (0, "down", 4), (1, "gate_up", 4), (0, "gate_up", 2)]
    # which trial the error names depends on which worker Ray reports lost first
    with pytest.raises(SmoeError, match=r"^a Ray worker was lost measuring layer \d \w+ at Q\d \(\w+\); the sensitivity "
                                        "table keeps every value measured so far: run the same command again to resume$"):
        fanout.measure_on_cluster(cluster, dict, (), dies_on_layer_one, todo, kept.__setitem__)
    assert (1, "gate_up", 4) not in kept and all(trial[0] == 0 and value == 0.0 for trial, value in kept.items())


@pytest.mark.parametrize("command", [["plan", "--budget", "3"], ["quantize"]])
def test_a_ray_address_that_does_not_answer_is_a_one_line_error_before_any_work(tiny, tmp_path, command):
    model, calib = tiny
    r = subprocess.run([sys.executable, "-m", "smoe.cli", command[0], str(model), *command[1:], "--calib", str(calib),
                        "--calib-tokens", "256", "-o", str(tmp_path / "out"), "--ray", "127.0.0.1:1", "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("smoe: error: --ray 127.0.0.1:1: no Ray cluster answers there")
    assert list(tmp_path.iterdir()) == []


def test_a_vault_encoded_on_a_ray_cluster_is_the_single_process_vault(cluster, tiny, tmp_path):
    """One task per MoE layer, each worker reading the checkpoint itself and encoding with the same calibration
    statistics on one thread: the same blobs, in the same order, byte for byte."""
    from smoe.convert import calibrate
    from smoe.convert.sculpt import sculpt

    model, calib = tiny
    stats = calibrate.collect(model, calib, tokens=256, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sculpt(model, tmp_path / "alone", encoder="gptq", calib=calib, calib_tokens=256, stats=stats, progress=False)
    finally:
        torch.set_num_threads(threads)
    sculpt(model, tmp_path / "fanned", encoder="gptq", calib=calib, calib_tokens=256, stats=stats, progress=False,
           encode_all=fanout.encoder_on(cluster, model))
    for name in ("experts.bin", "index.json"):
        assert (tmp_path / "alone" / name).read_bytes() == (tmp_path / "fanned" / name).read_bytes(), name
