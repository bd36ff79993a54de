"""The one token->expert loop, and the one way to split a layer's experts into groups that fit a cache.

The paths that run a layer's routed experts expert by expert go through `routed_sum`: the generic
decoder (transformers modules, experts from the store), the fast CPU decoder's prefill, calibration
(the source model's own experts) and the GPU kernels' reference. The fused kernels (the compiled CPU
step, the Triton kernels) run all of a token's experts in one call instead; the GPU decoder's prefill
splits a layer with `expert_groups` too, and runs each group's (token, slot) pairs in one kernel call.
Tests hold the fused paths to the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

# fetch(group of expert ids) -> {expert: run(rows [n, in]) -> rows [n, out]}, called once per group
Fetch = Callable[[list[int]], Mapping[int, Callable[[torch.Tensor], torch.Tensor]]]


def expert_groups(experts: list[int], per_group: int) -> list[list[int]]:
    """`experts` in order, in groups of at most `per_group` (at least one each): a long prompt's layer
    may route to more experts than a cache holds at once, and is then run group by group."""
    per_group = max(1, per_group)
    return [experts[i : i + per_group] for i in range(0, len(experts), per_group)]


def routed_experts(top_i: torch.Tensor, num_experts: int | None = None) -> list[int]:
    """The distinct experts a layer's routing picked, ascending; ids at or beyond `num_experts` are
    not experts (transformers' expert-parallel sentinel) and are left out."""
    experts = torch.unique(top_i).tolist()
    return [e for e in experts if num_experts is None or e < num_experts]


def routed_sum(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, fetch: Fetch, per_group: int | None = None,
               weight_input: bool = False, num_experts: int | None = None) -> torch.Tensor:
    """out[t] = sum over slots s of top_w[t, s] * expert_{top_i[t, s]}(x[t]), in x's dtype.

    x [T, in], top_i / top_w [T, k]. Each expert runs once, on all its tokens at once. With
    `weight_input` the weight scales the expert's input instead of its output (Llama 4). `per_group`
    bounds the experts fetched together (None: all at once)."""
    out = None
    experts = routed_experts(top_i, num_experts)
    for group in expert_groups(experts, per_group or len(experts) or 1):
        runs = fetch(group)
        for e in group:
            tokens, slots = torch.where(top_i == e)
            weight = top_w[tokens, slots, None]
            if weight_input:
                y = runs[e](x[tokens] * weight.to(x.dtype))
            else:
                y = runs[e](x[tokens])
                y = y * weight.to(y.dtype)
            if out is None:
                out = x.new_zeros(x.shape[0], y.shape[-1])
            out.index_add_(0, tokens, y.to(out.dtype))
    return out if out is not None else torch.zeros_like(x)
