"""Plan units finer than a fused tensor: expert groups by routed tokens, the proxy that shares a tensor's measured KL
among them, the exact planner over them, and the vaults, runtime and exports of plans whose experts differ in bits."""

import itertools
import json
import random
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from export_models import GGUF_ARCHITECTURE, save_exportable_model
from test_export import ROLES, assert_within_fp16_rounding_of_d, gguf_tensors, mlx_decode, vault_experts

from smoe.convert import calibrate
from smoe.convert.sculpt import Coder, encode_batched, encode_here, sculpt
from smoe.errors import SmoeError
from smoe.export.writer import export
from smoe.format.vault import Vault
from smoe.hf.gguf import open_source
from smoe.quality.plan import (
    bits_cost,
    expert_groups,
    experts_file_bytes,
    group_kls,
    make_plan,
    role_bits,
    table_for_model,
    write_heatmap,
)
from smoe.quality.sensitivity import UNITS, KLMeter, QuantisedModel, key, measure, measure_experts
from smoe.source.matching import map_experts
from smoe.testing.tiny_models import TOKENIZER_TEXT
from smoe.testing.vaults import tiny_model_dir

CALIB_TEXT = (TOKENIZER_TEXT + "\n") * 40


def smoe_cli(*args):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True)


def random_table(layers=2, experts=4, seed=0):
    """A sensitivity table with the per-expert proxy, shapes whose tensors are whole groups."""
    rng = random.Random(seed)
    table = {"moe_layers": list(range(layers)), "depths": [2, 4], "encoder": "gptq", "model_type": "qwen3_moe",
             "num_experts": experts, "numel": {}, "kl": {}, "proxy": {}, "routed_tokens": {}, "bias_nbytes": {},
             "expert_shapes": {"gate": [96, 128], "up": [96, 128], "down": [128, 96]}}
    for layer in range(layers):
        table["numel"][f"{layer}.gate_up"] = experts * 2 * 96 * 128
        table["numel"][f"{layer}.down"] = experts * 96 * 128
        table["routed_tokens"][str(layer)] = [rng.randint(0, 500) for _ in range(experts)]
        for unit in UNITS:
            q4 = rng.random() * 0.01
            table["kl"][key(layer, unit, 4)] = q4
            table["kl"][key(layer, unit, 2)] = q4 + rng.random() * 0.2
            for b in (2, 4):
                table["proxy"][key(layer, unit, b)] = [rng.random() * (16 if b == 2 else 1) for _ in range(experts)]
    return table


def every_allocation(table, groups):
    """Each allocation of a depth per (layer, unit, group): (chosen per layer and unit, predicted KL)."""
    members = {layer: expert_groups(table, layer, groups) for layer in table["moe_layers"]}
    slots = [(layer, u, g) for layer in table["moe_layers"] for u in UNITS for g in range(groups)]
    kls = {(layer, u, b): group_kls(table, layer, u, b, members[layer])
           for layer in table["moe_layers"] for u in UNITS for b in (2, 4)}
    for combo in itertools.product([2, 4], repeat=len(slots)):
        chosen = {layer: {u: [0] * table["num_experts"] for u in UNITS} for layer in table["moe_layers"]}
        for (layer, u, g), b in zip(slots, combo):
            for e in members[layer][g]:
                chosen[layer][u][e] = b
        yield chosen, sum(kls[(layer, u, b)][g] for (layer, u, g), b in zip(slots, combo))


# --- groups and the proxy ------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7])
def test_expert_groups_cover_every_expert_once_in_rank_order_of_routed_tokens(groups):
    table = random_table(experts=7, seed=groups)
    for layer in table["moe_layers"]:
        members = expert_groups(table, layer, groups)
        assert sorted(e for g in members for e in g) == list(range(7))
        assert max(map(len, members)) - min(map(len, members)) <= 1
        tokens = table["routed_tokens"][str(layer)]
        for busier, quieter in zip(members, members[1:]):
            assert min(tokens[e] for e in busier) >= max(tokens[e] for e in quieter)


