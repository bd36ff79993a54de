"""Expert linears on CPU straight from SMOE-Q4 / SMOE-Q2 codes.

Two compute forms, chosen once per expert when it is prepared (i.e. when it enters the cache):

* "dequant": decode once to the activation dtype, then F.linear. The exact reference: in fp32 it is
  bit for bit decode() followed by a matmul. Holds 2-4 bytes per weight.
* "int4": torch's CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`), which dequantises
  w = (q - 8) * scale + zero group by group inside the matmul. Holds half a byte per weight.
  Both depths map onto it exactly (d = s / h is the SMOE step):
      Q4: q = code,         scale = s / 7.5, zero = s / 15   ((code - 8) d + d/2 = (code - 7.5) d)
      Q2: q = 2 code + 5,   scale = s / 3,   zero = 0        ((2 code - 3) s/3 = (code - 1.5) s/1.5)
  The kernel rounds scale and zero to the activation dtype, so in bf16 each weight is off by at
  most one bf16 rounding (2**-9 relative), the same as decoding to bf16; in fp32 the weights equal
  decode()'s. The kernel needs in % 64 == 0 (a group must not span rows) and out % 16 == 0; a tensor
  that does not fit keeps the dequant form (listed in PreparedExpert.fallbacks).

The kernel's packed layout depends on the CPU build (AVX-512 and AVX2 interleave rows differently),
so it is found at first use by packing a probe with torch's own converter and comparing it with the
layouts known here; codes are then packed by a numba loop straight from the portable LSB-first bytes.
Measured on torch 2.13 (AVX-512): the kernel is vectorised for bf16 only; fp16 and fp32 run a scalar
loop 30-60x slower than F.linear, hence `choose_path`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numba
import numpy as np
import torch
import torch.nn.functional as F

from smoe import codec
from smoe.errors import SmoeError
from smoe.vault import QuantisedTensor

PATHS = ("dequant", "int4")
KERNEL_GROUP = codec.GROUP_SIZE  # one SMOE group is one K-block of the kernel
KERNEL_ROWS = 16  # the kernel walks out-features in blocks of 16, 32, 48 or 64
# Candidate packed layouts: (rows per block, "halves" pairs row j with row j + block/2, "pairs"
# pairs rows 2j and 2j + 1). A block left over at the end of `out` is always packed as pairs.
LAYOUTS = ((64, "halves"), (32, "halves"), (32, "pairs"), (64, "pairs"))
# Worst error allowed against decode()+matmul, relative to sum |x| |w| per output: one rounding of the
# weights and one of the output in the activation dtype, times two for margin; fp32 only accumulates.
TOLERANCE = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9, torch.float32: 2.0**-16}


@dataclass
class Int4Weight:
    """One projection in the kernel's form."""

    packed: torch.Tensor  # uint8 [out, in / 2], the kernel's layout
    scales_zeros: torch.Tensor  # [in / 64, out, 2] in the activation dtype

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.packed) + tensor_nbytes(self.scales_zeros)


@dataclass
class PreparedExpert:
    roles: tuple[str, ...]  # ("gate", "up", "down") or ("up", "down")
    path: str  # "dequant" or "int4"
    weights: dict[str, object]  # per role: a [out, in] tensor (dequant) or an Int4Weight
    biases: dict[str, torch.Tensor]  # per role, in the activation dtype; may be empty
    nbytes: int  # memory held, counted against the cache budget
    fallbacks: tuple[str, ...] = field(default=())  # int4 path: roles kept as dequant (shape)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- choosing a path -----------------------------------------------------------------------------


def choose_path(dtype: torch.dtype, bits: int = 4) -> str:
    """The "auto" path. int4 where the kernel is vectorised (bf16 on AVX2 / AVX-512 builds): it
    beats F.linear on pre-decoded bf16 weights while holding a quarter of the memory. fp16/fp32 fall
    to a scalar loop in torch's kernel, so dequant. Q2 and Q4 run the very same kernel."""
    codec.check_bits(bits)
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "int4"
    return "dequant"


def int4_fits(shape: tuple[int, ...]) -> bool:
    """Whether the kernel can express a [out, in] tensor: whole groups per row, whole row blocks."""
    out, inp = shape
    return inp % KERNEL_GROUP == 0 and out % KERNEL_ROWS == 0 and out > 0


