"""The one routing function: router logits -> (expert ids, routing weights), for every routing kind a
model description can state (smoe.source.description.Routing).

The generic decoder leaves routing to the family's transformers modules; the fast decoders call this.
The compiled CPU step keeps a fused copy of the softmax kind inside its kernel
(kernels_numba.top_k), which tests hold to this function.
"""

from __future__ import annotations

import torch

from smoe.source.description import Routing


def route(routing: Routing, logits: torch.Tensor, correction_bias: torch.Tensor | None = None):
    """(ids [T, k] int64, weights [T, k] fp32) for router logits [T, E] (router bias already added).

    Scores are softmax or sigmoid of the logits. Experts are chosen by score (by logit where the kind
    says `choice_by_logits`), plus the correction bias when the kind has one (for the choice only), within
    the best `topk_group` of `n_group` groups when the kind is group-limited. The weights are the chosen
    scores, renormalised to sum 1 when `normalise`, times `scale`."""
    if routing.custom:
        raise ValueError(f"routing {routing.custom!r} is the family's own; only its transformers module computes it")
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(logits)
    choice = logits if routing.choice_by_logits else scores
    choice = choice if correction_bias is None else choice + correction_bias.float()
    if routing.n_group > 1:
        choice = group_limited(choice, routing)
    ids = torch.topk(choice, routing.top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, ids)
    if routing.normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + routing.normalise_eps)
    return ids, weights * routing.scale


def group_limited(choice: torch.Tensor, routing: Routing) -> torch.Tensor:
    """`choice` with every expert outside the best `topk_group` groups set to -inf, so never chosen: the
    config check (config_checks.check_model_config) makes those groups hold at least top_k experts.
    DeepSeek-V2's and Mistral 4's routers fill 0 instead, which with their positive softmax scores
    chooses the same experts. A group scores its best two experts summed ("top2") or its best ("max")."""
    t, e = choice.shape
    grouped = choice.view(t, routing.n_group, e // routing.n_group)
    if routing.group_score == "top2":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best = torch.topk(group_scores, routing.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).reshape(t, e)