def test_group_count_outside_one_to_the_expert_count_is_an_error():
    for n in (0, 5):
        with pytest.raises(SmoeError, match="between 1"):
            expert_groups(random_table(), 0, n)
    with pytest.raises(SmoeError, match="no per-expert proxy"):
        expert_groups({k: v for k, v in random_table().items() if k != "proxy"}, 0, 2)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_group_kls_of_a_tensor_add_up_to_its_measured_kl(groups):
    table = random_table()
    for layer, u, b in itertools.product(table["moe_layers"], UNITS, (2, 4)):
        shares = group_kls(table, layer, u, b, expert_groups(table, layer, groups))
        assert len(shares) == groups and min(shares) >= 0
        assert sum(shares) == pytest.approx(table["kl"][key(layer, u, b)], rel=1e-12)


# --- the planner over expert groups --------------------------------------------------------------


@pytest.mark.parametrize("budget", [2.25, 2.6, 3.0, 3.5, 4.25])
def test_grouped_plan_is_optimal_for_a_bits_budget(budget):
    table = random_table(seed=int(budget * 10))
    doc = make_plan(table, budget_bits=budget, groups=2)
    weights = sum(table["numel"].values())
    assert doc["bits_per_weight"] <= budget + 1e-12
    best = min(kl for chosen, kl in every_allocation(table, 2)
               if sum(bits_cost(table, layer, {u: b}, 1) for layer, c in chosen.items() for u, bs in c.items()
                      for b in bs) <= budget * weights)
    assert doc["predicted_kl"] == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 1.0])
def test_grouped_plan_is_optimal_for_a_size_budget_counting_alignment(fraction):
    table = random_table(seed=3)
    every = lambda b: {layer: {u: b for u in UNITS} for layer in table["moe_layers"]}
    low, high = experts_file_bytes(table, every(2)), experts_file_bytes(table, every(4))
    size = low + fraction * (high - low)
    doc = make_plan(table, size_gb=size / 1e9, groups=2)
    assert doc["experts_file_bytes"] <= size
    best = min(kl for chosen, kl in every_allocation(table, 2) if experts_file_bytes(table, chosen) <= size)
    assert doc["predicted_kl"] == pytest.approx(best, rel=1e-12)


def test_finer_groups_never_predict_more_kl_at_the_same_budget():
    """8 groups of 16 experts refine 4, which refine 2 and 1: each finer plan can choose every coarser one."""
    table = random_table(layers=3, experts=16, seed=5)
    for budget in (2.5, 3.0, 3.5):
        kls = [make_plan(table, budget_bits=budget, groups=n)["predicted_kl"] for n in (1, 2, 4, 8, 16)]
        assert all(fine <= coarse + 1e-12 for coarse, fine in zip(kls, kls[1:]))


def test_one_group_is_the_fused_plan_and_finer_plans_give_a_depth_per_expert():
    table = random_table(experts=8, seed=1)
    fused = make_plan(table, budget_bits=3.0)
    assert make_plan(table, budget_bits=3.0, groups=1) == fused
    assert all(isinstance(b, int) for b in fused["tensors"].values()) and "expert_groups" not in fused
    fine = make_plan(table, budget_bits=3.0, groups=8)
    assert fine["expert_groups"]["count"] == 8
    assert any(isinstance(b, list) and len(b) == 8 and set(b) == {2, 4} for b in fine["tensors"].values())
    assert fine["bits_per_weight"] > fused["bits_per_weight"]  # the budget is met in finer steps


# --- end to end on a tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tiny_model_dir(tmp_path_factory.mktemp("units"), "qwen3_moe").parent
    (root / "calib.txt").write_text(CALIB_TEXT)
    stats = calibrate.collect(root / "model", root / "calib.txt", tokens=256, progress=False)
    qm = QuantisedModel(root / "model", "gptq", stats)
    windows = calibrate.calibration_windows(root / "model", root / "calib.txt", 256)
    table = table_for_model(measure(qm, windows, root / "sensitivity.json", "fp", progress=False), qm.expert_map)
    return root, stats, qm, windows, table


