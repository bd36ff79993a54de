"""Dtype names, one table each: safetensors' names (the full list), and the float dtypes a vault
stores (whose short names GGUF uses too); every other name table is derived from these."""

from __future__ import annotations

import torch

# safetensors dtype -> torch dtype (little-endian, as the format specifies).
SAFETENSORS = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
SAFETENSORS_NAMES = {t: n for n, t in SAFETENSORS.items()}

# The float dtypes of vault biases, runtime compute and exported trunks, by their short names
# (the vault index's and GGUF's).
FLOATS = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
FLOAT_NAMES = {t: n for n, t in FLOATS.items()}
# The same by torch's own names ("bfloat16"), as configs and --dtype spell them.
TORCH_NAMES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16)}
