"""Everything that touches transformers: model skeletons, the trunk, the experts registry, tokenizers.
The transformers internals used are listed in `smoe.hf.internals` with the versions they were checked against."""
