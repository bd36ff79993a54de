"""`smoe dequantize`: a standard Hugging Face checkpoint whose experts are the vault's decoded values,
so smoe can be checked against transformers and other tools on exactly the same weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from smoe.errors import SmoeError
from smoe.format.output import writing
from smoe.format.vault import COPIED_FILES, Vault
from smoe.hf.experts import is_dequantizable, parameters_of
from smoe.hf.model import build_model, experts_modules, load_trunk, model_config


def save_config_dtype(config, dtype: torch.dtype, directory: Path) -> None:
    """save_pretrained records its first parameter's dtype, a trunk tensor's stored one: record the
    dtype asked for instead, the experts', so that from_pretrained's default ("auto") loads them as made."""
    for c in [config, *(getattr(config, k) for k in config.sub_configs)]:
        if c is not None:
            c.dtype = dtype
    config.save_pretrained(directory)


def dequantize(vault_dir, out_dir, dtype: torch.dtype = torch.bfloat16, force: bool = False) -> Path:
    with writing(out_dir, "dequantize", [vault_dir], force) as out, Vault(vault_dir) as vault:
        model = dequantized_model(vault, dtype)
        save_checkpoint(model, vault, dtype, out.begin(make="dir"))  # a failure (a full disk) leaves no partial
        out.publish()
    return out.path


def dequantized_model(vault: Vault, dtype: torch.dtype):
    """The transformers model of the vault with its trunk as stored and its experts decoded in `dtype`."""
    model = build_model(model_config(vault), dtype, streaming=False)
    vault.check_trunk()
    load_trunk(model, vault, None, is_dequantizable)  # as stored: the trunk is written back bit for bit
    for layer, module in experts_modules(model, vault, is_dequantizable).items():
        experts = [vault.read_expert(layer, e) for e in range(vault.meta["num_experts"])]
        decoded = [{t.role: t.decode().to(dtype) for t in tensors} for tensors, _ in experts]
        biases = [{r: b.to(dtype) for r, b in b_.items()} for _, b_ in experts]
        for name, value in parameters_of(module, decoded, biases).items():
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path) if path else module
            if tuple(getattr(owner, leaf).shape) != tuple(value.shape):
                raise SmoeError(f"layer {layer}: {name} is {tuple(getattr(owner, leaf).shape)} in the model, "
                                f"the vault gives {tuple(value.shape)}")
            setattr(owner, leaf, torch.nn.Parameter(value, requires_grad=False))
    return model


def save_checkpoint(model, vault: Vault, dtype: torch.dtype, directory: Path) -> None:
    try:
        model.save_pretrained(directory)
    except SafetensorError as e:  # safetensors reports a failed write (a full disk) as its own error
        raise SmoeError(f"{directory}: cannot write the checkpoint ({e})") from None
    save_config_dtype(model.config, dtype, directory)
    for name in COPIED_FILES:
        if (vault.dir / name).exists() and name != "config.json":
            shutil.copyfile(vault.dir / name, directory / name)
