"""Everything that touches transformers: model skeletons, the trunk, the experts registry, tokenizers.
The transformers internals used are listed in `smoe.hf.internals` with the versions they were checked against."""

from smoe.source import families as _families


def _discover(config: dict):
    from smoe.hf.discover import discover_family  # transformers loads only when a config needs it

    return discover_family(config)


_families.add_discoverer(_discover)
