"""`import smoe`, then `AutoModelForCausalLM.from_pretrained(VAULT)` loads a vault through transformers'
quantizer registry, and its greedy tokens are `smoe generate`'s; without `import smoe`, transformers refuses it."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import smoe  # noqa: F401 (registers the vault's quantisation method)
from smoe.errors import SmoeError
from smoe.format.vault import Vault
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY
from smoe.testing.vaults import as_format_version, tiny_vault

PROMPT = [1, 2, 3, 4]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_from_pretrained_gives_smoe_generates_greedy_tokens(family, tmp_path):
    vault = tiny_vault(tmp_path, family, seed=2)
    model = AutoModelForCausalLM.from_pretrained(vault, dtype=torch.float32)
    try:
        assert model.smoe_runtime.describe() == {"decoder": "generic", "device": "cpu"}
        assert all(p.numel() == 0 for n, p in model.named_parameters() if ".experts." in n)  # nothing allocated
        got = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        sm = OpenedVault(vault, dtype="float32")
        try:
            want, _ = generate(sm, PROMPT, max_tokens=8, params=GREEDY)
        finally:
            sm.close()
        assert got[0, len(PROMPT):].tolist() == want[: len(got[0]) - len(PROMPT)] and len(want) == 8
        assert model.smoe_runtime.cache_stats()["misses"] > 0  # the experts came from the vault
    finally:
        model.smoe_runtime.close()


def test_from_pretrained_refuses_a_vault_whose_trunk_changed(tmp_path):
    vault = tiny_vault(tmp_path, "qwen3_moe")
    trunk = vault / "model.safetensors"
    data = bytearray(trunk.read_bytes())
    data[-1] ^= 1
    trunk.write_bytes(bytes(data))
    with pytest.raises(SmoeError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(vault)


@pytest.mark.parametrize("order", ["import smoe; import transformers.modeling_utils",
                                   "import transformers.modeling_utils; import smoe"])
def test_import_smoe_registers_the_method_whichever_is_imported_first(order):
    code = (f"{order}\nfrom transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING\n"
            "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
            "print('smoe' in AUTO_QUANTIZER_MAPPING, 'smoe_vault' in CONFIG_MAPPING)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "True True", proc.stderr[-2000:]


def test_import_smoe_alone_does_not_import_transformers():
    proc = subprocess.run([sys.executable, "-c", "import smoe, sys; print('transformers' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


# transformers' own entry points in a fresh process, first without smoe, then after `import smoe`: each result, or
# the error it raised. The address space is capped: a vault misread as a model class's default-size model (24 layers
# of 128 experts for Qwen3-MoE) fails there for memory in seconds instead of filling the machine.
ENTRY_POINTS = """
import json, resource, sys, torch
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, Qwen3MoeForCausalLM, pipeline

def named_class(v, **kwargs):
    model = Qwen3MoeForCausalLM.from_pretrained(v, **kwargs)
    streamed = "streamed" if hasattr(model, "smoe_runtime") else "not streamed"
    return f"{model.config.num_hidden_layers} layers of {model.config.num_experts} experts, {streamed}"

without_smoe = {
    "AutoModelForCausalLM": lambda v: AutoModelForCausalLM.from_pretrained(v).generate(torch.tensor([[1, 2, 3]])),
    "AutoModel": lambda v: AutoModel.from_pretrained(v)(torch.tensor([[1, 2, 3]])),
    "pipeline": lambda v: pipeline("text-generation", model=v)([1, 2, 3]),
    "AutoConfig": lambda v: AutoConfig.from_pretrained(v),
    "Qwen3MoeForCausalLM": named_class,
}
with_smoe = {
    "Qwen3MoeForCausalLM": named_class,
    "Qwen3MoeForCausalLM, AutoConfig's config": lambda v: named_class(v, config=AutoConfig.from_pretrained(v)),
}

def run(loaders):
    results = {}
    for name, load in loaders.items():
        try:
            results[name] = "loaded: " + str(load(sys.argv[1]))[:200]
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}"
    return results

results = {"without smoe": run(without_smoe), "smoe imported": "smoe" in sys.modules}
import smoe  # noqa: E402
results["with smoe"] = run(with_smoe)
print(json.dumps(results))
"""
UNKNOWN_TYPE = "ValueError: The checkpoint you are trying to load has model type `smoe_vault`"
NO_QUANT_METHOD = "ValueError: The model's quantization config from the arguments has no `quant_method` attribute"


@pytest.fixture(scope="module")
def entry_points(tiny_qwen_vault) -> dict:
    proc = subprocess.run([sys.executable, "-c", ENTRY_POINTS, str(tiny_qwen_vault["vault"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_transformers_without_smoe_never_loads_a_vault_silently(entry_points):
    assert entry_points["smoe imported"] is False
    results = dict(entry_points["without smoe"])
    assert results.pop("Qwen3MoeForCausalLM").startswith(NO_QUANT_METHOD), entry_points
    for name, result in results.items():
        assert result.startswith(UNKNOWN_TYPE), (name, result)


def test_a_model_class_named_directly_is_refused_with_smoe_unless_given_autoconfigs_config(entry_points,
                                                                                           tiny_qwen_vault):
    results = entry_points["with smoe"]
    assert results["Qwen3MoeForCausalLM"].startswith(NO_QUANT_METHOD), results
    with Vault(tiny_qwen_vault["vault"]) as v:
        size = f"{v.config['num_hidden_layers']} layers of {v.meta['num_experts']} experts"
    assert results["Qwen3MoeForCausalLM, AutoConfig's config"] == f"loaded: {size}, streamed"


@pytest.mark.parametrize("version", [2, 3])
def test_from_pretrained_loads_a_vault_of_an_older_format_as_the_same_model(tiny_qwen_vault, tmp_path, version):
    old = tmp_path / "old"
    old.mkdir()
    for p in tiny_qwen_vault["vault"].iterdir():
        (old / p.name).write_bytes(p.read_bytes())
    as_format_version(old, version)
    tokens = []
    for vault in (old, tiny_qwen_vault["vault"]):
        model = AutoModelForCausalLM.from_pretrained(vault, dtype=torch.float32)
        try:
            tokens.append(model.generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6,
                                         do_sample=False)[0].tolist())
        finally:
            model.smoe_runtime.close()
    assert tokens[0] == tokens[1]
