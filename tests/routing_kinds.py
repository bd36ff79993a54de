"""smoe.moe.route's kinds the fast decoders run, for the tests that hold the compiled routing kernels (numba,
Triton) to it: Qwen3 / Mixtral, DeepSeek-V3, DeepSeek-V2, sigmoid without groups."""

ROUTING_KINDS = {
    "softmax": dict(scoring="softmax", normalise=True),
    "softmax, share of all": dict(scoring="softmax", normalise=False),
    "sigmoid, bias, top-2 groups, scale": dict(scoring="sigmoid", normalise=True, normalise_eps=1e-20,
                                               correction_bias=True, n_group=4, topk_group=2, scale=2.5),
    "softmax, best-expert groups, scale": dict(scoring="softmax", normalise=False, n_group=8, topk_group=3,
                                              group_score="max", scale=16.0),
    "sigmoid, bias, no groups": dict(scoring="sigmoid", normalise=True, correction_bias=True, scale=1.8),
}
