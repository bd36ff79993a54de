"""smoe: run Mixture-of-Experts models larger than memory by streaming quantised experts from disk."""

__version__ = "0.1.0"


def load(vault_dir, **options):
    """The transformers model of a vault, its routed experts streamed from disk (see smoe.hf.load)."""
    from smoe.hf import load as load_vault  # torch and transformers load only when a model is asked for

    return load_vault(vault_dir, **options)
