"""Calibration, the weighted encoders, sensitivity tables and the exact bit-budget planner."""

import itertools
import json
import random
import subprocess
import sys

import pytest
import torch

from smoe.convert import calibrate, encoders
from smoe.convert.sculpt import sculpt
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.vault import Vault
from smoe.quality.plan import (
    bits_cost,
    blob_nbytes,
    experts_file_bytes,
    make_plan,
    role_bits,
    solve,
    table_for_model,
    write_heatmap,
)
from smoe.quality.sensitivity import UNITS, KLMeter, QuantisedModel, key, measure
from smoe.source.checkpoint import Checkpoint
from smoe.source.matching import map_experts
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import SHARED, SHARED_MODELS, tiny_model_dir

CALIB_TEXT = (TOKENIZER_TEXT + "\n") * 40


def smoe_cli(*args):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tiny_model_dir(tmp_path_factory.mktemp("quality"), "qwen3_moe").parent
    (root / "calib.txt").write_text(CALIB_TEXT)
    return root


@pytest.fixture(scope="module")
def tiny_stats(tiny):
    return calibrate.collect(tiny / "model", tiny / "calib.txt", tokens=256, progress=False)


# --- calibration ---------------------------------------------------------------------------------


def test_calibration_stats_equal_a_direct_computation(tiny, tiny_stats):
    """Hooks on transformers' own experts modules (default implementation) see the same inputs."""
    model, modules = calibrate.load_source_model(tiny / "model")
    seen = {}

    def hook(module, args):
        hidden, index = args[0], args[1]
        seen.setdefault(module.smoe_layer, []).append((hidden.double(), index))

    for m in modules.values():
        m.register_forward_pre_hook(hook)
    with torch.inference_mode():
        for window in calibrate.calibration_windows(tiny / "model", tiny / "calib.txt", 256):
            model(input_ids=window, use_cache=False)
    assert sorted(seen) == tiny_stats.layers
    for layer, calls in seen.items():
        m = modules[layer]
        gate_up = m.gate_up_proj.double()
        for e in range(m.num_experts):
            x = torch.cat([h[(idx == e).any(dim=-1)] for h, idx in calls])
            gate, up = (x @ gate_up[e].t()).chunk(2, dim=-1)
            inner = m.act_fn(gate) * up
            assert int(tiny_stats.counts[layer][e]) == x.shape[0]
            assert torch.allclose(tiny_stats.sums[layer]["gate_up"][e], x.t() @ x, rtol=1e-5, atol=1e-9)
            assert torch.allclose(tiny_stats.sums[layer]["down"][e], inner.t() @ inner, rtol=1e-4, atol=1e-9)
        everything = torch.cat([h for h, _ in calls])
        assert torch.allclose(tiny_stats.layer_sums[layer], everything.t() @ everything, rtol=1e-5, atol=1e-8)


def test_unrouted_expert_gets_the_neutral_prior(tiny_stats):
    stats = calibrate.CalibrationStats(**{**tiny_stats.__dict__, "counts": {k: v.clone() for k, v in tiny_stats.counts.items()},
                                          "sums": {k: {i: t.clone() for i, t in v.items()} for k, v in tiny_stats.sums.items()}})
    layer = stats.layers[0]
    stats.counts[layer][0] = 0
    for which in calibrate.INPUTS:
        stats.sums[layer][which][0].zero_()
    layer_mean = (stats.layer_sums[layer] / stats.layer_tokens[layer]).float()
    assert torch.allclose(stats.second_moment(layer, 0, "gate"), layer_mean)
    down = stats.second_moment(layer, 0, "down")
    assert torch.allclose(down, torch.diag(torch.diagonal(down)))  # isotropic: no channel favoured
    assert torch.allclose(torch.diagonal(down), torch.diagonal(down)[0].expand(down.shape[0]))


def test_short_calibration_warns_with_its_coverage(tiny, tmp_path):
    (tmp_path / "short.txt").write_text("the sea")
    messages = []
    stats = calibrate.collect(tiny / "model", tmp_path / "short.txt", tokens=256, progress=False, warn=messages.append)
    assert len(messages) == 1 and "warning" in messages[0] and f"{100 * stats.coverage():.0f}%" in messages[0]
    assert torch.isfinite(stats.second_moment(stats.layers[0], 0, "down")).all()


# --- encoders ------------------------------------------------------------------------------------


