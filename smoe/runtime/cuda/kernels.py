"""Routed experts on CUDA straight from SMOE-Q4 / SMOE-Q2 codes: fused dequant-matmul in Triton.

Input layout: the vault's own blob layout (docs/vault.md), unchanged. Blobs are copied as they are
into one uint8 `pool` tensor on the GPU, each starting on a 64-byte boundary (any cache slot); an
expert is named by the byte offset of its blob in the pool. Since every section of a blob is 64-byte
aligned, the kernels read the codes as 32-bit words and the scales as fp16 straight from the pool.
No float weight matrix is written to memory.

One source serves both depths: BITS is a compile-time constant, and gate/up and down may differ.
Supported: gated SiLU experts (gate, up, down) whose input widths are multiples of 64, so each group
of 64 codes lies in one row; anything else runs `reference_forward` (decode, then matmul) after a
one-line warning.

Two paths, chosen by the number of tokens:

* decode (one token, k experts; three launches, no host synchronisation, CUDA-graph capturable):
  `_prep` rewrites x into "field-major" order (below); `_gate_up` computes w_e * silu(gate_e x) * up_e x
  for every (row block, expert) and writes h in the same order; `_down` computes down_e h_e for every
  (row block, expert), and the last program of a row block to finish (an atomic arrival counter) adds
  the k parts in expert order: the result does not depend on the order programs run in.
* grouped (several tokens): (token, expert) pairs are sorted by expert and each expert's run is
  padded to whole blocks of BT pairs; `_grouped_gate_up` and `_grouped_down` dequantise a [BN, 128]
  weight tile (two groups, scales applied, in the activation dtype) in registers and multiply it with
  a [BT, 128] activation tile on the tensor cores; the k outputs of each token are summed in a fixed
  order. Padded pair counts are rounded up to powers of two and BT is one of 16/32/64, so a few
  compiled kernels and buffer sizes serve every batch; padding pairs read a zero row and are never
  stored. fp32 activations run the tiles in fp32 (exact, slow).

How the decode kernels turn codes into floats without int->float conversions (a slow instruction):
each byte of a code word is shifted to mantissa bits 15..22 and OR-ed with the bits of 1.0, so the
field j of the byte (BITS bits each) reads as f = 1 + c * 2^(BITS*j - 8). With the activation
pre-scaled as x' = x * 2^(8 - BITS*j) (exact: a power of two), f * x' = x' + c * x, and per group

    sum (c - h) x = sum f x' - C,   C = sum x' * (1 + h * 2^(BITS*j - 8))

where C does not depend on the row. Per weight: one AND-OR (one LOP3) and one FMA, plus one shift
per byte. In fp32 this loses a few bits to the cancellation of x' against C (relative error ~1e-5 at
Q4, ~3e-5 at Q2, far below a bf16 rounding). Measured speed and what limits it: BENCHMARKS.md.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.moe.activation import activate
from smoe.moe.dispatch import routed_sum
from smoe.runtime.buckets import bucket
from smoe.source.description import Experts

GROUP = codec.GROUP_SIZE
SLOT_ALIGNMENT = 64  # blob offsets in the pool must be multiples of this (the kernels read 32-bit words)
ONE_BITS = 0x3F800000  # 1.0f
PAIR_BUCKET_MIN = 64
GROUPS_PER_STEP = 2  # grouped kernels: 2 groups = 128 inputs per tensor-core step (4 spills at BT = 64)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # padded pair counts of the grouped path: powers of two from this


# --- layout of one layer's blobs -----------------------------------------------------------------


@dataclass(frozen=True)
class ExpertLayout:
    """Where gate, up and down sit inside a blob (byte offsets from its start), their depths and sizes.
    All experts of a layer share it. gate/up are [inter, hidden]; down is [hidden, inter]."""

    hidden: int
    inter: int
    bits_gate_up: int
    bits_down: int
    gate_codes: int
    gate_scales: int
    up_codes: int
    up_scales: int
    down_codes: int
    down_scales: int
    # per-expert biases (gpt-oss) kept in the blob: their dtype ("" for none) and byte offsets
    bias_dtype: str = ""
    gate_bias: int = 0
    up_bias: int = 0
    down_bias: int = 0
    # the experts' activation: SiLU-gated, or gpt-oss's clamped SwiGLU (alpha, limit). A property of the
    # model, not of the blob, carried here because every launch takes the layout (smoe.moe.activation)
    clamp: tuple[float, float] | None = None

    @classmethod
    def from_entry(cls, entry) -> ExpertLayout:
        """From a vault index entry (smoe.format.vault.ExpertEntry) of a gated expert."""
        t = {x.role: x for x in entry.tensors}
        if set(t) != {"gate", "up", "down"}:
            raise SmoeError(f"GPU experts need gate, up and down projections, got {sorted(t)}")
        (inter, hidden), (h2, i2) = t["gate"].shape, t["down"].shape
        if tuple(t["up"].shape) != (inter, hidden) or (h2, i2) != (hidden, inter):
            raise SmoeError(f"inconsistent expert shapes: {[(x.role, x.shape) for x in entry.tensors]}")
        if t["gate"].bits != t["up"].bits:
            raise SmoeError("gate and up must share one depth")
        return cls(hidden, inter, t["gate"].bits, t["down"].bits,
                   t["gate"].codes_offset, t["gate"].scales_offset, t["up"].codes_offset, t["up"].scales_offset,
                   t["down"].codes_offset, t["down"].scales_offset, **bias_fields(entry))

    def offsets(self) -> tuple[int, ...]:
        return (self.gate_codes, self.gate_scales, self.up_codes, self.up_scales, self.down_codes, self.down_scales)

    @property
    def experts(self) -> Experts:
        """What the kernels compute, as the description states it (smoe.moe.activation.activate)."""
        return Experts(intermediate_size=self.inter, clamp=self.clamp, biases=bool(self.bias_dtype))

    def unsupported(self) -> str | None:
        """Why the kernels cannot run this layout, or None."""
        if self.bias_dtype and any(o % BIAS_TYPES[self.bias_dtype].itemsize
                                   for o in (self.gate_bias, self.up_bias, self.down_bias)):
            return "expert biases not aligned to their dtype"
        if self.hidden % GROUP or self.inter % GROUP:
            return f"input widths {self.hidden} / {self.inter} are not multiples of {GROUP} (groups span rows)"
        if any(o % SLOT_ALIGNMENT for o in self.offsets()):
            return f"blob sections not {SLOT_ALIGNMENT}-byte aligned"
        if self.bits_gate_up not in codec.DEPTHS or self.bits_down not in codec.DEPTHS:
            return f"depths {self.bits_gate_up}/{self.bits_down}"
        return None


BIAS_TYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}  # the vault's bias dtypes


def bias_fields(entry) -> dict:
    """ExpertLayout's bias fields of a vault entry: gate, up and down biases of one dtype, or none."""
    b = {x.role: x for x in entry.biases}
    if not b:
        return {}
    if set(b) != {"gate", "up", "down"} or len({x.dtype for x in b.values()}) != 1 or b["gate"].dtype not in BIAS_TYPES:
        raise SmoeError(f"GPU experts take gate, up and down biases of one dtype ({', '.join(BIAS_TYPES)}), "
                        f"got {sorted((x.role, x.dtype) for x in b.values())}")
    return dict(bias_dtype=b["gate"].dtype, gate_bias=b["gate"].offset, up_bias=b["up"].offset,
                down_bias=b["down"].offset)


