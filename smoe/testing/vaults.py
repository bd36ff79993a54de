"""Tiny models, their vaults and their dequantised references, built one way for every test.

Most tests need the same three things: a tiny model of a family on disk, the vault sculpted from it,
and a reference model dequantised back from that vault to compare the runtime against.  Each test
file used to carry its own copy of those steps; these functions are the one copy, so that a change
to how a test vault is made (an option, a directory name) is made once.  The trained models under
../shared are used by the tests that want them when present; `SHARED_MODELS` names them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from smoe.convert.dequantize import dequantize
from smoe.convert.sculpt import sculpt
from smoe.format.vault import Vault
from smoe.testing.tiny_models import save_tiny_model

# Beside the repository (its parent directory), as in a development checkout; absent elsewhere,
# and every test that uses it skips or falls back to a tiny model then.
SHARED = Path(__file__).resolve().parents[3] / "shared"
SHARED_MODELS = {"qwen3_moe": SHARED / "models" / "qwen3-moe-28m", "mixtral": SHARED / "models" / "mixtral-28m-b",
                 "deepseek_v3": SHARED / "models" / "deepseek-v3-30m"}


def tiny_model_dir(tmp: Path, family: str, seed: int = 0, layout: str | None = None, name: str = "model",
                   architecture: dict | None = None, **config_overrides) -> Path:
    """A tiny random `family` model saved at tmp/name.

    `architecture` holds config values the model is built with (they may change shapes). config_overrides
    are written into its config.json after saving, so they must leave the weights' shapes alone
    (max_position_embeddings, say): the saved tensors are those of the tiny config.
    """
    model = Path(tmp) / name
    save_tiny_model(family, model, seed=seed, layout=layout, **(architecture or {}))
    if config_overrides:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps(config | config_overrides))
    return model


def vault_of(model: Path, out: Path | None = None, bits: int = 4, **options) -> Path:
    """The vault of `model` at `out` (default: "vault" beside the model), sculpted without progress bars."""
    out = Path(model).parent / "vault" if out is None else Path(out)
    sculpt(model, out, bits=bits, progress=False, **options)
    return out


def tiny_vault(tmp: Path, family: str, bits: int = 4, seed: int = 0, **options) -> Path:
    """tmp/vault, sculpted at `bits` (or by the `plan` in options) from a tiny model at tmp/model."""
    return vault_of(tiny_model_dir(tmp, family, seed=seed), Path(tmp) / "vault", bits, **options)


def dequantised_reference(vault: Path, tmp: Path, dtype: torch.dtype = torch.float32,
                          name: str = "reference") -> Path:
    """The transformers model of `vault` with its experts decoded, at tmp/name (fp32: for comparisons)."""
    return dequantize(vault, Path(tmp) / name, dtype=dtype)


def mixed_vault(tmp: Path, family: str, seed: int = 0) -> Path:
    """tmp/vault of a tiny `family` model sculpted by a plan: per MoE layer, gate/up and down at different
    depths, alternating between layers (what `smoe plan` makes, without measuring)."""
    model = tiny_model_dir(tmp, family, seed=seed)
    with Vault(vault_of(model, Path(tmp) / "probe")) as v:
        layers = v.meta["moe_layers"]
    plan = {}
    for n, layer in enumerate(layers):
        plan |= {(layer, "gate"): 4 - 2 * (n % 2), (layer, "up"): 4 - 2 * (n % 2), (layer, "down"): 2 + 2 * (n % 2)}
    vault = vault_of(model, Path(tmp) / "vault", plan=plan)
    with Vault(vault) as v:
        assert set(v.tensor_bits()["down"]) == {2, 4}
    return vault


def tiny_vault_and_reference(tmp: Path, family: str, bits: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """tiny_vault's tmp/vault and its fp32 dequantised reference at tmp/reference."""
    vault = tiny_vault(tmp, family, bits, seed)
    return vault, dequantised_reference(vault, tmp)