# --- prepare -------------------------------------------------------------------------------------


def prepare_expert(
    tensors: list[QuantisedTensor], biases: dict[str, torch.Tensor], dtype: torch.dtype, path: str = "auto"
) -> PreparedExpert:
    """Turn one expert's quantised projections into compute form for activations of `dtype`."""
    if path == "auto":
        path = choose_path(dtype, max(t.bits for t in tensors))
    if path not in PATHS:
        raise SmoeError(f"unknown CPU kernel path {path!r} (auto, {', '.join(PATHS)})")
    weights, fallbacks = {}, []
    for t in tensors:
        if len(t.shape) != 2:
            raise SmoeError(f"expert projection {t.role}: expected a 2-D weight, got shape {tuple(t.shape)}")
        if path == "int4" and int4_fits(tuple(t.shape)):
            self_check(dtype)
            weights[t.role] = to_int4(t, dtype)
        else:
            fallbacks += [t.role] if path == "int4" else []
            weights[t.role] = t.decode(dtype)
    cast = {role: b.to(dtype).contiguous() for role, b in biases.items()}
    held = sum(w.nbytes if isinstance(w, Int4Weight) else tensor_nbytes(w) for w in weights.values())
    held += sum(tensor_nbytes(b) for b in cast.values())
    return PreparedExpert(tuple(t.role for t in tensors), path, weights, cast, held, tuple(fallbacks))


def linear(x: torch.Tensor, expert: PreparedExpert, role: str) -> torch.Tensor:
    """x [T, in] -> [T, out] in x's dtype (the dtype the expert was prepared for), bias added."""
    w = expert.weights[role]
    bias = expert.biases.get(role)
    if not isinstance(w, Int4Weight):
        return F.linear(x, w, bias)
    out = w.packed.shape[0]
    if x.shape[0] == 0:
        return x.new_empty(0, out)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), w.packed, KERNEL_GROUP, w.scales_zeros)
    return y if bias is None else y.add_(bias)


# --- the int4 form -------------------------------------------------------------------------------


def to_int4(t: QuantisedTensor, dtype: torch.dtype) -> Int4Weight:
    out, inp = t.shape
    return Int4Weight(pack_int4(t.codes, t.bits, out, inp), scales_and_zeros(t.scales, t.bits, out, inp, dtype))


