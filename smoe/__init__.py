"""smoe: run Mixture-of-Experts models larger than memory by streaming quantised experts from disk.

`import smoe` makes `AutoModelForCausalLM.from_pretrained(VAULT)` load vaults: the "smoe" quantisation
method is registered with transformers as soon as transformers' quantizer registry is imported (now,
if it already is), so that `import smoe` itself stays light for the command line.
"""

import importlib.abc
import importlib.util
import sys

from smoe.version import __version__

__all__ = ["__version__", "load"]

_REGISTRY = "transformers.quantizers"


def load(vault_dir, **options):
    """The transformers model of a vault, its routed experts streamed from disk (see smoe.runtime.load)."""
    from smoe.runtime.load import load as load_vault  # torch and transformers load only when a model is asked for

    return load_vault(vault_dir, **options)


def _register() -> None:
    from smoe.hf import quantizer

    quantizer.set_attach(_attach)
    quantizer.register()


def _attach(model, vault_dir) -> None:
    """from_pretrained's last step (smoe.hf.quantizer): the runtime streams the model's experts."""
    from smoe.runtime.load import attach

    attach(model, vault_dir)


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds transformers' quantizer registry through the normal finders, runs it, then registers."""

    def find_spec(self, name, path=None, target=None):
        if name != _REGISTRY:
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
        _register()


if _REGISTRY in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _RegisterAfterImport())