def test_the_sweep_records_each_experts_routed_tokens_and_weighted_error_at_each_depth(tiny):
    _, stats, qm, _, table = tiny
    moe = qm.expert_map
    assert set(table["proxy"]) == {key(layer, u, b) for layer in moe.moe_layers for u in UNITS for b in (2, 4)}
    for layer in moe.moe_layers:
        assert table["routed_tokens"][str(layer)] == stats.counts[layer].tolist()
        for u in UNITS:
            q2, q4 = table["proxy"][key(layer, u, 2)], table["proxy"][key(layer, u, 4)]
            assert len(q2) == moe.num_experts and all(a > b > 0 for a, b in zip(q2, q4))


def test_quantising_every_group_of_a_tensor_alone_is_quantising_the_tensor(tiny):
    """measure_experts with all experts equals the fused trial, with none the source (KL 0)."""
    _, _, qm, windows, table = tiny
    meter = KLMeter(qm, windows)
    layer = qm.expert_map.moe_layers[0]
    every = list(range(qm.expert_map.num_experts))
    assert measure_experts(meter, layer, "down", 2, every) == pytest.approx(table["kl"][key(layer, "down", 2)], rel=1e-9)
    assert measure_experts(meter, layer, "down", 2, []) == pytest.approx(0.0, abs=1e-12)


