"""The trunk of a vault (every tensor that is not a routed expert, parameters and buffers) reaches the
model as stored, and `smoe dequantize` writes it back bit for bit.

Checked on every tiny family whose transformers model holds persistent floating-point buffers (routing
correction biases, layer scalars, decay tables): those are the tensors transformers' initialisation
would refill. Their source checkpoints store the weights in bf16 and the buffers in fp32, set to values
that no initialisation gives, as DeepSeek-V3's release stores its `e_score_correction_bias`.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file
from test_runtime import TOLERANCE, relative_error

from smoe.errors import SmoeError
from smoe.format.vault import Vault
from smoe.hf.experts import is_dequantizable
from smoe.hf.model import causal_lm_class, is_experts_param
from smoe.quality.evaluate import load_reference
from smoe.runtime.model import OpenedVault
from smoe.testing.tiny_models import save_tiny_model, tiny_families, tiny_model
from smoe.testing.vaults import dequantised_reference, reseal, tiny_model_dir, vault_of

DEQUANTIZE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def persistent_float_buffers(model) -> list[str]:
    state = model.state_dict()
    return [name for name, b in model.named_buffers() if name in state and b.is_floating_point()]


BUFFER_FAMILIES = [f for f in tiny_families() if persistent_float_buffers(tiny_model(f))]


def save_source(family: str, out: Path) -> Path:
    """The tiny model with its weights in bf16 and its buffers in fp32, moved off their initial values."""
    leaves = {name.rsplit(".", 1)[-1] for name in persistent_float_buffers(save_tiny_model(family, out, seed=2))}
    path = out / "model.safetensors"
    tensors, gen = load_file(path), torch.Generator().manual_seed(0)
    for key, t in tensors.items():  # saved names may differ from the model's; buffer leaf names do not
        if key.rsplit(".", 1)[-1] in leaves:
            tensors[key] = t + 0.1 * torch.randn(t.shape, generator=gen)
        elif t.is_floating_point():
            tensors[key] = t.to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=BUFFER_FAMILIES)
def built(request, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp(request.param)
    source = save_source(request.param, tmp / "source")
    out = {"family": request.param, "source": source, "vault": vault_of(source, tmp / "vault")}
    for name, dtype in DEQUANTIZE_DTYPES.items():
        out[name] = dequantised_reference(out["vault"], tmp, dtype, name=f"dequantized-{name}")
    return out


def from_pretrained(model_dir: Path):
    from transformers import AutoConfig

    model_class = causal_lm_class(AutoConfig.from_pretrained(model_dir))
    return model_class.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_every_trunk_buffer_reaches_the_model(built):
    source = from_pretrained(built["source"])
    initial = tiny_model(built["family"], seed=2)
    sm = OpenedVault(built["vault"], dtype="float32", kernel_path="dequant")
    for name in persistent_float_buffers(source):
        assert not torch.equal(source.get_buffer(name), initial.get_buffer(name))  # the check can fail
        assert torch.equal(sm.model.get_buffer(name), source.get_buffer(name)), name


def test_streaming_logits_match_transformers_on_the_source_trunk_and_dequantized_experts(built):
    """Against transformers running the dequantized checkpoint, and the source checkpoint with only its
    routed experts taken from that one: the runtime runs the source's trunk, not a re-initialised one."""
    dequantized = from_pretrained(built["float32"])
    hybrid = from_pretrained(built["source"])
    experts = {n: t for n, t in dequantized.state_dict().items() if is_experts_param(dequantized, n, is_dequantizable)}
    assert experts and not hybrid.load_state_dict(experts, strict=False).unexpected_keys
    sm = OpenedVault(built["vault"], dtype="float32", kernel_path="dequant")
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = sm.logits(ids)
    with torch.inference_mode():
        for reference in (dequantized, hybrid):
            assert relative_error(reference(input_ids=ids, use_cache=False).logits.float(), logits) < TOLERANCE


@pytest.mark.parametrize("dtype", DEQUANTIZE_DTYPES)
def test_dequantize_round_trips_every_trunk_tensor_bit_for_bit(built, dtype):
    with Vault(built["vault"]) as v:
        trunk = load_file(v.trunk_path)
    with safe_open(built[dtype] / "model.safetensors", "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    for key, t in trunk.items():
        assert key in written, key
        w = written[key]
        assert (w.dtype, w.shape) == (t.dtype, t.shape), key
        assert torch.equal(w.view(torch.uint8), t.view(torch.uint8)), key
    load_reference(built[dtype])(torch.tensor([[1, 2, 3]]))  # transformers loads and runs it
    # the trunk keeps its dtypes; from_pretrained's default ("auto") still loads the experts as asked
    assert json.loads((built[dtype] / "config.json").read_text())["dtype"] == dtype


def rewrite_source(tmp_path: Path, change) -> Path:
    """A tiny deepseek_v3 checkpoint with `change` applied to its tensors, sculpted."""
    path = tiny_model_dir(tmp_path, "deepseek_v3", seed=2) / "model.safetensors"
    save_file(change(load_file(path)), path, metadata={"format": "pt"})
    return vault_of(path.parent, tmp_path / "vault")


BAD_TRUNKS = {  # a change to the trunk's tensors -> what the refusal names
    "another shape than the config's": ({"model.norm.weight": torch.ones(65)},
                                        r"trunk tensor model\.norm\.weight: shape \(65,\) .* \(64,\)"),
    "a tensor the model lacks": ({"model.layers.0.mlp.extra.weight": torch.ones(4)},
                                 r"model\.layers\.0\.mlp\.extra\.weight"),
}


@pytest.mark.parametrize("case", BAD_TRUNKS)
def test_a_trunk_tensor_the_model_cannot_take_is_refused_at_quantize_and_at_open(tmp_path, case):
    extra, message = BAD_TRUNKS[case]
    source = tiny_model_dir(tmp_path, "deepseek_v3", seed=2)
    vault = vault_of(source, tmp_path / "vault")
    path = source / "model.safetensors"
    save_file(load_file(path) | extra, path, metadata={"format": "pt"})
    with pytest.raises(SmoeError, match=message):
        vault_of(source, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    trunk = load_file(vault / "model.safetensors") | extra  # a sealed vault crafted with the same trunk
    reseal(vault, "model.safetensors", save(trunk, metadata={"format": "pt"}))
    with pytest.raises(SmoeError, match=message):
        OpenedVault(vault, dtype="float32")


@pytest.mark.parametrize("missing", ["model.layers.1.post_attention_layernorm.weight", "model.norm.weight"])
def test_a_checkpoint_that_lacks_a_tensor_the_model_needs_is_refused_at_quantize(tmp_path, missing):
    source = tiny_model_dir(tmp_path, "deepseek_v3", seed=2)
    path = source / "model.safetensors"
    tensors = load_file(path)
    del tensors[missing]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(SmoeError, match=rf"lacks 1 tensors the model needs .*{missing}"):
        vault_of(source, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_a_config_without_model_type_is_refused_at_quantize(tmp_path):
    source = tiny_model_dir(tmp_path, "qwen3_moe", seed=2)
    config = json.loads((source / "config.json").read_text())
    del config["model_type"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(SmoeError, match="model_type is missing"):
        vault_of(source, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_trunk_tensor_the_model_declares_ignorable_is_left_out_as_transformers_leaves_it(tmp_path):
    # DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected: the release's multi-token-prediction layer 61
    vault = rewrite_source(tmp_path, lambda t: t | {"model.layers.61.eh_proj.weight": torch.ones(4, 4)})
    OpenedVault(vault, dtype="float32").logits(torch.tensor([[1, 2, 3]]))