# --- Triton kernels ------------------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: only the reference path exists
    triton = None

if triton is not None:
    FIELD_LOW = tl.constexpr(15)  # a byte is moved to mantissa bits 15..22

    @triton.jit
    def _byte_at_mantissa(w, B: tl.constexpr):
        """Byte B of each 32-bit word moved to bits 15..22 (other bits: garbage, masked later)."""
        if B * 8 < FIELD_LOW:
            return w << (FIELD_LOW - B * 8)
        else:
            return w >> (B * 8 - FIELD_LOW)

    @triton.jit
    def _field(v, one, J: tl.constexpr, BITS: tl.constexpr):
        """1 + code * 2^(BITS*J - 8) as fp32, for the field J of a byte placed by _byte_at_mantissa.
        `one` holds the bits of 1.0f in a register: with two immediates ptxas emits two LOP3s."""
        mask: tl.constexpr = (2**BITS - 1) * 2 ** (FIELD_LOW + BITS * J)
        return ((v & mask) | one).to(tl.float32, bitcast=True)

    @triton.jit
    def _prep(x_ptr, xp_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr):
        """x [T, n] -> xp [T, 32/BITS, n*BITS/32] fp32: xp[t, f, w] = x[t, w*PW + f] * 2^(8 - BITS*(f % PB))."""
        PW: tl.constexpr = 32 // BITS
        PB: tl.constexpr = 8 // BITS
        t = tl.program_id(1)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        x = tl.load(x_ptr + t * n + i, mask=ok, other=0.0).to(tl.float32)
        f = i % PW
        scale = (tl.full(f.shape, 256, tl.int32) >> (BITS * (f % PB))).to(tl.float32)
        tl.store(xp_ptr + t * n + f * (n // PW) + i // PW, x * scale, mask=ok)

    @triton.jit
    def _tile(g0, rows, row_ok, wpr: tl.constexpr, gpr: tl.constexpr, GW: tl.constexpr, WPG: tl.constexpr):
        """Addresses of loop step g0: groups g0 .. g0+GW-1 of the rows. Returns x_idx [GW, WPG] (word
        index along a row), g_ok [GW], code offsets and mask [GW, BN, WPG], scale offsets and mask [GW, BN]."""
        gi = g0 + tl.arange(0, GW)
        g_ok = gi < gpr
        x_idx = gi[:, None] * WPG + tl.arange(0, WPG)[None, :]
        code_off = rows[None, :, None] * wpr + x_idx[:, None, :]
        m3 = g_ok[:, None, None] & row_ok[None, :, None]
        s_off = gi[:, None] + rows[None, :] * gpr
        m2 = g_ok[:, None] & row_ok[None, :]
        return x_idx, g_ok, code_off, m3, s_off, m2

    @triton.jit
    def _group_products(a, b, xp_ptr, x_idx, x_ok, x_stride, one, TWO: tl.constexpr, BITS: tl.constexpr):
        """For a [GW, BN, WPG] tile of code words a (groups, rows, words of a group), and b when TWO:
        sum over each group's words of f * x' - C, as [GW, BN] (twice). x' of field f sits at
        xp_ptr + f * x_stride + x_idx, x_idx [GW, WPG]; x_ok [GW]: groups inside the row."""
        PB: tl.constexpr = 8 // BITS
        H: tl.constexpr = (2**BITS - 1) / 2
        acc_a = tl.zeros(a.shape, tl.float32)
        acc_b = tl.zeros(a.shape, tl.float32)
        c = tl.zeros(x_idx.shape, tl.float32)
        for byte in tl.static_range(4):
            va = _byte_at_mantissa(a, byte)
            if TWO:
                vb = _byte_at_mantissa(b, byte)
            for j in tl.static_range(PB):
                xf = tl.load(xp_ptr + (byte * PB + j) * x_stride + x_idx, mask=x_ok[:, None], other=0.0)
                c += xf * (1.0 + H * 2 ** (BITS * j) / 256.0)
                acc_a += _field(va, one, j, BITS) * xf[:, None, :]
                if TWO:
                    acc_b += _field(vb, one, j, BITS) * xf[:, None, :]
        return tl.sum(acc_a - c[:, None, :], axis=2), tl.sum(acc_b - c[:, None, :], axis=2)

    @triton.jit
    def _activate(gate, up, CLAMPED: tl.constexpr, ALPHA, LIMIT):
        """silu(gate) * up, or gpt-oss's clamped SwiGLU (smoe.moe.activation.activate)."""
        if CLAMPED:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            return gate / (1.0 + tl.exp(-ALPHA * gate)) * (up + 1.0)
        else:
            return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def _bias(bias_ptr, unit, at, rows, row_ok, BU: tl.constexpr):
        """An expert's bias at `at` (elements from its blob's start; BU elements per 64-byte unit), fp32."""
        return tl.load(bias_ptr + unit * BU + at + rows, mask=row_ok, other=0.0).to(tl.float32)

    @triton.jit
    def _blob_unit(offsets_ptr, ids_ptr, e, BY_ID: tl.constexpr):
        """Expert slot e's blob offset in 64-byte units: offsets[e], or with BY_ID the offset table's entry for
        the expert id ids[e] (the lookup inside the kernel instead of an indexing kernel before it)."""
        if BY_ID:
            return tl.load(offsets_ptr + tl.load(ids_ptr + e)) // 64
        return tl.load(offsets_ptr + e) // 64

    @triton.jit
    def _gate_up(words_ptr, halves_ptr, offsets_ptr, ids_ptr, route_ptr, xp_ptr, hp_ptr,
                 gate_w, gate_s, up_w, up_s, one, bias_ptr, gate_b, up_b, ALPHA, LIMIT,
                 n_rows: tl.constexpr, n_in: tl.constexpr,
                 BITS: tl.constexpr, BITS_OUT: tl.constexpr, BN: tl.constexpr, GW: tl.constexpr,
                 STAGES: tl.constexpr, PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                 BU: tl.constexpr, BY_ID: tl.constexpr):
        """Program (row block, expert e): hp[e] = route[e] * silu(gate_e x) * up_e x, field-major for
        the down projection's depth. gate_w/up_w: in-blob word offsets; gate_s/up_s: fp16 offsets.
        STAGES > 1: Triton pipelines the loop's loads through shared memory; PREFETCH: the codes and
        scales of the next step are loaded into registers before this step is computed."""
        WPG: tl.constexpr = 2 * BITS  # 32-bit words per group of 64 codes
        H: tl.constexpr = (2**BITS - 1) / 2
        wpr: tl.constexpr = n_in * BITS // 32
        gpr: tl.constexpr = n_in // 64
        e = tl.program_id(1)
        unit = _blob_unit(offsets_ptr, ids_ptr, e, BY_ID)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        gw_ptr = words_ptr + unit * 16 + gate_w
        uw_ptr = words_ptr + unit * 16 + up_w
        gs_ptr = halves_ptr + unit * 32 + gate_s
        us_ptr = halves_ptr + unit * 32 + up_s
        acc_g = tl.zeros((GW, BN), tl.float32)
        acc_u = tl.zeros((GW, BN), tl.float32)
        if PREFETCH:
            _, _, code_off, m3, s_off, m2 = _tile(0, rows, row_ok, wpr, gpr, GW, WPG)
            a_next = tl.load(gw_ptr + code_off, mask=m3, other=0)
            b_next = tl.load(uw_ptr + code_off, mask=m3, other=0)
            sa_next = tl.load(gs_ptr + s_off, mask=m2, other=0.0)
            sb_next = tl.load(us_ptr + s_off, mask=m2, other=0.0)
        for g0 in tl.range(0, gpr, GW, num_stages=STAGES):
            x_idx, g_ok, code_off, m3, s_off, m2 = _tile(g0, rows, row_ok, wpr, gpr, GW, WPG)
            if PREFETCH:
                a, b, sa, sb = a_next, b_next, sa_next, sb_next
                _, _, code_off, m3, s_off, m2 = _tile(g0 + GW, rows, row_ok, wpr, gpr, GW, WPG)
                a_next = tl.load(gw_ptr + code_off, mask=m3, other=0)
                b_next = tl.load(uw_ptr + code_off, mask=m3, other=0)
                sa_next = tl.load(gs_ptr + s_off, mask=m2, other=0.0)
                sb_next = tl.load(us_ptr + s_off, mask=m2, other=0.0)
            else:
                a = tl.load(gw_ptr + code_off, mask=m3, other=0)
                b = tl.load(uw_ptr + code_off, mask=m3, other=0)
                sa = tl.load(gs_ptr + s_off, mask=m2, other=0.0)
                sb = tl.load(us_ptr + s_off, mask=m2, other=0.0)
            pg, pu = _group_products(a, b, xp_ptr, x_idx, g_ok, wpr, one, True, BITS)
            acc_g += pg * sa.to(tl.float32)
            acc_u += pu * sb.to(tl.float32)
        gate = tl.sum(acc_g, axis=0) / H
        up = tl.sum(acc_u, axis=0) / H
        if HAS_BIAS:
            gate += _bias(bias_ptr, unit, gate_b, rows, row_ok, BU)
            up += _bias(bias_ptr, unit, up_b, rows, row_ok, BU)
        h = _activate(gate, up, CLAMPED, ALPHA, LIMIT) * tl.load(route_ptr + e).to(tl.float32)
        PW_O: tl.constexpr = 32 // BITS_OUT
        PB_O: tl.constexpr = 8 // BITS_OUT
        f = rows % PW_O
        scale = (tl.full(f.shape, 256, tl.int32) >> (BITS_OUT * (f % PB_O))).to(tl.float32)
        tl.store(hp_ptr + e * n_rows + f * (n_rows // PW_O) + rows // PW_O, h * scale, mask=row_ok)

    @triton.jit
    def _down(words_ptr, halves_ptr, offsets_ptr, ids_ptr, hp_ptr, part_ptr, count_ptr, y_ptr, down_w, down_s, one,
              route_ptr, bias_ptr, down_b, n_rows: tl.constexpr, n_in: tl.constexpr, k: tl.constexpr,
              BITS: tl.constexpr, BN: tl.constexpr, GW: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr,
              HAS_BIAS: tl.constexpr, BU: tl.constexpr, BY_ID: tl.constexpr):
        """Program (row block, expert e): part[e] = down_e hp[e] (routing already in hp). The last
        program of a row block to finish sums the k parts in expert order into y (deterministic),
        and resets the block's counter for the next call."""
        WPG: tl.constexpr = 2 * BITS
        H: tl.constexpr = (2**BITS - 1) / 2
        wpr: tl.constexpr = n_in * BITS // 32
        gpr: tl.constexpr = n_in // 64
        rb = tl.program_id(0)
        e = tl.program_id(1)
        rows = rb * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        unit = _blob_unit(offsets_ptr, ids_ptr, e, BY_ID)
        w_ptr = words_ptr + unit * 16 + down_w
        s_ptr = halves_ptr + unit * 32 + down_s
        xp = hp_ptr + e * n_in
        acc = tl.zeros((GW, BN), tl.float32)
        if PREFETCH:
            _, _, code_off, m3, s_off, m2 = _tile(0, rows, row_ok, wpr, gpr, GW, WPG)
            a_next = tl.load(w_ptr + code_off, mask=m3, other=0)
            s_next = tl.load(s_ptr + s_off, mask=m2, other=0.0)
        for g0 in tl.range(0, gpr, GW, num_stages=STAGES):
            x_idx, g_ok, code_off, m3, s_off, m2 = _tile(g0, rows, row_ok, wpr, gpr, GW, WPG)
            if PREFETCH:
                a, s = a_next, s_next
                _, _, code_off, m3, s_off, m2 = _tile(g0 + GW, rows, row_ok, wpr, gpr, GW, WPG)
                a_next = tl.load(w_ptr + code_off, mask=m3, other=0)
                s_next = tl.load(s_ptr + s_off, mask=m2, other=0.0)
            else:
                a = tl.load(w_ptr + code_off, mask=m3, other=0)
                s = tl.load(s_ptr + s_off, mask=m2, other=0.0)
            p, unused = _group_products(a, a, xp, x_idx, g_ok, wpr, one, False, BITS)
            acc += p * s.to(tl.float32)
        part = tl.sum(acc, axis=0) / H
        if HAS_BIAS:  # the routing weight is in hp already, not in the bias
            part += _bias(bias_ptr, unit, down_b, rows, row_ok, BU) * tl.load(route_ptr + e).to(tl.float32)
        tl.store(part_ptr + e * n_rows + rows, part, mask=row_ok)
        tl.debug_barrier()  # every thread's part is written before the arrival is counted
        arrived = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if arrived == k - 1:
            y = tl.zeros((BN,), tl.float32)
            for j in range(k):  # .cg: read from L2, where the other programs' parts are
                y += tl.load(part_ptr + j * n_rows + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)
            tl.store(count_ptr + rb, 0)

    @triton.jit
    def _dequant_tile(words_ptr, halves_ptr, rows, row_ok, g0, wpr: tl.constexpr, gpr: tl.constexpr,
                      BITS: tl.constexpr, GK: tl.constexpr, DT: tl.constexpr):
        """Groups g0 .. g0+GK-1 of rows [BN], dequantised: [BN, GK*64] in DT (zero past the row)."""
        WPG: tl.constexpr = 2 * BITS
        PW: tl.constexpr = 32 // BITS
        H: tl.constexpr = (2**BITS - 1) / 2
        gi = g0 + tl.arange(0, GK)
        ok = row_ok[:, None] & (gi < gpr)[None, :]
        wi = tl.arange(0, WPG)
        fi = tl.arange(0, PW)
        w = tl.load(words_ptr + rows[:, None, None] * wpr + gi[None, :, None] * WPG + wi[None, None, :],
                    mask=ok[:, :, None], other=0)  # [BN, GK, WPG]
        codes = (w[:, :, :, None] >> (fi * BITS)[None, None, None, :]) & (2**BITS - 1)  # [BN, GK, WPG, PW]
        d = tl.load(halves_ptr + rows[:, None] * gpr + gi[None, :], mask=ok, other=0.0).to(tl.float32) / H
        q = (codes.to(tl.float32) - H) * d[:, :, None, None]
        return tl.reshape(q, (q.shape[0], GK * 64)).to(DT)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, tl.trans(b), input_precision="ieee")
        else:
            return tl.dot(a, tl.trans(b))

    @triton.jit
    def _grouped_gate_up(words_ptr, halves_ptr, block_units_ptr, pair_token_ptr, x_ptr, h_ptr,
                         gate_w, gate_s, up_w, up_s, bias_ptr, gate_b, up_b, ALPHA, LIMIT,
                         n_rows: tl.constexpr, n_in: tl.constexpr,
                         BITS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, GK: tl.constexpr,
                         IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, BU: tl.constexpr):
        """Program (block of BT sorted pairs of one expert, row block): h[pair] = silu(gate x) * up x,
        GK groups (GK*64 inputs) per step on the tensor cores. pair_token[pair] is the pair's token
        (T for a padding pair: x row T is zero)."""
        blk = tl.program_id(0)
        unit = tl.load(block_units_ptr + blk)
        if unit < 0:  # past the last expert's run
            return
        pairs = blk * BT + tl.arange(0, BT)
        tok = tl.load(pair_token_ptr + pairs)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        wpr: tl.constexpr = n_in * BITS // 32
        gpr: tl.constexpr = n_in // 64
        ki = tl.arange(0, GK * 64)
        DT: tl.constexpr = x_ptr.dtype.element_ty
        acc_g = tl.zeros((BT, BN), tl.float32)
        acc_u = tl.zeros((BT, BN), tl.float32)
        for g0 in tl.range(0, gpr, GK, num_stages=2):
            col = g0 * 64 + ki
            x = tl.load(x_ptr + tok[:, None] * n_in + col[None, :], mask=col[None, :] < n_in, other=0.0)
            wg = _dequant_tile(words_ptr + unit * 16 + gate_w, halves_ptr + unit * 32 + gate_s,
                               rows, row_ok, g0, wpr, gpr, BITS, GK, DT)
            wu = _dequant_tile(words_ptr + unit * 16 + up_w, halves_ptr + unit * 32 + up_s,
                               rows, row_ok, g0, wpr, gpr, BITS, GK, DT)
            acc_g += _dot(x, wg, IEEE)
            acc_u += _dot(x, wu, IEEE)
        if HAS_BIAS:
            acc_g += _bias(bias_ptr, unit, gate_b, rows, row_ok, BU)[None, :]
            acc_u += _bias(bias_ptr, unit, up_b, rows, row_ok, BU)[None, :]
        h = _activate(acc_g, acc_u, CLAMPED, ALPHA, LIMIT)
        tl.store(h_ptr + pairs[:, None] * n_rows + rows[None, :], h.to(DT), mask=row_ok[None, :])

    @triton.jit
    def _grouped_down(words_ptr, halves_ptr, block_units_ptr, pair_id_ptr, h_ptr, route_ptr, y_ptr,
                      down_w, down_s, bias_ptr, down_b, n_rows: tl.constexpr, n_in: tl.constexpr, n_pairs,
                      BITS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, GK: tl.constexpr,
                      IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, BU: tl.constexpr):
        """Program (block of BT sorted pairs, row block): y[pair_id] = route * down h[sorted pair]."""
        blk = tl.program_id(0)
        unit = tl.load(block_units_ptr + blk)
        if unit < 0:
            return
        pairs = blk * BT + tl.arange(0, BT)
        pid = tl.load(pair_id_ptr + pairs)  # original (token * k + slot); n_pairs for padding
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        wpr: tl.constexpr = n_in * BITS // 32
        gpr: tl.constexpr = n_in // 64
        ki = tl.arange(0, GK * 64)
        DT: tl.constexpr = h_ptr.dtype.element_ty
        acc = tl.zeros((BT, BN), tl.float32)
        for g0 in tl.range(0, gpr, GK, num_stages=2):
            col = g0 * 64 + ki
            h = tl.load(h_ptr + pairs[:, None] * n_in + col[None, :], mask=col[None, :] < n_in, other=0.0)
            w = _dequant_tile(words_ptr + unit * 16 + down_w, halves_ptr + unit * 32 + down_s,
                              rows, row_ok, g0, wpr, gpr, BITS, GK, DT)
            acc += _dot(h, w, IEEE)
        if HAS_BIAS:
            acc += _bias(bias_ptr, unit, down_b, rows, row_ok, BU)[None, :]
        real = pid < n_pairs
        route = tl.load(route_ptr + pid, mask=real, other=0.0).to(tl.float32)
        y = acc * route[:, None]
        tl.store(y_ptr + pid[:, None] * n_rows + rows[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=real[:, None] & row_ok[None, :])


# --- launch configurations -----------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """(rows per program, groups per loop step, warps, pipeline stages, register prefetch 0/1) for
    _gate_up and for _down."""

    gate_up: tuple[int, int, int, int, int]
    down: tuple[int, int, int, int, int]


# The fastest tiles of the sweep in scripts/h200_kernels.py on an H200, per (hidden, inter, bits of
# gate/up, bits of down); other shapes take the rule in decode_config. Triton's shared-memory
# pipelining (stages > 1) was 20-25 % slower everywhere it had more than one loop step.
MEASURED_TILES = {
    (4096, 1536, 4, 4): DecodeConfig(gate_up=(32, 8, 4, 1, 0), down=(32, 8, 4, 1, 0)),
    (4096, 1536, 2, 2): DecodeConfig(gate_up=(32, 8, 4, 1, 1), down=(32, 8, 4, 1, 0)),
    (2048, 768, 4, 4): DecodeConfig(gate_up=(32, 8, 4, 1, 1), down=(32, 4, 4, 1, 0)),
    (2048, 768, 2, 2): DecodeConfig(gate_up=(32, 8, 4, 1, 1), down=(32, 16, 4, 2, 0)),
}


def decode_config(layout: ExpertLayout) -> DecodeConfig:
    """Tile sizes for the decode kernels: measured ones where known, else 32 rows x 8 groups per step,
    register prefetch for gate/up, 4 groups per step for a short down row (inter <= 768)."""
    key = (layout.hidden, layout.inter, layout.bits_gate_up, layout.bits_down)
    if key in MEASURED_TILES:
        return MEASURED_TILES[key]
    return DecodeConfig(gate_up=(32, 8, 4, 1, 1), down=(32, 4 if layout.inter <= 768 else 8, 4, 1, 0))


def tokens_per_block(pairs: int, runs: int) -> int:
    """BT of the grouped path from the mean pairs per expert: 16, 32 or 64 (the compiled variants)."""
    mean = pairs / max(runs, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


# --- entry points --------------------------------------------------------------------------------


def pool_views(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool as 32-bit words (codes) and fp16 (scales): the same bytes, no copy."""
    if pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() % 4:
        raise SmoeError("the expert pool must be a 1-D uint8 tensor whose size is a multiple of 4")
    return pool.view(torch.int32), pool.view(torch.float16)


def experts_forward(pool: torch.Tensor, layout: ExpertLayout, x: torch.Tensor, offsets: torch.Tensor,
                    weights: torch.Tensor, path: str = "auto", config: DecodeConfig | None = None,
                    distinct: int | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert(x[t]) with expert = down(silu(gate x) * up x), for x [T, hidden].

    offsets [T, k]: byte offset in `pool` of the blob of each token's k-th expert (multiples of 64).
    path: "auto" (Triton kernels on CUDA tensors, else the reference), "triton" (forced: on CPU
    tensors it needs TRITON_INTERPRET=1), "reference" (decode + matmul).
    distinct: how many distinct blobs the offsets name, where the caller knows (the GPU cache's own offsets,
    aligned by design): the grouped path then waits on the device for neither that count nor the alignment check.
    """
    if path == "auto":
        path = "triton" if x.is_cuda and triton is not None else "reference"
    if path == "reference":
        return reference_forward(pool, layout, x, offsets, weights)
    if path != "triton":
        raise SmoeError(f"unknown GPU kernel path {path!r} (auto, triton, reference)")
    why = layout.unsupported()
    if why is not None:
        warn_once(f"Triton expert kernels cannot run this layer ({why}); decoding experts and using matmul")
        return reference_forward(pool, layout, x, offsets, weights)
    if triton is None:
        raise SmoeError("the Triton kernels need the triton package")
    x2 = x.reshape(-1, layout.hidden).contiguous()
    offsets = offsets.reshape(x2.shape[0], -1).to(torch.int64).contiguous()
    weights = weights.reshape(x2.shape[0], -1).contiguous()
    if distinct is None and bool((offsets % SLOT_ALIGNMENT).any()):
        raise SmoeError(f"expert blob offsets must be multiples of {SLOT_ALIGNMENT} bytes")
    if x2.shape[0] == 1:
        y = decode_forward(pool, layout, x2, offsets[0], weights[0], config or decode_config(layout))
    else:
        y = grouped_forward(pool, layout, x2, offsets, weights, distinct)
    return y.view(x.shape)


def decode_forward(pool, layout: ExpertLayout, x: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                   config: DecodeConfig | None = None, out: torch.Tensor | None = None,
                   ids: torch.Tensor | None = None) -> torch.Tensor:
    """One token (x [1, hidden], contiguous) through its k experts: offsets int64 [k] (blob byte offsets,
    multiples of 64: not checked here, so that the call can be captured in a CUDA graph), weights [k]; or, with
    ids int64 [k] (expert ids), offsets is the layer's table of blob offsets by expert id, looked up in the
    kernels. Three launches and no host synchronisation."""
    config = config or decode_config(layout)
    xp = launch_prep(x, layout.bits_gate_up)
    hp = launch_gate_up(pool, layout, xp, offsets, weights, config.gate_up, ids)
    y = out if out is not None else torch.empty(1, layout.hidden, dtype=x.dtype, device=x.device)
    launch_down(pool, layout, hp, offsets, y, config.down, weights, ids)
    return y


def launch_prep(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [1, n] -> x' [32/bits, n*bits/32] fp32 (field-major, pre-scaled; see the module docstring)."""
    n = x.shape[-1]
    xp = torch.empty(n, dtype=torch.float32, device=x.device)
    _prep[(triton.cdiv(n, 1024), 1)](x, xp, n, BITS=bits, BLOCK=1024)
    return xp


def launch_gate_up(pool, layout: ExpertLayout, xp, offsets, weights, tiles: tuple[int, int, int],
                   ids=None) -> torch.Tensor:
    """h' [k, inter] fp32: routing weight * silu(gate x) * up x, field-major for the down projection."""
    words, halves = pool_views(pool)
    k = (ids if ids is not None else offsets).numel()
    hp = torch.empty(k, layout.inter, dtype=torch.float32, device=xp.device)
    bn, gw, nw, stages, prefetch = tiles
    b = bias_arguments(pool, layout)
    _gate_up[(triton.cdiv(layout.inter, bn), k)](
        words, halves, offsets, ids if ids is not None else offsets, weights, xp, hp,
        layout.gate_codes // 4, layout.gate_scales // 2, layout.up_codes // 4, layout.up_scales // 2, ONE_BITS,
        b.view, b.gate, b.up, *activation_arguments(layout),
        layout.inter, layout.hidden, BITS=layout.bits_gate_up, BITS_OUT=layout.bits_down, BN=bn, GW=gw, STAGES=stages,
        PREFETCH=bool(prefetch), HAS_BIAS=b.present, CLAMPED=layout.clamp is not None, BU=b.per_unit,
        BY_ID=ids is not None, num_warps=nw)
    return hp


def launch_down(pool, layout: ExpertLayout, hp, offsets, y, tiles: tuple[int, int, int], weights=None,
                ids=None) -> None:
    """y [1, hidden] = sum over the k experts of down_e h'_e (+ weights[e] * the down bias where there is one)."""
    words, halves = pool_views(pool)
    k = (ids if ids is not None else offsets).numel()
    bn, gw, nw, stages, prefetch = tiles
    blocks = triton.cdiv(layout.hidden, bn)
    part = torch.empty(k, layout.hidden, dtype=torch.float32, device=hp.device)
    b = bias_arguments(pool, layout)
    _down[(blocks, k)](
        words, halves, offsets, ids if ids is not None else offsets, hp, part, arrival_counters(hp.device, blocks), y,
        layout.down_codes // 4, layout.down_scales // 2, ONE_BITS, weights if weights is not None else hp,
        b.view, b.down, layout.hidden, layout.inter, k, BITS=layout.bits_down, BN=bn, GW=gw, STAGES=stages,
        PREFETCH=bool(prefetch), HAS_BIAS=b.present, BU=b.per_unit, BY_ID=ids is not None, num_warps=nw)


@dataclass(frozen=True)
class BiasArguments:
    view: torch.Tensor  # the pool in the biases' dtype (any view without biases: never read)
    gate: int  # element offsets inside a blob
    up: int
    down: int
    per_unit: int  # elements per 64-byte unit of blob offset
    present: bool


def bias_arguments(pool: torch.Tensor, layout: ExpertLayout) -> BiasArguments:
    if not layout.bias_dtype:
        return BiasArguments(pool.view(torch.float16), 0, 0, 0, 32, False)
    dtype = BIAS_TYPES[layout.bias_dtype]
    n = dtype.itemsize
    return BiasArguments(pool.view(dtype), layout.gate_bias // n, layout.up_bias // n, layout.down_bias // n,
                         SLOT_ALIGNMENT // n, True)


def activation_arguments(layout: ExpertLayout) -> tuple[float, float]:
    """(alpha, limit) of the clamped SwiGLU; unused for SiLU-gated experts."""
    return layout.clamp if layout.clamp is not None else (1.0, 0.0)


_COUNTERS: dict[str, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for _down's row blocks; the kernel leaves them zeroed again. One set per
    device: decode calls on one device must run on one stream."""
    key = str(device)
    if key not in _COUNTERS or _COUNTERS[key].numel() < n:
        _COUNTERS[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return _COUNTERS[key]


def sort_pairs(offsets: torch.Tensor, bt: int, capacity: int, runs: int):
    """(token, expert) pairs sorted by expert, each expert's run padded to whole blocks of bt.
    Returns per padded position the original pair id (n_pairs for padding) and per block the
    expert's blob unit (-1 past the end). `runs` bounds the number of distinct experts: the runs'
    lengths are counted into that many bins on the device, so nothing waits for the host and a CUDA
    graph can hold the call (a prompt's captured layers)."""
    n_pairs = offsets.numel()
    units = (offsets.reshape(-1) // SLOT_ALIGNMENT).to(torch.int64)
    sorted_units, order = torch.sort(units, stable=True)
    first = torch.ones(n_pairs, dtype=torch.bool, device=units.device)
    first[1:] = sorted_units[1:] != sorted_units[:-1]
    run = torch.cumsum(first.to(torch.int64), 0) - 1  # run index of each sorted pair
    counts = torch.zeros(runs, dtype=torch.int64, device=units.device).index_add_(0, run, torch.ones_like(run))
    starts = torch.cumsum(counts, 0) - counts  # first sorted position of each run
    padded = (counts + bt - 1) // bt * bt
    pad_start = torch.cumsum(padded, 0) - padded
    pos = pad_start[run] + torch.arange(n_pairs, device=units.device) - starts[run]
    pair_id = torch.full((capacity,), n_pairs, dtype=torch.int64, device=units.device)
    pair_id[pos] = order
    block_units = torch.full((capacity // bt,), -1, dtype=torch.int64, device=units.device)
    block_units[pos // bt] = sorted_units
    return pair_id, block_units


def grouped_forward(pool, layout: ExpertLayout, x: torch.Tensor, offsets: torch.Tensor,
                    weights: torch.Tensor, distinct: int | None = None) -> torch.Tensor:
    """Several tokens: x [T, hidden], offsets / weights [T, k]; `distinct` as experts_forward's."""
    words, halves = pool_views(pool)
    n_tok, k = offsets.shape
    n_pairs = n_tok * k
    # sizes the padded pair list: a host sync unless the caller knows it
    runs = distinct if distinct is not None else int(torch.unique(offsets).numel())
    bt = tokens_per_block(n_pairs, runs)
    capacity = bucket(n_pairs + runs * (bt - 1), PAIR_BUCKET_MIN)
    pair_id, block_units = sort_pairs(offsets, bt, capacity, runs)
    # tensor-core tiles in the activation dtype; fp32 for fp32 activations, and under Triton's
    # interpreter, whose bf16 tl.dot is wrong (triton 3.6)
    dt = x.dtype if x.dtype in (torch.float16, torch.bfloat16) and not INTERPRETED else torch.float32
    ieee = dt == torch.float32
    x_pad = torch.cat([x.to(dt), x.new_zeros(1, layout.hidden, dtype=dt)])  # row n_tok: padding reads zeros
    pair_token = torch.where(pair_id < n_pairs, pair_id // k, n_tok)
    h = torch.empty(capacity, layout.inter, dtype=dt, device=x.device)
    y = torch.empty(n_pairs, layout.hidden, dtype=torch.float32, device=x.device)
    bn = 64
    grid = (capacity // bt, triton.cdiv(layout.inter, bn))
    b = bias_arguments(pool, layout)
    _grouped_gate_up[grid](words, halves, block_units, pair_token, x_pad, h,
                           layout.gate_codes // 4, layout.gate_scales // 2, layout.up_codes // 4,
                           layout.up_scales // 2, b.view, b.gate, b.up, *activation_arguments(layout),
                           layout.inter, layout.hidden, BITS=layout.bits_gate_up, BT=bt, BN=bn, GK=GROUPS_PER_STEP,
                           IEEE=ieee, HAS_BIAS=b.present, CLAMPED=layout.clamp is not None, BU=b.per_unit,
                           num_warps=4)
    grid = (capacity // bt, triton.cdiv(layout.hidden, bn))
    _grouped_down[grid](words, halves, block_units, pair_id, h, weights.reshape(-1).contiguous(), y,
                        layout.down_codes // 4, layout.down_scales // 2, b.view, b.down, layout.hidden, layout.inter,
                        n_pairs, BITS=layout.bits_down, BT=bt, BN=bn, GK=GROUPS_PER_STEP, IEEE=ieee,
                        HAS_BIAS=b.present, BU=b.per_unit, num_warps=4)
    return y.view(n_tok, k, layout.hidden).sum(1).to(x.dtype)


# --- reference: decode, then matmul --------------------------------------------------------------


def expert_biases(pool: torch.Tensor, layout: ExpertLayout, offset: int) -> tuple:
    """(gate, up, down) biases in fp32 of the blob at `offset` (Nones without)."""
    if not layout.bias_dtype:
        return None, None, None
    dtype = BIAS_TYPES[layout.bias_dtype]
    n = dtype.itemsize
    return tuple(pool[offset + at: offset + at + rows * n].view(dtype).float()
                 for at, rows in ((layout.gate_bias, layout.inter), (layout.up_bias, layout.inter),
                                  (layout.down_bias, layout.hidden)))


def expert_weights(pool: torch.Tensor, layout: ExpertLayout, offset: int, dtype=torch.float32):
    """(gate, up, down) decoded from the blob at `offset` of the pool."""
    out = []
    for role, (rows, cols), bits in (("gate", (layout.inter, layout.hidden), layout.bits_gate_up),
                                     ("up", (layout.inter, layout.hidden), layout.bits_gate_up),
                                     ("down", (layout.hidden, layout.inter), layout.bits_down)):
        c_off, s_off = getattr(layout, f"{role}_codes"), getattr(layout, f"{role}_scales")
        n_codes, n_scales = codec.encoded_nbytes(rows * cols, bits)
        codes = pool[offset + c_off: offset + c_off + n_codes].view(-1, codec.packed_group_bytes(bits))
        scales = pool[offset + s_off: offset + s_off + n_scales].view(torch.float16)
        out.append(codec.decode(codes, scales, bits, (rows, cols), dtype))
    return out


def reference_forward(pool, layout: ExpertLayout, x: torch.Tensor, offsets: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """The specification: each expert decoded with smoe.format.codec.decode, then plain fp32 matmuls."""
    x2 = x.reshape(-1, layout.hidden).to(torch.float32)
    offsets = offsets.reshape(x2.shape[0], -1)
    weights = weights.reshape(x2.shape[0], -1).to(torch.float32)

    def fetch(group):
        # each decoded only when it runs: a layer's experts decoded at once could fill the GPU
        return {off: (lambda rows, off=off: expert_mlp(layout.experts, rows, expert_weights(pool, layout, int(off)),
                                                       expert_biases(pool, layout, int(off)))) for off in group}

    y = routed_sum(x2, offsets, weights, fetch)  # blobs keyed by their offset, not by expert id
    return y.to(x.dtype).view(x.shape)


def expert_mlp(experts: Experts, x, weights, biases):
    """down(act(gate x + b_gate, up x + b_up)) + b_down in fp32, the biases where the expert has them."""
    (gate, up, down), (b_gate, b_up, b_down) = weights, biases
    linear = torch.nn.functional.linear
    return linear(activate(experts, linear(x, gate, b_gate), linear(x, up, b_up)), down, b_down)


@functools.cache
def warn_once(message: str) -> None:
    print(f"smoe: warning: {message}", file=sys.stderr)
