"""A vault as a transformers model, its routed experts streamed from disk: `smoe.load(VAULT)` and
`AutoModelForCausalLM.from_pretrained(VAULT)` (through smoe.hf.quantizer, which calls `attach` here).

The streaming runtime's model is a transformers `PreTrainedModel` already (the experts modules run
through transformers' experts registry); this module gives it the vault's generation config so that
`.generate()` and `pipeline("text-generation", ...)` work as on any checkpoint, and ties the
runtime's lifetime (vault file, expert store) to the model object.
"""

from __future__ import annotations

from smoe.hf.model import generation_config
from smoe.runtime.model import OpenedVault


def load(vault_dir, dtype: str = "bfloat16", cache_gb: float | None = None, threads: int = 16,
         direct_io: bool = False):
    """The transformers model of VAULT. `cache_gb` bounds the expert cache (default: half the free
    RAM, at most all experts); the OpenedVault behind it is `model.smoe_runtime`."""
    runtime = OpenedVault(vault_dir, dtype=dtype, cache_bytes=None if cache_gb is None else int(cache_gb * 1e9),
                             threads=threads, direct_io=direct_io, decoder="generic")
    return adopt(runtime, runtime.model)


def attach(model, vault_dir) -> None:
    """from_pretrained's model of VAULT (trunk loaded by transformers): stream its experts from the vault.
    The trunk file was checksummed by the vault before transformers read it (smoe.hf.quantizer)."""
    runtime = OpenedVault(vault_dir, dtype=model.dtype, decoder="generic", model=model)
    adopt(runtime, model)


def adopt(runtime: OpenedVault, model):
    model.smoe_runtime = runtime  # the store and the vault's file live as long as the model
    config = generation_config(runtime.vault.dir)
    if config is not None:
        model.generation_config = config
    model.name_or_path = str(runtime.vault.dir)
    return model

