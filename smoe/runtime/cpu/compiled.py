"""The fast CPU decoder: the layer library (smoe.runtime.layers) over the expert store, for the model
descriptions smoe.runtime.weights.fast_decoder_gap admits (Qwen3-MoE, Mixtral, DeepSeek-V3/V2, ...):
few Python-level ops per layer.

At batch 1 on a CPU, time per token is mostly per-op overhead, not arithmetic: transformers' modules
spend ~1,000 small ops per token on a 6-layer model. This path reads the same trunk tensors from the
transformers model (q/k/v fused into one matrix whose slices become the model's own weights, so
nothing is copied and both paths compute the same function), keeps the sequence's KV in a
smoe.runtime.kv.SequenceState that grows in place, precomputes the rotary tables with the model's own
rotary module, and calls the expert store once per layer. A layer of a kind the library lacks (linear
attention, a state-space or convolution mixer: the description's mixer_layers) runs through the family's own
transformers module, whose MoE block reads the same store, on a cache of the family's kind kept in the
sequence state (smoe.runtime.kv.ModuleLayers); generate --json names those layers. The generic decoder (the
transformers modules) stays the reference and runs every other family.

One-token steps run compiled (`CompiledStep`, smoe/runtime/cpu/kernels_numba.py): per layer one call for
attention (GQA with its biases, window, sinks, output gate (its rows after v or in the query projection) and
norms, or MLA absorbed over the latent rows; a layer without rotary gets tables of width 0, one without a norm
on its input (OLMo-2's) reads x itself; the softmax scale carries multipliers and query temperature)
and, where the routing is plain softmax, its top-k (any other routing kind: one call to the route kernel);
then the routed experts straight from their codes (biases and gpt-oss's clamped SwiGLU included) when the
store prepared them in the "codes" form, else the eager expert path; shared experts and dense layers compiled
too. They work on numpy views of the same weights and state, so a prefill on the eager path and steps on the
compiled one share one cache. A sliding layer's step reads only its window's positions; a branch with a norm
on its output (AFMoE's MLP) is summed apart and normalised before it joins the residual stream. Activations
stay in fp32 there (the eager path rounds them to the model's dtype before bf16 matmuls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from smoe.hf.model import new_cache, run_layer
from smoe.hf.trunk import model_trunk
from smoe.moe.activation import activate
from smoe.moe.dispatch import routed_sum
from smoe.moe.routing import route
from smoe.runtime.buckets import bucket
from smoe.runtime.cpu import kernels as kernels_cpu
from smoe.runtime.cpu import kernels_numba as kn
from smoe.runtime.kv import HoldsSequence, SequenceState, grown_capacity, sequence_state
from smoe.runtime.layers import (
    ACT,
    LayerWeights,
    MlaWeights,
    decoder_layer,
    eager_step,
    embed,
    final_logits,
    matmul,
    multipliers,
    query_temperature,
    rope_tables,
    rotary_dim,
)
from smoe.runtime.weights import layer_weights, library_gap, module_layers, norm_weight, rms_epsilon
from smoe.switches import CPU_COMPILED, PREFETCH

# At batch 1 a bf16 matmul costs ~15 us of fixed overhead here against ~3 us in fp32, while a large one
# is bandwidth-bound and cheaper in bf16: activations run in fp32, matrices up to this many weights
# are held in fp32 (an exact upcast of the bf16 source), larger ones stay in the model's dtype.
SMALL_MATRIX = 1 << 20


class FastCpuDecoder(HoldsSequence):
    """Prefill and one-token steps over a OpenedVault's trunk and expert store, through the layer library;
    the sequence's KV lives in `state` (smoe.runtime.kv), which grows in place."""

    def __init__(self, sm, max_positions: int):
        cfg = sm.config.get_text_config()
        self.sm, self.store = sm, sm.store
        self.dtype = sm.dtype
        self.eps = rms_epsilon(cfg)
        self.description = d = sm.description
        attention = d.attention
        self.heads, self.kv_heads, self.head_dim = attention.heads, attention.kv_heads, attention.head_dim
        self.routing, self.kind = d.routing, d.experts
        self.top_k = self.routing.top_k
        self.normalize = self.routing.normalise
        trunk = model_trunk(sm.model)
        self.embed = trunk["embed"]
        self.final_norm = compute_form(norm_weight(d, trunk["final_norm"]))
        self.lm_head = compute_form(trunk["lm_head"])
        # a layer of a kind the library lacks runs through the family's own module (None here)
        self.modules, by_modules = trunk["layers"], module_layers(d)
        self.layers = [None if i in by_modules else layer_weights(layer, d, i).map(compute_form)
                       for i, layer in enumerate(self.modules)]
        self.last_module = max(by_modules, default=None)
        self.rotary = trunk["rotary"]
        self.rope_dim = rotary_dim(d)
        self.interleaved = "interleaved_rotary" in d.extras
        self.state = self.own = sequence_state(d, max_positions, ACT, limit=sm.max_positions)
        self.cos, self.sin = self.tables(max_positions)
        # Off by default: it pays only when reads are slow and the guess is good (BENCHMARKS.md).
        self.prefetch = PREFETCH.on()
        self.compiled = CompiledStep(self)

    def new_state(self, positions: int) -> SequenceState:
        """An empty state for another sequence, with room for `positions` tokens."""
        return sequence_state(self.description, grown_capacity(0, positions, self.own.limit), ACT, limit=self.own.limit)

    def reserve(self, positions: int) -> None:
        """Room for `positions` tokens: the state grows in place, the rotary tables with it."""
        self.state.reserve(positions)
        if self.cos.shape[0] < self.state.capacity:
            self.cos, self.sin = self.tables(self.state.capacity)

    def tables(self, positions: int):
        """The rotary tables for `positions` (of width 0 for a model without rotary: Jamba's attention has none)."""
        if self.rotary is None:
            return (torch.zeros(positions, 0, dtype=ACT),) * 2
        return rope_tables(self.rotary, positions, self.rope_dim)

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of the new tokens, appended after the cached ones."""
        start, t = self.pos, len(ids)
        self.reserve(start + t)
        if t == 1 and self.compiled.enabled:
            return self.compiled.step(ids[0])
        x = embed(self.description, self.embed, ids)  # [T, H]
        step = eager_step(start, t, self.cos, self.sin, self.eps, self.interleaved)
        for i, w in enumerate(self.layers):
            if w is None:
                x = self.module_layer(i, x, start)
                continue
            x = decoder_layer(self.description, w, x, self.state.layers[i], step,
                              lambda h, top_i, top_w, i=i: self.experts(i, h, top_i, top_w))
        self.state.length = start + t
        return final_logits(self.description, x, self.final_norm, self.lm_head, self.eps)

    def module_layer(self, i: int, x, start: int):
        """x [T, H] after layer i as the family's own module computes it (its MoE block reads the same expert
        store), continuing the sequence's cache of the family's kind (a new one when the sequence starts)."""
        held = self.state.layers[i]
        if held.length != start:  # the sequence starts (again): the family's cache of an earlier one is dropped
            held.cache, held.length = new_cache(self.sm.model), start
        positions = torch.arange(start, start + x.shape[0])[None]
        out = run_layer(self.modules[i], x.to(self.dtype)[None], positions, held.cache)[0].to(ACT)
        if i == self.last_module:
            held.length = start + x.shape[0]
        return out

    def prefetch_next(self, i: int, h) -> None:
        """Guess layer i+1's experts from layer i's expert input through layer i+1's router (the
        residual stream changes little between layers) and start reading them."""
        if i + 1 < len(self.layers) and getattr(self.layers[i + 1], "router", None) is not None:
            following = self.layers[i + 1]
            guess, _ = route(self.routing, matmul(h, following.router), following.correction)
            self.store.prefetch(i + 1, torch.unique(guess).tolist())

    def experts(self, i: int, h, top_i, top_w):
        """Layer i's routed experts for rows h, as the store prepared them."""
        if self.prefetch:
            self.prefetch_next(i, h)
        h, top_w = h.to(self.dtype), top_w.to(self.dtype)  # the experts were prepared for the model's dtype
        if h.shape[0] == 1:  # decode: one token, k experts: stack their outputs, weight them in one matmul
            ids = top_i[0].tolist()
            prepared = self.store.get(i, ids)
            return (top_w @ torch.cat([expert_mlp(prepared[e], h, self.kind) for e in ids])).to(ACT)
        return self.experts_batched(i, h, top_i, top_w).to(ACT)

    def experts_batched(self, i: int, h, top_i, top_w):
        def fetch(group):
            prepared = self.store.get(i, group)
            return {e: (lambda rows, p=prepared[e]: expert_mlp(p, rows, self.kind)) for e in group}

        return routed_sum(h, top_i, top_w, fetch, per_group=self.sm.routed.experts_per_group())


