"""The fast decoders' per-layer weight bundle (smoe.runtime.layers.LayerWeights) made of the transformers
model's own tensors (read by smoe.hf.trunk, so both decoders compute with the very tensors the generic decoder
uses), and what the fast decoders cover."""

from __future__ import annotations

from smoe.hf.trunk import layer_tensors
from smoe.runtime.layers import GqaWeights, LayerWeights, MlaWeights
from smoe.source.description import ModelDescription


def layer_weights(layer, description: ModelDescription, index: int) -> LayerWeights:
    """Decoder layer `index`'s trunk tensors (smoe.hf.trunk) as the layer library's bundle; MLA's kv_b
    [heads * (nope + v_head), latent] viewed per head (nothing is copied); a sliding layer's window, whether
    the layer has rotary, and its norms' weights as the library multiplies them (norm_weight)."""
    a = description.attention
    tensors = layer_tensors(layer, mla=a.kind == "mla", qk_norm=a.qk_norm in ("head", "full", "head_after_rotary"),
                            output_gate=a.output_gate and not a.query_gate, output_norms=description.output_norms,
                            moe_output_norm=description.moe_output_norm)
    attention = tensors.pop("attention")
    if a.kind == "mla":
        kv_b = attention.pop("kv_b")
        attention = MlaWeights(kv_b=kv_b.view(a.heads, kv_b.shape[0] // a.heads, a.latent_dim),
                               rotary=index not in a.nope_layers, **attention)
    else:
        attention = GqaWeights(window=a.sliding_window if index in a.sliding_layers else None,
                               rotary=index not in a.nope_layers, gated=a.output_gate, query_gate=a.query_gate,
                               **{k: norm_weight(description, v) if k in ("q_norm", "k_norm") else v
                                  for k, v in attention.items()})
    norms = ("input_norm", "post_norm", "attention_out_norm", "mlp_out_norm")
    return LayerWeights(attention=attention, **{k: norm_weight(description, v) if k in norms else v
                                                for k, v in tensors.items()})


def norm_weight(d: ModelDescription, weight):
    """An RMSNorm's weight as the layer library multiplies it: 1 + weight (in fp32, as the family computes it)
    where the description has norm_offset (Qwen3-Next's norms), else the weight itself."""
    if weight is None or "norm_offset" not in d.extras:
        return weight
    return 1.0 + weight.float()


EPSILON_KEYS = ("rms_norm_eps", "norm_eps")  # LFM2's norm_eps


def rms_epsilon(text_config) -> float:
    """The RMSNorms' epsilon under the first of EPSILON_KEYS the text config has."""
    return next(getattr(text_config, k) for k in EPSILON_KEYS if getattr(text_config, k, None) is not None)


def fast_decoder_gap(d: ModelDescription, device: str = "cpu") -> str | None:
    """Why the fast decoder of a device type ("cpu" | "cuda") does not cover description d, or None when it
    does. Both run the layer library's kinds (smoe.runtime.layers, library_gap), gpt-oss's included (windows,
    sinks, biases: the GPU's GQA block; biases and the clamped SwiGLU: its Triton kernels), as do HunYuan's q/k
    norm after rotary, layers without rotary, multipliers, Mistral 4's query temperature and AFMoE's output gate
    and norms, and rotary in pairs (ERNIE). Both run the layers of a kind the library lacks (linear attention,
    state-space mixers: the description's mixer_layers) through the family's own transformers modules (on the GPU
    eagerly, between its captured graphs). The kinds only the CPU's decoder has (CPU_ONLY: the GPU's fast decoder
    does not compute them) are gaps on the GPU, which keeps the generic decoder there."""
    gap = library_gap(d, mixers_by_modules=True)
    if device != "cuda":
        return gap
    return _gaps((gap is not None, gap or ""), *((True, what) for what in cpu_only(d)))


def cpu_only(d: ModelDescription) -> list[str]:
    """The kinds of d only the CPU's fast decoder computes (the GPU's keeps the generic decoder for them)."""
    return [what for what, has in CPU_ONLY.items() if has(d)]


# kinds the layer library and the compiled CPU step compute and the GPU's fast decoder does not
CPU_ONLY = {
    "norm_offset": lambda d: "norm_offset" in d.extras,
    "attention gate in the query projection": lambda d: d.attention.query_gate,
    "a norm on the MoE block's output": lambda d: d.moe_output_norm,
    "MLA layers without rotary": lambda d: d.attention.kind == "mla" and bool(d.attention.nope_layers),
    "no norms on the attention's and the MLP's inputs": lambda d: not d.input_norms,
    "experts chosen by logits + correction bias": lambda d: d.routing.choice_by_logits,
}

# the description's extras the layer library computes: rotary in pairs, and over part of each head, and norms
# scaled by (1 + weight) (norm_weight)
LIBRARY_EXTRAS = ("interleaved_rotary", "partial_rotary", "norm_offset")
# and those it computes where the description carries their layers or numbers (a rule that does not read them
# leaves a gap)
DESCRIBED_EXTRAS = {
    "no_rope_layers": lambda d: bool(d.attention.nope_layers),
    "multipliers": lambda d: d.multipliers is not None and d.attention.kind == "gqa",
    "temperature_tuning": lambda d: d.attention.query_temperature is not None,
    "attention_gate": lambda d: d.attention.output_gate and d.attention.kind == "gqa" and not d.attention.bias,
    "sandwich_norms": lambda d: d.output_norms and d.attention.kind == "gqa",
    "moe_output_norm": lambda d: d.moe_output_norm,
    "post_norms": lambda d: d.output_norms and not d.input_norms and d.attention.kind == "gqa",
}


def module_layers(d: ModelDescription) -> tuple[int, ...]:
    """The layers a fast decoder runs through the family's own transformers modules: those of a kind the
    layer library lacks (linear attention, state-space mixers)."""
    return d.attention.mixer_layers


def computes_extra(d: ModelDescription, extra: str) -> bool:
    return extra in LIBRARY_EXTRAS or (extra in DESCRIBED_EXTRAS and DESCRIBED_EXTRAS[extra](d))


def library_gap(d: ModelDescription, mixers_by_modules: bool = False) -> str | None:
    """What the layer library lacks for d: it runs GQA attention (q/k/v and o biases, q/k RMSNorm per head before
    or after rotary or over all heads, sliding windows and sink logits optional) and MLA without biases, windows
    or sinks, rotary half-split or interleaved, over the whole head or part of it, or none on the layers the
    description lists; every routing kind smoe.moe.route computes, router bias included; SiLU-gated or clamped
    SwiGLU experts, with or without biases; shared experts, gated or not; gated SiLU dense layers; Granite's
    multipliers (GQA), Mistral 4's query temperature, the attention output gate (GQA without biases: AFMoE's rows
    after v, Qwen3-Next's in the query projection), norms on the branches' outputs (GQA: AFMoE's and GLM-4's beside
    those on their inputs, OLMo-2's instead of them) and on the MoE block's output (AXK1) where the description
    reads them, and norms that scale by 1 + weight; no other EXTRAS. mixers_by_modules: the decoder asking runs
    the mixer layers through the family's own modules, so they are no gap."""
    a, r, e = d.attention, d.routing, d.experts
    return _gaps(
        (a.kind not in ("gqa", "mla"), f"{a.kind} attention"),
        (a.qk_norm not in (None, "head", "full", "head_after_rotary") or (a.kind == "mla" and a.qk_norm),
         f"{a.qk_norm} q/k norm"),
        (a.bias and a.kind == "mla", "attention biases"),
        (bool(a.sliding_layers) and a.kind == "mla", "sliding-window attention"),
        (a.sinks and a.kind == "mla", "attention sinks"),
        (bool(a.mixer_layers) and not mixers_by_modules, "linear-attention or state-space layers"),
        (r.custom is not None, f"its own routing ({r.custom})"),
        (r.weight_input, "routing weights on the experts' input"),
        (e.clamp is None and (not e.gated or e.activation != "silu"), f"{e.activation} experts"),
        *((True, f"{extra}") for extra in d.extras if not computes_extra(d, extra)),
    )


def _gaps(*gaps) -> str | None:
    found = [part for gap, what in gaps if gap for part in what.split(", ")]
    return ", ".join(dict.fromkeys(found)) or None
