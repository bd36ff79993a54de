"""Compiled (numba) kernels for one-token decode steps on CPU: the fast CPU decoder's whole layer in two
calls (attention + routing, then the routed experts) instead of dozens of eager torch ops.

At batch 1 a small model's decode time is per-op overhead, not arithmetic: an eager torch op costs
~1.3 us of dispatch and a bf16 F.linear ~15-35 us, while the same matvec compiled here runs at memory
speed. Activations are fp32 throughout. Weights come in three forms:

* fp32 [out, in] and bf16 held as uint16 [out, in] (widened per row: a bf16 is the top half of an
  fp32, so `uint32(w) << 16` viewed as fp32 is exact);
* expert projections straight from the vault's portable codes (LSB-first; Q4: byte j of a row holds
  columns 2j (low nibble) and 2j + 1; Q2: column 4j + i at bits 2i) with one fp32 step d = s / h per
  group of 64 consecutive weights of the row-major matrix (h = 7.5 at Q4, 1.5 at Q2).

A code matvec deinterleaves the activation once (x[2j], x[2j+1] for Q4; four phases for Q2) so the
loop over a row's bytes is contiguous, and factors the step out of each group:
    y_r = sum over the row's groups of d_g * (sum code * x - h * sum x)
with sum x over a group from prefix sums. Groups run over the flat tensor, so when in % 64 != 0 (the
small model's down projection has in = 96) a row starts inside a group. Such rows are copied once, at
prepare time, into rows of whole groups (`pad_rows`: the row is shifted right by its lead into the
group, the gap holds codes that meet activation zeros), because fixed 64-weight loops run ~3x faster
than loops over pieces of groups. A row must start on a byte, so in must be even (Q4) or a multiple
of 4 (Q2): `codes_fit` says so; other tensors keep the torch paths.

All kernels are single-threaded: numba's parallel (OpenMP) layer shares libgomp with torch and resets
torch's thread count when it starts. nogil lets a loader thread run them.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np

GROUP = 64
jit = numba.njit(fastmath=True, cache=True, boundscheck=False, nogil=True)


def codes_fit(shape: tuple[int, int], bits: int) -> bool:
    """Whether every row of a [out, in] tensor starts on a byte of the packed codes."""
    return len(shape) == 2 and shape[1] > 0 and shape[1] % (8 // bits) == 0


# --- dense matvecs -------------------------------------------------------------------------------


@jit
def matvec(w, x, y, wide):
    """y = w @ x for w fp32 or bf16-as-uint16 [out, in]; `wide` is a uint32 scratch of >= in."""
    out, n = w.shape
    if w.itemsize == 2:
        f = wide[:n].view(np.float32)
        for r in range(out):
            for j in range(n):
                wide[j] = np.uint32(w[r, j]) << 16
            acc = np.float32(0)
            for j in range(n):
                acc += f[j] * x[j]
            y[r] = acc
    else:
        for r in range(out):
            acc = np.float32(0)
            for j in range(n):
                acc += np.float32(w[r, j]) * x[j]
            y[r] = acc


@jit
def load_row(w, r, y):
    """y = row r of w (fp32 or bf16-as-uint16), as fp32: an embedding lookup."""
    n = w.shape[1]
    if w.itemsize == 2:
        bits = y.view(np.uint32)
        for j in range(n):
            bits[j] = np.uint32(w[r, j]) << 16
    else:
        for j in range(n):
            y[j] = np.float32(w[r, j])


@jit
def rms_norm(x, weight, eps, y):
    """y = x / sqrt(mean(x^2) + eps) * weight (in place when y is x)."""
    n = x.shape[0]
    ss = np.float32(0)
    for j in range(n):
        ss += x[j] * x[j]
    inv = np.float32(1.0 / math.sqrt(ss / n + eps))
    for j in range(n):
        y[j] = x[j] * inv * weight[j]


@jit
def add_bias(y, bias):
    """y += bias; a bias of length 0 is none."""
    for j in range(bias.shape[0]):
        y[j] += bias[j]


@jit
def silu(v):
    return v / (np.float32(1) + np.exp(-v))


@jit
def gated(g, u, alpha, limit):
    """An expert's down-projection input from its gate and up values: silu(g) * u, or with a limit > 0
    gpt-oss's clamped SwiGLU, (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g') for g' = min(g, limit)."""
    if limit > 0:
        g = min(g, limit)
        u = min(max(u, -limit), limit)
        return (u + np.float32(1)) * g / (np.float32(1) + np.exp(-alpha * g))
    return silu(g) * u