def compute_form(w: torch.Tensor) -> torch.Tensor:
    """The weight as the fast decoder multiplies it: small matrices and vectors in fp32, large as stored."""
    return w.to(ACT) if w.dim() == 1 or w.numel() <= SMALL_MATRIX else w


def expert_mlp(expert, x, kind):
    """One expert on rows x, with the activation of the description's experts (`kind`)."""
    gate, up = kernels_cpu.gate_and_up(x, expert)
    return kernels_cpu.linear(activate(kind, gate, up), expert, "down")


def as_numpy(w: torch.Tensor) -> np.ndarray:
    """A numpy view sharing w's memory: fp32 as is, bf16 as its uint16 bit patterns (what the kernels
    widen); any other dtype becomes an fp32 copy."""
    w = w.detach()
    if w.dtype == torch.bfloat16:
        return w.contiguous().view(torch.int16).numpy().view(np.uint16)
    if w.dtype != torch.float32:
        w = w.float()
    return w.contiguous().numpy()


@dataclass
class CompiledLayer:
    input_norm: np.ndarray
    attention: tuple  # the attention kernel's weight arrays, in its argument order
    post_norm: np.ndarray
    router: np.ndarray  # [0, H] for a dense layer
    router_bias: np.ndarray  # fp32 [E] (length 0: none)
    correction: torch.Tensor | None
    correction_scores: np.ndarray  # the correction bias as the route kernel reads it (fp32; length 0: none)
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    shared_gate: np.ndarray  # fp32 [hidden], the shared experts' output gate (length 0: none)
    dense: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    attention_scale: float = 0.0  # MLA's softmax scale
    window: int = 0  # a sliding GQA layer's window (0: none)
    rotary: bool = True  # False: a layer without rotary (the kernels get tables of width 0)
    attention_out_norm: np.ndarray | None = None  # the norm on the attention's output (length 0: none)
    mlp_out_norm: np.ndarray | None = None  # the norm on the MLP's or MoE block's output (None: none)
    query_gate: bool = False  # the output gate's rows follow each head's query rows (Qwen3-Next)
    state: tuple = ()  # views of the sequence state's tensors: (k, v) or (latent rows,)