def scales_and_zeros(scales: torch.Tensor, bits: int, out: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
    """fp16 scales [out * in / 64] -> the kernel's [in / 64, out, 2] (scale, zero) in `dtype`."""
    s = scales.to(torch.float32).view(out, inp // KERNEL_GROUP).t()
    if bits == 4:
        step = s / 7.5
        zero = step * 0.5  # (q - 8) step + step / 2 = (code - 7.5) step
    else:
        step = s / 3.0  # q = 2 code + 5: (q - 8) s / 3 = (code - 1.5) s / 1.5
        zero = torch.zeros_like(step)
    return torch.stack([step, zero], dim=-1).to(dtype).contiguous()


def pack_int4(codes: torch.Tensor, bits: int, out: int, inp: int) -> torch.Tensor:
    """Packed LSB-first codes [G, 64 * bits / 8] -> the kernel's uint8 [out, in / 2]."""
    layout = kernel_layout()
    if layout is None:  # an unknown build: let torch pack (slower, needs int32 codes)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4_values(codes, bits, out, inp), 1)
    rows, style = layout
    packed = np.empty(out * inp // 2, dtype=np.uint8)
    _pack_rows(codes.contiguous().numpy().reshape(out, -1), bits, rows, style == "halves", packed)
    return torch.from_numpy(packed).view(out, inp // 2)


def int4_values(codes: torch.Tensor, bits: int, out: int, inp: int) -> torch.Tensor:
    """The kernel's q per weight, int32 [out, in] (torch's converter input)."""
    q = codec.unpack_codes(codes, bits).to(torch.int32).view(out, inp)
    return q if bits == 4 else 2 * q + 5


# Single-threaded on purpose: numba's parallel (OpenMP) layer shares libgomp with torch and resets
# torch's thread count when it starts. nogil lets a loader thread pack while another computes.
@numba.njit(nogil=True, cache=True, boundscheck=False)
def _pack_rows(src, bits, rows, halves, dst):
    """src [out, in * bits / 8] LSB-first bytes -> dst: per block of `rows` out-features, [in, rows/2]
    bytes holding (q of row lo) | (q of row hi) << 4. Reads each row sequentially, one byte at a time."""
    out, width = src.shape
    per_byte = 8 // bits
    inp = width * per_byte
    for block in range((out + rows - 1) // rows):
        start = block * rows
        size = min(rows, out - start)
        half = size // 2
        split = halves and size == rows
        base = start * (inp // 2)
        for j in range(half):
            lo = start + j if split else start + 2 * j
            hi = lo + half if split else lo + 1
            for b in range(width):
                a = src[lo, b]
                c = src[hi, b]
                o = base + b * per_byte * half + j
                if bits == 4:
                    dst[o] = (a & 15) | (c << 4)
                    dst[o + half] = (a >> 4) | (c & 0xF0)
                else:
                    for k in range(4):
                        qa = 2 * ((a >> (2 * k)) & 3) + 5
                        qc = 2 * ((c >> (2 * k)) & 3) + 5
                        dst[o + k * half] = qa | (qc << 4)


# --- first-use checks ----------------------------------------------------------------------------


@functools.cache
def kernel_layout() -> tuple[int, str] | None:
    """Which known layout this build's converter produces, found by packing a probe both ways.
    112 rows = a full block plus a partial one for both 64- and 32-row blocks."""
    out, inp = 112, 2 * KERNEL_GROUP
    q = torch.randint(0, 16, (out, inp), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    codes = codec.pack_codes(q.view(-1, KERNEL_GROUP), 4)
    for rows, style in LAYOUTS:
        got = np.empty(out * inp // 2, dtype=np.uint8)
        _pack_rows(codes.numpy().reshape(out, -1), 4, rows, style == "halves", got)
        if torch.equal(torch.from_numpy(got).view(out, inp // 2), want):
            return rows, style
    return None


@functools.cache
def self_check(dtype: torch.dtype) -> None:
    """Once per process and dtype: the int4 path against decode()+matmul at both depths. Raises when
    the kernel (layout, scale mapping, dtype support) disagrees beyond rounding."""
    x = torch.randn(3, 3 * KERNEL_GROUP, generator=torch.Generator().manual_seed(1)).to(dtype)
    for bits in codec.DEPTHS:
        t = random_quantised((112, x.shape[1]), bits, seed=bits, role="check")
        y = linear(x, PreparedExpert(("check",), "int4", {"check": to_int4(t, dtype)}, {}, 0), "check")
        err = worst_error(x, t.decode(), y)
        if not err <= TOLERANCE.get(dtype, 2.0**-7):
            raise SmoeError(
                f"torch's int4 CPU kernel disagrees with SMOE-Q{bits} decode in {dtype} "
                f"(error {err:.3g} of sum |x||w|); use the dequant path"
            )


def worst_error(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    """max |y - x w^T| / (|x| |w|^T), the reference in fp32: the error per output relative to the
    largest it could reach with every term rounded."""
    xf = x.to(torch.float32)
    ref = xf @ w.to(torch.float32).t()
    scale = xf.abs() @ w.to(torch.float32).abs().t()
    return float(((y.to(torch.float32) - ref).abs() / scale.clamp_min(1e-30)).max())


def random_quantised(shape: tuple[int, int], bits: int, seed: int = 0, role: str = "w") -> QuantisedTensor:
    """A tensor with uniform random codes and fp16 scales in [1e-3, 0.05): every code value occurs.
    Built without the encoder on purpose: numba's parallel encoder restarts OpenMP, which resets
    torch's thread count."""
    g = torch.Generator().manual_seed(seed)
    groups = codec.num_groups(shape[0] * shape[1])
    codes = torch.randint(0, 2**bits, (groups, codec.GROUP_SIZE), generator=g, dtype=torch.uint8)
    scales = (torch.rand(groups, generator=g) * 0.049 + 1e-3).to(torch.float16)
    return QuantisedTensor(role, tuple(shape), bits, codec.pack_codes(codes, bits), scales)
