"""Reading one routed expert's projection ([out, in]) or bias ([out]) from a checkpoint, as a
ProjectionSource or BiasSource says where it lives."""

from __future__ import annotations

import torch

from smoe.errors import SmoeError
from smoe.source.layouts import BiasSource, ProjectionSource

# Formats whose dequantised tensors come [E, out, in] even where the bf16 release stores [E, in, out]:
# MXFP4 packs along the input dimension, so gpt-oss stores its MXFP4 experts untransposed.
_STORED_OUT_IN = {"mxfp4"}


def load_projection(ckpt, src: ProjectionSource, digest=None) -> torch.Tensor:
    """The projection as [out, in], contiguous, in the source dtype; `digest` is fed the bytes read."""
    ckpt.check_real_valued(src.name, "expert tensor")
    if src.stacked:
        t = _load_block(ckpt, src.name, src.expert_index, src.stacked, digest)
    else:
        t = ckpt.load(src.name, index=src.expert_index, digest=digest)
    if t.dim() != 2:
        raise SmoeError(f"{src.name}: expected a matrix for expert {src.expert_index} {src.role}, "
                        f"got shape {tuple(t.shape)}")
    if src.transpose and ckpt.source_format(src.name) not in _STORED_OUT_IN:
        t = t.t()
    return take_part(t, src.name, src.part, src.parts, src.interleaved).contiguous()


def load_bias(ckpt, src: BiasSource, digest=None) -> torch.Tensor:
    """The bias as [out]; fp64 is rounded here to the fp32 a vault keeps biases in, where a value
    beyond fp32's range can still be named instead of being stored as inf."""
    ckpt.check_real_valued(src.name, "expert bias")
    t = ckpt.load(src.name, index=src.expert_index, digest=digest)
    if t.dim() != 1:
        raise SmoeError(f"{src.name}: expected a vector for expert {src.expert_index} {src.role} bias, "
                        f"got shape {tuple(t.shape)}")
    if t.dtype == torch.float64:
        wide, t = t, t.float()
        if bool(torch.isfinite(wide).all()) and not bool(torch.isfinite(t).all()):
            raise SmoeError(f"tensor {src.name}: fp64 bias values of expert {src.expert_index} beyond the fp32 range "
                            f"a vault keeps biases in")
    return take_part(t, src.name, src.part, src.parts, src.interleaved).contiguous()


def take_part(t: torch.Tensor, name: str, part: int, parts: int, interleaved: bool) -> torch.Tensor:
    """Piece `part` of `parts` of t's rows (a Stored's part/parts/interleaved, as a projection is read)."""
    if parts == 1:
        return t
    if t.shape[0] % parts:
        raise SmoeError(f"{name}: {t.shape[0]} rows do not split into {parts} equal parts")
    if interleaved:
        return t[part::parts]
    return t.chunk(parts, dim=0)[part]


def _load_block(ckpt, name: str, block: int, blocks: int, digest=None) -> torch.Tensor:
    """Rows block*R:(block+1)*R of a 2-D [blocks*R, C] tensor, read one row at a time so that only
    that expert's bytes are read (a whole DBRX w1 is 2 GB)."""
    shape = ckpt.shape(name)
    if shape is None or len(shape) != 2 or shape[0] % blocks:
        raise SmoeError(f"{name}: shape {shape} does not stack {blocks} experts along dim 0")
    rows = shape[0] // blocks
    return torch.stack([ckpt.load(name, index=block * rows + r, digest=digest) for r in range(rows)])