def kernel_sized_vault(tmp: Path, family: str, bits: int = 4) -> tuple[Path, Path]:
    """(vault, fp32 dequantised reference) of a tiny model whose expert widths are multiples of 64, so
    that the GPU's Triton kernels (not their decode-then-matmul fallback), and with them CUDA graphs, run."""
    import transformers

    from smoe.testing.tiny_models import save_tiny_tokenizer, tiny_config

    tmp = Path(tmp)
    config = tiny_config(family)
    # the experts' width: families with dense layers name it apart, the others (Mixtral, OLMoE) use intermediate_size
    setattr(config, "moe_intermediate_size" if hasattr(config, "moe_intermediate_size") else "intermediate_size", 64)
    config.num_hidden_layers = 2
    if getattr(config, "layer_types", None):  # one entry per layer, checked on save
        config.layer_types = config.layer_types[:2]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    model.save_pretrained(tmp / "model")
    save_tiny_tokenizer(tmp / "model", config.vocab_size)
    vault = vault_of(tmp / "model", tmp / "vault", bits)
    with Vault(vault) as v:
        assert all(n % 64 == 0 for shape in v.meta["expert_shapes"].values() for n in shape), v.meta["expert_shapes"]
    return vault, dequantised_reference(vault, tmp)


def reseal(vault: Path, name: str, data: bytes | None) -> None:
    """Write `data` as the vault's file `name` (None removes it) and seal it again: its size and checksum
    into index.json, index.json's hash into the header. A vault whose checksums all match, for tests of
    what the readers check beyond them (index.json itself: `data` is the new index)."""
    import xxhash

    from smoe.format.vault import DATA_FILE, HEADER_SIZE, INDEX_FILE, file_checksum, pack_header, unpack_header

    vault = Path(vault)
    if name == INDEX_FILE:
        raw = data
    else:
        index = json.loads((vault / INDEX_FILE).read_bytes())
        if data is None:
            (vault / name).unlink()
            index["files"].pop(name)
        else:
            (vault / name).write_bytes(data)
            index["files"][name] = {"size": len(data), "xxh3_64": file_checksum(vault / name)}
        raw = json.dumps(index).encode()
    (vault / INDEX_FILE).write_bytes(raw)
    with open(vault / DATA_FILE, "r+b") as f:
        h = unpack_header(f.read(HEADER_SIZE), vault / DATA_FILE)
        f.seek(0)
        f.write(pack_header(h["bits"], h["alignment"], h["data_end"], h["blobs"], xxhash.xxh64_intdigest(raw)))


def as_format_version(vault: Path, version: int) -> Path:
    """The vault as format `version` (2 or 3) wrote it (docs/vault.md), sealed again: quantization_config names
    `quant_method: smoe`; the source's model type stays config.json's own (2) or is quantization_config's
    `model_type` under config.json's `smoe_vault` (3); index.json and the header say `version`."""
    import struct

    import xxhash

    from smoe.format.vault import CONFIG_FILE, DATA_FILE, HEADER, INDEX_FILE

    vault = Path(vault)
    config = json.loads((vault / CONFIG_FILE).read_text())
    sealed = config["quantization_config"]
    config["quantization_config"] = {"quant_method": "smoe", "format": "smoe-vault", "version": version,
                                     "bits": sealed["bits"]}
    if version == 2:
        config["model_type"] = sealed["source_model_type"]
    else:
        config["quantization_config"]["model_type"] = sealed["source_model_type"]
    reseal(vault, CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
    index = json.loads((vault / INDEX_FILE).read_bytes())
    reseal(vault, INDEX_FILE, json.dumps(index | {"version": version}, indent=1).encode())
    with open(vault / DATA_FILE, "r+b") as f:
        fields = list(HEADER.unpack(f.read(HEADER.size)))
        fields[1] = version
        packed = HEADER.pack(*fields)
        f.seek(0)
        f.write(packed + struct.pack("<Q", xxhash.xxh64_intdigest(packed)))
    return vault
