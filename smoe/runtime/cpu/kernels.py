"""Expert linears on CPU straight from SMOE-Q4 / SMOE-Q2 codes.

Three compute forms, chosen once per expert when it is prepared (when it enters the cache):

* "dequant": decode once to the activation dtype, then F.linear. The exact reference: in fp32 it is
  bit for bit decode() followed by a matmul. Holds 2 (bf16) or 4 (fp32) bytes per weight.
* "int4": torch's CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`), which dequantises
  w = (q - 8) * scale + zero group by group inside the matmul. Holds about half a byte per weight.
  Both depths map onto it exactly (s: the group's fp16 scale):
      Q4: q = code,         scale = s / 7.5, zero = s / 15   ((code - 8) s/7.5 + s/15 = (code - 7.5) s/7.5)
      Q2: q = 2 code + 5,   scale = s / 3,   zero = 0        ((2 code - 3) s/3 = (code - 1.5) s/1.5)
  The kernel rounds scale and zero to the activation dtype; since zero = scale / 2 (or 0) exactly,
  each weight is off by at most one rounding of the step (2**-9 relative in bf16), like decoding to
  bf16. In fp32 the weights equal decode()'s. The kernel needs in % 64 == 0 (a group must not span
  rows) and out % 16 == 0; a tensor that does not fit keeps the dequant form (PreparedExpert.fallbacks).
* "codes": the vault's own codes with fp32 group steps, run by the compiled kernels of
  smoe/runtime/cpu/kernels_numba.py (the fast CPU decoder's compiled step runs a layer's experts in one call). About
  half a byte per weight; exact in fp32. The "auto" choice for small experts (see choose_path).

Measured with torch 2.13 on AVX-512 (see smoe/bench/kernels_cpu.py): the kernel is vectorised for
bf16 only (fp16/fp32 run a scalar loop, 20-60x slower than F.linear). It dequantises once per block
of 4 tokens, so it beats F.linear on pre-decoded bf16 weights up to 4 tokens per call (1.5-1.8x at
1 token) and loses beyond (0.4x at 256). An int4 expert called with many tokens therefore decodes to
a dense temporary and uses F.linear (see DENSE_FROM_TOKENS).

The kernel's packed layout depends on the CPU build (AVX-512 and AVX2 interleave rows differently).
It is found at first use by packing a probe with torch's own converter and comparing with the
layouts known here; codes are then packed by a numba loop straight from the portable LSB-first bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numba
import numpy as np
import torch
import torch.nn.functional as F

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.vault import QuantisedTensor
from smoe.runtime.cpu import kernels_numba

PATHS = ("dequant", "int4", "codes")
KERNEL_GROUP = codec.GROUP_SIZE  # one SMOE group is one K-block of the kernel
KERNEL_ROWS = 16  # the kernel walks out-features in blocks of 16, 32, 48 or 64
# Most tokens per call for which the kernel beats F.linear on dense bf16 (measured crossover: 4).
INT4_MAX_TOKENS = 4
# From this many tokens, an int4 expert decodes a dense temporary (~1 G weights/s on one core) and
# runs F.linear: cheaper than the kernel's per-4-token dequantisation (measured crossover ~70).
DENSE_FROM_TOKENS = 96
# A codes expert called with this many tokens decodes a dense fp32 temporary (~3 G weights/s) and runs
# F.linear instead of one compiled matvec per token (measured: 2 tokens loop faster, 4 decode faster).
CODES_DENSE_FROM_TOKENS = 3
# The codes path runs an expert tensor of up to this many weights (above: torch's int4 kernel, 2.4x
# faster per matvec at Qwen3-30B-A3B's [768, 2048] in bf16, wins over the fast CPU decoder's fused layer).
CODES_MAX_WEIGHTS = 1 << 20
# Packed layouts known here: (rows per block, how two rows share a byte's nibbles). "halves": row j
# and row j + rows/2 (AVX-512: 64, AVX2: 32); "pairs": rows 2j and 2j + 1 (scalar builds). A partial
# block at the end of `out` is always packed as pairs.
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
class CodesWeight:
    """One projection as the vault stores it, for the compiled kernels (smoe/runtime/cpu/kernels_numba.py), with
    rows that start inside a group shifted onto whole groups (kernels_numba.pad_rows)."""

    codes: np.ndarray  # uint8 [out, width * bits / 8]: LSB-first codes, row r starting lead[r] weights in
    steps: np.ndarray  # fp32 [out, width / 64]: d = s / h of each group of the padded row
    lead: np.ndarray  # int64 [out], shared by every tensor of this shape (not counted)
    shape: tuple[int, int]
    bias: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))  # fp32 [out]; length 0: none

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.steps.nbytes


@dataclass
class PreparedExpert:
    roles: tuple[str, ...]  # ("gate", "up", "down") or ("up", "down")
    path: str  # "dequant", "int4" or "codes"
    weights: dict[str, object]  # per role: a [out, in] tensor (dequant), an Int4Weight or a CodesWeight
    biases: dict[str, torch.Tensor]  # per role, in the activation dtype; may be empty
    nbytes: int  # memory held, counted against the cache budget
    fallbacks: tuple[str, ...] = field(default=())  # int4 / codes path: roles the kernel cannot express


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- choosing a path -----------------------------------------------------------------------------


def choose_path(dtype: torch.dtype, bits: int = 4, tokens: int | None = None,
                shapes: list[tuple[int, int]] | None = None) -> str:
    """The "auto" path. With `shapes` (the expert's [out, in] tensors) small enough for the compiled
    kernels (each <= CODES_MAX_WEIGHTS and a row starting on a byte): "codes", which lets the fast
    decoder run a layer's experts in one compiled call, holds the vault's bytes only, and is exact in
    fp32. Otherwise int4 where torch's kernel is vectorised (bf16 on AVX2 / AVX-512 builds): faster
    than dense bf16 for decoding and a quarter of its memory; large calls go to a dense temporary in
    `linear`. Pass `tokens` (typical tokens per expert call) to get the faster form for that load
    alone: dense above INT4_MAX_TOKENS, at 4x the memory. Q2 and Q4 run alike."""
    codec.check_bits(bits)
    if tokens is not None and tokens > INT4_MAX_TOKENS:
        return "dequant"
    if shapes and all(o * i <= CODES_MAX_WEIGHTS and kernels_numba.codes_fit((o, i), bits) for o, i in shapes):
        return "codes"
    vectorised = dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return "int4" if vectorised else "dequant"


def int4_fits(shape: tuple[int, ...]) -> bool:
    """Whether the kernel can express a [out, in] tensor: whole groups per row, whole row blocks."""
    out, inp = shape
    return inp % KERNEL_GROUP == 0 and out % KERNEL_ROWS == 0 and out > 0


# --- prepare and run -----------------------------------------------------------------------------


def fuse_gate_up(tensors: list[QuantisedTensor], biases: dict[str, torch.Tensor]):
    """gate and up as one [2I, H] projection (one matmul instead of two). Concatenating the flat group
    arrays is exact when a tensor holds whole groups, whatever its row width."""
    by_role = {t.role: t for t in tensors}
    gate, up = by_role.get("gate"), by_role.get("up")
    if gate is None or up is None or gate.shape != up.shape or gate.bits != up.bits or gate.codes.numel() == 0:
        return tensors, biases
    if (gate.shape[0] * gate.shape[1]) % codec.GROUP_SIZE or ("gate" in biases) != ("up" in biases):
        return tensors, biases
    fused = QuantisedTensor("gate_up", (2 * gate.shape[0], gate.shape[1]), gate.bits,
                            torch.cat([gate.codes, up.codes]), torch.cat([gate.scales, up.scales]))
    rest = [t for t in tensors if t.role not in ("gate", "up")]
    fused_biases = {r: b for r, b in biases.items() if r not in ("gate", "up")}
    if "gate" in biases:
        fused_biases["gate_up"] = torch.cat([biases["gate"], biases["up"]])
    return [fused, *rest], fused_biases


def gate_and_up(x: torch.Tensor, expert: PreparedExpert) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up projections of x, from a fused weight when the expert has one."""
    if "gate_up" in expert.weights:
        return linear(x, expert, "gate_up").chunk(2, dim=-1)
    return linear(x, expert, "gate"), linear(x, expert, "up")


def prepare_expert(
    tensors: list[QuantisedTensor], biases: dict[str, torch.Tensor], dtype: torch.dtype, path: str = "auto",
    fuse: bool = False,
) -> PreparedExpert:
    """One expert's quantised projections -> compute form for activations of `dtype`; with `fuse`,
    gate and up become one "gate_up" projection (read it with `gate_and_up`). The codes form keeps
    gate and up apart: its kernels read each from the vault's layout, fusing saves nothing there."""
    if path == "auto":
        path = choose_path(dtype, max(t.bits for t in tensors), shapes=[tuple(t.shape) for t in tensors])
    if path not in PATHS:
        raise SmoeError(f"unknown CPU kernel path {path!r} (auto, {', '.join(PATHS)})")
    if fuse and path != "codes":
        tensors, biases = fuse_gate_up(tensors, biases)
    weights, fallbacks = {}, []
    for t in tensors:
        if len(t.shape) != 2:
            raise SmoeError(f"expert projection {t.role}: expected a 2-D weight, got shape {tuple(t.shape)}")
        if path == "int4" and int4_fits(tuple(t.shape)):
            self_check(dtype)
            weights[t.role] = to_int4(t, dtype)
        elif path == "codes" and kernels_numba.codes_fit(tuple(t.shape), t.bits):
            weights[t.role] = to_codes(t)
        else:
            fallbacks += [t.role] if path != "dequant" else []
            weights[t.role] = t.decode(dtype)
    cast = {role: b.to(dtype).contiguous() for role, b in biases.items()}
    held = sum(tensor_nbytes(w) if isinstance(w, torch.Tensor) else w.nbytes for w in weights.values())
    held += sum(tensor_nbytes(b) for b in cast.values()) + codes_biases(weights, cast)
    return PreparedExpert(tuple(t.role for t in tensors), path, weights, cast, held, tuple(fallbacks))


def codes_biases(weights: dict, biases: dict[str, torch.Tensor]) -> int:
    """Give each codes-form projection its bias in fp32, as the compiled kernels add it (the bias itself where
    the activations are fp32, a copy otherwise); the bytes the copies hold."""
    held = 0
    for role, w in weights.items():
        if isinstance(w, CodesWeight) and role in biases:
            w.bias = biases[role].float().numpy()
            held += 0 if biases[role].dtype == torch.float32 else w.bias.nbytes
    return held


def linear(x: torch.Tensor, expert: PreparedExpert, role: str) -> torch.Tensor:
    """x [T, in] -> [T, out] in x's dtype (the dtype the expert was prepared for), bias added."""
    w = expert.weights[role]
    bias = expert.biases.get(role)
    if isinstance(w, CodesWeight):
        y = codes_linear(x, w)
        return y if bias is None else y.add_(bias)
    if not isinstance(w, Int4Weight):
        return F.linear(x, w, bias)
    if x.shape[0] >= DENSE_FROM_TOKENS and kernel_layout() is not None:
        return F.linear(x, dense_weight(w, x.dtype), bias)
    if x.shape[0] == 0:
        return x.new_empty(0, w.packed.shape[0])
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), w.packed, KERNEL_GROUP, w.scales_zeros)
    return y if bias is None else y.add_(bias)


