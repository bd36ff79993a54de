"""smoe: run Mixture-of-Experts models larger than memory by streaming quantised experts from disk.

`import smoe` makes `AutoModelForCausalLM.from_pretrained(VAULT)` load vaults: the vault's model type is
registered with transformers' AutoConfig and the "smoe" quantisation method with its quantizer registry, each
as soon as transformers imports that registry (now, if it already has), so that `import smoe` itself stays
light for the command line.
"""

import importlib.abc
import importlib.util
import sys

from smoe.version import __version__

__all__ = ["__version__", "load"]


def load(vault_dir, **options):
    """The transformers model of a vault, its routed experts streamed from disk (see smoe.runtime.load)."""
    from smoe.runtime.load import load as load_vault  # torch and transformers load only when a model is asked for

    return load_vault(vault_dir, **options)


def _register_config() -> None:
    from smoe.hf import vault_config

    vault_config.register()


def _register_quantizer() -> None:
    from smoe.hf import quantizer

    quantizer.set_attach(_attach)
    quantizer.register()


# transformers' registries, each with what smoe puts in it: AutoConfig reads a config before the quantizers load
_REGISTRIES = {"transformers.models.auto.configuration_auto": _register_config,
               "transformers.quantizers": _register_quantizer}


def _attach(model, vault_dir) -> None:
    """from_pretrained's last step (smoe.hf.quantizer): the runtime streams the model's experts."""
    from smoe.runtime.load import attach

    attach(model, vault_dir)


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds one of transformers' registries through the normal finders, runs it, then registers."""

    def __init__(self, name: str, register):
        self.name, self.register = name, register

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None:
            return None
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.register()


for _name, _register in _REGISTRIES.items():
    if _name in sys.modules:
        _register()
    else:
        sys.meta_path.insert(0, _RegisterAfterImport(_name, _register))
