"""smoe.moe.route for the GPU's one-token steps in one Triton kernel.

At batch 1 the torch routing of a layer is a dozen small kernels, two or three of them top-k sorts (for
DeepSeek's grouped routing: the groups' top-2, the best groups, the best experts): on the H200 about 13% of
a resident DeepSeek-V2-Lite token went to the top-k kernels alone (scripts/gpu_profile_decode.py). One
program per token computes the whole choice in registers: scores (softmax or sigmoid), plus the correction
bias, group scores (best two summed, or best) and the best groups, then the k best experts by repeated
argmax (lowest index among equals), their weights normalised and scaled. smoe.moe.route stays the
reference (tests/test_kernels_triton.py holds the kernel to it through the interpreter) and computes what
the kernel does not take: CPU tensors, custom routing, grouped routing over a count of experts per group
that is not a power of two.
"""

from __future__ import annotations

import torch

from smoe.moe.routing import route
from smoe.runtime.cuda.kernels import triton
from smoe.source.description import Routing

MAX_EXPERTS = 1024  # one program holds every expert's score in registers

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _route(logits_ptr, bias_ptr, ids_ptr, weights_ptr, eps, scale, E: tl.constexpr, BLOCK_E: tl.constexpr,
               K: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr, TOPK_G: tl.constexpr, SIGMOID: tl.constexpr,
               HAS_BIAS: tl.constexpr, TOP2: tl.constexpr, NORMALISE: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        x = tl.load(logits_ptr + t * E + offs, mask=valid, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            scores = tl.where(valid, tl.sigmoid(x), 0.0)
        else:
            p = tl.exp(x - tl.max(x, axis=0))
            scores = p / tl.sum(p, axis=0)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
        if G > 1:  # E == BLOCK_E here: the groups are the rows of a [G, E/G] view
            grouped = tl.reshape(choice, (G, BLOCK_E // G))
            cols = tl.arange(0, BLOCK_E // G)
            best = tl.max(grouped, axis=1)
            group_scores = best
            if TOP2:
                first = tl.argmax(grouped, axis=1)
                rest = tl.where(cols[None, :] == first[:, None], float("-inf"), grouped)
                group_scores = best + tl.max(rest, axis=1)
            gids = tl.arange(0, G)
            keep = gids < 0
            for _ in tl.static_range(TOPK_G):
                g = tl.argmax(group_scores, axis=0)
                keep = keep | (gids == g)
                group_scores = tl.where(gids == g, float("-inf"), group_scores)
            choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (BLOCK_E,))
        slots = tl.arange(0, BLOCK_K)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
        weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in tl.static_range(K):
            j = tl.argmax(choice, axis=0)
            ids = tl.where(slots == k, j.to(tl.int64), ids)
            weights = tl.where(slots == k, tl.sum(tl.where(offs == j, scores, 0.0), axis=0), weights)
            choice = tl.where(offs == j, float("-inf"), choice)
        if NORMALISE:
            weights = weights / (tl.sum(weights, axis=0) + eps)
        tl.store(ids_ptr + t * K + slots, ids, mask=slots < K)
        tl.store(weights_ptr + t * K + slots, weights * scale, mask=slots < K)


def kernel_takes(routing: Routing, experts: int) -> bool:
    """Whether the kernel computes this routing kind for `experts` experts."""
    if routing.custom or routing.scoring not in ("softmax", "sigmoid") or experts > MAX_EXPERTS:
        return False
    if routing.n_group > 1:  # a group is a row of a power-of-two view
        return experts & (experts - 1) == 0 and routing.n_group & (routing.n_group - 1) == 0
    return True


def launch_route(routing: Routing, logits: torch.Tensor, correction: torch.Tensor | None):
    """(ids [T, k] int64, weights [T, k] fp32) by the kernel, for logits [T, E] on the kernel's device."""
    t, e = logits.shape
    k = routing.top_k
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    bias = correction.reshape(-1) if correction is not None else logits  # never read without HAS_BIAS
    grouped = routing.n_group > 1
    _route[(t,)](logits.contiguous(), bias, ids, weights, float(routing.normalise_eps), float(routing.scale),
                 E=e, BLOCK_E=triton.next_power_of_2(e), K=k, BLOCK_K=triton.next_power_of_2(k),
                 G=routing.n_group if grouped else 1, TOPK_G=routing.topk_group if grouped else 1,
                 SIGMOID=routing.scoring == "sigmoid", HAS_BIAS=correction is not None,
                 TOP2=routing.group_score == "top2", NORMALISE=routing.normalise)
    return ids, weights


def fused_route(routing: Routing, logits: torch.Tensor, correction: torch.Tensor | None):
    """smoe.moe.route's (ids, weights): by the kernel on a CUDA device where it takes the kind, else by route."""
    if triton is None or not logits.is_cuda or not kernel_takes(routing, logits.shape[-1]):
        return route(routing, logits, correction)
    return launch_route(routing, logits, correction)
