"""Checkpoint → vault and back: sculpting, the encoders (grid, calibrated GPTQ) with their calibration, dequantizing."""
