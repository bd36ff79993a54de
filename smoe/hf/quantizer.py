"""`AutoModelForCausalLM.from_pretrained(VAULT)`: the vault's quantisation method in transformers' registry.

A vault's config.json reads, through smoe.hf.vault_config, as the source's configuration with
`quantization_config: {quant_method: "smoe", ...}` (the file itself names neither, so transformers alone refuses it:
docs/vault.md) and its trunk is
`model.safetensors`, so transformers loads a vault as any pre-quantised checkpoint (bitsandbytes, GPTQ,
HQQ): it builds the model on the meta device, lets this quantizer adjust the skeleton, loads the trunk,
and calls the quantizer again. Before loading, the routed experts' parameters become empty placeholders (they are in
the vault's experts.bin, never in the trunk, so nothing is allocated for them) and the experts modules
are pointed at smoe's experts implementation; after loading, the runtime opens the vault's expert
store and attaches it (`set_attach`: the runtime sits above this package; `import smoe` connects the two),
and sets torch's CPU thread count for the process as `smoe generate` does (smoe.runtime.load).
"""

from __future__ import annotations

from pathlib import Path

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from smoe.errors import SmoeError
from smoe.format.vault import FORMAT_VERSION, QUANT_METHOD, READ_VERSIONS, READS, Vault

METHOD = QUANT_METHOD
_attach = None  # attach(model, vault_dir) -> None, set by the runtime


def set_attach(attach) -> None:
    global _attach
    _attach = attach


class SmoeConfig(QuantizationConfigMixin):
    """The `quantization_config` of a vault's config.json: format version and the experts' bits."""

    def __init__(self, format: str = "smoe-vault", version: int = FORMAT_VERSION, bits=None, **_):
        # other keys (quant_method itself) are the vault writer's; nothing else is read from them
        self.quant_method = METHOD
        self.format, self.version, self.bits = format, version, bits

    def to_dict(self) -> dict:
        return {"quant_method": METHOD, "format": self.format, "version": self.version, "bits": self.bits}


class SmoeQuantizer(HfQuantizer):
    """Loads a vault: trunk through transformers, routed experts streamed by smoe's runtime."""

    requires_calibration = False

    def __init__(self, quantization_config: SmoeConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.vault_dir: Path | None = None

    def validate_environment(self, *args, **kwargs):
        if not self.pre_quantized:
            raise SmoeError("smoe quantises with `smoe quantize MODEL -o VAULT`, not from_pretrained")
        if self.quantization_config.version not in READ_VERSIONS:
            raise SmoeError(f"vault format version {self.quantization_config.version}; this smoe reads "
                            f"versions {READS} (quantize again)")

    def update_device_map(self, device_map):
        return device_map

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        # imported here: this module is imported while transformers is still importing its own modules
        from smoe.hf.experts import (
            EXPERTS_IMPLEMENTATION,
            empty_parameters,
            is_experts_module,
            replace_unregistered_moe_blocks,
        )

        if not checkpoint_files:
            raise SmoeError("from_pretrained found no trunk file in the vault")
        self.vault_dir = Path(checkpoint_files[0]).parent
        vault = Vault(self.vault_dir)  # checks index and copied files; transformers reads the trunk itself
        try:
            vault.check_trunk()
        finally:
            vault.close()
        replace_unregistered_moe_blocks(model)
        ignored = set(model._keys_to_ignore_on_load_missing or ())
        for name, module in model.named_modules():
            if is_experts_module(module):
                ignored |= {f"{name}.{p}".replace(".", r"\.") for p in empty_parameters(module)}
        model._keys_to_ignore_on_load_missing = ignored  # not in the trunk, by design: no warning
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)

    def _process_model_after_weight_loading(self, model, **kwargs):
        if _attach is None:
            raise SmoeError("the smoe runtime is not loaded: `import smoe` before from_pretrained")
        _attach(model, self.vault_dir)
        return model

    def is_serializable(self):
        return False  # the vault is the serialised form

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Put the method in transformers' registries once (a second `import smoe` is a no-op)."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantization_config(METHOD)(SmoeConfig)
        register_quantizer(METHOD)(SmoeQuantizer)