def group_weighted_error(w, codes, scales, bits, importance):
    approx = codec.decode(codes, scales, bits, tuple(w.shape), torch.float64)
    err = (w.double() - approx) ** 2 * importance.double()[None, :]
    flat = err.reshape(-1)
    pad = codec.num_groups(flat.numel()) * 64 - flat.numel()
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, 64).sum(dim=1)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("shape", [(48, 128), (40, 96)])  # groups within rows, and groups spanning rows
def test_weighted_encoder_never_worse_than_grid_per_group(bits, shape):
    g = torch.Generator().manual_seed(bits * 100 + shape[1])
    w = torch.randn(shape, generator=g) * 0.02
    w[torch.rand(shape, generator=g) < 0.01] *= 8  # outliers, where scale choice matters
    importance = torch.rand(shape[1], generator=g) ** 4 + 1e-3
    codes, scales = encoders.encode(w, bits, "weighted", importance)
    grid_codes, grid_scales = codec.encode(w, bits)
    assert codes.shape == grid_codes.shape and codes.dtype == torch.uint8 and scales.dtype == torch.float16
    ours = group_weighted_error(w, codes, scales, bits, importance)
    grid = group_weighted_error(w, grid_codes, grid_scales, bits, importance)
    assert bool((ours <= grid * (1 + 1e-12)).all())
    assert float(ours.sum()) < 0.97 * float(grid.sum())


@pytest.mark.parametrize("bits", [4, 2])
def test_gptq_lowers_the_output_error_on_correlated_inputs(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(64, 128, generator=g) * 0.02
    mix = torch.randn(128, 128, generator=g) / 128**0.5 + torch.eye(128)
    x = torch.randn(4000, 128, generator=g) @ mix
    H = x.t() @ x / x.shape[0]

    def output_error(codes, scales):
        d = (codec.decode(codes, scales, bits, tuple(w.shape)) - w).double()
        return float(((d @ H.double()) * d).sum())

    grid = output_error(*codec.encode(w, bits))
    assert output_error(*encoders.encode(w, bits, "gptq", H)) < 0.9 * grid
    assert output_error(*encoders.encode(w, bits, "weighted", H)) <= grid


def test_weighted_encoders_need_calibration():
    with pytest.raises(SmoeError, match="calibration"):
        encoders.encode(torch.randn(8, 64), 4, "gptq")
    with pytest.raises(SmoeError, match="unknown encoder"):
        encoders.encode(torch.randn(8, 64), 4, "best")


# --- the planner ---------------------------------------------------------------------------------


def brute_force(groups, capacity):
    best = None
    for combo in itertools.product(*[range(len(g)) for g in groups]):
        cost = sum(groups[i][c][0] for i, c in enumerate(combo))
        value = sum(groups[i][c][1] for i, c in enumerate(combo))
        if cost <= capacity and (best is None or value < best - 1e-12):
            best = value
    return best


def test_solver_matches_brute_force_on_random_instances():
    rng = random.Random(7)
    for _ in range(200):
        groups = [[(rng.randint(1, 30), rng.random()) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 6))]
        capacity = rng.randint(sum(min(c for c, _ in g) for g in groups), sum(max(c for c, _ in g) for g in groups))
        choices, value, cost = solve(groups, capacity)
        assert cost <= capacity
        assert value == pytest.approx(sum(groups[i][c][1] for i, c in enumerate(choices)))
        assert value == pytest.approx(brute_force(groups, capacity))


def random_table(layers=5, seed=0):
    rng = random.Random(seed)
    table = {"moe_layers": list(range(layers)), "depths": [2, 4], "encoder": "grid", "model_type": "qwen3_moe",
             "num_experts": 4, "numel": {}, "kl": {}, "expert_shapes": {"gate": [96, 128], "up": [96, 128], "down": [128, 96]}}
    for layer in range(layers):
        table["numel"][f"{layer}.gate_up"] = 4 * 2 * 96 * 128
        table["numel"][f"{layer}.down"] = 4 * 96 * 128
        for unit in UNITS:
            q4 = rng.random() * 0.01
            table["kl"][key(layer, unit, 4)] = q4
            table["kl"][key(layer, unit, 2)] = q4 + rng.random() * 0.2
    return table