class CompiledStep:
    """One-token decode steps of a FastCpuDecoder through the compiled kernels: a layer's attention in one
    call (GQA, with the softmax top-k fused in where the routing is that plain; or MLA, absorbed, over the
    latent rows), the router's choice by kernels_numba.route otherwise, the routed experts straight from their
    codes, the shared experts and dense layers compiled. Every array is extracted once and every buffer
    preallocated: per layer, Python asks the store for the routed experts and passes arrays on."""

    def __init__(self, dec: FastCpuDecoder):
        self.dec = dec
        d = dec.description
        self.codes = CodesExperts(dec.top_k, dec.kind.clamp)
        # Matrices other than fp32 / bf16 (fp16 models) are held as fp32 copies; the eager path stays
        # the default there rather than doubling their memory. SMOE_CPU_COMPILED=0 turns the step off
        # (the eager path, for comparison).
        self.enabled = (library_gap(d, mixers_by_modules=True) is None and dec.dtype in (torch.float32, torch.bfloat16)
                        and CPU_COMPILED.on())
        if not self.enabled:
            return
        self.mla = d.attention.kind == "mla"
        self.norm_after_rotary = d.attention.qk_norm == "head_after_rotary"
        self.multipliers = multipliers(d)
        self.softmax_scale = self.multipliers.attention or 1.0 / math.sqrt(d.attention.head_dim)
        r = d.routing
        # the GQA kernel's own top-k computes softmax routing without bias, groups or scale
        self.fused_top_k = not self.mla and (r.scoring, r.correction_bias, r.n_group, r.scale, r.normalise_eps) == (
            "softmax", False, 1, 1.0, 0.0)
        hidden = dec.embed.shape[1]
        # None: a layer the family's own module runs (FastCpuDecoder.module_layer)
        self.layers = [compiled_layer(w, hidden) if w is not None else None for w in dec.layers]
        self.own_layers = [layer for layer in self.layers if layer is not None]
        self.embed, self.final_norm, self.lm_head = as_numpy(dec.embed), as_numpy(dec.final_norm), as_numpy(dec.lm_head)
        matrices = [m for layer in self.own_layers for m in (*layer.attention, *(layer.dense or ()), *(layer.shared or ()))
                    if isinstance(m, np.ndarray) and m.ndim >= 2]
        self.wide = np.zeros(max([hidden, *(m.shape[-1] for m in matrices)]), dtype=np.uint32)
        self.x = np.zeros(hidden, dtype=np.float32)
        self.h = np.zeros(hidden, dtype=np.float32)
        self.branch = np.zeros(hidden, dtype=np.float32)
        self.logits = np.zeros(self.lm_head.shape[0], dtype=np.float32)
        self.router_logits = np.zeros(r.num_experts or 1, dtype=np.float32)
        self.no_router = np.zeros((0, hidden), dtype=np.float32)
        self.ungated = np.zeros(0, dtype=np.float32)
        self.top_i = np.zeros(dec.top_k, dtype=np.int64)
        self.route_work = np.zeros(kn.route_work_size(r.num_experts or 1, r.n_group), dtype=np.float32)
        # (state, its generation) the state views and work buffer were made for: the state itself, not its id(),
        # which a later state may reuse once this one is freed (the kernels would then write through stale views)
        self.bound = None

    def bind(self) -> None:
        """Views of the current sequence state's tensors, and a work buffer for its capacity."""
        dec, state = self.dec, self.dec.state
        if self.bound is not None and self.bound[0] is state and self.bound[1] == state.generation:
            return
        for layer, held in zip(self.layers, state.layers):
            if layer is None:
                continue
            layer.state = (held.rows.numpy(),) if self.mla else (held.k.numpy(), held.v.numpy())
        self.cos, self.sin = dec.cos.contiguous().numpy(), dec.sin.contiguous().numpy()
        self.no_cos, self.no_sin = self.cos[:, :0], self.sin[:, :0]  # a layer without rotary rotates nothing
        mlps = [2 * m[0].shape[0] + self.x.shape[0] for layer in self.own_layers for m in (layer.dense, layer.shared) if m]
        self.work = np.zeros(max([self.attention_work(state.capacity), *mlps]), dtype=np.float32)
        self.bound = (state, state.generation)

    def attention_work(self, positions: int) -> int:
        a, hidden = self.dec.description.attention, self.x.shape[0]
        if self.mla:
            q_a, _, _, _, _, k_up, v_up, _ = self.own_layers[0].attention
            return kn.mla_work_size(a.heads, k_up.shape[1], a.rope_key_dim, v_up.shape[1], q_a.shape[0], a.latent_dim,
                                    positions, hidden)
        rows = max(layer.attention[0].shape[0] for layer in self.own_layers)
        routers = max(layer.router.shape[0] for layer in self.own_layers)
        return kn.attention_work_size(rows, a.head_dim, positions, routers, hidden)

    def step(self, token: int) -> torch.Tensor:
        """Logits [1, V] of one token appended after the cached ones."""
        self.bind()
        dec, pos, m = self.dec, self.dec.pos, self.multipliers
        kn.load_row(self.embed, token, self.x)
        if m.embedding != 1:
            self.x *= np.float32(m.embedding)
        temperature = self.temperature(pos)
        for i, layer in enumerate(self.layers):
            if layer is None:
                self.x[:] = dec.module_layer(i, torch.from_numpy(self.x)[None], pos)[0].numpy()
                continue
            self.attention(layer, pos, temperature)
            if layer.mlp_out_norm is None:
                self.mlp(i, layer, self.x, m.residual)
                continue
            self.branch[:] = 0  # the branch apart, to be normalised before it joins x
            self.mlp(i, layer, self.branch, 1.0)
            kn.rms_norm(self.branch, layer.mlp_out_norm, dec.eps, self.branch)
            self.x += np.float32(m.residual) * self.branch
        dec.state.length = pos + 1
        kn.final_logits(self.x, self.final_norm, dec.eps, self.lm_head, self.h, self.logits, self.wide)
        logits = torch.from_numpy(self.logits.copy())[None]
        return logits if m.logits == 1 else logits / m.logits

    def mlp(self, i: int, layer: CompiledLayer, out: np.ndarray, residual: float) -> None:
        """out += residual times layer i's dense MLP or MoE block (routed and shared experts) on h."""
        if layer.dense is not None:
            kn.dense_mlp(out, self.h, *layer.dense, self.ungated, residual, self.work, self.wide)
            return
        if not self.fused_top_k:
            self.route(layer)
        if residual != 1:  # the routed experts' share scaled through their weights
            self.codes.top_w *= np.float32(residual)
        self.experts(i, out)
        if layer.shared is not None:
            kn.dense_mlp(out, self.h, *layer.shared, layer.shared_gate, residual, self.work, self.wide)

    def temperature(self, pos: int) -> float:
        """The queries' scale at pos (layers.query_temperature: Mistral 4's), 1 where the description has none."""
        scale = query_temperature(self.dec.description, torch.tensor([pos]))
        return 1.0 if scale is None else float(scale[0])

    def attention(self, layer: CompiledLayer, pos: int, temperature: float) -> None:
        """x += the layer's attention; h = the experts' input (and the top-k, when fused). A query scaled by
        `temperature` scales its scores, so the softmax scale carries it."""
        dec = self.dec
        cos, sin = (self.cos, self.sin) if layer.rotary else (self.no_cos, self.no_sin)
        if self.mla:
            kn.mla_attention(self.x, pos, dec.heads, dec.eps, dec.description.attention.latent_norm_eps,
                             layer.input_norm, *layer.attention, layer.post_norm,
                             *layer.state, cos, sin, layer.attention_scale * temperature, dec.interleaved,
                             self.h, self.work, self.wide)
            return
        router = layer.router if self.fused_top_k else self.no_router
        kn.attention_and_route(self.x, pos, dec.heads, dec.eps, layer.input_norm, *layer.attention, layer.window,
                               layer.attention_out_norm, layer.post_norm, router, layer.router_bias, *layer.state, cos,
                               sin, dec.interleaved, self.norm_after_rotary, layer.query_gate,
                               self.softmax_scale * temperature,
                               self.multipliers.residual, dec.top_k, dec.normalize, self.h, self.top_i, self.codes.top_w,
                               self.work, self.wide)

    def route(self, layer: CompiledLayer) -> None:
        """The router's logits and choice compiled (kernels_numba.route: smoe.moe.route's every kind)."""
        logits = self.router_logits[: layer.router.shape[0]]
        kn.matvec(layer.router, self.h, logits, self.wide)
        kn.add_bias(logits, layer.router_bias)
        r = self.dec.routing
        kn.route(logits, layer.correction_scores, r.scoring == "sigmoid", r.choice_by_logits, r.n_group, r.topk_group,
                 r.group_score == "top2", r.top_k, r.normalise, r.normalise_eps, r.scale, self.top_i,
                 self.codes.top_w, self.route_work)

    def experts(self, i: int, out: np.ndarray) -> None:
        """out += layer i's routed experts on h, weighted."""
        dec = self.dec
        ids = self.top_i.tolist()
        if dec.prefetch:
            dec.prefetch_next(i, torch.from_numpy(self.h)[None])
        prepared = dec.store.get(i, ids)
        chosen = [prepared[e] for e in ids]
        if not self.codes.run(out, self.h, chosen):
            self.eager_experts(chosen, out)

    def eager_experts(self, chosen: list, out: np.ndarray) -> None:
        """Experts in another form (dequant, int4, or a tensor the codes kernels cannot read)."""
        h = torch.from_numpy(self.h)[None].to(self.dec.dtype)
        weights = self.codes.top_w
        y = sum(float(w) * expert_mlp(p, h, self.dec.kind).float() for w, p in zip(weights, chosen))
        out += y[0].numpy()


