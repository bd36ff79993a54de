"""A vault's config.json in transformers' AutoConfig: model type `smoe_vault` stands for the source's.

From format version 3 a vault's config.json names the model type `smoe_vault` (docs/vault.md). Transformers
without smoe does not know it, so `AutoModelForCausalLM.from_pretrained(VAULT)` fails before reading a weight,
naming that type, where it would otherwise load the trunk and leave the experts random. `import smoe`
registers the type (transformers' public `AutoConfig.register`): reading it gives the source family's own
configuration, whose quantization_config (`quant_method: smoe`, which from version 4 the file keeps under a key
of smoe's own) then hands the model to smoe's quantizer (smoe.hf.quantizer). A model class named directly never
comes here: transformers reads config.json into that class's configuration and, finding no `quant_method`,
refuses the vault.
"""

from __future__ import annotations

from transformers.configuration_utils import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, AutoConfig

from smoe.format.vault import CONFIG_FILE, VAULT_MODEL_TYPE, source_model_config


class VaultConfig(PreTrainedConfig):
    """Never an instance: reading a vault's config gives the configuration class of the source's model type."""

    model_type = VAULT_MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        config = source_model_config(config_dict, kwargs.get("name_or_path", CONFIG_FILE))
        if config["model_type"] not in CONFIG_MAPPING:  # AutoConfig's own error type, for callers that catch it
            raise ValueError(f"the vault's source model type {config['model_type']!r} is unknown to transformers")
        return CONFIG_MAPPING[config["model_type"]].from_dict(config, **kwargs)


def register() -> None:
    """Put the vault's model type in AutoConfig's registry once."""
    if VAULT_MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(VAULT_MODEL_TYPE, VaultConfig)