@pytest.mark.parametrize("budget", [2.25, 2.5, 3.0, 3.5, 4.25])
def test_plan_is_optimal_for_a_bits_budget(budget):
    table = random_table()
    doc = make_plan(table, budget_bits=budget)
    assert doc["bits_per_weight"] <= budget + 1e-12
    best = None
    units = [(layer, u) for layer in table["moe_layers"] for u in UNITS]
    for combo in itertools.product([2, 4], repeat=len(units)):
        chosen = {}
        for (layer, u), b in zip(units, combo):
            chosen.setdefault(layer, {})[u] = b
        storage = sum(bits_cost(table, layer, c) for layer, c in chosen.items())
        if storage <= budget * sum(table["numel"].values()):
            kl = sum(table["kl"][key(layer, u, b)] for (layer, u), b in zip(units, combo))
            best = kl if best is None else min(best, kl)
    assert doc["predicted_kl"] == pytest.approx(best)


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 1.0])
def test_plan_is_optimal_for_a_size_budget_counting_alignment(fraction):
    table = random_table(layers=4, seed=3) | {"bias_nbytes": {}}
    every = lambda b: {layer: {u: b for u in UNITS} for layer in table["moe_layers"]}
    low, high = experts_file_bytes(table, every(2)), experts_file_bytes(table, every(4))
    size = low + fraction * (high - low)
    doc = make_plan(table, size_gb=size / 1e9)
    assert doc["experts_file_bytes"] <= size
    best = None
    for combo in itertools.product(itertools.product([2, 4], repeat=2), repeat=4):
        chosen = {layer: dict(zip(UNITS, c)) for layer, c in enumerate(combo)}
        if experts_file_bytes(table, chosen) <= size:
            kl = sum(table["kl"][key(layer, u, b)] for layer, c in chosen.items() for u, b in c.items())
            best = kl if best is None else min(best, kl)
    assert doc["predicted_kl"] == pytest.approx(best)


def test_plan_counts_scales_honestly():
    table = random_table()
    assert make_plan(table, budget_bits=4.25)["bits_per_weight"] == 4.25
    assert make_plan(table, budget_bits=2.25)["bits_per_weight"] == 2.25
    assert set(make_plan(table, budget_bits=4.2499)["tensors"].values()) == {2, 4}


@pytest.mark.parametrize("kwargs", [{"budget_bits": 2.2}, {"budget_bits": 4.3}, {"budget_bits": 2.0}, {"size_gb": 1e-9},
                                    {"size_gb": 1000.0}])
def test_budget_outside_the_depths_range_is_an_error(kwargs):
    with pytest.raises(SmoeError, match="outside the depths' range"):
        make_plan(random_table(), **kwargs)


def test_plan_that_does_not_match_the_model_is_an_error(tiny):
    ckpt = Checkpoint(tiny / "model")
    moe = map_experts(ckpt.config, ckpt.names())
    with pytest.raises(SmoeError, match="does not match the model"):
        role_bits(make_plan(random_table(), budget_bits=3.0), moe)
    doc = {"moe_layers": moe.moe_layers, "num_experts": moe.num_experts,
           "tensors": {f"{layer}.{u}": 4 for layer in moe.moe_layers for u in UNITS}}
    del doc["tensors"][f"{moe.moe_layers[0]}.down"]
    with pytest.raises(SmoeError, match="does not match the model"):
        role_bits(doc, moe)


# --- end to end on the tiny model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_table(tiny, tiny_stats):
    qm = QuantisedModel(tiny / "model", "gptq", tiny_stats)
    windows = calibrate.calibration_windows(tiny / "model", tiny / "calib.txt", 256)
    path = tiny / "sensitivity.json"
    table = measure(qm, windows, path, "fp", progress=False)
    return qm, windows, path, table_for_model(table, qm.expert_map)


def test_sensitivity_measures_every_fused_tensor_at_every_depth(tiny_table):
    qm, _, _, table = tiny_table
    assert set(table["kl"]) == {key(layer, u, b) for layer in qm.expert_map.moe_layers for u in UNITS for b in (2, 4)}
    for layer in qm.expert_map.moe_layers:
        for u in UNITS:
            assert table["kl"][key(layer, u, 2)] > table["kl"][key(layer, u, 4)] > 0


def test_sensitivity_resumes_where_it_stopped(tiny_table):
    qm, windows, path, table = tiny_table
    saved = json.loads(path.read_text())
    dropped = key(qm.expert_map.moe_layers[0], "down", 2)
    del saved["kl"][dropped]
    path.write_text(json.dumps(saved))
    meter = KLMeter(qm, windows)
    calls = []
    original = meter.kl
    meter.kl = lambda: calls.append(1) or original()
    again = measure(qm, windows, path, "fp", progress=False, meter=meter)
    assert len(calls) == 1
    assert again["kl"][dropped] == pytest.approx(table["kl"][dropped], rel=1e-9)
    with pytest.raises(SmoeError, match="another model"):
        measure(qm, windows, path, "other", progress=False)


