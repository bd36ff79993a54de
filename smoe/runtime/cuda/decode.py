"""The decode path on an NVIDIA GPU: trunk resident on the GPU, routed experts in the GPU expert cache,
computed by the Triton kernels straight from their blobs (the descriptions fast_decoder_gap admits for
"cuda"). A GQA layer runs this module's attention_block, an MLA layer the layer library's MLA attention on a
static step (mla_block: absorbed; a prompt from the sequence's start expanded); both are compiled by inductor and
captured in the graphs, and both end at the router's logits, which smoe.runtime.cuda.routing turns into the top-k in one kernel.

One token is cut into segments at the points where the host must learn the routing:

    segment i = experts of layer i-1 (+ residual) -> attention of layer i -> router i -> top-k

Each segment works on static buffers (token id, position, residual, expert input, top-k ids and
weights, blob offsets), so it is captured once as a CUDA graph and replayed: one launch per segment
instead of ~30 small kernels. Between segments the host reads layer i's top-k ids (the one sync per
layer that streaming needs: the experts to read depend on them), lets the cache bring misses in
(copies on a side stream the compute stream waits for) and writes the blob offsets. When the cache
holds every expert of the model, offsets come from a device table inside the graph and the whole
token is one graph with no sync but the final read of the logits. So it is when pinned host RAM holds
every expert (a host tier of them all): a missed expert is read in place by the kernels, and the experts
routed most often are moved into the GPU slots between tokens (smoe.runtime.cuda.placement).

Several tokens at once (prompt prefill, teacher-forced evaluation) run layer by layer with the grouped
kernel; a layer whose experts do not fit the cache together is done in expert groups. With every expert
resident nothing in a prompt's layers waits for the host (offsets from the device table), so a prompt that
starts a sequence runs as a CUDA graph too: padded to the next of PROMPT_LENGTHS (the padding comes after
the prompt, so causal attention keeps it out of the prompt's positions, and the KV entries it leaves lie
past the sequence's end, where later tokens overwrite them), captured on the first prompt of that length and
replayed after. A prompt's ~30 eager ops a layer otherwise cost the host more than the GPU spends on them.
Other prompts (a continued sequence, experts streamed, past the longest length) run eagerly.

A layer of a kind the layer library lacks (linear attention, a state-space or convolution mixer: the
description's mixer_layers, as on the fast CPU decoder) runs through the family's own transformers module,
moved to the device, on a cache of the family's kind kept in the sequence state (smoe.runtime.kv.ModuleLayers,
renewed when a sequence starts again); the experts of its MoE block come from the same GPU expert cache
(ModuleExperts). Such a layer cannot be captured: transformers' cache objects are made, replaced and grown
from the host, and its MoE block asks the cache for experts on the host. So a one-token step ends a segment
before each such layer, which runs eagerly between the captured segments, reading and writing the static
residual; segment i+1 then starts from that residual (no MLP branch of layer i to add: the module added its
own). With every expert resident the whole-token graph is cut the same way: one graph per stretch of
segments between such layers.

On a CPU "device" (tests without a GPU) everything runs eagerly and the experts run through
kernels_triton.experts_forward's reference path or, under TRITON_INTERPRET=1, the Triton kernels.
"""

from __future__ import annotations

import functools
from dataclasses import fields, replace

import torch
import torch.nn.functional as F

from smoe.errors import SmoeError
from smoe.hf.experts import attach_routed, empty_parameters, is_experts_module
from smoe.hf.model import new_cache, run_layer
from smoe.hf.trunk import model_trunk
from smoe.moe.dispatch import expert_groups
from smoe.runtime.cuda import gemv
from smoe.runtime.cuda import kernels as kernels_triton
from smoe.runtime.cuda.attention import covers, decode_attention
from smoe.runtime.cuda.cache import GpuExpertCache
from smoe.runtime.cuda.placement import Placement
from smoe.runtime.cuda.routing import fused_route
from smoe.runtime.kv import HoldsSequence, Latents, SequenceState, grown_capacity, sequence_state
from smoe.runtime.layers import (
    MlaWeights,
    attend_within,
    dense_mlp,
    eager_step,
    mapped,
    mla_attention,
    multipliers,
    query_temperature,
    rms_norm,
    rope_tables,
    rotary_dim,
    rotate,
    scaled,
    shared_mlp,
    static_step,
)
from smoe.runtime.weights import layer_weights, module_layers, rms_epsilon
from smoe.switches import GPU_ATTENTION_KERNEL, GPU_IN_PLACE, GPU_INDUCTOR, GPU_PROMPT_GRAPHS

ACT = torch.float32  # the residual stream; matrices run in the model's dtype
# the lengths a prompt is padded to and captured at (at most a third of a prompt's work is padding)
PROMPT_LENGTHS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


