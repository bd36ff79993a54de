"""Measuring quantisation: evaluation (ppl, KL, top-1), per-tensor sensitivity, bit plans, codec reports."""
