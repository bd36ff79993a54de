"""The tokenizer of a grammar library (llguidance), built from a transformers tokenizer."""

from __future__ import annotations


def grammar_tokenizer(tok, eos_ids: list[int]):
    """An llguidance tokenizer of `tok` whose end of sequence is any of `eos_ids` (the model's, which
    may differ from the tokenizer's own eos_token). Costs about a second for a 150k vocabulary."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tok, eos_token=sorted(eos_ids) or None)