def compiled_layer(w: LayerWeights, hidden: int) -> CompiledLayer:
    """A layer's trunk tensors as the kernels read them (numpy views; bf16 as uint16)."""
    empty, nothing = np.zeros(0, dtype=np.float32), np.zeros((0, hidden), dtype=np.float32)
    vector = lambda t: t.float().reshape(-1).contiguous().numpy() if t is not None else empty  # fp32, 0: none
    a = w.attention
    if isinstance(a, MlaWeights):
        kv_b = as_numpy(a.kv_b)
        q_a = as_numpy(a.q_a) if a.q_a is not None else nothing
        attention = (q_a, as_numpy(a.q_a_norm) if a.q_a is not None else empty, as_numpy(a.q if a.q is not None else a.q_b),
                     as_numpy(a.kv_a), as_numpy(a.kv_a_norm), kv_b[:, : a.nope], kv_b[:, a.nope :], as_numpy(a.o))
    else:
        attention = (as_numpy(a.qkv), vector(a.qkv_bias), as_numpy(a.q_norm) if a.q_norm is not None else empty,
                     as_numpy(a.k_norm) if a.k_norm is not None else empty, as_numpy(a.o), vector(a.o_bias),
                     vector(a.sinks))
    return CompiledLayer(
        vector(w.input_norm), attention, vector(w.post_norm),
        as_numpy(w.router) if w.router is not None else nothing, vector(w.router_bias), w.correction,
        vector(w.correction), tuple(map(as_numpy, w.shared)) if w.shared is not None else None,
        vector(w.shared_gate), tuple(map(as_numpy, w.dense)) if w.dense is not None else None,
        a.scale if isinstance(a, MlaWeights) else 0.0, 0 if isinstance(a, MlaWeights) else a.window or 0,
        a.rotary, vector(w.attention_out_norm),
        as_numpy(w.mlp_out_norm) if w.mlp_out_norm is not None else None,
        not isinstance(a, MlaWeights) and a.query_gate,
    )


