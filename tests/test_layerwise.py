"""Calibration run one decoder layer at a time (smoe.hf.layerwise) against the whole model run at once."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from smoe.convert import calibrate, encoders
from smoe.errors import SmoeError
from smoe.hf.experts import experts_input_sizes
from smoe.hf.layerwise import LayerByLayer
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir, vault_of

CALIB_TEXT = (TOKENIZER_TEXT + "\n") * 40
TOKENS = 256


def whole_model_stats(model_dir, text) -> calibrate.CalibrationStats:
    """The statistics as recorded with the whole model loaded by transformers, one window at a time."""
    model, modules = calibrate.load_source_model(model_dir, calibrate.IMPLEMENTATION)
    some = next(iter(modules.values()))
    stats = calibrate.CalibrationStats(num_experts=some.num_experts, tokens=0, text_hash="")
    recorder = calibrate.Recorder(stats, experts_input_sizes(some))
    for module in modules.values():
        module.smoe_recorder = recorder
    with torch.inference_mode():
        for window in calibrate.calibration_windows(model_dir, text, TOKENS):
            model(input_ids=window, use_cache=False)
    return stats


def model_with_text(tmp_path, family: str, **options):
    model = tiny_model_dir(tmp_path, family, **options)
    (tmp_path / "calib.txt").write_text(CALIB_TEXT)
    return model, tmp_path / "calib.txt"


MORE_EXPERTS = {"qwen3_moe": {"num_experts": 12}, "mixtral": {"num_local_experts": 12}}  # expert 10 after expert 2


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_layer_by_layer_statistics_equal_the_whole_models(tmp_path, family):
    """Dense first layers, MLA, sliding/full attention with sinks, linear attention, experts stored one tensor per
    expert (merged in transformers' order, numbers numerically): each layer gets the arguments and weights the
    model's own forward and loader give it."""
    model, text = model_with_text(tmp_path, family, architecture=MORE_EXPERTS.get(family))
    layered = calibrate.collect(model, text, TOKENS, progress=False)
    whole = whole_model_stats(model, text)
    assert layered.layers == sorted(whole.counts) and layered.layers
    for layer in layered.layers:
        assert torch.equal(layered.counts[layer], whole.counts[layer])
        assert layered.layer_tokens[layer] == whole.layer_tokens[layer]
        torch.testing.assert_close(layered.layer_sums[layer], whole.layer_sums[layer], rtol=1e-5, atol=1e-8)
        for which in calibrate.INPUTS:
            torch.testing.assert_close(layered.sums[layer][which], whole.sums[layer][which], rtol=1e-5, atol=1e-8)


def test_layer_by_layer_gptq_codes_equal_the_whole_models(tmp_path):
    model, text = model_with_text(tmp_path, "qwen3_moe")
    layered, whole = calibrate.collect(model, text, TOKENS, progress=False), whole_model_stats(model, text)
    w = torch.randn(64, layered.sums[layered.layers[0]]["gate_up"].shape[-1], generator=torch.Generator().manual_seed(0))
    same = total = 0
    for layer in layered.layers:
        for expert in range(layered.num_experts):
            a, _ = encoders.encode(w, 4, "gptq", layered.second_moment(layer, expert, "gate"))
            b, _ = encoders.encode(w, 4, "gptq", calibrate.CalibrationStats.second_moment(
                calibrate.CalibrationStats(whole.num_experts, 0, "", whole.sums, whole.counts, whole.layer_sums,
                                           whole.layer_tokens), layer, expert, "gate"))
            same, total = same + int((a == b).sum()), total + a.numel()
    assert same / total >= 0.999


def test_only_one_layer_is_in_memory_at_a_time(tmp_path):
    model, text = model_with_text(tmp_path, "qwen3_moe", architecture={"num_hidden_layers": 3})
    runner = LayerByLayer(model, calibrate.calibration_windows(model, text, TOKENS), calibrate.IMPLEMENTATION)
    loaded = lambda module: any(not p.is_meta for p in module.parameters())
    seen = []
    for i in runner.run():
        seen.append(i)
        assert [loaded(layer) for layer in runner.layers] == [j == i for j in range(3)]
        assert not loaded(runner.decoder.embed_tokens)  # read once, for the first layer's inputs, then freed
    assert seen == [0, 1, 2] and not loaded(runner.model)


def test_hidden_states_beyond_the_memory_share_go_to_disk_with_the_same_result(tmp_path, monkeypatch):
    model, text = model_with_text(tmp_path, "qwen3_moe")
    in_memory = calibrate.collect(model, text, TOKENS, progress=False)
    monkeypatch.setattr("smoe.hf.layerwise.IN_MEMORY_BYTES", 0)
    on_disk = calibrate.collect(model, text, TOKENS, progress=False)
    for layer in in_memory.layers:
        assert torch.equal(in_memory.sums[layer]["down"], on_disk.sums[layer]["down"])


def test_streamed_statistics_write_the_vault_the_collected_ones_write(tmp_path):
    model, text = model_with_text(tmp_path, "qwen3_moe")
    streamed = vault_of(model, tmp_path / "streamed", calib=text, calib_tokens=TOKENS)
    collected = vault_of(model, tmp_path / "collected", calib=text, calib_tokens=TOKENS,
                         stats=calibrate.collect(model, text, TOKENS, progress=False))
    assert (streamed / "experts.bin").read_bytes() == (collected / "experts.bin").read_bytes()


def test_streamed_statistics_refuse_a_layer_asked_for_after_a_later_one(tmp_path):
    model, text = model_with_text(tmp_path, "qwen3_moe")
    stats = calibrate.StreamedStats(model, text, TOKENS, progress=False)
    stats.second_moment(1, 0, "gate")
    with pytest.raises(SmoeError, match="asked for after those of layer 1"):
        stats.second_moment(0, 0, "gate")


def test_a_layer_missing_from_the_checkpoint_is_one_line_naming_it(tmp_path):
    model, text = model_with_text(tmp_path, "qwen3_moe")
    tensors = load_file(model / "model.safetensors")
    dropped = next(n for n in tensors if n.startswith("model.layers.1.") and "q_proj" in n)
    save_file({n: t for n, t in tensors.items() if n != dropped}, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SmoeError, match="no tensor for 1 parameters of layer 1"):
        calibrate.collect(model, text, TOKENS, progress=False)


# A child process calibrates a model deep enough to show growth, printing its peak RSS (VmHWM) after each layer.
PEAK_PER_LAYER = """
import json, sys
import torch
from smoe.convert.calibrate import collect_layers

torch.set_num_threads(1)  # the same allocations as with more, and quicker on a busy machine

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

peaks = []
for layer in collect_layers(sys.argv[1], sys.argv[2], int(sys.argv[3]), progress=False):
    del layer
    peaks.append(peak())
print(json.dumps(peaks))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_calibration_peak_memory_does_not_grow_with_depth(tmp_path):
    """Layer by layer, memory holds one layer whatever the depth: the peak after the last of 16 layers is within a
    few MB of the peak after the 4th, here with temporaries of about 1 MB each (hidden size 512, 8 experts of
    256); with glibc's sliding mmap threshold (smoe.hf.layerwise.fix_mmap_threshold) it grew 92-96 MB, with the
    threshold fixed 2-5 MB."""
    model, text = model_with_text(tmp_path, "qwen3_moe", architecture={
        "num_hidden_layers": 16, "decoder_sparse_step": 1, "hidden_size": 512, "head_dim": 16, "num_experts": 8,
        "moe_intermediate_size": 256, "intermediate_size": 256, "max_position_embeddings": 512})
    child = subprocess.run([sys.executable, "-c", PEAK_PER_LAYER, str(model), str(text), "512"], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    peaks = json.loads(child.stdout.splitlines()[-1])
    assert len(peaks) == 16
    grown = peaks[-1] - peaks[3]
    assert grown < 24 << 20, f"peak RSS grew {grown / 2**20:.0f} MB from layer 4 to 16: {[p >> 20 for p in peaks]} MB"