class GpuLayer:
    """One decoder layer's trunk weights (smoe.runtime.layers.LayerWeights) on the device: matrices in the
    model's dtype, vectors (norms, correction bias) in fp32 like the residual stream they apply to."""

    def __init__(self, layer, index: int, description, device, dtype):
        def put(t, as_dtype=None):
            return t.detach().to(device=device, dtype=as_dtype or (ACT if t.dim() == 1 else dtype)).contiguous()

        w = layer_weights(layer, description, index)
        attn = w.attention
        self.input_norm, self.post_norm = put(w.input_norm), put(w.post_norm)
        self.mla = isinstance(attn, MlaWeights)
        if self.mla:
            self.attention = mapped(attn, put)
        else:
            self.qkv, self.o = put(attn.qkv), put(attn.o)
            self.qkv_bias = put(attn.qkv_bias, dtype) if attn.qkv_bias is not None else None
            self.o_bias = put(attn.o_bias, dtype) if attn.o_bias is not None else None
            self.sinks, self.window = (put(attn.sinks) if attn.sinks is not None else None), attn.window
            self.rotary, self.gated = attn.rotary, attn.gated
            self.qk_norm = self.q_norm_full = self.k_norm_full = None
            if description.attention.qk_norm == "full":  # over all heads: q and k each normalised whole
                self.q_norm_full, self.k_norm_full = put(attn.q_norm, dtype), put(attn.k_norm, dtype)
            elif attn.q_norm is not None:  # [heads + kv_heads, head_dim]: q and k heads normalised by one kernel
                a = description.attention
                self.qk_norm = torch.cat([put(attn.q_norm, dtype).expand(a.heads, -1),
                                          put(attn.k_norm, dtype).expand(a.kv_heads, -1)])
        # a one-token step's attention fits the decode-attention kernel (smoe.runtime.cuda.attention)
        self.kernel_attends = not self.mla and covers(description, self) is None
        self.attention_out_norm = put(w.attention_out_norm) if w.attention_out_norm is not None else None
        self.mlp_out_norm = put(w.mlp_out_norm) if w.mlp_out_norm is not None else None
        self.moe = w.router is not None
        self.router = put(w.router) if self.moe else None
        self.router_bias = put(w.router_bias, dtype) if w.router_bias is not None else None
        self.correction = put(w.correction) if w.correction is not None else None
        self.shared = tuple(put(p) for p in w.shared) if w.shared is not None else None
        self.shared_gate = put(w.shared_gate) if w.shared_gate is not None else None
        self.dense = None if self.moe else tuple(put(p) for p in w.dense)