# --- the codes form ------------------------------------------------------------------------------


def to_codes(t: QuantisedTensor) -> CodesWeight:
    """The vault's codes laid out one padded row per output, with fp16 scales turned into fp32 steps
    once (decode()'s d)."""
    out, inp = t.shape
    lead, width = kernels_numba.row_layout((out, inp))
    steps = (t.scales.to(torch.float32) / codec.half_range(t.bits)).numpy()
    codes = np.empty((out, width * t.bits // 8), dtype=np.uint8)
    padded_steps = np.empty((out, width // codec.GROUP_SIZE), dtype=np.float32)
    kernels_numba.pad_rows(t.codes.contiguous().numpy().reshape(-1), steps, t.bits, out, inp, lead, width,
                           codes, padded_steps)
    return CodesWeight(codes, padded_steps, lead, (out, inp))


def codes_linear(x: torch.Tensor, w: CodesWeight) -> torch.Tensor:
    """Few tokens: the compiled code matvec per token, in fp32. Many: decode a dense fp32 temporary
    once (exactly decode()'s weights) and F.linear, which is faster from CODES_DENSE_FROM_TOKENS."""
    out, inp = w.shape
    xf = x.to(torch.float32).contiguous()
    if x.shape[0] >= CODES_DENSE_FROM_TOKENS:
        return F.linear(xf, codes_dense(w)).to(x.dtype)
    y = np.empty((x.shape[0], out), dtype=np.float32)
    phases, prefix = kernels_numba.activation_buffers(inp)
    for row, v in zip(y, xf.numpy()):
        kernels_numba.split_activation(v, phases, prefix)
        kernels_numba.code_matvec(w.codes, w.steps, w.lead, phases, prefix, row)
    return torch.from_numpy(y).to(x.dtype)


def codes_dense(w: CodesWeight) -> torch.Tensor:
    """The decoded [out, in] fp32 weight."""
    dense = np.empty(w.shape, dtype=np.float32)
    kernels_numba.decode_codes(w.codes, w.steps, w.lead, w.shape[1], dense)
    return torch.from_numpy(dense)


# --- the int4 form -------------------------------------------------------------------------------


def to_int4(t: QuantisedTensor, dtype: torch.dtype) -> Int4Weight:
    out, inp = t.shape
    return Int4Weight(pack_int4(t.codes, t.bits, out, inp), scales_and_zeros(t.scales, t.bits, out, inp, dtype))


def scales_and_zeros(scales: torch.Tensor, bits: int, out: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
    """fp16 scales [out * in / 64] -> the kernel's [in / 64, out, 2] (scale, zero) in `dtype`."""
    s = scales.to(torch.float32).view(out, inp // KERNEL_GROUP).t()
    if bits == 4:
        step = s / 7.5
        zero = step * 0.5  # (q - 8) step + step / 2 = (code - 7.5) step; halving stays exact when rounded
    else:
        step = s / 3.0  # q = 2 code + 5: (q - 8) s / 3 = (code - 1.5) s / 1.5
        zero = torch.zeros_like(step)
    return torch.stack([step, zero], dim=-1).to(dtype).contiguous()


def pack_int4(codes: torch.Tensor, bits: int, out: int, inp: int) -> torch.Tensor:
    """Packed LSB-first codes [G, 64 * bits / 8] -> the kernel's uint8 [out, in / 2]."""
    layout = kernel_layout()
    if layout is None:  # a build whose layout is unknown here: let torch pack (slower, int32 codes)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4_values(codes, bits, out, inp), 1)
    rows, style = layout
    packed = np.empty(out * inp // 2, dtype=np.uint8)
    _pack_rows(codes.contiguous().numpy().reshape(out, -1), bits, rows, style == "halves", packed)
    return torch.from_numpy(packed).view(out, inp // 2)


def int4_values(codes: torch.Tensor, bits: int, out: int, inp: int) -> torch.Tensor:
    """The kernel's q per weight, int32 [out, in] (torch's converter input)."""
    q = codec.unpack_codes(codes, bits).to(torch.int32).view(out, inp)
    return q if bits == 4 else 2 * q + 5


def dense_weight(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The int4 form decoded back to a dense [out, in] weight in `dtype` (scales as prepared)."""
    rows, style = kernel_layout()
    out, inp = w.packed.shape[0], w.packed.shape[1] * 2
    dense = np.empty((out, inp), dtype=np.float32)
    sz = w.scales_zeros.to(torch.float32).numpy()
    _unpack_rows(w.packed.numpy().reshape(-1), sz, rows, style == "halves", dense)
    return torch.from_numpy(dense).to(dtype)


# numba loops are single-threaded on purpose: numba's parallel (OpenMP) layer shares libgomp with
# torch and resets torch's thread count when it starts. nogil lets a loader thread run them.


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _pair_rows(start, size, rows, halves, j):
    """The two rows whose nibbles share byte column j of a row block (low nibble, high nibble)."""
    half = size // 2
    if halves and size == rows:
        return start + j, start + j + half
    return start + 2 * j, start + 2 * j + 1


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _pack_rows(src, bits, rows, halves, dst):
    """src [out, in * bits / 8] LSB-first bytes -> dst: per block of `rows` out-features, [in, size/2]
    bytes of q(row lo) | q(row hi) << 4. Reads rows sequentially, one source byte at a time."""
    out, width = src.shape
    per_byte = 8 // bits
    inp = width * per_byte
    for start in range(0, out, rows):
        size = min(rows, out - start)
        half = size // 2
        base = start * (inp // 2)
        for j in range(half):
            lo, hi = _pair_rows(start, size, rows, halves, j)
            for b in range(width):
                a = src[lo, b]
                c = src[hi, b]
                o = base + b * per_byte * half + j
                if bits == 4:  # two codes per byte: even k in the low nibble
                    dst[o] = (a & 15) | (c << 4)
                    dst[o + half] = (a >> 4) | (c & 0xF0)
                else:  # four codes per byte, mapped to q = 2 code + 5
                    for k in range(4):
                        qa = 2 * ((a >> (2 * k)) & 3) + 5
                        qc = 2 * ((c >> (2 * k)) & 3) + 5
                        dst[o + k * half] = qa | (qc << 4)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _unpack_rows(packed, sz, rows, halves, dst):
    """The inverse of _pack_rows, dequantised: dst [out, in] fp32 = (q - 8) * scale + zero, with one
    rounding (exact in fp64), so fp32 scales give decode()'s weights bit for bit."""
    out, inp = dst.shape
    for start in range(0, out, rows):
        size = min(rows, out - start)
        half = size // 2
        base = start * (inp // 2)
        for j in range(half):
            lo, hi = _pair_rows(start, size, rows, halves, j)
            for g in range(inp // KERNEL_GROUP):
                s_lo, z_lo, s_hi, z_hi = sz[g, lo, 0], sz[g, lo, 1], sz[g, hi, 0], sz[g, hi, 1]
                for k in range(g * KERNEL_GROUP, (g + 1) * KERNEL_GROUP):
                    byte = packed[base + k * half + j]
                    dst[lo, k] = np.float32(np.float64((byte & 15) - 8) * s_lo + z_lo)
                    dst[hi, k] = np.float32(np.float64((byte >> 4) - 8) * s_hi + z_hi)


# --- first-use checks ----------------------------------------------------------------------------


@functools.cache
def kernel_layout() -> tuple[int, str] | None:
    """Which known layout this build's converter produces, found by packing a probe both ways.
    112 rows = a full block plus a partial one for both 64- and 32-row blocks."""
    t = random_quantised((112, 2 * KERNEL_GROUP), 4, seed=0)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4_values(t.codes, 4, *t.shape), 1)
    for rows, style in LAYOUTS:
        got = np.empty(want.numel(), dtype=np.uint8)
        _pack_rows(t.codes.numpy().reshape(t.shape[0], -1), 4, rows, style == "halves", got)
        if torch.equal(torch.from_numpy(got).view(want.shape), want):
            return rows, style
    return None


@functools.cache
def self_check(dtype: torch.dtype) -> None:
    """Once per process and dtype: the int4 kernel against decode()+matmul at both depths. Raises
    when it disagrees beyond rounding (layout, scale mapping or dtype support gone wrong)."""
    x = torch.randn(3, 3 * KERNEL_GROUP, generator=torch.Generator().manual_seed(1)).to(dtype)
    for bits in codec.DEPTHS:
        t = random_quantised((112, x.shape[1]), bits, seed=bits)
        w = to_int4(t, dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, KERNEL_GROUP, w.scales_zeros)
        err = worst_error(x, t.decode(), y)
        if not err <= TOLERANCE.get(dtype, 2.0**-7):
            raise SmoeError(
                f"torch's int4 CPU kernel disagrees with SMOE-Q{bits} decode in {dtype} "
                f"(error {err:.3g} of sum |x||w|); use the dequant path"
            )


def worst_error(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    """max |y - x w^T| / (|x| |w|^T) with the reference in fp32: the error of each output relative
    to the largest that rounding every term could cause."""
    xf, wf = x.to(torch.float32), w.to(torch.float32)
    ref = xf @ wf.t()
    bound = xf.abs() @ wf.abs().t()
    return float(((y.to(torch.float32) - ref).abs() / bound.clamp_min(1e-30)).max())


def random_quantised(shape: tuple[int, int], bits: int, seed: int = 0, role: str = "w") -> QuantisedTensor:
    """A tensor of uniform random codes and fp16 scales in [1e-3, 0.05): every code value occurs.
    Built without the encoder on purpose: numba's parallel encoder restarts OpenMP, which resets
    torch's thread count."""
    g = torch.Generator().manual_seed(seed)
    groups = codec.num_groups(shape[0] * shape[1])
    codes = torch.randint(0, 2**bits, (groups, codec.GROUP_SIZE), generator=g, dtype=torch.uint8)
    scales = (torch.rand(groups, generator=g) * 0.049 + 1e-3).to(torch.float16)
    return QuantisedTensor(role, tuple(shape), bits, codec.pack_codes(codes, bits), scales)