# --- code matvecs --------------------------------------------------------------------------------


# Zeros around an activation: a padded row starts up to a group before the row (lead < 64) and ends
# up to two groups after it (width <= in + 126).
PAD = GROUP
PAD_AFTER = 2 * GROUP


@functools.cache
def row_layout(shape: tuple[int, int]) -> tuple[np.ndarray, int]:
    """Each row's lead (weights between the start of its first group and the row's start) and the
    padded row width, a whole number of groups: max over rows of lead + in, rounded up to 64. Cached:
    every expert of a shape shares one read-only lead array."""
    out, n = shape
    lead = (np.arange(out, dtype=np.int64) * n) % GROUP
    width = -(-int(lead.max(initial=0) + n) // GROUP) * GROUP
    lead.setflags(write=False)
    return lead, width


@jit
def pad_rows(codes, steps, bits, out, n, lead, width, padded, padded_steps):
    """The vault's flat codes -> one padded row per output: row r's codes start `lead[r]` weights into
    its first group, so every group of 64 in a padded row has one step; the padding holds code 0 and
    is multiplied by activation zeros. padded: uint8 [out, width * bits / 8], padded_steps [out, width / 64]."""
    per = 8 // bits
    for r in range(out):
        first = r * n - lead[r]  # flat index of the row's first group
        for j in range(width // per):
            padded[r, j] = 0
        for j in range(n // per):
            padded[r, lead[r] // per + j] = codes[(r * n) // per + j]
        groups = width // GROUP
        for c in range(groups):
            g = first // GROUP + c
            padded_steps[r, c] = steps[g] if g < steps.shape[0] else 0


@jit
def split_activation(x, phases, prefix):
    """phases[i, PAD / per + j] = x[per * j + i] for both depths (rows 0-1: Q4, rows 2-5: Q2; a Q2
    phase needs len(x) % 4 == 0, else its rows stay unused) with zeros around, and prefix[PAD + c] =
    sum x[:c] (flat over the padding: the zeros add nothing). Sizes: activation_buffers(len(x))."""
    n = x.shape[0]
    phases[:] = 0
    for j in range(n // 2):
        phases[0, PAD // 2 + j] = x[2 * j]
        phases[1, PAD // 2 + j] = x[2 * j + 1]
    for j in range(n // 4):
        for i in range(4):
            phases[2 + i, PAD // 4 + j] = x[4 * j + i]
    acc = np.float32(0)
    for c in range(prefix.shape[0]):
        prefix[c] = acc
        if PAD <= c < PAD + n:
            acc += x[c - PAD]


@jit
def code_matvec(codes, steps, lead, phases, prefix, y):
    """y [out] = decoded weights @ x, from rows laid out by pad_rows and x by split_activation. The
    depth follows from the sizes: a group of 64 weights is 64 * bits / 8 bytes. Every row is whole
    groups, so the inner loops have a fixed trip count, which is what LLVM vectorises well here."""
    if codes.shape[1] * 8 // (steps.shape[1] * GROUP) == 4:
        _q4_rows(codes.reshape(-1), codes.shape[1], steps, lead, phases[0], phases[1], prefix, y)
    else:
        _q2_rows(codes.reshape(-1), codes.shape[1], steps, lead, phases[2], phases[3], phases[4], phases[5], prefix, y)


@jit
def _q4_rows(codes, width, steps, lead, xe, xo, prefix, y):
    """codes flat, xe / xo the even / odd phases. Each row reads through views that start at the row:
    runtime offsets inside the inner loop (or 2-D indexing) keep LLVM from vectorising it (3-4x slower)."""
    groups = steps.shape[1]
    for r in range(y.shape[0]):
        start = PAD - lead[r]  # the padded row's first weight, in the padded activation
        acc = np.float32(0)
        e = xe[start // 2 :]
        o = xo[start // 2 :]
        row = codes[r * width :]
        for c in range(groups):
            s = np.float32(0)
            for j in range(32):
                b = row[c * 32 + j]
                s += np.float32(b & 15) * e[c * 32 + j] + np.float32(b >> 4) * o[c * 32 + j]
            xs = prefix[start + (c + 1) * GROUP] - prefix[start + c * GROUP]
            acc += steps[r, c] * (s - np.float32(7.5) * xs)
        y[r] = acc


@jit
def _q2_rows(codes, width, steps, lead, x0, x1, x2, x3, prefix, y):
    groups = steps.shape[1]
    for r in range(y.shape[0]):
        start = PAD - lead[r]
        p0 = x0[start // 4 :]
        p1 = x1[start // 4 :]
        p2 = x2[start // 4 :]
        p3 = x3[start // 4 :]
        row = codes[r * width :]
        acc = np.float32(0)
        for c in range(groups):
            s = np.float32(0)
            for j in range(16):
                b = row[c * 16 + j]
                i = c * 16 + j
                s += (np.float32(b & 3) * p0[i] + np.float32((b >> 2) & 3) * p1[i]
                      + np.float32((b >> 4) & 3) * p2[i] + np.float32(b >> 6) * p3[i])
            xs = prefix[start + (c + 1) * GROUP] - prefix[start + c * GROUP]
            acc += steps[r, c] * (s - np.float32(1.5) * xs)
        y[r] = acc


@jit
def decode_codes(codes, steps, lead, n, dst):
    """dst [out, n] fp32 = (code - h) * d from the padded rows, a group at a time into a scratch row,
    then the row's own columns: exactly QuantisedTensor.decode()'s values."""
    out, width = codes.shape
    groups = steps.shape[1]
    bits = width * 8 // (groups * GROUP)
    row = np.empty(groups * GROUP, dtype=np.float32)
    for r in range(out):
        b = codes[r]
        for c in range(groups):
            d = steps[r, c]
            o = c * GROUP
            if bits == 4:
                for j in range(32):
                    v = b[c * 32 + j]
                    row[o + 2 * j] = (np.float32(v & 15) - np.float32(7.5)) * d
                    row[o + 2 * j + 1] = (np.float32(v >> 4) - np.float32(7.5)) * d
            else:
                for j in range(16):
                    v = b[c * 16 + j]
                    for i in range(4):
                        row[o + 4 * j + i] = (np.float32((v >> (2 * i)) & 3) - np.float32(1.5)) * d
        dst[r] = row[lead[r] : lead[r] + n]


def activation_buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(phases, prefix) for split_activation of a length-n activation."""
    padded = n + PAD + PAD_AFTER
    return np.zeros((6, padded // 2), dtype=np.float32), np.zeros(padded + 1, dtype=np.float32)


# --- one decoder layer ---------------------------------------------------------------------------


@jit
def rotate(v, cos, sin, tmp):
    """Rotary embedding of one head in place, half-split layout: v * cos + rotate_half(v) * sin."""
    hd = v.shape[0]
    half = hd // 2
    for j in range(half):
        tmp[j] = v[j] * cos[j] - v[j + half] * sin[j]
        tmp[j + half] = v[j + half] * cos[j + half] + v[j] * sin[j + half]
    for j in range(hd):
        v[j] = tmp[j]


@jit
def attend(q, k_cache, v_cache, kv_head, first, length, scale, sinks, head, scores, out):
    """One query head over cached positions first..length-1 of one kv head: softmax(scale q k) v, the
    softmax also over the head's sink logit sinks[head] when sinks is not empty (its share is dropped)."""
    hd = q.shape[0]
    best = -np.inf
    if sinks.shape[0]:
        best = sinks[head]
    for t in range(first, length):
        acc = np.float32(0)
        for j in range(hd):
            acc += q[j] * k_cache[kv_head, t, j]
        scores[t] = acc * scale
        best = max(best, scores[t])
    total = np.float32(0)
    if sinks.shape[0]:
        total = np.float32(np.exp(sinks[head] - best))
    for t in range(first, length):
        scores[t] = np.exp(scores[t] - best)
        total += scores[t]
    for j in range(hd):
        out[j] = 0
    for t in range(first, length):
        p = scores[t] / total
        for j in range(hd):
            out[j] += p * v_cache[kv_head, t, j]


@jit
def largest(values, k, top_i):
    """top_i[:k] = the indices of the k largest values, largest first (lowest index first among equals)."""
    for slot in range(k):
        best = -1
        for i in range(values.shape[0]):
            taken = False
            for prev in range(slot):
                taken = taken or top_i[prev] == i
            if not taken and (best < 0 or values[i] > values[best]):
                best = i
        top_i[slot] = best


@jit
def top_k(logits, k, normalize, top_i, top_w):
    """The k largest logits (lowest index first among equals) and their routing weights: with
    `normalize` a softmax over the k, else their share of a softmax over all."""
    e = logits.shape[0]
    largest(logits, k, top_i)
    high = logits[top_i[0]]
    total = np.float32(0)
    if normalize:
        for slot in range(k):
            total += np.exp(logits[top_i[slot]] - high)
    else:
        for i in range(e):
            total += np.exp(logits[i] - high)
    for slot in range(k):
        top_w[slot] = np.exp(logits[top_i[slot]] - high) / total


@jit
def route(logits, correction, sigmoid, by_logits, n_group, topk_group, top2, k, normalize, eps, scale, top_i, top_w,
          work):
    """smoe.moe.route for one token, compiled: scores are the softmax or sigmoid of the logits; experts are
    chosen by score (by logit where `by_logits`) plus `correction` (length 0: none) within the best
    `topk_group` of `n_group` groups (a group scores its best two summed when `top2`, else its best); the
    weights are the chosen scores, divided by their sum + eps when `normalize`, times `scale`. Among equal
    choices the lowest index wins.
    `work`: fp32 scratch of route_work_size(E, n_group) or more."""
    e = logits.shape[0]
    scores, choice, groups = work[:e], work[e : 2 * e], work[2 * e : 2 * e + n_group]
    if sigmoid:
        for i in range(e):
            scores[i] = 1.0 / (1.0 + np.exp(-logits[i]))
    else:
        high = logits.max()
        total = np.float32(0)
        for i in range(e):
            scores[i] = np.exp(logits[i] - high)
            total += scores[i]
        for i in range(e):
            scores[i] /= total
    for i in range(e):
        choice[i] = (logits[i] if by_logits else scores[i]) + (correction[i] if correction.shape[0] else np.float32(0))
    if n_group > 1:
        size = e // n_group
        for g in range(n_group):
            best, second = -np.inf, -np.inf
            for j in range(g * size, (g + 1) * size):
                if choice[j] > best:
                    best, second = choice[j], best
                elif choice[j] > second:
                    second = choice[j]
            groups[g] = best + second if top2 else best
        for _ in range(n_group - topk_group):  # the worst groups, one at a time, leave the choice
            worst = 0
            for g in range(1, n_group):
                if groups[g] < groups[worst]:
                    worst = g
            groups[worst] = np.inf
            for j in range(worst * size, (worst + 1) * size):
                choice[j] = -np.inf
    largest(choice, k, top_i)
    total = np.float32(0)
    for slot in range(k):
        total += scores[top_i[slot]]
    for slot in range(k):
        w = scores[top_i[slot]]
        top_w[slot] = (w / (total + eps) if normalize else w) * scale


def route_work_size(experts: int, n_group: int) -> int:
    return 2 * experts + max(n_group, 1)


@jit
def attention_and_route(x, pos, heads, eps, input_norm, qkv, qkv_bias, q_norm, k_norm, o, o_bias, sinks, window,
                        out_norm, post_norm, router, router_bias, k_cache, v_cache, cos, sin, interleaved, norm_after_rotary,
                        query_gate, scale, residual, k, normalize, h, top_i, top_w, work, wide):
    """Everything of one layer before its experts, for one token at position `pos`: x += attention,
    h = the experts' (post-norm) input, and the router's top-k (router of shape [0, H]: a dense layer,
    nothing routed). Caches are [kv_heads, positions, hd] fp32; qkv_bias, o_bias, sinks, router_bias of
    length 0: none; input_norm / post_norm of length 0: none (the branch takes x itself, OLMo-2); q_norm /
    k_norm of length 0: none, of length hd: per head (after rotary where norm_after_rotary), longer: over all
    heads; window > 0: the token attends to itself and the window - 1 positions before it; cos / sin of width
    0: no rotary. The scores are q k times `scale`. qkv rows past q, k and v: an output gate, the heads' output
    times their sigmoid (AFMoE); with query_gate that gate's rows follow each head's query rows instead
    ([q_h; gate_h], Qwen3-Next). The attention's output, normalised by out_norm where it is not empty, joins x
    times `residual`.
    `work`: fp32 scratch of attention_work_size(...) or more."""
    n = x.shape[0]
    kv_heads, positions, hd = k_cache.shape
    rows = qkv.shape[0]
    proj = work[:rows]
    attn = work[rows : 2 * rows]
    tmp = work[2 * rows : 2 * rows + hd]
    at = 2 * rows + hd
    scores = work[at : at + positions]
    at += positions
    logits = work[at : at + router.shape[0]]
    at += router.shape[0]
    out = work[at : at + n]
    norm_or_copy(x, input_norm, eps, h)
    matvec(qkv, h, proj, wide)
    add_bias(proj, qkv_bias)
    q_width = 2 * hd if query_gate else hd  # a query head's rows, its gate's included
    keys = heads * q_width  # where k starts
    full = q_norm.shape[0] > hd  # one norm over all q heads and one over all k heads (OLMoE), else per head
    if full:
        rms_norm(proj[: heads * hd], q_norm, eps, proj[: heads * hd])
        rms_norm(proj[keys : keys + kv_heads * hd], k_norm, eps, proj[keys : keys + kv_heads * hd])
    per_head = q_norm.shape[0] > 0 and not full
    for head in range(heads + kv_heads):  # q heads then k heads: per-head norm and rotary
        start = head * q_width if head < heads else keys + (head - heads) * hd
        v = proj[start : start + hd]
        if per_head and not norm_after_rotary:
            rms_norm(v, q_norm if head < heads else k_norm, eps, v)
        _rope(v, cos[pos], sin[pos], interleaved, tmp)
        if per_head and norm_after_rotary:
            rms_norm(v, q_norm if head < heads else k_norm, eps, v)
    for g in range(kv_heads):
        k_cache[g, pos] = proj[keys + g * hd : keys + (g + 1) * hd]
        v_cache[g, pos] = proj[keys + (kv_heads + g) * hd : keys + (kv_heads + g + 1) * hd]
    group = heads // kv_heads  # GQA: query head i reads kv head i // group
    first = max(0, pos + 1 - window) if window > 0 else 0
    for head in range(heads):
        attend(proj[head * q_width : head * q_width + hd], k_cache, v_cache, head // group, first, pos + 1,
               np.float32(scale), sinks, head, scores, attn[head * hd : (head + 1) * hd])
    if query_gate:
        for head in range(heads):
            for j in range(hd):
                attn[head * hd + j] /= np.float32(1) + np.exp(-proj[head * q_width + hd + j])
    gate = keys + 2 * kv_heads * hd
    if rows > gate:
        for j in range(heads * hd):
            attn[j] /= np.float32(1) + np.exp(-proj[gate + j])
    matvec(o, attn[: heads * hd], out, wide)
    add_bias(out, o_bias)
    if out_norm.shape[0]:
        rms_norm(out, out_norm, eps, out)
    r = np.float32(residual)
    for j in range(n):
        x[j] += r * out[j]
    norm_or_copy(x, post_norm, eps, h)
    if router.shape[0]:
        matvec(router, h, logits, wide)
        add_bias(logits, router_bias)
        top_k(logits, k, normalize, top_i, top_w)


@jit
def norm_or_copy(x, weight, eps, out):
    """out = rms_norm(x) with weight, or x itself where weight is empty (a branch without an input norm)."""
    if weight.shape[0]:
        rms_norm(x, weight, eps, out)
    else:
        for j in range(x.shape[0]):
            out[j] = x[j]


@jit
def rotate_pairs(v, cos, sin, tmp):
    """Rotary embedding of one head in place, interleaved layout: pairs (v_2j, v_2j+1) rotated by frequency
    j, written out half-split (as smoe.runtime.layers.rotate does: the query and key share the layout)."""
    half = v.shape[0] // 2
    for j in range(half):
        tmp[j] = v[2 * j] * cos[j] - v[2 * j + 1] * sin[j]
        tmp[j + half] = v[2 * j + 1] * cos[j] + v[2 * j] * sin[j]
    for j in range(2 * half):
        v[j] = tmp[j]


@jit
def add_rows(w, coeffs, y, wide):
    """y = coeffs @ w for w fp32 or bf16-as-uint16 [rows, n] (a row combination: y[j] = sum_d c_d w[d, j])."""
    rows, n = w.shape
    for j in range(n):
        y[j] = 0
    f = wide[:n].view(np.float32)
    for d in range(rows):
        c = coeffs[d]
        if w.itemsize == 2:
            for j in range(n):
                wide[j] = np.uint32(w[d, j]) << 16
            for j in range(n):
                y[j] += c * f[j]
        else:
            for j in range(n):
                y[j] += c * np.float32(w[d, j])


@jit
def mla_attention(x, pos, heads, eps, latent_eps, input_norm, q_a, q_a_norm, q_b, kv_a, kv_a_norm, k_up, v_up, o,
                  post_norm, rows, cos, sin, scale, interleaved, h, work, wide):
    """One token's MLA at position `pos`, absorbed (smoe.runtime.layers.mla_attention): x += attention,
    h = the post-attention norm of x. q_a of shape [0, H]: no query low rank, q_b is the query projection.
    rows: the sequence's latents [positions, latent + rope]; k_up [heads, nope, latent] and v_up
    [heads, v_head, latent] are views of kv_b. `work`: fp32 of mla_work_size(...) or more."""
    n = x.shape[0]
    positions, width = rows.shape
    nope, latent = k_up.shape[1], k_up.shape[2]
    rope = width - latent
    per_head = nope + rope
    v_head = v_up.shape[1]
    at = 0
    q = work[at : at + heads * per_head]
    at += heads * per_head
    qa = work[at : at + q_a.shape[0]]
    at += q_a.shape[0]
    compressed = work[at : at + width]
    at += width
    q_latent = work[at : at + latent]
    at += latent
    o_latent = work[at : at + latent]
    at += latent
    attn = work[at : at + heads * v_head]
    at += heads * v_head
    scores = work[at : at + positions]
    at += positions
    tmp = work[at : at + rope]
    at += rope
    out = work[at : at + n]
    rms_norm(x, input_norm, eps, h)
    if q_a.shape[0]:
        matvec(q_a, h, qa, wide)
        rms_norm(qa, q_a_norm, latent_eps, qa)
        matvec(q_b, qa, q, wide)
    else:
        matvec(q_b, h, q, wide)
    matvec(kv_a, h, compressed, wide)
    rms_norm(compressed[:latent], kv_a_norm, latent_eps, rows[pos, :latent])
    rows[pos, latent:] = compressed[latent:]
    _rope(rows[pos, latent:], cos[pos], sin[pos], interleaved, tmp)
    for head in range(heads):
        q_rope = q[head * per_head + nope : (head + 1) * per_head]
        _rope(q_rope, cos[pos], sin[pos], interleaved, tmp)
        add_rows(k_up[head], q[head * per_head : head * per_head + nope], q_latent, wide)
        best = -np.inf
        for t in range(pos + 1):
            acc = np.float32(0)
            for j in range(latent):
                acc += q_latent[j] * rows[t, j]
            for j in range(rope):
                acc += q_rope[j] * rows[t, latent + j]
            scores[t] = acc * scale
            best = max(best, scores[t])
        total = np.float32(0)
        for t in range(pos + 1):
            scores[t] = np.exp(scores[t] - best)
            total += scores[t]
        for j in range(latent):
            o_latent[j] = 0
        for t in range(pos + 1):
            p = scores[t] / total
            for j in range(latent):
                o_latent[j] += p * rows[t, j]
        matvec(v_up[head], o_latent, attn[head * v_head : (head + 1) * v_head], wide)
    matvec(o, attn, out, wide)
    for j in range(n):
        x[j] += out[j]
    rms_norm(x, post_norm, eps, h)


@jit
def _rope(v, cos, sin, interleaved, tmp):
    """Rotary over the first len(cos) values of v (all of them but for partial rotary), in place."""
    part = v[: cos.shape[0]]
    if interleaved:
        rotate_pairs(part, cos, sin, tmp)
    else:
        rotate(part, cos, sin, tmp)


def mla_work_size(heads: int, nope: int, rope: int, v_head: int, q_rank: int, latent: int, positions: int,
                  hidden: int) -> int:
    return heads * (nope + rope + v_head) + q_rank + 3 * latent + 2 * rope + positions + hidden


def attention_work_size(qkv_rows: int, head_dim: int, positions: int, router_rows: int, hidden: int) -> int:
    return 2 * qkv_rows + head_dim + positions + router_rows + hidden


@jit
def dense_mlp(x, h, gate, up, down, scale_by, residual, work, wide):
    """x += residual * down(silu(gate h) * up h) for a dense (unrouted) MLP layer, times sigmoid(scale_by · h)
    when scale_by (fp32 [n]) is not empty (Qwen2-MoE's gated shared expert); work: fp32 of >= 2 * inter + n."""
    inter = gate.shape[0]
    g = work[:inter]
    u = work[inter : 2 * inter]
    matvec(gate, h, g, wide)
    matvec(up, h, u, wide)
    for j in range(inter):
        g[j] = silu(g[j]) * u[j]
    d = work[2 * inter : 2 * inter + x.shape[0]]
    matvec(down, g, d, wide)
    scale = np.float32(residual)
    if scale_by.shape[0]:
        acc = np.float32(0)
        for j in range(h.shape[0]):
            acc += scale_by[j] * h[j]
        scale /= np.float32(1) + np.exp(-acc)
    for j in range(x.shape[0]):
        x[j] += scale * d[j]


@jit
def experts(x, h, count, weights, gate, gate_steps, up, up_steps, down, down_steps, biases, clamp, leads, inter, work):
    """x += sum over the first `count` experts e of weights[e] * down(gated(gate h, up h)), every
    projection from codes padded by pad_rows (leads: the (gate/up, down) row leads of the layer's
    shapes), plus its bias: biases holds (gate, up, down) biases per expert, each of length 0 for none.
    clamp: (alpha, limit) of gpt-oss's clamped SwiGLU, limit 0 for SiLU (see `gated`). The tuples may be
    longer than `count` (padded to a bucket size so the compiled code is reused); entries past `count` are
    never read. work: fp32 of experts_work_size(len(x), inter)."""
    n = x.shape[0]
    up_lead, down_lead = leads
    hp, at = _carve2(work, 0, 6, (n + PAD + PAD_AFTER) // 2)
    hs, at = _carve(work, at, n + PAD + PAD_AFTER + 1)
    ap, at = _carve2(work, at, 6, (inter + PAD + PAD_AFTER) // 2)
    a_s, at = _carve(work, at, inter + PAD + PAD_AFTER + 1)
    g, at = _carve(work, at, inter)
    u, at = _carve(work, at, inter)
    d, at = _carve(work, at, n)
    alpha, limit = clamp
    split_activation(h, hp, hs)
    for e in range(count):
        gate_bias, up_bias, down_bias = biases[e]
        code_matvec(gate[e], gate_steps[e], up_lead, hp, hs, g)
        code_matvec(up[e], up_steps[e], up_lead, hp, hs, u)
        add_bias(g, gate_bias)
        add_bias(u, up_bias)
        for j in range(inter):
            g[j] = gated(g[j], u[j], alpha, limit)
        split_activation(g, ap, a_s)
        code_matvec(down[e], down_steps[e], down_lead, ap, a_s, d)
        add_bias(d, down_bias)
        w = weights[e]
        for j in range(n):
            x[j] += w * d[j]


def experts_work_size(n: int, inter: int) -> int:
    """fp32 scratch `experts` needs for hidden size n (even) and expert width inter (even)."""
    return 4 * (n + PAD + PAD_AFTER) + 1 + 4 * (inter + PAD + PAD_AFTER) + 1 + 2 * inter + n


@jit
def _carve(work, at, size):
    """The next `size` floats of a scratch buffer, and where the one after starts."""
    return work[at : at + size], at + size


@jit
def _carve2(work, at, rows, cols):
    return work[at : at + rows * cols].reshape(rows, cols), at + rows * cols


@jit
def final_logits(x, norm, eps, lm_head, h, logits, wide):
    rms_norm(x, norm, eps, h)
    matvec(lm_head, h, logits, wide)
