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
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.testing.vaults import tiny_vault

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
            want, _ = generate(sm, PROMPT, max_tokens=8)
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


# transformers' own entry points in a process that never imports smoe: each result, or the error it raised
WITHOUT_SMOE = """
import json, sys, torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, pipeline
loaders = {
    "AutoModelForCausalLM": lambda v: AutoModelForCausalLM.from_pretrained(v).generate(torch.tensor([[1, 2, 3]])),
    "AutoModel": lambda v: AutoModel.from_pretrained(v)(torch.tensor([[1, 2, 3]])),
    "pipeline": lambda v: pipeline("text-generation", model=v)([1, 2, 3]),
    "AutoConfig": lambda v: AutoConfig.from_pretrained(v),
}
results = {}
for name, load in loaders.items():
    try:
        results[name] = "loaded: " + repr(load(sys.argv[1]))[:200]
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"
print(json.dumps(results | {"smoe imported": "smoe" in sys.modules}))
"""


def test_transformers_without_smoe_never_loads_a_vault_silently(tiny_qwen_vault):
    proc = subprocess.run([sys.executable, "-c", WITHOUT_SMOE, str(tiny_qwen_vault["vault"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert results.pop("smoe imported") is False
    for name, result in results.items():
        assert result.startswith("ValueError: The checkpoint you are trying to load has model type `smoe_vault`"), \
            (name, result)