class GpuDecoder(HoldsSequence):
    """forward(ids) -> logits [T, V] (fp32) of the new tokens, continuing the cached sequence."""

    def __init__(self, sm, device: torch.device, gpu_cache_bytes: int, max_positions: int, host_cache_bytes: int = 0,
                 threads: int = 16, direct_io: bool = False, kernel_path: str = "auto", graphs: bool = True,
                 in_place: bool | None = None, prompt_graphs: bool | None = None):
        cfg = sm.config.get_text_config()
        self.vault, self.device, self.dtype = sm.vault, torch.device(device), sm.dtype
        self.description = sm.description
        self.routing = sm.description.routing
        self.eps, self.top_k = rms_epsilon(cfg), self.routing.top_k
        self.kernel_path = kernel_path
        try:
            self.load(sm, gpu_cache_bytes, max_positions, host_cache_bytes, threads, direct_io)
        except torch.OutOfMemoryError:
            raise SmoeError(f"out of GPU memory placing the trunk, a GPU expert cache of {gpu_cache_bytes / 1e9:.3g} GB "
                            f"and a KV cache of {max_positions} positions; use a smaller --gpu-cache-gb") from None
        self.static = StaticBuffers(self, cfg.hidden_size)
        # graphs need every layer on the Triton kernels: the decode-then-matmul fallback syncs
        self.graphs = graphs and self.device.type == "cuda" and kernel_path != "reference" and all(
            layout.unsupported() is None for layout in self.layouts.values())
        # inductor fuses a single-token step's small kernels (SMOE_GPU_INDUCTOR=0: eager, as on the CPU)
        compile_ok = self.graphs and GPU_INDUCTOR.on()
        self.blocks = {kind: compiled_block(kind) if compile_ok else EAGER_BLOCKS[kind] for kind in EAGER_BLOCKS}
        # a one-token step's attention in the decode-attention kernel, where it covers the layer
        self.attention_kernel = ((self.device.type == "cuda" or kernels_triton.INTERPRETED) and kernel_path != "reference"
                                 and kernels_triton.triton is not None and GPU_ATTENTION_KERNEL.on())
        if self.attention_kernel:
            self.blocks["gqa_step"] = AttentionStep(compile_ok)
        self.eager_kinds = set() if compile_ok else set(EAGER_BLOCKS)  # what a compiler failure leaves eager
        self.segments: list | None = None  # captured CUDA graphs, one per segment
        self.whole_token = None  # one graph for the whole token when every expert is resident
        self.table = None  # [layers, experts] blob offsets in the pool (whole-token mode)
        # misses read in place from pinned host RAM when it holds every expert (smoe.runtime.cuda.placement)
        self.in_place = GPU_IN_PLACE.on() if in_place is None else in_place
        self.placement: Placement | None = None
        # prompts that start a sequence with every expert resident, padded and captured (PROMPT_LENGTHS)
        self.prompt_graphs = GPU_PROMPT_GRAPHS.on() if prompt_graphs is None else prompt_graphs
        self.prompts: dict[int, PromptGraph] = {}  # by padded length
        self.prompt_pool = torch.cuda.graph_pool_handle() if self.graphs else None  # one pool: run one at a time

    def load(self, sm, gpu_cache_bytes, max_positions, host_cache_bytes, threads, direct_io) -> None:
        """Trunk, expert cache and KV cache onto the device."""
        trunk = model_trunk(sm.model)
        put = lambda t: t.detach().to(device=self.device, dtype=self.dtype).contiguous()
        self.embed, self.lm_head = put(trunk["embed"]), put(trunk["lm_head"])
        self.final_norm = trunk["final_norm"].detach().to(device=self.device, dtype=ACT)
        # a layer of a kind the library lacks runs through the family's own module (None here, in self.modules)
        by_modules = set(module_layers(self.description))
        self.layers = [None if i in by_modules else GpuLayer(layer, i, self.description, self.device, self.dtype)
                       for i, layer in enumerate(trunk["layers"])]
        self.model, self.module_experts = sm.model, ModuleExperts(self)
        self.modules = {i: self.module_on_device(trunk["layers"][i]) for i in sorted(by_modules)}
        self.experts_in = {i: [m for m in layer.modules() if is_experts_module(m)] for i, layer in self.modules.items()}
        self.last_module = max(by_modules, default=None)
        # the blobs' layout, with the experts' activation the kernels compute (gpt-oss's clamped SwiGLU)
        clamp = self.description.experts.clamp
        moe = set(self.vault.meta["moe_layers"])
        self.layouts = {i: replace(layer_layout(self.vault, i), clamp=clamp) for i, w in enumerate(self.layers)
                        if (w.moe if w is not None else i in moe)}
        self.cache = GpuExpertCache(self.vault, gpu_cache_bytes, self.device, self.top_k, host_cache_bytes,
                                    threads=threads, direct_io=direct_io)
        self.rotary = trunk["rotary"]
        self.state = self.own = sequence_state(self.description, max_positions, self.dtype, self.device,
                                               limit=sm.max_positions)
        self.rope_for_capacity()

    def module_on_device(self, layer):
        """A decoder layer the family's own module runs, on the device (the parameters of its experts modules,
        placeholders, emptied so that the layer moves; module_layer points those modules at the GPU cache)."""
        for module in layer.modules():
            if is_experts_module(module):
                empty_parameters(module)
        return layer.to(self.device)

    def rope_for_capacity(self) -> None:
        """Rotary tables and the position index for the state's capacity (of width 0 for a model without
        rotary: Jamba's attention has none)."""
        if self.rotary is None:
            cos = sin = torch.zeros(self.state.capacity, 0)
        else:
            cos, sin = rope_tables(self.rotary, self.state.capacity, rotary_dim(self.description))
        self.cos, self.sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)
        self.positions = torch.arange(self.state.capacity, device=self.device)

    def new_state(self, positions: int) -> SequenceState:
        """An empty state for another sequence, with room for `positions` tokens."""
        try:
            return sequence_state(self.description, grown_capacity(0, positions, self.own.limit), self.dtype,
                                  self.device, limit=self.own.limit)
        except torch.OutOfMemoryError:
            raise SmoeError(f"out of GPU memory for the KV cache of another sequence ({positions} positions)") from None

    def use(self, state: SequenceState | None) -> None:
        """Run `state` from now on: graphs captured over another state's tensors are dropped (a state reused
        for the next sequence keeps them)."""
        before = self.state
        super().use(state)
        if self.state is not before:
            self.drop_graphs()
        if self.positions.shape[0] != self.state.capacity:  # the attention masks span the state's positions
            self.rope_for_capacity()

    def reserve(self, positions: int) -> None:
        """Room for `positions` tokens: the sequence state grows in place (the trunk and the expert cache stay);
        the captured graphs read the old tensors, so they are dropped and captured again on the next step."""
        if positions <= self.state.capacity:
            return
        try:
            self.state.reserve(positions)
        except torch.OutOfMemoryError:
            raise SmoeError(f"out of GPU memory growing the KV cache to {positions} positions") from None
        self.rope_for_capacity()
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they read the state's tensors as they were): captured again when next run."""
        self.segments = self.whole_token = None
        self.prompts = {}

    # --- many tokens: the grouped kernel, eager or a captured prompt -------------------------------

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> torch.Tensor:
        start, t = self.pos, len(ids)
        self.reserve(start + t)
        if t == 1:
            return self.step(ids[0])
        if self.placement is not None:  # the prompt's experts go through the cache's own slots
            self.placement.account()  # under the residency the steps before it ran with
            self.placement.settle()
        elif self.table is None and self.cache.n_slots >= len(self.vault.entries):
            self.preload()  # every expert resident from the first prompt on: its offsets from the table
        length = self.prompt_length(start, t)
        if length is None:
            x = self.prompt_layers(torch.tensor(ids, device=self.device), start)
        else:
            x = self.prompt_captured(ids, length)
        self.state.length = start + t
        if self.placement is not None:
            self.placement.rebuild()
        return self.logits(x)

    def prompt_layers(self, ids, start: int):
        """The residual [T, hidden] (fp32) after every layer, for tokens `ids` (a device tensor) after `start`."""
        t = ids.shape[0]
        x = self.embedded(ids)
        pos = torch.arange(start, start + t, device=self.device)
        for i, w in enumerate(self.layers):
            if w is None:
                x = self.module_layer(i, x, start)
                continue
            x, h, logits = EAGER_BLOCKS["mla" if w.mla else "gqa"](x, None, pos, end=start + t, **self.block_args(i))
            x = x + self.mlp(i, h, *self.route(i, logits))
        return x

    def prompt_length(self, start: int, t: int) -> int | None:
        """The length a prompt of t tokens after `start` runs padded to (PROMPT_LENGTHS), or None: it runs as it is.
        Padded where it starts a sequence, every expert is resident (no host wait in its layers) and no layer runs
        through the family's modules; captured where graphs run (on a CPU device, the tests', padded only)."""
        if not self.prompt_graphs or start != 0 or self.modules or self.table is None or self.placement is not None:
            return None
        if not (self.graphs or self.device.type == "cpu"):
            return None
        length = next((n for n in PROMPT_LENGTHS if n >= t), None)
        return length if length is not None and length <= self.state.capacity else None

    def prompt_captured(self, ids: list[int], length: int):
        """The prompt's residual after every layer, [T, hidden]: the prompt padded to `length` through that length's
        graph, captured after the first such prompt has run eagerly (compiling and warming up). The LM head runs
        after, on the prompt's own rows only. The padding's routed experts are not counted as the cache's hits."""
        padded = torch.tensor(ids + [0] * (length - len(ids)), device=self.device)
        hits = self.cache.stats.hits
        run = self.prompts.get(length)
        if run is None:
            run = self.prompts[length] = PromptGraph(padded, self.prompt_layers(padded, 0))
            if self.graphs:
                run.capture(lambda: run.x.copy_(self.prompt_layers(run.ids, 0)), self.device, self.prompt_pool)
        else:
            run.ids.copy_(padded)
            if run.graph is not None:
                run.graph.replay()
            else:  # its capture failed: eagerly
                run.x.copy_(self.prompt_layers(run.ids, 0))
        self.cache.stats.hits = hits + len(ids) * self.top_k * len(self.layouts)
        return run.x[: len(ids)]

    def module_layer(self, i: int, x, start: int):
        """x [T, H] (fp32) after layer i as the family's own module computes it (its experts from the GPU expert
        cache), continuing the sequence's cache of the family's kind (a new one when the sequence starts)."""
        held = self.state.layers[i]
        if held.length != start:  # the sequence starts (again): the family's cache of an earlier one is dropped
            held.cache, held.length = new_cache(self.model), start
        for module in self.experts_in[i]:  # its experts from this decoder's cache (another may share the model)
            attach_routed(module, i, self.module_experts)
        t = x.shape[0]
        out = run_layer(self.modules[i], x.to(self.dtype)[None], self.positions[start: start + t][None], held.cache)
        if i == self.last_module:
            held.length = start + t
        return out[0].to(ACT)

    def mlp(self, i: int, h, top_i, top_w, one=None):
        """Layer i's MLP branch as it joins the residual stream: its routed experts (one token: from the segment's
        offsets `one`, or the layer's offset table `one` at the expert ids top_i) plus its shared experts, or its
        dense MLP; then the norm on its output and the residual multiplier where the model has them (branch)."""
        w = self.layers[i]
        if not w.moe:
            out = dense_mlp(w.dense, h)
        else:
            out = self.experts_one(i, h, top_w, one, top_i) if one is not None else self.experts_chunked(i, h, top_i,
                                                                                                           top_w)
            out = out if w.shared is None else out + shared_mlp(w.shared, w.shared_gate, h)
        return branch(out, w.mlp_out_norm, multipliers(self.description).residual, self.eps)

    def experts_chunked(self, i: int, h, top_i, top_w):
        """The layer's experts for every token: with every expert resident, from the device offset table without a
        host wait; else in groups of experts that fit the cache's slots together (experts_by_groups)."""
        if self.table is not None and self.placement is None:
            return self.experts_resident(i, h, top_i, top_w)
        return self.experts_by_groups(i, h, top_i, top_w)

    def experts_resident(self, i: int, h, top_i, top_w):
        """Every (token, slot) pair's blob offset looked up in the offset table on the device; the grouped kernel
        told the layer's expert count as its run count (an upper bound: it sizes the padded pair list), so nothing
        waits for the routing: the host runs ahead launching the next layers."""
        self.cache.stats.hits += top_i.numel()
        runs = min(self.table.shape[1], top_i.numel())
        return kernels_triton.experts_forward(self.cache.pool, self.layouts[i], h, self.table[i][top_i], top_w,
                                              path=self.kernel_path, distinct=runs)

    def experts_by_groups(self, i: int, h, top_i, top_w):
        """The layer's experts for every token, in groups of experts that fit the cache's slots together
        (smoe.moe.dispatch.expert_groups): each expert is read once, and each group runs its
        (token, slot) pairs as rows of one expert each. One host sync: the distinct experts."""
        groups = expert_groups(torch.unique(top_i).tolist(), self.cache.n_slots)
        if len(groups) == 1:
            return self.run_experts(i, h, top_i, top_w, groups[0])
        out = torch.zeros(h.shape, dtype=ACT, device=h.device)  # a token's k experts summed in fp32, as one call does
        for group in groups:
            tokens, slots = torch.where(torch.isin(top_i, torch.tensor(group, device=top_i.device)))
            pairs = self.run_experts(i, h[tokens], top_i[tokens, slots, None], top_w[tokens, slots, None], group)
            out.index_add_(0, tokens, pairs.to(ACT))
        return out

    def run_experts(self, i: int, h, top_i, top_w, experts: list[int]):
        """The (token, slot) pairs' experts (`experts`: the distinct ones, ascending): the cache asked once per
        expert, each pair's blob offset looked up on the device through a table uploaded without a host wait
        (a prompt of T tokens has T * k pairs and a few hundred distinct experts)."""
        table = torch.zeros(experts[-1] + 1, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        table[experts] = torch.tensor(self.cache.offsets(i, experts), dtype=torch.int64)
        offs = table.to(self.device, non_blocking=True)[top_i]
        return kernels_triton.experts_forward(self.cache.pool, self.layouts[i], h, offs, top_w, path=self.kernel_path,
                                              distinct=len(experts))

    # --- the pieces of a layer -------------------------------------------------------------------

    def block_args(self, i: int) -> dict:
        """Everything layer i's block needs but the residual and the positions."""
        w, held = self.layers[i], self.state.layers[i]
        shared = dict(positions=self.positions, cos=self.cos, sin=self.sin, input_norm=w.input_norm,
                      post_norm=w.post_norm, router=w.router, router_bias=w.router_bias, description=self.description,
                      eps=self.eps, dtype=self.dtype)
        if w.mla:
            weights = {f.name: getattr(w.attention, f.name) for f in fields(w.attention)}
            return shared | weights | dict(rows=held.rows, latent_dim=held.latent_dim)
        return shared | dict(k_cache=held.k[None], v_cache=held.v[None], qkv=w.qkv, qkv_bias=w.qkv_bias,
                             qk_norm=w.qk_norm, q_norm_full=w.q_norm_full, k_norm_full=w.k_norm_full, o=w.o,
                             o_bias=w.o_bias, sinks=w.sinks, window=w.window, rotary=w.rotary, gated=w.gated,
                             attention_out_norm=w.attention_out_norm)

    def embedded(self, ids):
        """The tokens' embeddings [T, hidden] (fp32), times the embedding multiplier (layers.embed's)."""
        return scaled(self.embed[ids].to(ACT), multipliers(self.description).embedding)

    def logits(self, x):
        """Logits [T, V] (fp32), divided by the logits multiplier (layers.final_logits')."""
        logits = gemv.linear(F.rms_norm(x, x.shape[-1:], self.final_norm, self.eps).to(self.dtype), self.lm_head).float()
        divisor = multipliers(self.description).logits
        return logits if divisor == 1 else logits / divisor

    # --- one token: segments on static buffers ---------------------------------------------------

    def step(self, token: int) -> torch.Tensor:
        s = self.static
        s.set_token(token, self.pos)
        if self.whole_token_ready():
            self.run_whole_token()
            if self.placement is not None:
                self.placement.after_token()
            else:  # every routed expert is resident (a module layer's experts are counted by the cache it asks)
                self.cache.stats.hits += self.top_k * sum(self.layers[i] is not None for i in self.layouts)
        else:
            for seg in range(len(self.layers) + 1):
                self.run_segment(seg)
                if seg < len(self.layers) and self.layers[seg] is None:
                    self.module_step(seg)
                elif seg < len(self.layers) and self.layers[seg].moe:
                    self.load_offsets(seg)
        self.state.length += 1
        return s.logits.clone()

    def module_step(self, i: int) -> None:
        """Layer i, one the family's own module runs, on the static residual: eager, between the captured
        segments (see the module's docstring)."""
        s = self.static
        s.x.copy_(self.module_layer(i, s.x, self.pos))

    def load_offsets(self, i: int) -> None:
        ids = self.static.top_i[0].tolist()  # the sync: the host must know which experts to bring
        self.static.set_offsets(self.cache.offsets(i, ids))

    def segment(self, seg: int) -> None:
        """Segment seg on the static buffers (segment_on), which the host reads and writes between segments."""
        s = self.static
        out = self.segment_on(seg, s.x, s.h, s.top_w, s.offsets)
        if out is None:
            return
        x, h, top_i, top_w = out
        if x is not s.x:
            s.x.copy_(x)
        if h is not s.h:
            s.h.copy_(h)
        if top_i is not None:  # layer seg routes
            s.top_i.copy_(top_i)
            s.top_w.copy_(top_w)

    def segment_on(self, seg: int, x, h, top_w, offsets, ids=None):
        """Experts of layer seg-1, then attention and routing of layer seg (or the LM head, into the static logits:
        None). x: the residual before layer seg-1's MLP branch; h, top_w, offsets: that layer's expert input,
        weights and blob offsets (with ids, its expert ids: offsets is then the layer's offset table). Returns the
        next segment's (x, h, top_i, top_w). Where layer seg-1 is one the family's own module runs, the residual
        holds its whole output (nothing to add); where layer seg is, the segment ends with the residual it starts
        from, plus layer seg-1's branch."""
        s = self.static
        if seg == 0:
            x, added = self.embedded(s.token), None
        elif self.layers[seg - 1] is None:
            added = None
        else:
            added = self.mlp(seg - 1, h, ids, top_w, one=offsets)
        if seg == len(self.layers):
            s.logits.copy_(self.logits(x if added is None else x + added))
            return None
        if self.layers[seg] is None:
            return (x if added is None else x + added), h, None, top_w
        x, h, logits = self.run_block(self.layers[seg], x, added, s.pos, self.block_args(seg))
        if logits is None:  # a dense layer
            return x, h, None, top_w
        top_i, top_w = self.route(seg, logits)
        return x, h, self.routed(seg, top_i), top_w

    def route(self, i: int, logits):
        """Layer i's (top-k ids, weights) from its router's logits (None, None for a dense layer): one Triton
        kernel on the GPU (smoe.runtime.cuda.routing), smoe.moe.route elsewhere."""
        if logits is None:
            return None, None
        return fused_route(self.routing, logits, self.layers[i].correction)

    def routed(self, seg: int, top_i):
        """The experts layer seg runs: its router's (a benchmark's subclass replays recorded ones)."""
        return top_i

    def run_block(self, layer: GpuLayer, x, added, pos, args):
        kind = "mla" if layer.mla else "gqa_step" if self.attention_kernel and layer.kernel_attends else "gqa"
        try:
            return self.blocks[kind](x, added, pos, **args)
        except Exception as err:  # a compiler failure must not stop decoding: the same function, eager
            if kind == "gqa_step":  # the kernel (or its compiled ends) failed: the torch block instead
                kernels_triton.warn_once(f"the decode-attention step failed ({type(err).__name__}); "
                                         "running the attention as torch ops")
                self.attention_kernel = False
                return self.run_block(layer, x, added, pos, args)
            if kind in self.eager_kinds:
                raise
            kernels_triton.warn_once(f"compiling the decode step failed ({type(err).__name__}); running it eagerly")
            self.eager_kinds.add(kind)
            self.blocks[kind] = EAGER_BLOCKS[kind]
            return self.blocks[kind](x, added, pos, **args)

    def experts_one(self, i: int, h, top_w, offsets, ids=None):
        """Layer i's routed experts for one token: h [1, hidden], top_w [1, k], offsets [k] of their blobs (with ids
        [k], the layer's offset table by expert id)."""
        layout = self.layouts[i]
        # straight to the decode kernels where they run: experts_forward checks the offsets' alignment
        # on the host, a sync that a captured graph cannot hold (the cache's slots are aligned by design)
        if self.device.type == "cuda" and self.kernel_path != "reference" and layout.unsupported() is None:
            # written in fp32, the residual's dtype: no conversion kernel between the experts and the residual
            out = torch.empty(1, layout.hidden, dtype=ACT, device=h.device)
            return kernels_triton.decode_forward(self.cache.pool, layout, h, offsets, top_w[0], out=out, ids=ids)
        offsets = offsets if ids is None else offsets[ids]
        return kernels_triton.experts_forward(self.cache.pool, layout, h, offsets[None], top_w, path=self.kernel_path)

    def idle(self, seg: int) -> bool:
        """Whether segment seg does nothing: it lies between two layers the family's own modules run."""
        return 0 < seg < len(self.layers) and self.layers[seg - 1] is None and self.layers[seg] is None

    def run_segment(self, seg: int) -> None:
        """Eager on the first token (it compiles the kernels and warms the libraries up), captured at
        its end, replayed from then on (an idle segment is not captured: None)."""
        if self.segments is None:
            self.segment(seg)
            if self.graphs and seg == len(self.layers):
                self.segments = [None if self.idle(i) else capture(lambda i=i: self.segment(i), self.device)
                                 for i in range(seg + 1)]
            return
        if self.segments[seg] is not None:
            self.segments[seg].replay()

    # --- one graph per token: every expert resident, or read in place ------------------------------

    def whole_token_ready(self) -> bool:
        """Whether a token runs as whole-token graphs, its experts' offsets from a device table: every expert
        resident (preload), or every expert in pinned host RAM and misses read in place (Placement)."""
        if self.table is None:
            if self.cache.n_slots >= len(self.vault.entries):
                self.preload()
            elif self.reads_in_place():
                self.cache.fill_host()
                self.placement = Placement(self.cache, len(self.layers))
                self.table = self.placement.table
        return self.table is not None

    def reads_in_place(self) -> bool:
        """Whether misses are read in place: asked for, the host tier holds every expert, no layer runs through
        the family's modules (they ask the cache on the host), and the experts run in the Triton kernels, which
        read any address (on a CPU device the pool holds the host tier: any path reads it)."""
        kernels = self.graphs or self.device.type == "cpu"
        return self.in_place and not self.modules and self.cache.holds_all_in_host() and kernels

    @torch.inference_mode()  # the placement's tensors were made under it (in a step)
    def account(self) -> None:
        """Bring the cache's stats up to date (misses read in place are counted on the device)."""
        if self.placement is not None:
            self.placement.account()

    def preload(self) -> bool:
        """Bring every expert into the GPU cache and build the device offset table."""
        experts = 1 + max(e for _, e in self.vault.entries)
        table = torch.zeros(len(self.layers), experts, dtype=torch.int64)
        for layer, e in sorted(self.vault.entries):
            table[layer, e] = self.cache.offsets(layer, [e])[0]
        self.table = table.to(self.device)
        return True

    def stretches(self) -> list[range]:
        """The token's segments cut after each layer the family's own modules run (which runs eagerly between
        two stretches): one stretch, every segment, for a model without such layers."""
        ends = [i for i, w in enumerate(self.layers) if w is None] + [len(self.layers)]
        return [range(start, end + 1) for start, end in zip([0, *(e + 1 for e in ends[:-1])], ends)]

    def whole_token_body(self, segments: range) -> None:
        """A stretch of segments, each handing its tensors straight to the next (no static buffer between them:
        the host reads nothing inside a stretch); it starts from the static residual (the module layer's before
        it) and leaves its residual there for the module layer after it, or writes the logits."""
        s = self.static
        x, h, top_i, top_w = s.x, s.h, s.top_i, s.top_w
        for seg in segments:
            offsets = ids = None
            if seg > 0 and self.layers[seg - 1] is not None and self.layers[seg - 1].moe:
                offsets, ids = self.table[seg - 1], top_i[0]  # looked up inside the expert kernels
                if self.placement is not None:
                    self.placement.record(seg - 1, ids)
            out = self.segment_on(seg, x, h, top_w, offsets, ids)
            if out is None:  # the LM head
                return
            x, h, top_i, top_w = out
        s.x.copy_(x)

    def run_whole_token(self) -> None:
        """The token's stretches, each one graph (every segment of the token when no layer runs through the
        family's modules), the module layers eagerly between them. Eager first: compiles and warms up, see
        run_segment."""
        stretches, eager = self.stretches(), self.whole_token is None
        for n, segments in enumerate(stretches):
            if eager:
                self.whole_token_body(segments)
            elif self.whole_token[n] is not None:
                self.whole_token[n].replay()
            if segments[-1] < len(self.layers):
                self.module_step(segments[-1])
        if eager and self.graphs:
            self.whole_token = [None if all(map(self.idle, segments)) else
                                capture(lambda segments=segments: self.whole_token_body(segments), self.device)
                                for segments in stretches]

    def close(self) -> None:
        self.cache.close()


class ModuleExperts:
    """The routed experts of a layer the family's own module runs (smoe.hf.experts' registry calls forward),
    computed as the GPU decoder computes a prompt's: from the GPU expert cache, in groups of experts that fit it
    together."""

    def __init__(self, dec: GpuDecoder):
        self.dec = dec

    def forward(self, module, hidden_states, top_k_index, top_k_weights):
        h = hidden_states.reshape(-1, hidden_states.shape[-1])
        top_i, top_w = top_k_index.reshape(h.shape[0], -1), top_k_weights.reshape(h.shape[0], -1).to(ACT)
        out = self.dec.experts_chunked(module.smoe_layer, h.to(self.dec.dtype), top_i, top_w)
        return out.to(hidden_states.dtype).view(hidden_states.shape)


def mla_block(x, added, pos, *, rows, latent_dim: int, positions, cos, sin, input_norm, post_norm, router,
              description, eps: float, dtype, router_bias=None, end: int | None = None, **attention):
    """attention_block's contract for an MLA layer, through the layer library's attention over the compressed
    latents (smoe.runtime.layers.mla_attention: absorbed; expanded for a prompt from the sequence's start) on a
    static step, so graphs can hold it. Its weights come as plain tensors (`attention`: MlaWeights' fields) and the
    bundles are made inside, so one compiled function serves every layer. `end` (a prompt's eager call): attend
    over the first `end` positions only, causally, instead of the whole static cache under a mask."""
    if added is not None:
        x = x + added
    interleaved = "interleaved_rotary" in description.extras
    step = (static_step(pos, positions, cos, sin, eps, interleaved) if end is None
            else eager_step(end - x.shape[0], x.shape[0], cos, sin, eps, interleaved))
    out = mla_attention(description, MlaWeights(**attention), rms_norm(x, input_norm, eps), Latents(rows, latent_dim),
                        step)  # Mistral 4's query temperature included
    x = x + scaled(out, multipliers(description).residual)
    h = rms_norm(x, post_norm, eps).to(dtype)
    return x, h, F.linear(h, router, router_bias) if router is not None else None


def attention_block(x, added, pos, *, k_cache, v_cache, positions, cos, sin, input_norm, qkv, qkv_bias, qk_norm,
                    q_norm_full, k_norm_full, o, post_norm, router, description, eps: float, dtype, o_bias=None,
                    sinks=None, window: int | None = None, rotary: bool = True, gated: bool = False,
                    attention_out_norm=None, router_bias=None, end: int | None = None):
    """One layer up to its experts, for tokens at positions `pos` (a device tensor): the residual x
    (fp32; plus `added`, the previous layer's MLP branch, when given), attention over the static KV
    cache, then the experts' input h and the router's logits (None for a dense layer). The layer library's
    GQA kinds (smoe.runtime.layers.gqa_attention): q/k norm before or after rotary or over all heads, no rotary
    on a NoPE layer, windows, sinks, the output gate, the query temperature, and the description's multipliers
    and norm on the branch's output. A pure function of its tensors, so that it can be compiled once and serve
    every layer. `end` (a prompt's eager call, whose shapes may vary): attend over the first `end` positions only,
    causally (flash attention for a whole prompt), instead of the whole static cache under a mask."""
    x, projected = attention_in(x, added, input_norm=input_norm, qkv=qkv, qkv_bias=qkv_bias, eps=eps, dtype=dtype)
    a = description.attention
    t, heads, kv_heads, hd = x.shape[0], a.heads, a.kv_heads, a.head_dim  # rotary may cover part of a head
    q, k, v, gate = projected.split([heads * hd, kv_heads * hd, kv_heads * hd, heads * hd * gated], dim=-1)
    if q_norm_full is not None:  # one norm over all heads (OLMoE), before they are split
        q = F.rms_norm(q, q.shape[-1:], q_norm_full, eps)
        k = F.rms_norm(k, k.shape[-1:], k_norm_full, eps)
    qk = torch.cat([q.view(t, heads, hd), k.view(t, kv_heads, hd)], dim=1)
    after_rotary = a.qk_norm == "head_after_rotary"  # HunYuan's: each rotated head normalised
    if qk_norm is not None and not after_rotary:  # one norm over q and k heads: their weights side by side
        qk = F.rms_norm(qk, (hd,), eps=eps) * qk_norm
    if rotary:  # in pairs (ERNIE) written out half-split: q and k alike, so their dot products are the pairs'
        qk = rotate(qk, cos[pos][:, None], sin[pos][:, None], "interleaved_rotary" in description.extras)
    if qk_norm is not None and after_rotary:
        qk = F.rms_norm(qk, (hd,), eps=eps) * qk_norm
    q, k = qk.split([heads, kv_heads], dim=1)
    k_cache[0].index_copy_(1, pos, k.transpose(0, 1))
    v_cache[0].index_copy_(1, pos, v.view(t, kv_heads, hd).transpose(0, 1))
    temperature = query_temperature(description, pos)
    if temperature is not None:
        q = q * temperature[:, None, None].to(q.dtype)
    scale = multipliers(description).attention  # None: 1 / sqrt(head_dim)
    if end is not None:  # a prompt: the positions held so far, the new ones causally
        k_cache, v_cache, positions = k_cache[:, :, :end], v_cache[:, :, :end], positions[:end]
    # every cached position up to each token's own: a mask over the whole static cache, so the shapes
    # never change and the step can be captured in a graph
    visible = positions[None, :] <= pos[:, None]
    if window is not None or sinks is not None:  # a sliding layer (the last `window` positions), sink logits (gpt-oss)
        if window is not None:
            visible = visible & (positions[None, :] > pos[:, None] - window)
        out = attend_within(q.transpose(0, 1)[None], k_cache, v_cache, visible, scale, sinks).to(dtype)
    elif end is not None and end == t:  # a whole prompt: no mask, so SDPA may take its flash kernel
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache, v_cache, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache, v_cache, attn_mask=visible[None, None],
                                             scale=scale, enable_gqa=True)
    out = out[0].transpose(0, 1).reshape(t, -1)
    if gated:  # AFMoE's output gate
        out = out * torch.sigmoid(gate)
    return attention_out(x, out, o=o, o_bias=o_bias, attention_out_norm=attention_out_norm, post_norm=post_norm,
                         router=router, router_bias=router_bias, description=description, eps=eps, dtype=dtype)


