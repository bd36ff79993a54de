"""A vault as a transformers model, its routed experts streamed from disk: `smoe.load(VAULT)` and
`AutoModelForCausalLM.from_pretrained(VAULT)` (through smoe.hf.quantizer, which calls `attach` here).

The streaming runtime's model is a transformers `PreTrainedModel` already (the experts modules run
through transformers' experts registry); this module gives it the vault's generation config so that
`.generate()` and `pipeline("text-generation", ...)` work as on any checkpoint, and ties the
runtime's lifetime (vault file, expert store) to the model object.

Both set torch's CPU thread count, process-wide, by the command line's rule (smoe.devices.set_torch_threads):
without it a 2-core machine decodes several times slower than `smoe generate`. OMP_NUM_THREADS in the
environment, `smoe.load(..., torch_threads=N)`, or torch.set_num_threads after loading choose another count.
"""

from __future__ import annotations

from smoe.devices import set_torch_threads
from smoe.hf.model import generation_config
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import generation_config_fields, sampling_defaults


def load(vault_dir, dtype: str = "bfloat16", cache_gb: float | None = None, threads: int = 16,
         direct_io: bool = False, torch_threads: int | None = None):
    """The transformers model of VAULT. `cache_gb` bounds the expert cache (default: half the free
    RAM, at most all experts); `threads` reads experts in parallel; `torch_threads` is torch's CPU thread
    count for the whole process (default: the command line's, see the module's docstring). The OpenedVault
    behind it is `model.smoe_runtime`."""
    set_torch_threads(torch_threads)
    runtime = OpenedVault(vault_dir, dtype=dtype, cache_bytes=None if cache_gb is None else int(cache_gb * 1e9),
                             threads=threads, direct_io=direct_io, decoder="generic")
    return adopt(runtime, runtime.model)


def attach(model, vault_dir) -> None:
    """from_pretrained's model of VAULT (trunk loaded by transformers): stream its experts from the vault.
    The trunk file was checksummed by the vault before transformers read it (smoe.hf.quantizer). torch's
    thread count is set here, as smoe.load sets it."""
    set_torch_threads()
    runtime = OpenedVault(vault_dir, dtype=model.dtype, decoder="generic", model=model)
    adopt(runtime, model)


def adopt(runtime: OpenedVault, model):
    model.smoe_runtime = runtime  # the store and the vault's file live as long as the model
    config = generation_config(runtime.vault.dir)
    if config is not None:
        model.generation_config = config
    # generate() without sampling arguments samples as `smoe generate` and the server do
    model.generation_config.update(**generation_config_fields(sampling_defaults(runtime.vault.dir)))
    model.name_or_path = str(runtime.vault.dir)
    return model