def test_a_per_expert_plan_writes_its_bits_to_the_byte_and_the_runtime_reads_it(tiny, tmp_path):
    from smoe.runtime.model import OpenedVault

    root, stats, qm, windows, table = tiny
    moe = qm.expert_map
    doc = make_plan(table, budget_bits=3.25, groups=moe.num_experts)
    depths = role_bits(doc, moe)
    assert any(isinstance(b, tuple) and set(b) == {2, 4} for b in depths.values())
    out = tmp_path / "vault"
    sculpt(root / "model", out, plan=depths, encoder="gptq", calib=root / "calib.txt", calib_tokens=256, stats=stats,
           progress=False)
    with Vault(out) as v:
        for entry in v.entries.values():
            for t in entry.tensors:
                b = depths[(entry.layer, t.role)]
                assert t.bits == (b if isinstance(b, int) else b[entry.expert])
    assert (out / "experts.bin").stat().st_size == doc["experts_file_bytes"]
    for layer in moe.moe_layers:
        for u in UNITS:
            qm.set(layer, u, doc["tensors"][f"{layer}.{u}"])
    try:
        want = qm.model(input_ids=windows[0], use_cache=False).logits
        for decoder in ("fast", "generic"):
            sm = OpenedVault(out, dtype="float32", decoder=decoder)
            try:
                assert torch.allclose(sm.logits(windows[0]), want, atol=1e-4, rtol=1e-4), decoder
            finally:
                sm.close()
    finally:
        for layer in moe.moe_layers:
            for u in UNITS:
                qm.set(layer, u, None)
    write_heatmap(doc, table, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("encoder", ["gptq", "grid"])
def test_batched_encoding_of_a_per_expert_plan_gives_each_expert_its_own_depth(tiny, encoder):
    root, stats, _, _, _ = tiny
    ckpt = open_source(root / "model", calibrated=True)
    moe = map_experts(ckpt.config, ckpt.names())
    depths = {(layer, role): tuple(2 + 2 * ((e + (role == "down")) % 2) for e in range(moe.num_experts))
              for layer in moe.moe_layers for role in moe.roles}
    coder = Coder(encoder, stats, depths, 4)
    todo = sorted(moe.experts)
    here = list(encode_here(ckpt, moe, coder, torch.device("cpu"), todo))
    batched = list(encode_batched(ckpt, moe, coder, torch.device("cpu"), todo, chunk=4))
    for a, b in zip(here, batched):
        want = [(t.role, depths[(a.key[0], t.role)][a.key[1]]) for t in a.tensors]
        assert [(t.role, t.bits) for t in a.tensors] == [(t.role, t.bits) for t in b.tensors] == want
        if encoder == "grid":
            assert all(torch.equal(ta.codes, tb.codes) for ta, tb in zip(a.tensors, b.tensors))


def test_plan_cli_with_expert_groups_and_quantize_from_it(tiny, tmp_path):
    root, _, qm, _, _ = tiny
    plan = tmp_path / "plan.json"
    r = smoe_cli("plan", root / "model", "--budget", "3.0", "--calib", root / "calib.txt", "--calib-tokens", "256",
                 "-o", plan, "--expert-groups", "3", "-q")
    assert r.returncode == 0, r.stderr
    doc = json.loads(plan.read_text())
    assert doc["expert_groups"]["count"] == 3 and doc["bits_per_weight"] <= 3.0
    assert all(isinstance(b, int) or len(b) == qm.expert_map.num_experts for b in doc["tensors"].values())
    r = smoe_cli("quantize", root / "model", "-o", tmp_path / "v", "--plan", plan, "-q", "--json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "v" / "experts.bin").stat().st_size == doc["experts_file_bytes"]
    r = smoe_cli("plan", root / "model", "--budget", "3.0", "--calib", root / "calib.txt", "--calib-tokens", "256",
                 "-o", tmp_path / "p2.json", "--expert-groups", str(qm.expert_map.num_experts + 1), "-q")
    assert r.returncode == 2 and "--expert-groups" in r.stderr and "Traceback" not in r.stderr
    r = smoe_cli("quantize", root / "model", "-o", tmp_path / "w", "--expert-groups", "2")
    assert r.returncode == 2 and "--budget" in r.stderr and "Traceback" not in r.stderr


# --- exports of layers whose experts differ in bits -----------------------------------------------


@pytest.fixture(scope="module")
def per_expert_vault(tmp_path_factory):
    """An exportable tiny qwen3_moe sculpted with alternate experts of each layer at Q4 and Q2 (down the other way)."""
    tmp = tmp_path_factory.mktemp("per-expert")
    model = save_exportable_model("qwen3_moe", tmp / "model", 32, architecture=GGUF_ARCHITECTURE.get("qwen3_moe"))
    ckpt = open_source(model)
    moe = map_experts(ckpt.config, ckpt.names())
    depths = {(layer, role): tuple(2 + 2 * ((e + (role == "down")) % 2) for e in range(moe.num_experts))
              for layer in moe.moe_layers for role in moe.roles}
    sculpt(model, tmp / "vault", plan=depths, progress=False)
    with Vault(tmp / "vault") as v:
        assert {t.bits for e in v.entries.values() for t in e.tensors} == {2, 4}
    return tmp / "vault"


def test_gguf_of_a_layer_whose_experts_differ_in_bits_decodes_to_the_vault_weights(per_expert_vault, tmp_path):
    tensors = gguf_tensors(export(per_expert_vault, "gguf", tmp_path / "m.gguf"))
    with Vault(per_expert_vault) as v:
        layers = v.meta["moe_layers"]
    for layer in layers:
        for role, name in ROLES.items():
            t = tensors[f"blk.{layer}.{name}.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
            want, s, _ = vault_experts(per_expert_vault, layer, role)
            assert_within_fp16_rounding_of_d(gguf.quants.dequantize(t.data, t.tensor_type), want, s)


def test_mlx_of_a_layer_whose_experts_differ_in_bits_holds_every_expert_at_4_bits_losslessly(per_expert_vault, tmp_path):
    from safetensors import safe_open

    out = export(per_expert_vault, "mlx", tmp_path / "mlx")
    config = json.loads((out / "config.json").read_text())
    with safe_open(out / "model.safetensors", "numpy") as f:
        for layer in json.loads((per_expert_vault / "index.json").read_text())["moe_layers"]:
            for role, proj in {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}.items():
                module = f"model.layers.{layer}.mlp.switch_mlp.{proj}"
                assert config["quantization"][module]["bits"] == 4
                want, s, _ = vault_experts(per_expert_vault, layer, role)
                got = mlx_decode(*(f.get_tensor(f"{module}.{k}") for k in ("weight", "scales", "biases")), 4)
                assert got.shape == want.shape
                assert np.all(np.abs(got - want) <= s / 1024 + 1e-7 * s)