def attention_in(x, added, *, input_norm, qkv, qkv_bias, eps: float, dtype):
    """A GQA block's start: the residual (plus the previous layer's MLP branch) and its q/k/v projection."""
    if added is not None:
        x = x + added
    h = F.rms_norm(x, x.shape[-1:], input_norm, eps).to(dtype)
    return x, gemv.linear(h, qkv, qkv_bias)


def attention_out(x, out, *, o, o_bias, attention_out_norm, post_norm, router, router_bias, description, eps: float,
                  dtype):
    """A block's end from the heads' output: the residual after the attention branch, the experts' input and the
    router's logits (None for a dense layer)."""
    x = x + branch(gemv.linear(out, o, o_bias), attention_out_norm, multipliers(description).residual, eps)
    h = F.rms_norm(x, x.shape[-1:], post_norm, eps).to(dtype)
    return x, h, gemv.linear(h, router, router_bias) if router is not None else None


class AttentionStep:
    """attention_block for one token at a device position, with the attention between the projections in the
    decode-attention kernel (smoe.runtime.cuda.attention) instead of the torch ops: the start and the end of
    the block compiled by inductor (or eager), the kernel between them, all captured in the token's graphs."""

    def __init__(self, compiled: bool):
        wrap = (lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)) if compiled else (lambda fn: fn)
        self.start, self.end = wrap(attention_in), wrap(attention_out)

    def __call__(self, x, added, pos, *, k_cache, v_cache, cos, sin, input_norm, qkv, qkv_bias, qk_norm, o, post_norm,
                 router, description, eps: float, dtype, o_bias=None, sinks=None, window: int | None = None,
                 rotary: bool = True, attention_out_norm=None, router_bias=None, **unused):
        a = description.attention
        x, projected = self.start(x, added, input_norm=input_norm, qkv=qkv, qkv_bias=qkv_bias, eps=eps, dtype=dtype)
        out = decode_attention(projected, k_cache[0], v_cache[0], pos, cos, sin, qk_norm, sinks, heads=a.heads,
                               kv_heads=a.kv_heads, head_dim=a.head_dim, eps=eps,
                               scale=multipliers(description).attention, window=window, rotary=rotary)
        return self.end(x, out, o=o, o_bias=o_bias, attention_out_norm=attention_out_norm, post_norm=post_norm,
                        router=router, router_bias=router_bias, description=description, eps=eps, dtype=dtype)