def test_mixed_vault_from_a_plan_runs_and_holds_the_planned_bits(tiny, tiny_table, tiny_stats, tmp_path):
    from smoe.runtime.model import OpenedVault

    qm, windows, _, table = tiny_table
    doc = make_plan(table, budget_bits=3.25)
    depths = role_bits(doc, qm.expert_map)
    assert set(depths.values()) == {2, 4}
    out = tmp_path / "mixed"
    sculpt(tiny / "model", out, plan=depths, encoder="gptq", calib=tiny / "calib.txt", calib_tokens=256,
           stats=tiny_stats, progress=False)
    with Vault(out) as v:
        assert v.meta["encoder"] == "gptq"
        for entry in v.entries.values():
            for t in entry.tensors:
                assert t.bits == depths[(entry.layer, t.role)]
    assert (out / "experts.bin").stat().st_size == experts_file_bytes(table, {
        layer: {u: doc["tensors"][f"{layer}.{u}"] for u in UNITS} for layer in qm.expert_map.moe_layers})
    qm.set_plan({(layer, u): doc["tensors"][f"{layer}.{u}"] for layer in qm.expert_map.moe_layers for u in UNITS})
    sm = OpenedVault(out, dtype="float32")
    try:
        streamed = sm.logits(windows[0])
        assert torch.allclose(streamed, qm.model(input_ids=windows[0], use_cache=False).logits, atol=1e-4, rtol=1e-4)
    finally:
        sm.close()
        qm.set_plan({(layer, u): None for layer in qm.expert_map.moe_layers for u in UNITS})
    write_heatmap(doc, table, tmp_path / "plan.png", measured_kl=0.01)
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_blob_size_formula_matches_the_vault(tiny, tmp_path):
    sculpt(tiny / "model", tmp_path / "v", bits=2, progress=False)
    with Vault(tmp_path / "v") as v:
        shapes = {r: tuple(s) for r, s in v.meta["expert_shapes"].items()}
        for entry in v.entries.values():
            assert entry.size == blob_nbytes(shapes, {r: 2 for r in shapes})


def test_quantize_with_a_budget_writes_a_mixed_vault_and_reports_kl(tiny, tmp_path):
    out = tmp_path / "budget"
    r = smoe_cli("quantize", tiny / "model", "-o", out, "--budget", "3.0", "--calib", tiny / "calib.txt",
                 "--calib-tokens", "256", "--encoder", "gptq", "-q")
    assert r.returncode == 0, r.stderr
    assert "measured" in r.stdout and "predicted" in r.stdout
    assert f"experts.bin {(out / 'experts.bin').stat().st_size:,} bytes, predicted {(out / 'experts.bin').stat().st_size:,}" \
        in r.stdout
    for suffix in (".plan.json", ".plan.png", ".plan.sensitivity.json"):
        assert (tmp_path / f"budget{suffix}").exists()
    with Vault(out) as v:
        assert {t.bits for e in v.entries.values() for t in e.tensors} <= {2, 4}
    r = smoe_cli("plan", tiny / "model", "--budget", "2.0", "--calib", tiny / "calib.txt", "-o", tmp_path / "p.json")
    assert r.returncode == 2 and r.stderr.startswith("smoe: error:") and "Traceback" not in r.stderr
    r = smoe_cli("quantize", tiny / "model", "-o", tmp_path / "w", "--encoder", "weighted")
    assert r.returncode == 2 and "--calib" in r.stderr


def test_gptq_beats_grid_on_a_trained_expert():
    model = SHARED_MODELS["qwen3_moe"]
    if not model.exists():
        pytest.skip(f"{model} is absent: the trained-model check needs the shared models")
    ckpt = Checkpoint(model)
    moe = map_experts(ckpt.config, ckpt.names())
    from smoe.source.loading import load_projection

    src = moe.experts[(0, 0)][0]
    w = load_projection(ckpt, src).float()
    stats = calibrate.collect(model, SHARED / "corpus" / "train.txt.gz", tokens=1024, progress=False)
    H = stats.second_moment(0, 0, "gate")

    def output_error(codes, scales):
        d = (codec.decode(codes, scales, 4, tuple(w.shape)) - w).double()
        return float(((d @ H.double()) * d).sum())

    assert output_error(*encoders.encode(w, 4, "gptq", H)) < 0.5 * output_error(*codec.encode(w, 4))