class CodesExperts:
    """One token's routed experts straight from their codes (kernels_numba.experts): x += sum_k w_k e_k(h),
    with their biases and, for gpt-oss, the clamped SwiGLU (`clamp`: the description's (alpha, limit)).
    The weights go in `top_w`, padded to a bucket of slots so one compiled specialisation serves."""

    def __init__(self, top_k: int, clamp: tuple[float, float] | None = None):
        self.slots = bucket(top_k)  # experts per call, padded: one compiled specialisation
        self.top_w = np.zeros(self.slots, dtype=np.float32)  # padding slots keep weight 0
        self.clamp = tuple(np.float32(v) for v in clamp or (0.0, 0.0))  # limit 0: SiLU
        self.work: dict[int, np.ndarray] = {}  # expert width -> scratch

    def run(self, x: np.ndarray, h: np.ndarray, chosen: list) -> bool:
        """Add the chosen experts' weighted outputs on h [hidden] to x; False (nothing done) when one of
        them is not in a form the kernel reads."""
        if not all(from_codes(p) for p in chosen):
            return False
        pad = [chosen[0]] * (self.slots - len(chosen))  # never read: the kernel stops at len(chosen)
        w = [p.weights for p in chosen + pad]
        inter = w[0]["gate"].shape[0]
        work = self.work.get(inter)
        if work is None:
            work = self.work[inter] = np.zeros(kn.experts_work_size(x.shape[0], inter), dtype=np.float32)
        kn.experts(x, h, len(chosen), self.top_w,
                   tuple(e["gate"].codes for e in w), tuple(e["gate"].steps for e in w),
                   tuple(e["up"].codes for e in w), tuple(e["up"].steps for e in w),
                   tuple(e["down"].codes for e in w), tuple(e["down"].steps for e in w),
                   tuple((e["gate"].bias, e["up"].bias, e["down"].bias) for e in w), self.clamp,
                   (w[0]["gate"].lead, w[0]["down"].lead), inter, work)
        return True


def from_codes(expert) -> bool:
    """Whether the compiled expert kernel can run this prepared expert."""
    return expert.path == "codes" and not expert.fallbacks and expert.roles == ("gate", "up", "down")