def branch(out, norm, residual: float, eps: float):
    """A residual branch's output (attention, MLP) as it joins the stream, in fp32: normalised where the layer
    has a norm on it (AFMoE), times the residual multiplier (Granite), as layers.decoder_layer does."""
    out = out.to(ACT)
    return scaled(out if norm is None else rms_norm(out, norm, eps), residual)


EAGER_BLOCKS = {"gqa": attention_block, "mla": mla_block}


@functools.cache
def compiled_block(kind: str):
    """A layer's block ("gqa" | "mla") compiled by inductor: its ~30 small kernels fused into a few (one
    compile serves every layer and every decoder of the process; shapes are static in single-token steps)."""
    return torch.compile(EAGER_BLOCKS[kind], fullgraph=True, dynamic=False)


class StaticBuffers:
    """The tensors a captured segment reads and writes; the host fills token, position and offsets
    through pinned staging copies (ordered on the compute stream, so no host wait)."""

    def __init__(self, dec: GpuDecoder, hidden: int):
        dev, k = dec.device, dec.top_k
        self.inputs = torch.zeros(2, dtype=torch.int64, device=dev)  # the token and its position: one copy
        self.token, self.pos = self.inputs[0:1], self.inputs[1:2]
        self.x = torch.zeros(1, hidden, dtype=ACT, device=dev)
        self.h = torch.zeros(1, hidden, dtype=dec.dtype, device=dev)
        self.top_i = torch.zeros(1, k, dtype=torch.int64, device=dev)
        self.top_w = torch.zeros(1, k, dtype=ACT, device=dev)
        self.offsets = torch.zeros(k, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(1, dec.lm_head.shape[0], dtype=ACT, device=dev)
        pinned = dev.type == "cuda"
        self.stage = torch.zeros(2 + k, dtype=torch.int64, pin_memory=pinned)
        self.stage_inputs, self.stage_offsets = self.stage[:2], self.stage[2:]

    def upload(self, dst: torch.Tensor, values: list[int], stage: torch.Tensor) -> None:
        # the host reaches this point only after a sync on the compute stream (reading top-k or the
        # previous logits), so the previous copy out of the staging area has finished; written through numpy
        # (no tensor made per token: host time between two tokens' graphs is GPU idle time)
        stage.numpy()[:] = values
        dst.copy_(stage.view(dst.shape), non_blocking=True)

    def set_token(self, token: int, pos: int) -> None:
        self.upload(self.inputs, [token, pos], self.stage_inputs)

    def set_offsets(self, offsets: list[int]) -> None:
        self.upload(self.offsets, offsets, self.stage_offsets)


def capture(fn, device, pool=None):
    """fn captured as a CUDA graph (capturing runs nothing; fn has run eagerly before), its memory from `pool`
    where given (graphs that share one must not run at the same time)."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


class PromptGraph:
    """A padded prompt's static token ids and final residual, and the graph that maps one to the other (None
    until captured, or where capturing failed: then the prompt runs eagerly on the same buffers)."""

    def __init__(self, ids: torch.Tensor, x: torch.Tensor):
        self.ids, self.x, self.graph = ids, x, None

    def capture(self, fn, device, pool) -> None:
        try:
            self.graph = capture(fn, device, pool)
        except RuntimeError as err:  # an op that cannot be captured must not stop the prompt: eager from now on
            kernels_triton.warn_once(f"capturing a prompt's layers failed ({err}); running prompts eagerly")
            self.graph = None


def layer_layout(vault, layer: int) -> kernels_triton.ExpertLayout:
    """The blob layout shared by every expert of a layer (the kernels index blobs with one layout)."""
    layouts = {kernels_triton.ExpertLayout.from_entry(e) for (at, _), e in vault.entries.items() if at == layer}
    if len(layouts) != 1:
        raise SmoeError(f"layer {layer}: experts differ in layout (depths or shapes); the GPU kernels need one per layer")
    return layouts.pop()


def kernels_cover(vault) -> bool:
    """Whether the Triton kernels run every MoE layer's experts (no decode-then-matmul fallback)."""
    try:
        return all(layer_layout(vault, layer).unsupported() is None for layer in vault.meta["moe_layers"])
    except SmoeError:
        return False
