"""smoe: run Mixture-of-Experts models larger than memory by streaming quantised experts from disk."""

from smoe.version import __version__

__all__ = ["__version__", "load"]


def load(vault_dir, **options):
    """The transformers model of a vault, its routed experts streamed from disk (see smoe.runtime.load.load)."""
    from smoe.runtime.load import load as load_vault  # torch and transformers load only when a model is asked for

    return load_vault(vault_dir, **options)
