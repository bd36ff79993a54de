"""The families `smoe export --to gguf` writes but smoe does not read back: one row per family.

smoe.source.gguf's ARCHITECTURES holds the families smoe both writes and reads (and DeepSeek's MLA,
smoe.export.gguf_mla); a row here adds a family whose llama.cpp graph (src/models/<arch>.cpp) runs a
decoder smoe describes (smoe.source.description): which architecture it becomes, which of the
description's features that graph computes, and the metadata it reads that the common export does not
write. Routing comes from the description as for DeepSeek. What the graph computes differently is
refused by name, before anything is written.

glm4_moe (GLM-4.5) is llama.cpp's `glm4moe`: leading dense layers, a shared expert, sigmoid scores
chosen with the correction bias (`exp_probs_b`), rotary over the first half of each head (NeoX order,
as Hugging Face's), optional q/k norms and attention biases. Its multi-token-prediction layer is not
in a vault and is not written (llama.cpp decodes without it). Its graph builds a shared expert on every MoE layer.
solar_open (GLM-4.5's MoE block in Llama's decoder layer) and sarvam_moe (GLM-4.5's modules, rotary over the
whole head) are written as glm4moe too, as llama.cpp's converter writes Solar Open. A vault of sarvam_moe holds the
release's names (transformers converts them on load): its fused query_key_value is written as q, k and v split by
their sizes, as transformers splits it, and the other names as transformers renames them.

gpt_oss is llama.cpp's `gpt-oss`: attention sinks (`attn_sinks.weight`), biases on every projection, the
router and the experts, sliding-window layers as a per-layer pattern, YaRN, and the clamped SwiGLU with
llama.cpp's fixed alpha 1.702 and limit 7. llama.cpp rounds YaRN's correction range outward to whole
dimensions (ggml_rope_yarn_corr_dims, transformers' truncate = true); gpt-oss as released says truncate = false, and
is written all the same, as llama.cpp's converter writes it: 9 of gpt-oss-20b's 32 rotary frequencies then differ
from transformers', by up to 43%. llama.cpp's own converter writes the released MXFP4 experts
as they are; the graph takes any expert type, and these are Q4_1 like every family's.

granitemoe (and granitemoeshared) is llama.cpp's `granitemoe`: Granite's four multipliers as the embedding,
attention, residual and logit scales, rotary over adjacent pairs (q/k rows reordered, as for Mixtral,
and their biases with them), the shared MLP's fused input_linear split into gate and up. hunyuan_v1_moe is
`hunyuan-moe`: q/k norms after rotary, an ungated shared MLP; its NTK-alpha RoPE ("dynamic" with alpha) is a
fixed base, written as one.
ernie4_5_moe is `ernie4_5-moe`: softmax scores chosen with the correction bias, rotary over adjacent pairs
as Hugging Face's own. exaone_moe is `exaone-moe` and afmoe is `afmoe`: sliding layers with rotary, full
ones without; AFMoE adds the output gate, the norms after both branches and muP's embedding scale, all of
which its graph computes unconditionally.

llama4_text (Llama 4's text model, what a vault of a Llama 4 checkpoint holds) is `llama4`: dense and MoE
layers interleaved, a shared expert, the router's sigmoid weight on each expert's input, rotary over adjacent
pairs as Hugging Face's own. Its graph fixes what transformers reads from the config (NoPE every 4th layer,
chunks of 8192 on the others, the NoPE queries' temperature, the q/k norm but on 128 experts): a config
that says otherwise is refused. lfm2_moe is `lfm2moe`: short-convolution layers beside attention ones,
told apart by their 0 key/value heads, the kernels squeezed to [channels, width] as the converter does.

qwen3_next is `qwen3next`: gated delta-net layers beside gated attention ones (partial rotary, q/k norms), the
converter's rewrites of the trunk made here (the fused in_proj_qkvz as every head's q, k, v then z, A = -exp(A_log),
the (1 + w) norms as 1 + w), the delta-net layers listed as attention.recurrent_layers. Its graph takes the
delta-net's q/k L2-norm eps from rms_norm_eps where transformers fixes 1e-6: another eps is refused.
granitemoehybrid is `granitehybrid`: Mamba2 layers (0 key/value heads) beside attention ones, Granite's
multipliers, rotary switched on or off for all attention layers by rope_finetuned; its graph fixes an inner size of
twice the hidden size, a convolution bias and no time-step limit.

jamba is `jamba`: Mamba (selective-scan) layers beside attention ones without rotary, told apart by their 0 key/value
heads, dense and MoE layers wherever the config puts them (the graph takes a layer as MoE where it finds its router),
softmax scores left unnormalised; the norms of the time step, B and C as the converter names them, A = -exp(A_log).
Its graph fixes an inner size of twice the hidden size, a convolution bias, SiLU, no projection biases, and heads
that span the hidden size. (DeepSeek-V3's attention under other families' names is smoe.export.gguf_mla's.)

mellum is `mellum` and hy_v3 is `hy_v3`, names the pinned gguf package does not list (llama.cpp's loader reads the
architecture and tensor names as strings, and every tensor these write has a name in another architecture's table):
Mellum is Qwen3-MoE's modules with sliding layers, which llama.cpp's graph rotates at the full layers' base (it reads
rope.freq_base_swa but passes every layer the context's base), so other bases are refused; HY-V3 routes as DeepSeek-V3
without groups, adds a shared expert without an output gate, takes dense layers where it finds no router, and reads its
correction bias as blk.N.exp_probs_b, without the .bias suffix. dbrx is `dbrx`: the config's own key names read as
the common ones (config_view), LayerNorm's eps (transformers' default, as llama.cpp's converter writes it) and the
q/k/v clamp (0 where clip_qkv is None), softmax weights divided by their sum (another p-norm refused).

qwen3_5_moe_text (Qwen3.5-MoE's text model) is `qwen35moe`: qwen3next's layers with the delta-net's projections apart
(in_proj_qkv, in_proj_z, in_proj_a, in_proj_b), their value heads reordered from grouped by key head to tiled as the
converter does (ggml broadcasts q and k over the value heads so), and M-RoPE sections (the converter's [11, 11, 10]
where the config names none; on text every section turns by the one position, so any sections compute plain rotary;
ggml asserts they span at most a head, and more is refused). gemma4_text (Gemma 4's text model) is `gemma4`: a dense
MLP beside the experts on every layer, the router on the normalised residual with its input scale
(ffn_gate_inp.scale) and per-expert scale (ffn_down_exps.scale), the layer scalar, sliding layers of head_dim with plain
RoPE and full ones of their own width and key/value heads (per_layer_config) with proportional RoPE, written as the
converter writes it: rope_freqs of 1 on the turned pairs and 1e30 on the others; the final softcap written as 0 where
the config has none (llama.cpp's default is 30). Per-layer embeddings (the small dense models) are refused.
nemotron_h is `nemotron_h_moe`: one mixer per layer, Mamba2, attention without rotary or MoE, told apart as the graph
does by their key/value heads (0 on all but attention) and feed-forward widths (the experts' on MoE layers, 0 elsewhere);
the release's backbone names, the converter's rewrites of the Mamba2 tensors (A = -exp(A_log), [heads, 1] A and D, the
gated norm per group), sigmoid scores chosen with the correction bias and an ungated relu² shared expert, which the graph
builds on every MoE layer. Its graph builds every feed-forward layer as MoE, so dense MLP layers are refused; it does
not clamp the time step where transformers clamps it from below at time_step_min: the release's 1e-3 is taken (it moves
only steps below it, by less than that), a larger one refused.
minimax is `minimax-01`, a name the pinned gguf package lacks (tensors named as minimax-m2's, the lightning layers' own
as llama.cpp's table names them): lightning attention layers listed as attention.recurrent_layers beside softmax ones
with rotary over the whole head (transformers' MiniMax reads no partial factor; one is refused), Mixtral's experts and
router, the three residual factors as one residual_scale (unequal factors, or branch factors other than 1, refused).
The decays are not written: the graph computes transformers' rates from the head count and depth, its depth factor
1 - i / (layers - 1) where transformers divides by layers - 1 + 1e-5 (at most 1e-5 / (layers - 1) apart), the recurrence
in one block where transformers runs blocks of block_size. Its graph normalises the lightning output at rms_norm_eps
where transformers builds that norm at 1e-6; written all the same, as llama.cpp's converter writes the release (1e-5):
on the tiny model the decoded logits then differ by 3.5e-5 of their largest, 2.8e-5 at equal eps.

A multimodal checkpoint's vault holds its text model beside the vision (and audio) towers, its config a text_config:
the text model is written from the text_config and the tensors under model.language_model., the towers are left out
(llama.cpp reads them from its own mmproj file, which llama.cpp's converter writes from the checkpoint). So are the
multimodal Qwen3.5-MoE's and Gemma 4's, whose vaults smoe names by their text models (qwen3_5_moe_text, gemma4_text).
qwen3_vl_moe is `qwen3vlmoe`: Qwen3-MoE's layers with M-RoPE over whole heads (transformers' [24, 20, 20] where the
config names none; plain rotary on text, sections spanning more than a head refused as for qwen35moe) and the count of
deepstack layers, to which text tokens add zeros. glm4v_moe (GLM-4.5V) is glm4moe, GLM-4.5's row with the M-RoPE
sections (transformers' [8, 12, 12] where the config names none), which switch llama.cpp's graph from NeoX rotary to
M-RoPE, the same on text.

kimi_linear is `kimi-linear`: delta-attention (KDA) layers, told apart by their 0 key/value heads, beside MLA layers
without rotary, written as deepseek2's (smoe.export.gguf_mla: one key/value head of the latent, kv_b split); the
converter's rewrites (A = -exp(A_log), dt_bias as ssm_dt's bias, the [channels, 1, width] kernels in F32), DeepSeek-V3's
routing with groups, a leading dense MLP and shared experts; model_max_length as the context length. Its graph takes the
delta-attention's q/k L2-norm eps from rms_norm_eps where transformers fixes 1e-6; written all the same (as llama.cpp's
converter writes the release): on the tiny model at rms_norm_eps 1e-5 the decoded logits differ by 4.9e-4 of their
largest, 6.7e-5 at equal eps.

granitemoe_swa is `granite_swa`, a name the pinned gguf package lacks (tensors named as granitemoe's): granitemoe's row
with sink logits, sliding-window layers (which its loader requires) and layers without rotary (layer_rope_theta 0) as
the converter's rope_pattern; its shared MLP's input_linear kept fused as ffn_up_shexp, as the converter writes it. Its
graph turns every rotary layer at one base: other per-layer bases are refused (rope_per_layer_type).

cohere2_moe is `cohere2moe`, a name the pinned gguf package lacks (tensors named as glm4moe's): attention and the MLP
side by side on one norm (LayerNorm, or RMSNorm where rms_norm_eps is set: llama.cpp takes the norm whose eps it finds),
rotary over adjacent pairs on the sliding layers and the leading dense ones only (transformers' force_rope with
prefix_dense_sliding_window_pattern 1; another pattern that leaves a dense layer unturned is refused), shared experts
averaged with the routed ones (the graph's fixed 0.5; "sum" refused), softmax or sigmoid scores written from the
description (the converter writes none, and llama.cpp's default is sigmoid), the logit scale. mimo_v2_flash is `mimo2`:
DeepSeek-V3's routing without groups, scale or shared experts (the graph reads none of them), sliding layers with twice
the key/value heads (head_count_kv per layer), sink logits (saved as attention_sink_bias) and their own rotary base,
values of v_head_dim scaled by attention.value_scale, dense layers where there is no router; one rotary width for
both layer types (other partial factors refused).

glm_moe_dsa (GLM-5) is llama.cpp's `glm-dsa`, written through the MLA path beside deepseek_v32 (smoe.export.gguf_mla):
DeepSeek-V3.2's with rotary over adjacent pairs in the indexer and indexer layers that reuse the previous one's choice.
laguna is `laguna`, a name the pinned gguf package lacks (tensors named as afmoe's, its norm before the MLP as
ffn_norm): sigmoid choice by score + correction bias, normalised and scaled, a shared expert of its own width, q/k norm
per head, the attention output times the softplus of g_proj (one gate per head or per channel, which llama.cpp tells by
g_proj's width), query heads per layer (head_count per layer), the sliding layers' rotary part and base beside the full
ones'; a soft-capped router and RoPE scaling (which llama.cpp's graph turns on the full layers only) refused.
step3p7 (Step-3.7's text model, which its vault keeps under model. beside the tower, in the release's names) is `step35`:
sigmoid choice by score + correction bias (router_bias, as exp_probs_b), normalised and scaled, a shared expert on
every MoE layer, dense layers where there is no router, the (1 + w) RMSNorms as 1 + w, q/k norm per head, the
attention output times the sigmoid of g_proj per head, the sliding layers' own query heads (head_count per layer) and
rotary base, the SwiGLU clamps per layer (swiglu_clamp_exp on the experts, swiglu_clamp_shexp on the shared and dense
MLPs; 0: none). Its graph turns the whole head on the sliding layers and half of it on the full ones (rope.dimension_count
is the whole head), scores by 1 / sqrt(head_dim) and asserts that a layer slides: other rotary parts, RoPE scaling, a
query_pre_attn_scalar other than head_dim, a gate per channel, MLP biases and a model without sliding layers refused.

hy_v4 (HY-V4) is `hy_v4`, a name the pinned gguf package lacks (tensors named as glm-dsa's, the hyper-connections' and
the output gate's as llama.cpp's table names them); its vault holds the release's names (transformers saves them too),
read as transformers renames them (HY_V4_RENAMES). DeepSeek-V3.2's MLA written as deepseek2's, with sink logits
(learnable_sink_param) and the attention output times the sigmoid of linear_gate per value channel (attn_gate); its
indexer's head count, width and top-k, and indexer_types as the converter writes them (the "shared" layers reuse the
previous indexer's choice); DeepSeek-V3's routing without groups (its graph reads none: n_group > 1 refused), leading
dense layers, a shared expert on every MoE layer (0 refused); the experts' SwiGLU clamped at swiglu_limit on every
layer (swiglu_clamp_exp: the gate from above before SiLU, up both ways; the graph takes a limit at or below 1e-6 as
none where transformers clamps at any: refused); the hyper-connections' stream count, eps and magnitude, their mixing
matrices F32 as the converter keeps them. Its graph turns adjacent pairs where transformers' HY-V4 turns the two halves
of each head's rotary part, and the converter writes the release's rows as they are: the rotary rows of q_b, kv_a and
the indexer's q, k and key norm are reordered into pairs here (as for Llama), so that llama.cpp computes transformers'
attention and the indexer's choice. It normalises the query and latent at rms_norm_eps where transformers builds those
norms at 1e-6; written all the same, as the converter writes the release (1e-5): on the tiny model the decoded logits
then differ by 1.5e-5 of their largest, 1.1e-6 at equal eps. It fixes the attention scale at 1 / sqrt(qk_head_dim)
where transformers' grows with YaRN's mscale (RoPE scaling refused), runs SiLU on every MLP (another hidden_act, which
transformers' dense and shared MLPs take, refused), needs indexer heads wider than the rotary part and layer 0 to run
its own indexer. It keeps the indexer's keys in the K cache's type, as deepseek32 does (smoe.export.gguf_mla).

minimax_m3_vl (MiniMax-M3's text model, which its vault keeps under language_model.model. beside the tower, in the
release's names, read as transformers renames them: MINIMAX_M3_RENAMES) is `minimax-m3`, a name the pinned gguf package
lacks (tensors named as minimax-m2's, the dense MLPs', the shared expert's and the indexer's as llama.cpp's table names
them): DeepSeek-V3's sigmoid choice by score + correction bias without groups, normalised and scaled, a shared expert
as wide as the routed ones (llama.cpp sizes it so), leading dense layers of dense_intermediate_size, gpt-oss's clamped
SwiGLU on all of them at the graph's fixed alpha 1.702 and limit 7 (others refused), Gemma's (1 + w) RMSNorms written
as 1 + w (the indexer's too), q/k norm per head. rope.dimension_count is what transformers turns, head_dim times
rope_parameters' partial_rotary_factor: transformers' MiniMax-M3 reads no rotary_dim, which llama.cpp's converter
writes. Its block-sparse attention: the indexer's heads, width, kept blocks, block size and local blocks, its
projections in F32 as the converter writes them; the graph makes exactly the MoE layers block-sparse, with one indexer
head per key/value head, turning the attention's rotary width of each indexer head (other layer_types, head counts and
a rotary width beyond index_head_dim refused). llama.cpp attends block-sparsely only with flash attention (and one
sequence, or a cache per sequence); without it, to every key. With flash attention (and the default F16 cache) the
decoded logits of the tiny model differ from smoe's by 2.9e-4 of their largest, mean KL 1.5e-8.

dots3_note (Dots3-Note's text model, which its vault keeps under model. beside the vision and audio towers, in the
release's names) is `dots3note`, a name the pinned gguf package lacks (tensors named as glm-dsa's, the rotary key's norm
as attn_k_norm and the output gate as attn_gate): DeepSeek-V3's MLA over adjacent rotary pairs with a sigmoid gate per
head (g_proj), DeepSeek-V3.2's indexer on the indexed layers (its head count, width and top-k; indexer.types true on
them), sliding layers with MLA sizes of their own (per_layer_config: heads as head_count per layer, the latent rank, key
and value widths under the _swa keys) and their own rotary base (rope.freq_base_swa; the indexed layers' is
rope.freq_base), DeepSeek-V3's routing without groups (n_group > 1 refused), leading dense layers and shared experts as
wide as the routed ones (llama.cpp sizes them so). transformers scales the normalised query and key/value latents by
sqrt(hidden_size / rank), the layer kind's rank: folded into q_a_norm and kv_a_norm, as the converter does only where
the config says apply_mla_qkv_lora_rescale. Its graph turns the indexer's rotary part as two halves (NeoX) where
transformers' indexer turns adjacent pairs, and the converter writes the release's rows as they are: the rotary rows of
the indexer's q, k and key norm are reordered into halves here, so that llama.cpp chooses transformers' keys. Its graph
reads one rotary width and one q_lora rank for both layer kinds, turns them without scaling, runs SiLU MLPs, rotates the
indexer by a Hadamard matrix of a power of two from 64 and builds an indexer on every layer that does not slide, and
needs a sliding window and the indexer's sizes (layers of both kinds): other configs, and a config.json in the release's
layout (its swa_* keys, which transformers reads into per_layer_config), refused. It keeps the indexer's keys in the K
cache's type, as deepseek32 does (on the tiny model its Q4 export with the default F16 cache: mean KL 3.0e-3; with F32
caches 2.5e-5). The graph's other eps (the latent and rotary-key norms at rms_norm_eps, the indexer's key LayerNorm at
1e-6) are transformers'.

Refused by name (REFUSED): phimoe, whose llama.cpp graph weighs the chosen experts by a plain softmax where
transformers' sparsemixer does not; qwen4_exp and its text model qwen4_exp_text (`qwen4exp`), whose graph llama.cpp
0.3.36 marks pending complete reimplementation, not to be used as a reference (TAG_QWEN4_REIMPLEMENT), so that an
export could not be checked against it.

deepseek_v4 (DeepSeek-V4, whose vault holds the release's names) is `deepseek4`, a name the pinned gguf package lacks
(every tensor named here, _deepseek_v4_pieces, as llama.cpp's converter names the release's): hyper-connections (their
stream count, Sinkhorn iterations and eps, the mixings F32), one key/value head whose keys are its values (head_count_kv
1), the low-rank query with its unweighted norm per head, sink logits, rotary over adjacent pairs of each head's last
part (llama.cpp turns them there too: no rows reordered) at the main base on the sliding layers and the compress base
on the compressed ones, the output through o_groups low-rank projections; compress_ratios from layer_types (0, 4 or
128), the compressors, and the indexer's head count, width and top-k on the sparse layers; the sqrt of softplus of the
logits (expert_gating_func 4, which the pinned gguf package lacks) chosen with the correction bias, normalised and
scaled, a shared expert; the SwiGLU clamp of the experts and the shared expert (swiglu_clamp_exp and _shexp). With F32
caches llama.cpp computes smoe's logits to 1e-6 of their largest, the compressed keys and the indexer's choice
included. Its hash-routed layers (mlp_layer_types "hash_moe", hash_layer_count of them) choose their experts by the
token id through the table tid2eid, written as llama.cpp's converter writes it (I32 ffn_gate_tid2eid, the one integer
trunk tensor the export reads) and weighted as transformers weighs them (the sqrt of softplus of the chosen experts'
logits, no correction bias, normalised and scaled). Refused by name: hash-routed layers that are not the first ones
(llama.cpp's deepseek4 hashes layers below hash_layer_count), RoPE scaling, compressions other than 4 and 128, output
groups that split heads (its graph asserts whole heads), indexer heads of other than a multiple of 64 and a model
without a compressed_sparse_attention layer (its caches rotate the indexer's keys by Hadamard matrices of 64 or more,
and divide by zero sizing them for an indexer on no layer), a swiglu_limit at or below 1e-6, another hidden_act, biases
and tied embeddings.

glm5_next (GLM-5.3's text model, which its vault keeps under model.language_model. beside the vision tower, in the
release's names) is `glm5-next`, a name the pinned gguf package lacks (tensors named as kimi-linear's, the indexer's and
the hyper-connections' as llama.cpp's table names them): kimi_linear's delta-attention layers, told apart by their 0
key/value heads (A = -exp(A_log), dt_bias as ssm_dt's bias, the [channels, 1, width] kernels in F32; the forget gate's
lower bound written where the config has one, without which the graph computes the softplus gate as transformers does),
beside MLA layers without rotary (qk_rope_head_dim 0) written as deepseek2's (smoe.export.gguf_mla), whose indexer
scores pools of index_kpool keys (each a softmax-weighted sum of its keys, the compressor's gate and position terms in
F32 as the converter keeps them), keeps index_topk / index_kpool pools and the incomplete last one (kpool_select_tail),
the layers indexer_types marks "shared" reusing the previous indexer's choice, its key LayerNorm at transformers' 1e-6
(layer_norm_epsilon); DeepSeek-V3's routing without groups (its graph reads none: n_group > 1 refused), leading dense
layers, a shared expert on every MoE layer; every MLP's SwiGLU clamped at swiglu_limit (swiglu_clamp_exp on the experts,
swiglu_clamp_shexp, which the graph takes for the dense MLPs too, on the others); the hyper-connections' stream count,
Sinkhorn iterations and eps, their mixings F32, the streams averaged before the final norm. Its graph's eps are
transformers': the delta-attention's q/k L2 norm at 1e-6, the query, latent, output and stream norms at rms_norm_eps.
With F32 caches llama.cpp computes smoe's logits of the tiny model to 3.3e-6 of their largest (mean KL 1.1e-12); its
default F16 cache rounds the latents and the pooled keys (max |Δlogit| 0.14, mean KL 1.8e-5). Refused by name: other
than four hyper-connection streams (the graph asserts four), pools of one key, other than as many delta-attention heads
as attention heads, the incomplete last pool left out (index_kpool_always_select_tail false: llama.cpp's queries before
the first full pool then attend to no key, and its logits are NaN), another hidden_act, a swiglu_limit at or below 1e-6,
no shared expert and tied embeddings.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from smoe.export import gguf_mla
from smoe.export.source import HASH_TABLE, require
from smoe.source.description import ModelDescription
from smoe.source.gguf import Architecture, permute_rope, unpermute_rope

SINKS = "self_attn.sinks"  # llama.cpp's converter names them attn_sinks.weight
# under mlp.gate (GLM-4.5, dots.llm1), block_sparse_moe (MiniMax-M2), mlp (EXAONE-MoE), mlp.moe_statics (ERNIE, [1, E])
CORRECTION_BIAS = "e_score_correction_bias"
EXPERT_BIAS = ".expert_bias"  # the correction bias of AFMoE (under mlp) and LFM2-MoE (under feed_forward)
GRANITE_SHARED_IN = "shared_mlp.input_linear.weight"  # [2 · width, hidden]: gate rows, then up rows
# depthwise convolution kernels, [channels, 1, width] in transformers: llama.cpp's converter squeezes them to
# [channels, width] and keeps them F32 (ggml's ssm_conv reads F32)
CONV_KERNELS = ("conv.conv.weight", "mamba.conv1d.weight", "linear_attn.conv1d.weight", "mixer.conv1d.weight")
# Kimi's delta-attention kernels, [channels, 1, width] as llama.cpp's kimi-linear reads them
KIMI_CONV_KERNELS = ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight")
# GLM-5.3's k-pool compressor, which llama.cpp's converter keeps in F32 (indexer_compressor_gate and _ape)
GLM5_NEXT_KPOOL = ("indexer.index_kpool_compress_gate", "indexer.index_kpool_compress_ape")
# matrices llama.cpp reads as F32 whatever the trunk type: the kernels, Mamba's A and D ([heads, 1]), GLM-5.3's k-pool
# compressor
F32_TRUNK = (*CONV_KERNELS, "mamba.A_log", "mamba.D", "mixer.A_log", "mixer.D", *KIMI_CONV_KERNELS, "self_attn.A_log",
             *GLM5_NEXT_KPOOL)
# and by their GGUF names: HY-V4's hyper-connection mixings, which its release and llama.cpp's converter keep in F32
# and MiniMax-M3's indexer projections, which llama.cpp's converter writes in F32
F32_GGUF = ("hc_attn_fn.weight", "hc_ffn_fn.weight", "output_hc_fn.weight", "indexer.q_proj.weight",
            "indexer.k_proj.weight")
# the names of HY-V4's release (and of transformers' save_pretrained) as transformers renames them on load, in order
HY_V4_RENAMES = ((r"\.hc_pre\.hc_", ".hc_"), (r"\.learnable_sink_param", ".sinks"), (r"\.linear_gate", ".gate_proj"),
                 (r"\.hc_attn_layer\.hc_(fn|base|scale)", r".attn_hc.\1"),
                 (r"\.hc_mlp_layer\.hc_(fn|base|scale)", r".ffn_hc.\1"), (r"\.hc_head_(fn|base|scale)", r".hc_\1"))
SHARED_MLPS = (".shared_experts.", ".shared_mlp.", ".shared_expert.", ".share_expert.")
AFMOE_NOPE_STEP = 4  # llama.cpp's afmoe leaves rotary out of every 4th layer (n_no_rope_layer_step, not read from the file)
# llama.cpp's llama4 constants, whatever the file says: NoPE every 4th layer (n_no_rope_layer_step) and chunked
# attention on the others (its swa pattern), chunks of 8192, the NoPE queries' temperature (floor, scale) and
# no q/k norm for the 128-expert model (use_kq_norm)
LLAMA4_EVERY, LLAMA4_CHUNK, LLAMA4_TEMPERATURE, LLAMA4_NO_NORM_EXPERTS = 4, 8192, (8192, 0.1), 128
OAI_CLAMP = (1.702, 7.0)  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
QWEN3_NEXT_L2_EPS = 1e-6  # transformers' l2norm of the delta-net's q and k
QWEN3_5_MROPE = (11, 11, 10)  # transformers' and llama.cpp's converter's sections where the config names none
QWEN3_VL_MROPE = (24, 20, 20)  # transformers' Qwen3-VL sections where the config names none
GLM4V_MROPE = (8, 12, 12)  # transformers' GLM-4.5V sections where the config names none
TEXT_PREFIX = "model.language_model."  # a multimodal checkpoint's text model, beside its towers
# transformers' Nemotron-H clamps the Mamba2 time step from below at time_step_min, llama.cpp does not: the release's
# 1e-3 moves only steps below it, by less than 1e-3; a larger minimum is refused
NEMOTRON_H_STEP_MIN = 1e-3
# MiniMax's residual factors: llama.cpp's minimax-01 scales both residuals of every layer by one residual_scale
MINIMAX_ALPHAS = ("linear_attn_alpha_factor", "full_attn_alpha_factor", "mlp_alpha_factor")
MINIMAX_BETAS = ("linear_attn_beta_factor", "full_attn_beta_factor", "mlp_beta_factor")
# the lightning layers' tensors as llama.cpp's minimax-01 names them; their decays are recomputed, not written
MINIMAX_LIGHTNING = {"qkv_proj.weight": gguf.MODEL_TENSOR.ATTN_QKV, "output_gate.weight": gguf.MODEL_TENSOR.ATTN_GATE,
                     "norm.weight": gguf.MODEL_TENSOR.ATTN_NORM_2, "out_proj.weight": gguf.MODEL_TENSOR.ATTN_OUT}
MINIMAX_DECAYS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


@dataclass(frozen=True)
class GgufFamily:
    arch: Architecture
    routing: dict  # Routing fields the graph fixes (anything it reads from metadata is written instead)
    extras: tuple[str, ...] = ()  # description extras the graph computes; any other is refused
    qk_norms: tuple[str | None, ...] = (None,)  # q/k norm kinds the graph computes
    attention_bias: bool = False  # q/k/v/o biases read (llama.cpp's qkv loader takes them when present)
    expert_biases: bool = False
    dense_first: bool = False  # dense layers before the MoE ones (leading_dense_block_count)
    sliding_window: bool = False  # sliding-window layers, written as a per-layer pattern
    all_kv_heads: bool = False  # the graph sizes k and v as n_head heads: no grouped-query attention
    shared_gate: bool = False  # the shared expert scaled by a sigmoid gate (ffn_gate_inp_shexp)
    moe_keys: bool = False  # gating, scale, normalisation, groups, shared experts read from metadata (write_moe)
    rope_types: tuple[str, ...] = ("default",)
    shared_width: bool = False  # the shared experts' width read from metadata (else n_shared × the routed width)
    interleaved: bool = False  # every interleave_moe_layer_step-th layer MoE, the others dense (Llama 4)
    dense_width_key: str = "intermediate_size"  # the config key of the dense layers' width (feed_forward_length)
    recurrent_kv: bool = False  # head_count_kv per layer, 0 on the layers whose mixer is not attention
    any_moe_layers: bool = False  # the graph builds a layer as MoE where its router is: any layout
    # full-attention layers of their own head width and key/value heads (global_head_dim, num_global_key_value_heads)
    global_heads: bool = False
    # feed_forward_length per layer: the experts' width on MoE layers, 0 on the others (Nemotron-H's mixer kinds)
    ffn_per_layer: bool = False
    check: Callable[[str, dict, ModelDescription], None] | None = None  # the family's own refusals
    write: Callable[[gguf.GGUFWriter, dict, ModelDescription, list[int]], None] | None = None  # its own metadata
    # the GGUF tensors a trunk tensor becomes where the family's converter rewrites it (else None)
    pieces: Callable[[str, tuple[int, ...], dict, gguf.TensorNameMap], list[gguf_mla.Piece] | None] | None = None
    # llama.cpp's name of an architecture the pinned gguf package does not list; `arch` is then one it lists whose
    # tensors name every tensor the family writes (llama.cpp's loader reads the name and the tensors as strings, from
    # one table of tensor names shared by every architecture)
    name: str | None = None
    # DeepSeek's MLA attention written as deepseek2's (smoe.export.gguf_mla): one K/V head of the latent, kv_b split
    mla: bool = False
    sliding_kv_factor: int = 1  # the sliding layers' key/value heads, times the config's (head_count_kv per layer)
    value_width_key: str | None = None  # the config key of the value heads' width, where it is not head_dim
    heads_key: str | None = None  # the config key of the query heads per layer (head_count per layer)
    sliding_heads_key: str | None = None  # the config key of the sliding layers' query heads (head_count per layer)
    whole_head_rope: bool = False  # rope.dimension_count is the whole head, which the graph halves on the full layers
    # where a multimodal checkpoint's vault keeps its text model (Step-3.7's release layout: model., its tower beside)
    text_prefix: str = TEXT_PREFIX
    # (pattern, replacement) applied in turn to a vault's tensor names: the release's as transformers renames them
    renames: tuple[tuple[str, str], ...] = ()
    layer_config_heads: bool = False  # head_count per layer from per_layer_config (Dots3-Note's sliding layers)
    one_kv_head: bool = False  # one key/value head whatever num_key_value_heads says (DeepSeek-V4's)

    def renamed(self, key: str) -> str:
        for pattern, replacement in self.renames:
            key = re.sub(pattern, replacement, key)
        return key

    @property
    def llama_name(self) -> str:
        return self.name or gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, self.arch.arch)]


def _gpt_oss(name: str, config: dict, desc: ModelDescription) -> None:
    require(desc.experts.clamp == OAI_CLAMP,
            f"{name}: llama.cpp's gpt-oss clamps SwiGLU at alpha 1.702, limit 7; this model has {desc.experts.clamp}")
    require(desc.attention.bias, f"{name}: llama.cpp's gpt-oss needs attention biases")
    require(bool(desc.attention.sliding_layers), f"{name}: llama.cpp's gpt-oss needs sliding-window layers")


def _glm4_moe(name: str, config: dict, desc: ModelDescription) -> None:
    require(desc.shared_experts >= 1, f"{name}: llama.cpp's glm4moe adds a shared expert to every MoE layer; this "
            "model has n_shared_experts = 0")


# the release names of Sarvam-MoE's attention and embeddings, as transformers renames them on load
SARVAM_RENAMES = ((r"^model\.word_embeddings\.", "model.embed_tokens."), (r"\.attention\.dense\.", ".self_attn.o_proj."),
                  (r"\.attention\.query_layernorm\.", ".self_attn.q_norm."),
                  (r"\.attention\.key_layernorm\.", ".self_attn.k_norm."))


def _sarvam_pieces(key: str, shape: tuple[int, ...], config: dict,
                   names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """query_key_value's rows [q | k | v] (weight and bias) as q, k and v; the other release names renamed."""
    if ".attention.query_key_value." in key:
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        sizes = [config["num_attention_heads"] * dim] + [config["num_key_value_heads"] * dim] * 2
        require(sum(sizes) == shape[0], f"trunk tensor {key}: {shape[0]} rows, the config says q, k, v of {sizes}")
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        return [(names.get_name(key.replace("attention.query_key_value", f"self_attn.{p}_proj"),
                                try_suffixes=(".weight", ".bias")), (n, *shape[1:]),
                 lambda t, a=a, n=n: t[a:a + n].contiguous()) for p, a, n in zip("qkv", starts, sizes)]
    renamed = key
    for pattern, name in SARVAM_RENAMES:
        renamed = re.sub(pattern, name, renamed)
    if renamed != key:
        return [(names.get_name(renamed, try_suffixes=(".weight", ".bias")), shape, lambda t: t)]
    return None


def _write_granite(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """llama.cpp reads a zero scale as none; the config checks hold every multiplier to [1e-6, 1e6]."""
    m = desc.multipliers
    writer.add_embedding_scale(m.embedding)
    writer.add_attention_scale(m.attention)
    writer.add_residual_scale(m.residual)
    writer.add_logit_scale(m.logits)


def _hunyuan(name: str, config: dict, desc: ModelDescription) -> None:
    rope = gguf_mla.rope_parameters(config)
    require(rope.get("rope_type", rope.get("type")) != "dynamic" or rope.get("alpha"),
            f"{name}: dynamic RoPE without a fixed alpha changes with the length; llama.cpp's hunyuan-moe takes a fixed base")


def _write_ernie(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    writer.add_interleave_moe_layer_step(1)  # every layer after the leading dense ones is MoE (check)
    writer.add_leading_dense_block_count(moe_layers[0])


def _rope_on_sliding_only(name: str, arch: str, desc: ModelDescription) -> None:
    """EXAONE-MoE's and AFMoE's graphs rotate on sliding layers only, and need the window to tell them."""
    a = desc.attention
    require(a.sliding_window is not None, f"{name}: llama.cpp's {arch} needs sliding-window layers (rotary only on them)")
    full = tuple(i for i in range(desc.num_layers) if i not in set(a.sliding_layers))
    require(a.nope_layers == full, f"{name}: llama.cpp's {arch} rotates exactly the sliding layers; this model's "
            f"layers without rotary are {a.nope_layers}, its full ones {full}")


def _exaone(name: str, config: dict, desc: ModelDescription) -> None:
    _rope_on_sliding_only(name, "exaone-moe", desc)


def _afmoe(name: str, config: dict, desc: ModelDescription) -> None:
    _rope_on_sliding_only(name, "afmoe", desc)
    every = tuple(i for i in range(desc.num_layers) if (i + 1) % AFMOE_NOPE_STEP == 0)
    require(desc.attention.nope_layers == every, f"{name}: llama.cpp's afmoe leaves rotary out of every "
            f"{AFMOE_NOPE_STEP}th layer; this model's layers without it are {desc.attention.nope_layers}")
    require(desc.multipliers is not None and desc.multipliers.embedding == desc.hidden_size ** 0.5,
            f"{name}: llama.cpp's afmoe scales the embeddings by sqrt(hidden_size); this model has mup_enabled = false")
    require(desc.output_norms, f"{name}: llama.cpp's afmoe normalises both branches' outputs")


def _llama4(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's llama4 fixes what transformers reads from the config: NoPE every 4th layer, chunks of 8192
    on the others, the NoPE layers' query temperature, and the q/k norm on all but the 128-expert model."""
    n = desc.num_layers
    roped = [int((i + 1) % LLAMA4_EVERY != 0) for i in range(n)]
    interval = config.get("no_rope_layer_interval", LLAMA4_EVERY)  # transformers' rule where the list is absent
    listed = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    require(listed == roped, f"{name}: no_rope_layers {listed} is not what llama.cpp's llama4 computes (NoPE on every "
            f"{LLAMA4_EVERY}th layer)")
    chunked = ["chunked_attention" if r else "full_attention" for r in roped]
    require(config.get("attention_chunk_size") == LLAMA4_CHUNK and config.get("layer_types", chunked) == chunked,
            f"{name}: llama.cpp's llama4 attends in chunks of {LLAMA4_CHUNK} on the rotary layers; this model's chunk is "
            f"{config.get('attention_chunk_size')}, its layer types {config.get('layer_types')}")
    temperature = (config.get("attn_temperature_tuning", True), config.get("floor_scale", LLAMA4_TEMPERATURE[0]),
                   config.get("attn_scale", LLAMA4_TEMPERATURE[1]))  # transformers' defaults where absent
    require(temperature == (True, *LLAMA4_TEMPERATURE), f"{name}: llama.cpp's llama4 scales NoPE queries with floor "
            f"{LLAMA4_TEMPERATURE[0]} and scale {LLAMA4_TEMPERATURE[1]}; this model's tuning, floor and scale are "
            f"{temperature}")
    norm = desc.attention.qk_norm is not None
    require(norm == (desc.routing.num_experts != LLAMA4_NO_NORM_EXPERTS), f"{name}: llama.cpp's llama4 takes a q/k "
            f"norm exactly when there are not {LLAMA4_NO_NORM_EXPERTS} experts; this model has {desc.routing.num_experts} "
            f"experts and use_qk_norm = {norm}")


def _write_llama4(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    writer.add_interleave_moe_layer_step(moe_layers[0] + 1)  # the layout the check holds to the step


def _lfm2_moe(name: str, config: dict, desc: ModelDescription) -> None:
    require(not config.get("conv_bias", False), f"{name}: llama.cpp's lfm2moe has no short-convolution biases")
    # its tensor list has no output.weight: the graph takes the embeddings as the lm_head
    require(config.get("tie_word_embeddings", True), f"{name}: an untied lm_head is not what llama.cpp's lfm2moe reads")
    convs = tuple(i for i, t in enumerate(config.get("layer_types") or []) if t == "conv")
    require(desc.attention.mixer_layers == convs, f"{name}: llama.cpp's lfm2moe takes attention or short-convolution "
            f"layers; this model's other layers are {desc.attention.mixer_layers}")


def _write_lfm2_moe(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    writer.add_shortconv_l_cache(config["conv_L_cache"])


def _qwen3_next(name: str, config: dict, desc: ModelDescription) -> None:
    _delta_net(name, "qwen3next", config, desc)


def _delta_net(name: str, arch: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's qwen3next and qwen35moe size each delta-net state as head_v_dim² with head_v_dim the key heads'
    width, and build every layer's shared expert."""
    require(config["linear_key_head_dim"] == config["linear_value_head_dim"],
            f"{name}: llama.cpp's {arch} takes key and value heads of one width in its delta-net layers; this "
            f"model's are {config['linear_key_head_dim']} and {config['linear_value_head_dim']}")
    require(desc.shared_experts == 1, f"{name}: llama.cpp's {arch} needs the gated shared expert; this model has "
            "shared_expert_intermediate_size = 0")
    # build_gdn_l2_norm divides q and k by sqrt(sum x² + rms_norm_eps); transformers' l2norm adds a fixed 1e-6
    require(config.get("rms_norm_eps") == QWEN3_NEXT_L2_EPS, f"{name}: llama.cpp's {arch} takes the delta-net's "
            f"q/k L2-norm eps from rms_norm_eps, transformers fixes it at {QWEN3_NEXT_L2_EPS}; this model's "
            f"rms_norm_eps is {config.get('rms_norm_eps')}")


def _write_qwen3_next(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The delta-net sizes as the converter writes them, and which layers are delta-net ones (the array, not the
    interval, so that any layer_types is written as it is)."""
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    mixers = set(desc.attention.mixer_layers)
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [i in mixers for i in range(desc.num_layers)])


def _qwen3_next_pieces(key: str, shape: tuple[int, ...], config: dict,
                       names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """What llama.cpp's converter rewrites: the fused in_proj_qkvz (per key head [q, k, v, z]) as the q, k, v rows of
    every head then z's; A_log as A = -exp(A_log); dt_bias as ssm_dt's bias; the (1 + w) RMSNorms as 1 + w (the
    gated norm of the delta-net output multiplies by w itself)."""
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    if key.endswith("linear_attn.in_proj_qkvz.weight"):
        return _qkvz(layer, shape, config)
    if key.endswith("linear_attn.A_log"):
        return [(f"blk.{layer}.ssm_a", shape, lambda t: -torch.exp(t.float()))]
    if key.endswith("linear_attn.dt_bias"):
        return [(f"blk.{layer}.ssm_dt.bias", shape, lambda t: t)]
    if key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: t.float() + 1)]
    return None


def _qkvz(layer: str, shape: tuple[int, ...], config: dict) -> list[gguf_mla.Piece]:
    k_heads, k_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
    v_width = config["linear_num_value_heads"] // k_heads * config["linear_value_head_dim"]  # per key head
    sizes = [k_dim, k_dim, v_width, v_width]
    split = lambda t: [p.reshape(-1, shape[1]) for p in t.view(k_heads, sum(sizes), shape[1]).split(sizes, dim=1)]
    qkv_rows = k_heads * (2 * k_dim + v_width)
    return [(f"blk.{layer}.attn_qkv.weight", (qkv_rows, shape[1]), lambda t: torch.cat(split(t)[:3]).contiguous()),
            (f"blk.{layer}.attn_gate.weight", (k_heads * v_width, shape[1]), lambda t: split(t)[3].contiguous())]


def _qwen3_5_moe(name: str, config: dict, desc: ModelDescription) -> None:
    """qwen3next's limits, and M-RoPE sections ggml can hold (it asserts they span at most a head)."""
    _delta_net(name, "qwen35moe", config, desc)
    _mrope_in_a_head(name, "qwen35moe", config, QWEN3_5_MROPE)


def _mrope_in_a_head(name: str, arch: str, config: dict, default: tuple[int, ...]) -> None:
    """ggml asserts that M-RoPE sections span at most a head."""
    sections = mrope_sections(config, default)
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    require(sum(sections) <= head, f"{name}: llama.cpp's {arch} takes M-RoPE sections spanning at most a head "
            f"({head}); this model's are {sections}")


def mrope_sections(config: dict, default: tuple[int, ...] = QWEN3_5_MROPE) -> list[int]:
    """M-RoPE sections (t, h, w and a fourth llama.cpp reads), the family's default where absent; on text every
    section turns by the one position, so any sections compute plain rotary."""
    sections = list(gguf_mla.rope_parameters(config).get("mrope_section") or default)
    return (sections + [0] * 4)[:4]


def _write_qwen3_5_moe(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    _write_qwen3_next(writer, config, desc, moe_layers)
    writer.add_rope_dimension_sections(mrope_sections(config))


def _qwen3_5_pieces(key: str, shape: tuple[int, ...], config: dict,
                    names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """What llama.cpp's converter rewrites: the delta-net's value heads from grouped by key head to tiled (v0 of every
    key head, then v1, ...: ggml broadcasts q and k so), in every tensor that has them; A_log as A = -exp(A_log); dt_bias
    as ssm_dt's bias; the kernel squeezed; the (1 + w) RMSNorms as 1 + w."""
    if "linear_attn." not in key:
        return _qwen3_next_pieces(key, shape, config, names)
    layer = key.split(".")[2]
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    tiled = lambda t, dim, width: (t.unflatten(dim, (k_heads, v_heads // k_heads, width)).transpose(dim, dim + 1)
                                   .flatten(dim, dim + 2).contiguous())
    v_dim, qk_rows = config["linear_value_head_dim"], 2 * k_heads * config["linear_key_head_dim"]
    tail = lambda t, width: torch.cat([t[:qk_rows], tiled(t[qk_rows:], 0, width)])
    if key.endswith("in_proj_qkv.weight"):
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: tail(t, v_dim))]
    if key.endswith("conv1d.weight"):  # [channels, 1, width]: q, k channels, then v's
        squeezed = (shape[0], shape[2])
        return [(names.get_name(key, try_suffixes=(".weight",)), squeezed, lambda t: tail(t.reshape(squeezed), v_dim))]
    if key.endswith("in_proj_z.weight"):
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: tiled(t, 0, v_dim))]
    if key.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: tiled(t, 0, 1))]
    if key.endswith("out_proj.weight"):
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: tiled(t, 1, v_dim))]
    if key.endswith("A_log"):
        return [(f"blk.{layer}.ssm_a", shape, lambda t: -torch.exp(tiled(t.float(), 0, 1)))]
    if key.endswith("dt_bias"):
        return [(f"blk.{layer}.ssm_dt.bias", shape, lambda t: tiled(t, 0, 1))]
    return None


def _mamba_basics(name: str, config: dict, arch: str) -> None:
    """What llama.cpp's Mamba layers fix: an inner size of twice the hidden size, a convolution bias, SiLU, no
    projection biases."""
    require(config.get("mamba_expand") == 2, f"{name}: llama.cpp's {arch} takes mamba_expand = 2; this model has "
            f"{config.get('mamba_expand')}")
    require(config.get("mamba_conv_bias", True), f"{name}: llama.cpp's {arch} adds a convolution bias; this model has "
            "mamba_conv_bias = false")
    require(not config.get("mamba_proj_bias", False), f"{name}: llama.cpp's {arch} has no Mamba projection biases")
    require(config.get("hidden_act", "silu") == "silu", f"{name}: llama.cpp's {arch} takes SiLU; this model has "
            f"{config.get('hidden_act')}")


def _granite_hybrid(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's granitehybrid runs Mamba2 layers with an inner size of twice the hidden size, a convolution bias,
    SiLU, no projection biases and no limit on the time step."""
    _mamba_basics(name, config, "granitehybrid")
    # transformers writes infinity as {"__float__": "Infinity"} in config.json
    limit = tuple(float(x["__float__"] if isinstance(x, dict) else x)
                  for x in config.get("time_step_limit") or (0.0, float("inf")))
    require(limit == (0.0, float("inf")), f"{name}: llama.cpp's granitehybrid does not clamp the time step; this "
            f"model's time_step_limit is {limit}")


def _write_granite_hybrid(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """Granite's multipliers, the Mamba2 sizes as the converter writes them, and rotary on or off for every
    attention layer (llama.cpp reads rope_finetuned as that switch)."""
    _write_granite(writer, config, desc, moe_layers)
    writer.add_ssm_conv_kernel(config["mamba_d_conv"])
    writer.add_ssm_state_size(config["mamba_d_state"])
    writer.add_ssm_group_count(config["mamba_n_groups"])
    writer.add_ssm_inner_size(config["mamba_expand"] * config["hidden_size"])
    writer.add_ssm_time_step_rank(config["mamba_n_heads"])
    writer.add_rope_scaling_finetuned(config.get("position_embedding_type") == "rope")


def _mamba2_pieces(key: str, shape: tuple[int, ...], config: dict,
                   names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """What llama.cpp's Mamba2 converter rewrites: A_log as A = -exp(A_log) and D, both [heads, 1]; dt_bias as
    ssm_dt's bias; the gated norm's weight as [groups, inner / groups], one row per group it normalises."""
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    return _mamba2_rewrites(key, shape, layer, "mamba.", config.get("mamba_n_groups", 1))


def _mamba2_rewrites(key: str, shape: tuple[int, ...], layer, module: str, n_groups: int) -> list | None:
    """The Mamba2 rewrites of _mamba2_pieces for a mixer module named `module` (Granite's "mamba.", Nemotron-H's
    "mixer.") with n_groups norm groups; None for any other tensor."""
    column = (*shape, 1)
    if key.endswith(module + "A_log"):
        return [(f"blk.{layer}.ssm_a", column, lambda t: -torch.exp(t.float()).reshape(column))]
    if key.endswith(module + "D"):
        return [(f"blk.{layer}.ssm_d", column, lambda t: t.reshape(column))]
    if key.endswith(module + "dt_bias"):
        return [(f"blk.{layer}.ssm_dt.bias", shape, lambda t: t)]
    if key.endswith(module + "norm.weight"):
        groups = (n_groups, shape[0] // n_groups)
        return [(f"blk.{layer}.ssm_norm.weight", groups, lambda t: t.reshape(groups))]
    return None


def _jamba(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's jamba runs Mamba layers with an inner size of twice the hidden size, a convolution bias, SiLU and no
    projection biases, and sizes q and the output projection as the hidden size."""
    _mamba_basics(name, config, "jamba")
    a = desc.attention
    require(a.heads * a.head_dim == desc.hidden_size, f"{name}: llama.cpp's jamba takes heads that span the hidden "
            f"size; this model has {a.heads} heads of {a.head_dim} for {desc.hidden_size}")


def _write_jamba(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The Mamba sizes as the converter writes them (a time-step rank of "auto" is transformers' ceil(hidden / 16))."""
    rank = config.get("mamba_dt_rank", "auto")
    writer.add_ssm_conv_kernel(config.get("mamba_d_conv", 4))
    writer.add_ssm_inner_size(config["mamba_expand"] * config["hidden_size"])
    writer.add_ssm_state_size(config.get("mamba_d_state", 16))
    writer.add_ssm_time_step_rank(-(config["hidden_size"] // -16) if rank == "auto" else rank)


def _mamba_pieces(key: str, shape: tuple[int, ...], config: dict,
                  names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """What llama.cpp's Mamba converter rewrites: A_log as A = -exp(A_log), [inner, state] as it is."""
    if key.endswith("mamba.A_log"):
        return [(f"blk.{key.split('.')[2]}.ssm_a", shape, lambda t: -torch.exp(t.float()))]
    return None


def _nemotron_h(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's nemotron_h_moe builds every feed-forward layer as ungated relu² experts beside one ungated shared
    expert, and Mamba2 layers with SiLU, no projection biases and no clamp on the time step."""
    kinds = config.get("layers_block_type") or list(config.get("hybrid_override_pattern") or "")
    dense = [i for i, kind in enumerate(kinds) if kind in ("mlp", "-")]
    require(not dense, f"{name}: llama.cpp's nemotron_h_moe builds every feed-forward layer as MoE; this model's layers "
            f"{dense} are dense MLPs")
    require(desc.experts.activation == "relu2" and not desc.experts.gated, f"{name}: llama.cpp's nemotron_h_moe takes "
            f"ungated relu² experts; this model's are {desc.experts.activation}")
    require(desc.shared_experts == 1, f"{name}: llama.cpp's nemotron_h_moe needs the shared expert; this model has "
            "moe_shared_expert_intermediate_size = 0")
    require(config.get("mamba_hidden_act", "silu") == "silu" and not config.get("use_bias", False),
            f"{name}: llama.cpp's nemotron_h_moe takes SiLU Mamba2 layers without projection biases; this model has "
            f"mamba_hidden_act = {config.get('mamba_hidden_act')}, use_bias = {config.get('use_bias')}")
    step = config.get("time_step_min", NEMOTRON_H_STEP_MIN)
    require(step <= NEMOTRON_H_STEP_MIN, f"{name}: llama.cpp's nemotron_h_moe does not clamp the Mamba2 time step, "
            f"transformers clamps it from below at time_step_min; this model's {step} is above the release's "
            f"{NEMOTRON_H_STEP_MIN}")


def _write_nemotron_h(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The Mamba2 sizes as the converter writes them, and the LayerNorm eps the loader requires (the RMSNorms' too)."""
    writer.add_ssm_conv_kernel(config["conv_kernel"])
    writer.add_ssm_state_size(config["ssm_state_size"])
    writer.add_ssm_group_count(config["n_groups"])
    writer.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
    writer.add_ssm_time_step_rank(config["mamba_num_heads"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])


def _nemotron_h_pieces(key: str, shape: tuple[int, ...], config: dict,
                       names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """What llama.cpp's converter rewrites in the mixers: A_log as A = -exp(A_log) and D, both [heads, 1]; dt_bias as
    ssm_dt's bias; the gated norm's weight as [groups, inner / groups]; the correction bias under its backbone name."""
    layer = key.split(".")[2] if ".layers." in key else None
    if key.endswith(CORRECTION_BIAS):
        return [(f"blk.{layer}.exp_probs_b.bias", shape, lambda t: t)]
    return _mamba2_rewrites(key, shape, layer, "mixer.", config.get("n_groups", 1))


def _minimax(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's minimax-01 scales the normalised input of both residuals of every layer by one residual_scale (the
    branch by 1); transformers' MiniMax turns the whole head (its rotary reads no partial factor)."""
    alphas = {k: config.get(k, 1) for k in MINIMAX_ALPHAS}
    betas = {k: config.get(k, 1) for k in MINIMAX_BETAS}
    require(len(set(alphas.values())) == 1 and set(betas.values()) == {1}, f"{name}: llama.cpp's minimax-01 scales every "
            f"residual by one factor and no branch; this model's factors are {alphas | betas}")
    factor = gguf_mla.rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    require(factor == 1.0, f"{name}: transformers' MiniMax turns the whole head; this model's partial_rotary_factor "
            f"{factor} would be written as a partial rotary")


def _write_minimax(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The residual scale, and which layers are lightning ones (the array, so that any layer_types is written)."""
    writer.add_residual_scale(float(config.get(MINIMAX_ALPHAS[0], 1)))
    mixers = set(desc.attention.mixer_layers)
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [i in mixers for i in range(desc.num_layers)])


def _minimax_pieces(key: str, shape: tuple[int, ...], config: dict,
                    names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The lightning layers' projections, gate and output norm under minimax-01's names; their decay buffers, which
    llama.cpp computes from the head count and depth, left out."""
    if ".self_attn." not in key:
        return None
    layer, tail = key.split(".")[2], key.split(".self_attn.")[1]
    if tail in MINIMAX_DECAYS:
        return []
    if tail in MINIMAX_LIGHTNING:
        return [(gguf.TENSOR_NAMES[MINIMAX_LIGHTNING[tail]].format(bid=int(layer)) + ".weight", shape, lambda t: t)]
    return None


def _qwen3_vl_moe(name: str, config: dict, desc: ModelDescription) -> None:
    _mrope_in_a_head(name, "qwen3vlmoe", config, QWEN3_VL_MROPE)


def _write_qwen3_vl_moe(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The M-RoPE sections and the count of layers that add the vision tower's deepstack features, as the converter
    writes them (text tokens add zeros there)."""
    writer.add_rope_dimension_sections(mrope_sections(config, QWEN3_VL_MROPE))
    writer.add_num_deepstack_layers(len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or []))


def _glm4v_moe(name: str, config: dict, desc: ModelDescription) -> None:
    _glm4_moe(name, config, desc)
    _mrope_in_a_head(name, "glm4moe", config, GLM4V_MROPE)


def _write_glm4v_moe(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The M-RoPE sections, which switch llama.cpp's glm4moe from NeoX rotary to M-RoPE (the same on text)."""
    writer.add_rope_dimension_sections(mrope_sections(config, GLM4V_MROPE))


def _kimi_linear(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's kimi-linear runs as many delta-attention heads as MLA ones, and its short convolutions with SiLU (the
    router's weights always normalised: the row's routing)."""
    require(config["linear_num_heads"] == config["num_attention_heads"], f"{name}: llama.cpp's kimi-linear takes as many "
            f"delta-attention heads as attention heads; this model has {config['linear_num_heads']} and "
            f"{config['num_attention_heads']}")
    require(config.get("hidden_act", "silu") == "silu", f"{name}: llama.cpp's kimi-linear convolves with SiLU; this "
            f"model has {config.get('hidden_act')}")


def _write_kimi_linear(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_kda_head_dim(config["linear_head_dim"])


def _kimi_linear_pieces(key: str, shape: tuple[int, ...], config: dict,
                        names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """What llama.cpp's converter rewrites: kv_b split as deepseek2's, A_log as A = -exp(A_log), dt_bias as ssm_dt's
    bias; the leading dense MLP, which Kimi names as its MoE block, under the dense names."""
    if (split := gguf_mla.pieces(key, shape, config)) is not None:
        return split
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    if key.endswith("self_attn.A_log"):
        return [(f"blk.{layer}.ssm_a", shape, lambda t: -torch.exp(t.float()))]
    if key.endswith("self_attn.dt_bias"):
        return [(f"blk.{layer}.ssm_dt.bias", shape, lambda t: t)]
    if re.search(r"\.block_sparse_moe\.(gate|up|down)_proj\.weight$", key):
        return [(names.get_name(key.replace("block_sparse_moe", "mlp"), try_suffixes=(".weight",)), shape, lambda t: t)]
    return None


GLM5_NEXT_HC_STREAMS = 4  # llama.cpp's glm5-next asserts four hyper-connection streams
GLM5_NEXT_INDEXER_KEY_NORM_EPS = 1e-6  # transformers' GLM-5.3 builds the indexer's key LayerNorm at this eps
# the indexer's tensors under llama.cpp's names, by their transformers names within self_attn.indexer
GLM5_NEXT_INDEXER = {"wq_b.weight": "indexer.attn_q_b.weight", "wk.weight": "indexer.attn_k.weight",
                     "k_norm.weight": "indexer.k_norm.weight", "k_norm.bias": "indexer.k_norm.bias",
                     "weights_proj.weight": "indexer.proj.weight",
                     "index_kpool_compress_gate": "indexer_compressor_gate.weight",
                     "index_kpool_compress_ape": "indexer_compressor_ape.weight"}


def _glm5_next(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's glm5-next runs as many delta-attention heads as MLA ones, four hyper-connection streams, pools of
    more than one key (a query before the first full pool attends to the incomplete one only), SiLU everywhere, a shared
    expert on every MoE layer, clamps only at a limit above 1e-6, and reads an untied output matrix."""
    require(config["linear_num_heads"] == config["num_attention_heads"], f"{name}: llama.cpp's glm5-next takes as many "
            f"delta-attention heads as attention heads; this model has {config['linear_num_heads']} and "
            f"{config['num_attention_heads']}")
    require(config["hc_mult"] == GLM5_NEXT_HC_STREAMS, f"{name}: llama.cpp's glm5-next takes {GLM5_NEXT_HC_STREAMS} "
            f"hyper-connection streams; this model's hc_mult is {config['hc_mult']}")
    require(config["index_kpool"] > 1, f"{name}: llama.cpp's glm5-next pools more than one key; this model's "
            f"index_kpool is {config['index_kpool']}")
    require(config["index_kpool_always_select_tail"], f"{name}: llama.cpp's glm5-next attends to no key before the "
            "first full pool unless it appends the incomplete one (its logits there are NaN); this model has "
            "index_kpool_always_select_tail = false")
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's glm5-next takes SiLU convolutions and MLPs; this "
            f"model's hidden_act is {desc.experts.activation}")
    require(desc.shared_experts >= 1, f"{name}: llama.cpp's glm5-next adds a shared expert to every MoE layer; this "
            "model has n_shared_experts = 0")
    require(config["swiglu_limit"] > SWIGLU_CLAMP_MIN, f"{name}: llama.cpp's glm5-next takes a swiglu_limit at or "
            f"below {SWIGLU_CLAMP_MIN} as none, transformers clamps at it; this model's is {config['swiglu_limit']}")
    _untied(name, "glm5-next", config)


def _write_glm5_next(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """What llama.cpp's converter writes beside the MLA keys: the delta-attention's kernel, head width and gate bound
    (none: softplus), the indexer's sizes and pools, the indexer's key-norm eps, the hyper-connections and every
    MLP's SwiGLU clamp."""
    arch, limit = writer.arch, float(config["swiglu_limit"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_kda_head_dim(config["linear_head_dim"])
    if config.get("linear_lower_bound") is not None:
        writer.add_float32(f"{arch}.kda.gate_lower_bound", float(config["linear_lower_bound"]))
    writer.add_indexer_head_count(config["index_n_heads"])
    writer.add_indexer_key_length(config["index_head_dim"])
    writer.add_indexer_top_k(config["index_topk"])
    writer.add_uint32(f"{arch}.attention.indexer.kpool", config["index_kpool"])
    writer.add_bool(f"{arch}.attention.indexer.kpool_select_tail", bool(config["index_kpool_always_select_tail"]))
    writer.add_layer_norm_eps(GLM5_NEXT_INDEXER_KEY_NORM_EPS)
    writer.add_uint32(f"{arch}.hyper_connection.count", config["hc_mult"])
    writer.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", config["hc_sinkhorn_iters"])
    writer.add_float32(f"{arch}.hyper_connection.epsilon", config["hc_eps"])
    writer.add_swiglu_clamp_exp([limit] * desc.num_layers)
    writer.add_swiglu_clamp_shexp([limit] * desc.num_layers)  # the graph clamps the dense MLPs with it too


def _glm5_next_pieces(key: str, shape: tuple[int, ...], config: dict,
                      names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """kimi-linear's rewrites (kv_b split, A = -exp(A_log), dt_bias as ssm_dt's bias); the hyper-connections' fn, base
    and scale and the indexer's tensors (the k-pool compressor's included) under llama.cpp's names."""
    if m := re.fullmatch(r"model\.layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)", key):
        return [(f"blk.{m[1]}.hc_{m[2]}_{m[3]}.weight", shape, lambda t: t)]
    if m := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.indexer\.(.+)", key):
        require(m[2] in GLM5_NEXT_INDEXER, f"trunk tensor {key}: no llama.cpp name for it in glm5-next")
        return [(f"blk.{m[1]}.{GLM5_NEXT_INDEXER[m[2]]}", shape, lambda t: t)]
    return _kimi_linear_pieces(key, shape, config, names)


def _granite_swa(name: str, config: dict, desc: ModelDescription) -> None:
    require(bool(desc.attention.sliding_layers), f"{name}: llama.cpp's granite_swa needs sliding-window layers (it "
            "reads their pattern)")


def _write_granite_swa(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """Granite's multipliers, and which layers turn by rotary (the converter's rope_pattern)."""
    _write_granite(writer, config, desc, moe_layers)
    nope = set(desc.attention.nope_layers)
    writer.add_array(f"{writer.arch}.attention.rope_pattern", [i not in nope for i in range(desc.num_layers)])


def _granite_swa_pieces(key: str, shape: tuple[int, ...], config: dict,
                        names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The shared MLP's input_linear kept fused as ffn_up_shexp (gate rows, then up rows: llama.cpp's SwiGLU halves); the
    router, block_sparse_moe.router, as ffn_gate_inp."""
    tensor = {GRANITE_SHARED_IN: gguf.MODEL_TENSOR.FFN_UP_SHEXP, "block_sparse_moe.router.weight": gguf.MODEL_TENSOR.FFN_GATE_INP}
    for suffix, name in tensor.items():
        if key.endswith(suffix):
            return [(f"{gguf.TENSOR_NAMES[name].format(bid=int(key.split('.')[2]))}.weight", shape, lambda t: t)]
    return None


def _mellum(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's mellum rotates whole heads with plain RoPE, and its sliding layers at the full layers' base: it
    reads rope.freq_base_swa but its graph passes the context's base to every layer."""
    rope = gguf_mla.rope_parameters(config)
    for kind in ("full_attention", "sliding_attention"):
        params = rope.get(kind, rope)
        require(params.get("rope_type", "default") == "default" and params.get("partial_rotary_factor", 1.0) == 1.0,
                f"{name}: llama.cpp's mellum takes plain RoPE over the whole head; this model's {kind} layers take "
                f"{params}")
    bases = {kind: rope.get(kind, rope).get("rope_theta") for kind in ("full_attention", "sliding_attention")}
    require(not desc.attention.sliding_layers or len(set(bases.values())) == 1, f"{name}: llama.cpp's mellum rotates "
            f"sliding layers at the full layers' base; this model's bases are {bases}")


def _hy_v3_pieces(key: str, shape: tuple[int, ...], config: dict,
                  names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """hy_v3 loads the correction bias as blk.N.exp_probs_b, without the .bias the other graphs read."""
    if key.endswith("mlp.expert_bias"):
        return [(f"blk.{key.split('.')[2]}.exp_probs_b", shape, lambda t: t)]
    return None


GEMMA4_ROUTING = "per-expert scales over a normalised router input"


def _gemma4(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's gemma4 runs tanh-GELU experts and dense MLPs, plain RoPE on the sliding layers and proportional RoPE
    (or plain over the whole head) on the full ones; the per-layer embeddings of the small models are not written."""
    require(desc.experts.activation == "gelu_pytorch_tanh", f"{name}: llama.cpp's gemma4 takes tanh-GELU experts; this "
            f"model's are {desc.experts.activation}")
    require(not config.get("hidden_size_per_layer_input"), f"{name}: per-layer embeddings are not exported to GGUF")
    kinds = {t: {(o.get("head_dim", config["head_dim"]), o.get("num_key_value_heads")) for o, u in
                 zip(_layer_overrides(config), config["layer_types"]) if u == t} for t in set(config["layer_types"])}
    require(len(kinds.get("full_attention", ())) <= 1 and kinds.get("sliding_attention", {(config["head_dim"], None)})
            == {(config["head_dim"], None)}, f"{name}: llama.cpp's gemma4 takes one head width and key/value head count "
            f"for the full layers and the config's for the sliding ones; this model's per_layer_config has {kinds}")
    require(not config.get("use_double_wide_mlp"), f"{name}: the double-wide MLPs of shared-KV layers are not exported "
            "to GGUF")
    rope = gguf_mla.rope_parameters(config)
    sliding, full = rope.get("sliding_attention", rope), rope.get("full_attention", rope)
    require(sliding.get("rope_type", "default") == "default", f"{name}: llama.cpp's gemma4 takes plain RoPE on sliding "
            f"layers; this model's are {sliding}")
    require(full.get("rope_type", "default") == "proportional" or full.get("partial_rotary_factor", 1.0) == 1.0,
            f"{name}: llama.cpp's gemma4 takes proportional RoPE or plain RoPE over the whole head on full layers; this "
            f"model's are {full}")


def _write_gemma4(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The sliding layers' head width, rotary width and base; no shared-KV layers nor per-layer embeddings; the final
    softcap (0: none, where llama.cpp's default is 30)."""
    rope = gguf_mla.rope_parameters(config)
    sliding = rope.get("sliding_attention", rope)
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    writer.add_rope_dimension_count_swa(int(config["head_dim"] * sliding.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base_swa(float(sliding.get("rope_theta", 10000.0)))
    writer.add_shared_kv_layers(config.get("num_kv_shared_layers") or 0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_final_logit_softcapping(float(config.get("final_logit_softcapping") or 0.0))


def _gemma4_pieces(key: str, shape: tuple[int, ...], config: dict,
                   names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The router's input scale and per-expert scale (on the experts' outputs, as ffn_down_exps.scale), the layer
    scalar; and beside the final norm the full layers' RoPE frequency factors: 1 on the rotated pairs, 1e30 (no turn) on
    the others, which is proportional RoPE in NeoX order, as llama.cpp's converter writes it."""
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    if key.endswith("router.scale"):
        return [(f"blk.{layer}.ffn_gate_inp.scale", shape, lambda t: t)]
    if key.endswith("router.per_expert_scale"):
        return [(f"blk.{layer}.ffn_down_exps.scale", shape, lambda t: t)]
    if key.endswith("layer_scalar"):
        return [(f"blk.{layer}.layer_output_scale.weight", shape, lambda t: t)]
    if key == "model.norm.weight":
        full = gguf_mla.rope_parameters(config)
        full = full.get("full_attention", full)
        pairs = _global_head_dim(config) // 2
        turned = int(pairs * full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else pairs
        factors = torch.tensor([1.0] * turned + [1e30] * (pairs - turned))
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: t),
                ("rope_freqs.weight", (pairs,), lambda t: factors)]
    return None


def _layer_overrides(config: dict) -> list[dict]:
    """Gemma 4's per_layer_config (transformers' from global_head_dim and num_global_key_value_heads), one per layer."""
    overrides = config.get("per_layer_config") or {}
    return [overrides.get(str(i), {}) for i in range(config["num_hidden_layers"])]


def _global_head_dim(config: dict) -> int:
    """The full layers' head width (the check holds them to one, as llama.cpp's key_length)."""
    full = [o.get("head_dim", config["head_dim"]) for o, t in zip(_layer_overrides(config), config["layer_types"])
            if t == "full_attention"]
    return full[0] if full else config["head_dim"]


def _cohere2_moe(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's cohere2moe rotates the sliding layers and the leading dense ones and no other, averages the shared
    experts with the routed ones, and runs SiLU experts; it reads the sliding pattern, which a model needs to have."""
    a = desc.attention
    require(bool(a.sliding_layers), f"{name}: llama.cpp's cohere2moe needs sliding-window layers (it reads their "
            "window and pattern)")
    lead = min(desc.moe_layers, default=desc.num_layers)
    unturned = tuple(i for i in range(desc.num_layers) if i not in set(a.sliding_layers) and i >= lead)
    require(a.nope_layers == unturned, f"{name}: llama.cpp's cohere2moe rotates the sliding layers and the leading "
            f"dense ones; this model's layers without rotary are {a.nope_layers}, not {unturned}")
    require(not desc.shared_experts or "shared_average" in desc.extras, f"{name}: llama.cpp's cohere2moe averages the "
            f"shared experts with the routed ones; this model's shared_expert_combination_strategy is "
            f"{config.get('shared_expert_combination_strategy')!r}")
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's cohere2moe takes SiLU experts; this model's are "
            f"{desc.experts.activation}")
    require(desc.multipliers.logits != float("inf"), f"{name}: llama.cpp's cohere2moe reads a logit_scale of 0 as none")


def _write_cohere2_moe(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The logit scale, and LayerNorm's eps where the model has no RMSNorm (llama.cpp takes the norm whose eps it
    finds)."""
    writer.add_logit_scale(float(config.get("logit_scale", 1.0)))
    if "layer_norm" in desc.extras:
        writer.add_layer_norm_eps(config["layer_norm_eps"])


def _mimo_v2_flash(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's mimo2 turns every layer by one plain rotary width (the sliding layers at their own base) and reads
    the sliding pattern, which a model needs to have; it runs SiLU experts."""
    require(bool(desc.attention.sliding_layers), f"{name}: llama.cpp's mimo2 needs sliding-window layers (it reads "
            "their window and pattern)")
    rope = gguf_mla.rope_parameters(config)
    kinds = {t: rope.get(t) or {} for t in ("full_attention", "sliding_attention")}
    factors = {t: p.get("partial_rotary_factor") for t, p in kinds.items()}
    require(None not in factors.values() and len(set(factors.values())) == 1, f"{name}: llama.cpp's mimo2 turns one "
            f"rotary width on every layer; this model's partial_rotary_factor per layer type is {factors}")
    types = {t: p.get("rope_type", "default") for t, p in kinds.items()}
    require(set(types.values()) == {"default"}, f"{name}: RoPE scaling {types} is not exported to GGUF")
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's mimo2 takes SiLU experts; this model's are "
            f"{desc.experts.activation}")


def _write_mimo_v2_flash(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The sliding layers' rotary base and the value scale (llama.cpp takes 1 as none)."""
    writer.add_rope_freq_base_swa(float(gguf_mla.rope_parameters(config)["sliding_attention"]["rope_theta"]))
    writer.add_float32(f"{writer.arch}.attention.value_scale", float(config.get("attention_value_scale") or 1.0))


def _mimo_v2_flash_pieces(key: str, shape: tuple[int, ...], config: dict,
                          names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The sink logits under their release name (attention_sink_bias, as transformers saves them) as attn_sinks.weight."""
    if key.endswith("self_attn.attention_sink_bias"):
        return [(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_SINKS].format(bid=int(key.split('.')[2]))}.weight", shape,
                 lambda t: t)]
    return None


def _laguna(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's laguna turns each layer type by its own rotary part and base without scaling, and runs SiLU
    experts."""
    rope = gguf_mla.rope_parameters(config)
    types = {t: (rope.get(t) or {}).get("rope_type", "default") for t in ("full_attention", "sliding_attention")}
    require(set(types.values()) == {"default"}, f"{name}: RoPE scaling {types} is not exported to GGUF")
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's laguna takes SiLU experts; this model's are "
            f"{desc.experts.activation}")


def _write_laguna(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The sliding layers' rotary part and base."""
    sliding = gguf_mla.rope_parameters(config).get("sliding_attention")
    if sliding:
        writer.add_rope_dimension_count_swa(int(config["head_dim"] * sliding.get("partial_rotary_factor", 1.0)))
        writer.add_rope_freq_base_swa(float(sliding["rope_theta"]))


def _laguna_pieces(key: str, shape: tuple[int, ...], config: dict,
                   names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The norm before the MLP, which afmoe's names take for one after attention, as ffn_norm."""
    if key.endswith("post_attention_layernorm.weight"):
        return [(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_NORM].format(bid=int(key.split('.')[2]))}.weight", shape,
                 lambda t: t)]
    return None


STEP35_ROTARY = {"full_attention": 0.5, "sliding_attention": 1.0}  # llama.cpp's step35: half of each head on full layers


def _step3p7(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's step35 gates each head (not each channel), turns half of each head on the full layers and all of
    it on the sliding ones without scaling, and scores by 1 / sqrt(head_dim) (a query_pre_attn_scalar that is not
    head_dim is the description's multipliers, refused with the other extras); its graph asserts that a layer slides."""
    require(bool(desc.attention.sliding_layers), f"{name}: llama.cpp's step35 needs sliding-window layers (its graph "
            "asserts one)")
    gating = config.get("gating", True)
    require(gating is True or gating == "per-head", f"{name}: llama.cpp's step35 gates each head's output; this "
            f"model's gating is {gating!r} (a gate per channel)")
    rope = gguf_mla.rope_parameters(config)
    kinds = {t: rope.get(t) or {} for t in set(config.get("layer_types") or ("full_attention",))}
    types = {t: p.get("rope_type", "default") for t, p in kinds.items()}
    require(set(types.values()) == {"default"}, f"{name}: RoPE scaling {types} is not exported to GGUF")
    factors = {t: p.get("partial_rotary_factor", 1.0) for t, p in kinds.items()}
    want = {t: STEP35_ROTARY.get(t) for t in factors}
    require(factors == want, f"{name}: llama.cpp's step35 turns half of each head on the full layers and all of it on "
            f"the sliding ones; this model's partial_rotary_factor per layer type is {factors}")


def _write_step3p7(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The clamps per layer (0: none) and the sliding layers' rotary base."""
    n = desc.num_layers
    writer.add_swiglu_clamp_exp([float(v or 0.0) for v in config.get("swiglu_limits") or [0.0] * n])
    writer.add_swiglu_clamp_shexp([float(v or 0.0) for v in config.get("swiglu_limits_shared") or [0.0] * n])
    writer.add_rope_freq_base_swa(float(gguf_mla.rope_parameters(config)["sliding_attention"]["rope_theta"]))


def _step3p7_pieces(key: str, shape: tuple[int, ...], config: dict,
                    names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The (1 + w) RMSNorms as 1 + w, and the release's router_bias as exp_probs_b, as the converter writes them."""
    if key.endswith("norm.weight"):
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: t.float() + 1)]
    if key.endswith(".moe.router_bias"):
        return [(names.get_name(f"{key}.bias", try_suffixes=(".bias",)), shape, lambda t: t)]
    return None


# llama.cpp's hy_v4 clamps the experts' SwiGLU only at a limit above this (build_moe_ffn); transformers' at any
SWIGLU_CLAMP_MIN = 1e-6
# the trunk tensors whose rows hold rotary parts (the last qk_rope_head_dim rows of each head), with the config key of
# their head count (None: one head)
HY_V4_ROTARY_ROWS = {"self_attn.q_b_proj.weight": "num_attention_heads", "self_attn.kv_a_proj_with_mqa.weight": None,
                     "self_attn.indexer.wq_b.weight": "index_n_heads", "self_attn.indexer.wk.weight": None,
                     "self_attn.indexer.k_norm.weight": None, "self_attn.indexer.k_norm.bias": None}


def _untied(name: str, arch: str, config: dict) -> None:
    require(not config.get("tie_word_embeddings"), f"{name}: llama.cpp's {arch} reads an output matrix of its own; this "
            "model ties it to the embeddings")


def _hy_v4(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's hy_v4 builds a shared expert on every MoE layer and SiLU everywhere (transformers' HY-V4 takes
    hidden_act on its dense and shared MLPs), clamps the experts only at a limit above 1e-6, turns the indexer's rotary
    part inside its heads, needs the first layer to run its own indexer and reads an untied output matrix."""
    require(desc.shared_experts >= 1, f"{name}: llama.cpp's hy_v4 adds a shared expert to every MoE layer; this model "
            "has n_shared_experts = 0")
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's hy_v4 takes SiLU MLPs; this model's hidden_act is "
            f"{desc.experts.activation}")
    require(config["swiglu_limit"] > SWIGLU_CLAMP_MIN, f"{name}: llama.cpp's hy_v4 takes a swiglu_limit at or below "
            f"{SWIGLU_CLAMP_MIN} as none, transformers clamps at it; this model's is {config['swiglu_limit']}")
    require(config["index_head_dim"] > config["qk_rope_head_dim"], f"{name}: llama.cpp's hy_v4 needs indexer heads "
            f"wider than the rotary part ({config['qk_rope_head_dim']}); this model's index_head_dim is "
            f"{config['index_head_dim']}")
    require(config["indexer_types"][0] == "full", f"{name}: llama.cpp's hy_v4 needs layer 0 to run its own indexer; "
            f"this model's indexer_types start with {config['indexer_types'][0]!r}")
    _untied(name, "hy_v4", config)


def _write_hy_v4(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The hyper-connections' stream count, eps and magnitude, and the experts' SwiGLU clamp on every layer."""
    writer.add_uint32(f"{writer.arch}.hyper_connection.count", config["hc_mult"])
    writer.add_float32(f"{writer.arch}.hyper_connection.epsilon", config["hc_eps"])
    writer.add_float32(f"{writer.arch}.hyper_connection.magnitude", config["hc_magnitude"])
    writer.add_swiglu_clamp_exp([float(config["swiglu_limit"])] * desc.num_layers)


def _hy_v4_pieces(key: str, shape: tuple[int, ...], config: dict,
                  names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """kv_b split as deepseek2's; the hyper-connections' fn, base and scale under llama.cpp's names; the output gate
    as attn_gate; the rotary rows of the queries and keys (the indexer's too) reordered into adjacent pairs."""
    if (split := gguf_mla.pieces(key, shape, config)) is not None:
        return split
    if m := re.fullmatch(r"model\.layers\.(\d+)\.(attn|ffn)_hc\.(fn|base|scale)", key):
        return [(f"blk.{m[1]}.hc_{m[2]}_{m[3]}.weight", shape, lambda t: t)]
    if m := re.fullmatch(r"model\.hc_head\.hc_(fn|base|scale)", key):
        return [(f"output_hc_{m[1]}.weight", shape, lambda t: t)]
    if key.endswith("self_attn.gate_proj.weight"):
        return [(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_GATE].format(bid=int(key.split('.')[2]))}.weight", shape,
                 lambda t: t)]
    rows = next((k for k in HY_V4_ROTARY_ROWS if key.endswith(k)), None)
    if rows is not None:
        heads = config[HY_V4_ROTARY_ROWS[rows]] if HY_V4_ROTARY_ROWS[rows] else 1
        return [(names.get_name(key, try_suffixes=(".weight", ".bias")), shape,
                 lambda t: rotary_in_pairs(t, heads, config["qk_rope_head_dim"]))]
    return None


DEEPSEEK_V4_ROUTING = "sqrt of softplus"  # the description's name of DeepSeek-V4's scores (llama.cpp's sqrtsoftplus)
# the compression of each layer type llama.cpp's deepseek4 computes (its compress_ratios: 0 on the sliding layers)
DEEPSEEK_V4_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
HADAMARD_MIN = 64  # the smallest Hadamard rotation llama.cpp's caches apply to the indexer's keys
DEEPSEEK_V4_GATING = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, which the pinned gguf package lacks
# the release's tensor names (a vault keeps them) as llama.cpp's deepseek4 names them, by suffix within a layer
DEEPSEEK_V4_LAYER = {"attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
                     "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wq_b.weight": "attn_q_b.weight",
                     "attn.wkv.weight": "attn_kv.weight", "attn.norm.weight": "attn_kv_a_norm.weight",
                     "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
                     "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
                     "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
                     "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",  # [vocab, top_k], written I32 (HASH_TABLE)
                     "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
                     "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
                     "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
                     "attn.compressor.ape": "attn_compressor_ape.weight",
                     "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
                     "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
                     "attn.compressor.norm.weight": "attn_compressor_norm.weight",
                     "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
                     "attn.indexer.weights_proj.weight": "indexer.proj.weight",
                     "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
                     "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
                     "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
                     "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
                     **{f"hc_{b}_{p}": f"hc_{b}_{p}.weight" for b in ("attn", "ffn") for p in ("fn", "base", "scale")}}
DEEPSEEK_V4_ROOT = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "head.weight": "output.weight", "lm_head.weight": "output.weight",
                    **{f"model.hc_head.hc_{p}": f"output_hc_{p}.weight" for p in ("fn", "base", "scale")}}


def _deepseek_v4(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's deepseek4 routes by the token id the first hash_layer_count layers only, compresses by 4 and 128
    only, turns its rotary unscaled (as written), projects the output by groups of whole heads, clamps only at a limit
    above 1e-6, runs SiLU and reads no biases and an untied output matrix."""
    rates = config["compress_rates"]
    require(rates == DEEPSEEK_V4_RATES, f"{name}: llama.cpp's deepseek4 compresses by {DEEPSEEK_V4_RATES}; this "
            f"model's compress_rates are {rates}")
    mlp = config["mlp_layer_types"]
    hashed = deepseek_v4_hash_layers(config)
    require(mlp[:hashed] == ["hash_moe"] * hashed, f"{name}: llama.cpp's deepseek4 routes by the token id the first "
            f"hash_layer_count layers only; this model's mlp_layer_types are {mlp}")
    require(config["num_attention_heads"] % config["o_groups"] == 0, f"{name}: llama.cpp's deepseek4 projects the "
            f"output by groups of whole heads; this model's {config['o_groups']} o_groups do not divide its "
            f"{config['num_attention_heads']} heads")
    require("compressed_sparse_attention" in config["layer_types"], f"{name}: llama.cpp's deepseek4 needs a "
            "compressed_sparse_attention layer (its indexer's cache divides by zero without one); this model's "
            f"layer_types are {config['layer_types']}")
    require(config["index_head_dim"] % HADAMARD_MIN == 0, f"{name}: llama.cpp's deepseek4 rotates the indexer's keys "
            f"by Hadamard matrices of {HADAMARD_MIN} or more and needs indexer heads of a multiple of {HADAMARD_MIN}; "
            f"this model's index_head_dim is {config['index_head_dim']}")
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's deepseek4 takes SiLU MLPs; this model's "
            f"hidden_act is {desc.experts.activation}")
    require(config["swiglu_limit"] > SWIGLU_CLAMP_MIN, f"{name}: llama.cpp's deepseek4 takes a swiglu_limit at or "
            f"below {SWIGLU_CLAMP_MIN} as none, transformers clamps at it; this model's is {config['swiglu_limit']}")
    for kind, rope in config["rope_parameters"].items():
        require(rope.get("rope_type", "default") == "default", f"{name}: RoPE scaling {rope.get('rope_type')!r} "
                f"({kind}) is not exported to GGUF")
    require(not config.get("attention_bias") and not config.get("mlp_bias"), f"{name}: llama.cpp's deepseek4 reads "
            "no biases on the attention or the MLPs")
    _untied(name, "deepseek4", config)


def deepseek_v4_hash_layers(config: dict) -> int:
    """llama.cpp's hash_layer_count: how many mlp_layer_types are "hash_moe" (_deepseek_v4 checks they come first)."""
    return list(config["mlp_layer_types"]).count("hash_moe")


def _write_deepseek_v4(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """What llama.cpp's converter writes: the query's rank, the grouped output, the routing (sqrtsoftplus), the
    clamps, the hyper-connections, the compression of each layer (0 on the sliding ones), the hash layers' count, and
    the indexer's sizes."""
    n, r = config["num_hidden_layers"], desc.routing
    writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_expert_shared_count(desc.shared_experts)
    writer.add_uint32(f"{writer.arch}.expert_gating_func", DEEPSEEK_V4_GATING)
    writer.add_expert_weights_scale(r.scale)
    writer.add_expert_weights_norm(r.normalise)
    writer.add_swiglu_clamp_exp([float(config["swiglu_limit"])] * n)
    writer.add_swiglu_clamp_shexp([float(config["swiglu_limit"])] * n)
    writer.add_uint32(f"{writer.arch}.attention.indexer.head_count", config["index_n_heads"])
    writer.add_uint32(f"{writer.arch}.attention.indexer.key_length", config["index_head_dim"])
    writer.add_uint32(f"{writer.arch}.attention.indexer.top_k", config["index_topk"])
    writer.add_uint32(f"{writer.arch}.attention.output_group_count", config["o_groups"])
    writer.add_uint32(f"{writer.arch}.attention.output_lora_rank", config["o_lora_rank"])
    ratios = [config["compress_rates"].get(t, 0) for t in config["layer_types"]]
    writer.add_array(f"{writer.arch}.attention.compress_ratios", ratios)
    writer.add_float32(f"{writer.arch}.attention.compress_rope_freq_base",
                       float(config["rope_parameters"]["compress"]["rope_theta"]))
    writer.add_uint32(f"{writer.arch}.hyper_connection.count", config["hc_mult"])
    writer.add_uint32(f"{writer.arch}.hyper_connection.sinkhorn_iterations", config["hc_sinkhorn_iters"])
    writer.add_float32(f"{writer.arch}.hyper_connection.epsilon", config["hc_eps"])
    writer.add_uint32(f"{writer.arch}.hash_layer_count", deepseek_v4_hash_layers(config))
    writer.add_uint32(f"{writer.arch}.embedding_length_out", config["hidden_size"] * config["hc_mult"])


def _deepseek_v4_pieces(key: str, shape: tuple[int, ...], config: dict,
                        names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """Every trunk tensor under llama.cpp's deepseek4 name, as the release (and the vault) names it."""
    if key in DEEPSEEK_V4_ROOT:
        return [(DEEPSEEK_V4_ROOT[key], shape, lambda t: t)]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
    require(m is not None and m[2] in DEEPSEEK_V4_LAYER, f"trunk tensor {key}: no llama.cpp name for it in deepseek4")
    keep = (lambda t: expert_ids(key, t, config["n_routed_experts"])) if key.endswith(HASH_TABLE) else (lambda t: t)
    return [(f"blk.{m[1]}.{DEEPSEEK_V4_LAYER[m[2]]}", shape, keep)]


def expert_ids(key: str, table: torch.Tensor, experts: int) -> torch.Tensor:
    """The token-id table as it is, once every entry is an expert llama.cpp can look up (it reads the ids unchecked)."""
    require(table.numel() == 0 or (int(table.min()) >= 0 and int(table.max()) < experts),
            f"trunk tensor {key}: expert ids outside 0..{experts - 1} (from {int(table.min())} to {int(table.max())})")
    return table


def rotary_in_pairs(t: torch.Tensor, heads: int, rope: int) -> torch.Tensor:
    """Each head's last `rope` rows from transformers' two halves to llama.cpp's adjacent pairs (permute_rope)."""
    rows = t.reshape(heads, t.shape[0] // heads, *t.shape[1:])
    turned = permute_rope(rows[:, -rope:].reshape(heads * rope, *t.shape[1:]), heads)
    return torch.cat([rows[:, :-rope], turned.reshape(heads, rope, *t.shape[1:])], dim=1).reshape(t.shape)


# the release names of MiniMax-M3's text model as transformers renames them on load (its experts are the vault's own)
MINIMAX_M3_RENAMES = ((r"^language_model\.lm_head\.", "lm_head."),
                      (r"^language_model\.model\.", "model.language_model."),
                      (r"\.block_sparse_moe\.(gate|shared_experts)\.", r".mlp.\1."),
                      (r"\.block_sparse_moe\.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                      (r"\.self_attn\.index_(q|k)_(proj|norm)\.", r".self_attn.indexer.\1_\2."))
MINIMAX_M3_SPARSE = "minimax_m3_sparse"  # the layer type whose attention its indexer makes block-sparse
# the MLPs minimax-m3 names beside minimax-m2's tensors: the dense layers' and the shared expert's
MINIMAX_M3_MLPS = {"mlp.gate_proj": gguf.MODEL_TENSOR.FFN_GATE, "mlp.up_proj": gguf.MODEL_TENSOR.FFN_UP,
                   "mlp.down_proj": gguf.MODEL_TENSOR.FFN_DOWN,
                   "mlp.shared_experts.gate_proj": gguf.MODEL_TENSOR.FFN_GATE_SHEXP,
                   "mlp.shared_experts.up_proj": gguf.MODEL_TENSOR.FFN_UP_SHEXP,
                   "mlp.shared_experts.down_proj": gguf.MODEL_TENSOR.FFN_DOWN_SHEXP}


def _minimax_m3(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's minimax-m3 runs gpt-oss's SwiGLU at alpha 1.702 and limit 7, attends block-sparsely on exactly the
    MoE layers with one indexer head per key/value head, turns the indexer's heads by the attention's rotary width and
    reads an untied output matrix."""
    require(desc.experts.clamp == OAI_CLAMP, f"{name}: llama.cpp's minimax-m3 clamps SwiGLU at alpha 1.702, limit 7; "
            f"this model has {desc.experts.clamp}")
    sparse = [i for i, t in enumerate(config["layer_types"]) if t == MINIMAX_M3_SPARSE]
    require(sparse == list(desc.moe_layers), f"{name}: llama.cpp's minimax-m3 attends block-sparsely on exactly "
            f"the MoE layers {list(desc.moe_layers)}; this model's sparse layers are {sparse}")
    require(config["index_n_heads"] == desc.attention.kv_heads, f"{name}: llama.cpp's minimax-m3 takes one indexer "
            f"head per key/value head ({desc.attention.kv_heads}); this model has index_n_heads "
            f"{config['index_n_heads']}")
    rotary = int(config["head_dim"] * gguf_mla.rope_parameters(config).get("partial_rotary_factor", 1.0))
    require(rotary <= config["index_head_dim"], f"{name}: llama.cpp's minimax-m3 turns {rotary} dimensions of each "
            f"indexer head; this model's index_head_dim is {config['index_head_dim']}")
    _untied(name, "minimax-m3", config)


def _write_minimax_m3(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The indexer: its heads, their width, the blocks of keys it keeps, their size and the local ones always kept."""
    writer.add_indexer_head_count(config["index_n_heads"])
    writer.add_indexer_key_length(config["index_head_dim"])
    writer.add_indexer_top_k(config["index_topk_blocks"])
    writer.add_uint32(f"{writer.arch}.attention.indexer.block_size", config["index_block_size"])
    writer.add_uint32(f"{writer.arch}.attention.indexer.local_blocks", config["index_local_blocks"])


def _minimax_m3_pieces(key: str, shape: tuple[int, ...], config: dict,
                       names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The (1 + w) RMSNorms as 1 + w (the indexer's too), as the converter writes them; the indexer, the dense MLPs and
    the shared expert under minimax-m3's names."""
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    if m := re.fullmatch(r"model\.layers\.\d+\.self_attn\.indexer\.(q|k)_(proj|norm)\.weight", key):
        offset = 1.0 if m[2] == "norm" else 0.0
        return [(f"blk.{layer}.indexer.{m[1]}_{m[2]}.weight", shape, lambda t: t.float() + offset)]
    if key.endswith("norm.weight"):
        return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t: t.float() + 1)]
    if m := re.fullmatch(r"model\.layers\.\d+\.(mlp\.(?:shared_experts\.)?\w+_proj)\.weight", key):
        return [(f"{gguf.TENSOR_NAMES[MINIMAX_M3_MLPS[m[1]]].format(bid=int(layer))}.weight", shape, lambda t: t)]
    return None


DOTS3_TYPES = ("indexed_attention", "sliding_attention")  # the layer types llama.cpp's dots3note builds


def dots3_layer(config: dict, layer: int) -> dict:
    """The config of one Dots3-Note layer: its per_layer_config values over the model's."""
    return config | _layer_overrides(config)[layer]


def _dots3_note(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's dots3note builds indexed and sliding layers (transformers holds each kind to one MLA geometry) with
    one rotary width and one q_lora rank for both, rotary without scaling, SiLU MLPs and an indexer rotated by a
    Hadamard matrix of a power of two from 64; it reads a sliding window and the indexer's sizes."""
    release = sorted(k for k in config if k.startswith("swa_"))
    require(not release, f"{name}: a config in the release's layout ({', '.join(release)}), whose sliding layers' sizes "
            "transformers reads into per_layer_config; export a vault of the checkpoint as transformers saves it")
    types = config["layer_types"]
    require(set(types) <= set(DOTS3_TYPES), f"{name}: llama.cpp's dots3note builds {' and '.join(DOTS3_TYPES)} layers "
            f"only (an indexer on every layer that does not slide); this model's layer types are {sorted(set(types))}")
    for kind, what in (("sliding_attention", "a sliding window"), ("indexed_attention", "the indexer's sizes")):
        require(kind in types, f"{name}: llama.cpp's dots3note reads {what}; this model has no {kind} layers")
    for key in ("qk_rope_head_dim", "q_lora_rank"):
        values = {dots3_layer(config, i)[key] for i in range(len(types))}
        require(len(values) == 1, f"{name}: llama.cpp's dots3note takes one {key} for every layer; this model's are "
                f"{sorted(values)}")
    rope = gguf_mla.rope_parameters(config)
    for kind in set(types):
        layer = dots3_layer(config, types.index(kind))
        turned = int(layer["head_dim"] * rope[kind].get("partial_rotary_factor", 1.0))
        require(rope[kind].get("rope_type", "default") == "default", f"{name}: RoPE scaling "
                f"{rope[kind].get('rope_type')!r} on the {kind} layers is not exported to GGUF")
        require(turned == layer["qk_rope_head_dim"], f"{name}: transformers turns {turned} dimensions of the {kind} "
                f"layers' heads (head_dim × partial_rotary_factor), llama.cpp's dots3note qk_rope_head_dim "
                f"{layer['qk_rope_head_dim']}")
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's dots3note takes SiLU MLPs; this model's hidden_act "
            f"is {desc.experts.activation}")
    width = config["index_head_dim"]
    require(width >= gguf_mla.INDEXER_ROTATION and width & (width - 1) == 0 and config["qk_rope_head_dim"] <= width,
            f"{name}: llama.cpp's dots3note rotates the indexer heads by a Hadamard matrix of a power of two from "
            f"{gguf_mla.INDEXER_ROTATION}, at least the rotary part; this model's index_head_dim is {width}")


def _write_dots3_note(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """The sliding layers' MLA sizes and rotary base, and which layers run the indexer (those that do not slide)."""
    swa = dots3_layer(config, config["layer_types"].index("sliding_attention"))  # one MLA geometry per layer type
    arch, latent, rope = writer.arch, swa["kv_lora_rank"], swa["qk_rope_head_dim"]
    writer.add_uint32(f"{arch}.attention.kv_lora_rank_swa", latent)
    writer.add_key_length_swa(latent + rope)
    writer.add_value_length_swa(latent)
    writer.add_uint32(f"{arch}.attention.key_length_mla_swa", swa["qk_nope_head_dim"] + rope)
    writer.add_uint32(f"{arch}.attention.value_length_mla_swa", swa["v_head_dim"])
    writer.add_rope_freq_base_swa(gguf_mla.rope_parameters(config)["sliding_attention"]["rope_theta"])
    writer.add_array(f"{arch}.attention.indexer.types", [t == "indexed_attention" for t in config["layer_types"]])


def _dots3_note_pieces(key: str, shape: tuple[int, ...], config: dict,
                       names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """kv_b split by the layer's own sizes; the rotary key's norm as attn_k_norm, g_proj as attn_gate; the latents'
    scale sqrt(hidden_size / rank) folded into their norms (as the converter does with apply_mla_qkv_lora_rescale;
    transformers always scales); the indexer's rotary rows from adjacent pairs to the halves llama.cpp turns."""
    if not key.startswith("model.layers."):
        return None
    bid = int(key.split(".")[2])
    layer = dots3_layer(config, bid)
    if (split := gguf_mla.pieces(key, shape, layer)) is not None:
        return split
    tensor = lambda t: f"{gguf.TENSOR_NAMES[t].format(bid=bid)}.weight"
    if key.endswith("self_attn.k_rope_only_layernorm.weight"):
        return [(tensor(gguf.MODEL_TENSOR.ATTN_K_NORM), shape, lambda t: t)]
    if key.endswith("self_attn.g_proj.weight"):
        return [(tensor(gguf.MODEL_TENSOR.ATTN_GATE), shape, lambda t: t)]
    for norm, rank in (("q_a_layernorm", "q_lora_rank"), ("kv_a_layernorm", "kv_lora_rank")):
        if key.endswith(f"self_attn.{norm}.weight"):
            scale = (layer["hidden_size"] / layer[rank]) ** 0.5
            return [(names.get_name(key, try_suffixes=(".weight",)), shape, lambda t, s=scale: t.float() * s)]
    heads = {"indexer.wq_b.weight": layer["index_n_heads"], "indexer.wk.weight": 1, "indexer.k_norm.weight": 1,
             "indexer.k_norm.bias": 1}
    part = next((k for k in heads if key.endswith(f"self_attn.{k}")), None)
    if part is not None:
        return [(names.get_name(key, try_suffixes=(".weight", ".bias")), shape,
                 lambda t: rotary_in_halves(t, heads[part], layer["qk_rope_head_dim"]))]
    return None


def rotary_in_halves(t: torch.Tensor, heads: int, rope: int) -> torch.Tensor:
    """Each head's first `rope` rows from transformers' adjacent pairs to llama.cpp's NeoX halves (unpermute_rope)."""
    rows = t.reshape(heads, t.shape[0] // heads, *t.shape[1:])
    turned = unpermute_rope(rows[:, :rope].reshape(heads * rope, *t.shape[1:]), heads)
    return torch.cat([turned.reshape(heads, rope, *t.shape[1:]), rows[:, rope:]], dim=1).reshape(t.shape)


# DBRX's config names its sizes its own way (transformers' DbrxConfig maps them; config.json keeps them)
DBRX_KEYS = {"num_hidden_layers": "n_layers", "hidden_size": "d_model", "num_attention_heads": "n_heads",
             "max_position_embeddings": "max_seq_len"}
DBRX_LAYER_NORM_EPS = 1e-5  # transformers' DBRX builds nn.LayerNorm (bias-free) at its default eps


def _dbrx(name: str, config: dict, desc: ModelDescription) -> None:
    """llama.cpp's dbrx runs SiLU experts (another p-norm of the weights is a custom routing, refused with it)."""
    require(desc.experts.activation == "silu", f"{name}: llama.cpp's dbrx takes SiLU experts; this model's are "
            f"{desc.experts.activation}")


def _write_dbrx(writer: gguf.GGUFWriter, config: dict, desc: ModelDescription, moe_layers: list[int]) -> None:
    """LayerNorm's eps in place of RMSNorm's, and the q/k/v clamp (0: none, as transformers' clip_qkv = None)."""
    writer.add_layer_norm_eps(DBRX_LAYER_NORM_EPS)
    writer.add_clamp_kqv(float((config.get("attn_config") or {}).get("clip_qkv") or 0.0))


def config_view(name: str, config: dict) -> dict:
    """The config with the common keys the export reads, where the family names them its own way (DBRX, Nemotron-H,
    Kimi-Linear, a multimodal checkpoint's text_config)."""
    if name in FAMILIES and isinstance(config.get("text_config"), dict):  # a multimodal checkpoint's vault
        return config | config["text_config"] | {"model_type": config["model_type"]}
    if name == "kimi_linear":  # its context length is model_max_length, as the converter reads it
        return config | {"max_position_embeddings": config["model_max_length"]}
    if name == "nemotron_h":
        kinds = config.get("layers_block_type") or config.get("hybrid_override_pattern")
        return config | {"num_hidden_layers": len(kinds), "rms_norm_eps": config["layer_norm_epsilon"]}
    if name != "dbrx":
        return config
    attn = config.get("attn_config") or {}
    return config | {k: config[v] for k, v in DBRX_KEYS.items()} | {
        "num_key_value_heads": attn.get("kv_n_heads", config["n_heads"]), "rope_theta": attn.get("rope_theta")}


def arch_name(name: str, arch: Architecture) -> str:
    """The architecture name llama.cpp reads for the family."""
    family = FAMILIES.get(name)
    if family:
        return family.llama_name
    return gguf_mla.INDEXED.get(name) or gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch.arch)]


def _arch(arch: str, experts_key: str, permute_qk: bool = False, expert_width_key: bool = True) -> Architecture:
    return Architecture(arch, permute_qk=permute_qk, expert_width_key=expert_width_key, experts_key=experts_key,
                        readable=False)


SOFTMAX_UNNORMALISED = dict(scoring="softmax", normalise=False, correction_bias=False, scale=1.0, n_group=1)
SIGMOID_BIASED = dict(scoring="sigmoid", correction_bias=True)
SOFTMAX_NORMALISED = SOFTMAX_UNNORMALISED | dict(normalise=True)
FAMILIES = {
    "glm4_moe": GgufFamily(_arch("GLM4_MOE", "n_routed_experts"), SIGMOID_BIASED, extras=("partial_rotary",),
                           qk_norms=(None, "head"), attention_bias=True, dense_first=True, moe_keys=True,
                           check=_glm4_moe),
    # GLM-4.5's MoE block under Llama's attention (no q/k norm) and GLM-4.5's modules with whole-head rotary
    "solar_open": GgufFamily(_arch("GLM4_MOE", "n_routed_experts"), SIGMOID_BIASED, attention_bias=True,
                             dense_first=True, moe_keys=True, check=_glm4_moe),
    "sarvam_moe": GgufFamily(_arch("GLM4_MOE", "n_routed_experts"), SIGMOID_BIASED, qk_norms=(None, "head"),
                             attention_bias=True, dense_first=True, moe_keys=True, check=_glm4_moe,
                             pieces=_sarvam_pieces),
    "gpt_oss": GgufFamily(_arch("GPT_OSS", "num_local_experts"),
                          dict(scoring="softmax", normalise=True, router_bias=True, scale=1.0, n_group=1),
                          attention_bias=True, expert_biases=True, sliding_window=True, rope_types=("default", "yarn"),
                          check=_gpt_oss),
    "olmoe": GgufFamily(_arch("OLMOE", "num_experts"), SOFTMAX_UNNORMALISED, qk_norms=("full",), all_kv_heads=True),
    "qwen2_moe": GgufFamily(_arch("QWEN2MOE", "num_experts"), SOFTMAX_UNNORMALISED, attention_bias=True,
                           shared_gate=True),
    "minimax_m2": GgufFamily(_arch("MINIMAXM2", "num_local_experts"), SIGMOID_BIASED | dict(normalise=True, scale=1.0,
                             n_group=1), extras=("partial_rotary",), qk_norms=("full",), moe_keys=True),
    "dots1": GgufFamily(_arch("DOTS1", "n_routed_experts"), SIGMOID_BIASED | dict(n_group=1), qk_norms=("head",),
                        all_kv_heads=True, dense_first=True, moe_keys=True),
    # Granite's experts take feed_forward_length, as Mixtral's; rotary over adjacent pairs: q/k rows reordered
    **{t: GgufFamily(_arch("GRANITE_MOE", "num_local_experts", permute_qk=True, expert_width_key=False),
                     SOFTMAX_UNNORMALISED | dict(normalise=True), extras=("multipliers",), attention_bias=True,
                     shared_width=True, write=_write_granite)
       for t in ("granitemoe", "granitemoeshared")},
    "hunyuan_v1_moe": GgufFamily(_arch("HUNYUAN_MOE", "num_experts"), SOFTMAX_UNNORMALISED | dict(normalise=True),
                                 qk_norms=("head_after_rotary",), rope_types=("default", "dynamic"), shared_width=True,
                                 check=_hunyuan),
    "ernie4_5_moe": GgufFamily(_arch("ERNIE4_5_MOE", "moe_num_experts"),
                               SOFTMAX_UNNORMALISED | dict(normalise=True, correction_bias=True),
                               extras=("interleaved_rotary",), dense_first=True, shared_width=True, write=_write_ernie),
    "exaone_moe": GgufFamily(_arch("EXAONE_MOE", "num_experts"), SIGMOID_BIASED, extras=("no_rope_layers",),
                             qk_norms=("head",), dense_first=True, sliding_window=True, moe_keys=True, shared_width=True,
                             check=_exaone),
    "afmoe": GgufFamily(_arch("AFMOE", "num_experts"), SIGMOID_BIASED,
                        extras=("sandwich_norms", "attention_gate", "no_rope_layers", "multipliers"), qk_norms=("head",),
                        dense_first=True, sliding_window=True, moe_keys=True, check=_afmoe),
    # Llama 4's text model (the vault of a Llama 4 checkpoint is its llama4_text); rotary over adjacent pairs as
    # Hugging Face's own, so q/k keep their rows; the router's sigmoid weight scales each expert's input
    "llama4_text": GgufFamily(_arch("LLAMA4", "num_local_experts"),
                              dict(scoring="sigmoid", normalise=False, weight_input=True, correction_bias=False,
                                   n_group=1, scale=1.0),
                              extras=("interleaved_rotary", "no_rope_layers", "temperature_tuning", "chunked_attention"),
                              qk_norms=(None, "l2_after_rotary"), interleaved=True,
                              dense_width_key="intermediate_size_mlp", check=_llama4, write=_write_llama4),
    # short-convolution layers beside attention ones: llama.cpp tells them apart by their 0 key/value heads
    "lfm2_moe": GgufFamily(_arch("LFM2MOE", "num_experts"), SIGMOID_BIASED | dict(normalise=True, scale=1.0, n_group=1),
                           qk_norms=("head",), dense_first=True, moe_keys=True, recurrent_kv=True, check=_lfm2_moe,
                           write=_write_lfm2_moe),
    # gated delta-net layers beside gated attention ones; the converter's rewrites of the trunk in _qwen3_next_pieces
    "qwen3_next": GgufFamily(_arch("QWEN3NEXT", "num_experts"), SOFTMAX_UNNORMALISED | dict(normalise=True),
                             extras=("norm_offset", "attention_gate", "partial_rotary"), qk_norms=("head",),
                             shared_gate=True, check=_qwen3_next, write=_write_qwen3_next, pieces=_qwen3_next_pieces),
    # Qwen3-Next's layers with the delta-net's projections apart, value heads tiled, and M-RoPE sections
    "qwen3_5_moe_text": GgufFamily(_arch("QWEN35MOE", "num_experts"), SOFTMAX_NORMALISED,
                                   extras=("norm_offset", "attention_gate", "partial_rotary"), qk_norms=("head",),
                                   shared_gate=True, check=_qwen3_5_moe, write=_write_qwen3_5_moe,
                                   pieces=_qwen3_5_pieces),
    # Mamba2 layers beside attention ones, told apart by their 0 key/value heads; Granite's multipliers and
    # q/k rows reordered for rotary over adjacent pairs, as granitemoe's (rotary or not: both rows move alike)
    "granitemoehybrid": GgufFamily(_arch("GRANITE_HYBRID", "num_local_experts", permute_qk=True, expert_width_key=False),
                                   SOFTMAX_UNNORMALISED | dict(normalise=True), extras=("multipliers", "no_rope_layers"),
                                   attention_bias=True, shared_width=True, recurrent_kv=True, check=_granite_hybrid,
                                   write=_write_granite_hybrid, pieces=_mamba2_pieces),
    # Mamba layers beside attention ones without rotary, told apart by their 0 key/value heads; MoE where a router is
    "jamba": GgufFamily(_arch("JAMBA", "num_experts", expert_width_key=False), SOFTMAX_UNNORMALISED,
                        extras=("no_rope_layers",), recurrent_kv=True, any_moe_layers=True, check=_jamba,
                        write=_write_jamba, pieces=_mamba_pieces),
    # Qwen3-MoE's modules, sliding layers where the config has them (at the full layers' rotary base); tensors named
    # as qwen3moe's
    "mellum": GgufFamily(_arch("QWEN3MOE", "num_local_experts"), SOFTMAX_NORMALISED, extras=("rope_per_layer_type",),
                         qk_norms=("head",), sliding_window=True, check=_mellum, name="mellum"),
    # sigmoid scores chosen with the correction bias, q/k norms before rotary, a shared expert without an output gate,
    # dense layers where there is no router; tensors named as dots1's
    "hy_v3": GgufFamily(_arch("DOTS1", "num_experts"), SIGMOID_BIASED | dict(normalise=True, n_group=1),
                        qk_norms=("head",), moe_keys=True, shared_width=True, any_moe_layers=True,
                        pieces=_hy_v3_pieces, name="hy_v3"),
    # a dense MLP beside the experts on every layer (the description's shared expert), four norms around them, the router
    # on the normalised residual with its input and per-expert scales; full layers of their own head width
    "gemma4_text": GgufFamily(_arch("GEMMA4", "num_experts"), SOFTMAX_NORMALISED | dict(custom=GEMMA4_ROUTING),
                              extras=("sandwich_norms", "partial_rotary", "multipliers"), qk_norms=("head",),
                              sliding_window=True, shared_width=True, any_moe_layers=True, global_heads=True,
                              check=_gemma4, write=_write_gemma4, pieces=_gemma4_pieces),
    # LayerNorm, the fused Wqkv clamped, softmax weights over their sum; the experts' width is feed_forward_length
    "dbrx": GgufFamily(_arch("DBRX", "moe_num_experts", expert_width_key=False), SOFTMAX_NORMALISED,
                       extras=("layer_norm", "clip_qkv"), check=_dbrx, write=_write_dbrx),
    # Mamba2, attention without rotary and MoE layers, one mixer each, told apart by their key/value heads and
    # feed-forward widths; sigmoid scores chosen with the correction bias, an ungated relu² shared expert
    "nemotron_h": GgufFamily(_arch("NEMOTRON_H_MOE", "n_routed_experts"), SIGMOID_BIASED, extras=("no_rope_layers",),
                             moe_keys=True, shared_width=True, recurrent_kv=True, any_moe_layers=True,
                             ffn_per_layer=True, check=_nemotron_h, write=_write_nemotron_h,
                             pieces=_nemotron_h_pieces),
    # lightning (linear) attention layers beside softmax attention ones, listed as recurrent; Mixtral's experts and
    # router; tensors named as minimax-m2's, the lightning layers' own named in _minimax_pieces
    "minimax": GgufFamily(_arch("MINIMAXM2", "num_local_experts", expert_width_key=False), SOFTMAX_NORMALISED,
                          extras=("multipliers",), check=_minimax, write=_write_minimax, pieces=_minimax_pieces,
                          name="minimax-01"),
    # Qwen3-VL-MoE's text model: Qwen3-MoE's layers, M-RoPE (plain rotary on text) over whole heads
    "qwen3_vl_moe": GgufFamily(_arch("QWEN3VLMOE", "num_experts"), SOFTMAX_NORMALISED, qk_norms=("head",),
                               check=_qwen3_vl_moe, write=_write_qwen3_vl_moe),
    # GLM-4.5V's text model: GLM-4.5's layers, M-RoPE (NeoX rotary on text) over the first half of each head
    "glm4v_moe": GgufFamily(_arch("GLM4_MOE", "n_routed_experts"), SIGMOID_BIASED, extras=("partial_rotary",),
                            qk_norms=(None, "head"), attention_bias=True, dense_first=True, moe_keys=True,
                            check=_glm4v_moe, write=_write_glm4v_moe),
    # Granite's MoE with sink logits, sliding-window layers and layers without rotary (rope_pattern); tensors named as
    # granitemoe's, q/k rows reordered as its
    "granitemoe_swa": GgufFamily(_arch("GRANITE_MOE", "num_local_experts", permute_qk=True, expert_width_key=False),
                                 SOFTMAX_NORMALISED, extras=("multipliers", "no_rope_layers"), attention_bias=True,
                                 sliding_window=True, shared_width=True, check=_granite_swa, write=_write_granite_swa,
                                 pieces=_granite_swa_pieces, name="granite_swa"),
    # delta-attention (KDA) layers, told apart by their 0 key/value heads, beside MLA ones without rotary; DeepSeek-V3's
    # routing, a leading dense MLP and shared experts
    "kimi_linear": GgufFamily(_arch("KIMI_LINEAR", "num_experts"), SIGMOID_BIASED | dict(normalise=True),
                              extras=("no_rope_layers",), dense_first=True, moe_keys=True, recurrent_kv=True, mla=True,
                              check=_kimi_linear, write=_write_kimi_linear, pieces=_kimi_linear_pieces),
    # GLM-5.3's text model: delta-attention (KDA) layers, told apart by their 0 key/value heads, beside MLA ones without
    # rotary whose indexer chooses pools of keys (shared by the layers that reuse its choice); DeepSeek-V3's routing
    # without groups, leading dense layers and shared experts, every MLP's SwiGLU clamped; hyper-connections; tensors
    # named as kimi-linear's, the indexer's and the hyper-connections' in _glm5_next_pieces
    "glm5_next": GgufFamily(_arch("KIMI_LINEAR", "n_routed_experts"), SIGMOID_BIASED | dict(n_group=1),
                            extras=("no_rope_layers", "block_sparse_attention", "shared_indexer", "swiglu_gate_limit",
                                    "hyper_connections"),
                            dense_first=True, moe_keys=True, recurrent_kv=True, mla=True, check=_glm5_next,
                            write=_write_glm5_next, pieces=_glm5_next_pieces, name="glm5-next"),
    # attention and the MLP side by side on one norm, rotary over adjacent pairs on the sliding and leading dense layers
    # only, shared experts averaged with the routed ones, the logits scaled; tensors named as glm4moe's
    "cohere2_moe": GgufFamily(_arch("GLM4_MOE", "num_experts"), dict(correction_bias=False, n_group=1),
                              extras=("parallel_block", "interleaved_rotary", "multipliers", "layer_norm",
                                      "no_rope_layers", "shared_average"),
                              dense_first=True, sliding_window=True, moe_keys=True, shared_width=True,
                              dense_width_key="prefix_dense_intermediate_size", check=_cohere2_moe,
                              write=_write_cohere2_moe, name="cohere2moe"),
    # DeepSeek-V3's routing without groups, scale or shared experts; sliding layers with twice the key/value heads, sink
    # logits and their own rotary base; values of their own width, scaled; dense layers where there is no router
    "mimo_v2_flash": GgufFamily(_arch("MIMO2", "n_routed_experts"), SIGMOID_BIASED | dict(normalise=True, scale=1.0,
                                n_group=1), extras=("partial_rotary", "rope_per_layer_type", "sliding_kv_heads",
                                                    "sliding_sinks", "value_head_dim", "value_scale"),
                                sliding_window=True, any_moe_layers=True, sliding_kv_factor=2,
                                value_width_key="v_head_dim", check=_mimo_v2_flash, write=_write_mimo_v2_flash,
                                pieces=_mimo_v2_flash_pieces),
    # sigmoid choice by score + correction bias, a shared expert of its own width, q/k norm per head, the attention
    # output times the softplus of g_proj (per head or per element, as its width says), query heads per layer, each
    # layer type's rotary part and base; tensors named as afmoe's
    "laguna": GgufFamily(_arch("AFMOE", "num_experts"), SIGMOID_BIASED,
                         extras=("softplus_gate", "heads_per_layer", "partial_rotary", "rope_per_layer_type"),
                         qk_norms=("head",), dense_first=True, sliding_window=True, moe_keys=True, shared_width=True,
                         heads_key="num_attention_heads_per_layer", check=_laguna, write=_write_laguna,
                         pieces=_laguna_pieces, name="laguna"),
    # Step-3.7's text model: sigmoid choice by score + correction bias, a shared expert on every MoE layer, (1 + w)
    # norms, the attention output times the sigmoid of g_proj per head, the sliding layers' own query heads and rotary
    # base (the graph turns half of each head on the full layers), the SwiGLU clamped per layer
    "step3p7": GgufFamily(_arch("STEP35", "n_routed_experts"), SIGMOID_BIASED | dict(normalise=True, n_group=1),
                          extras=("norm_offset", "sigmoid_gate", "heads_per_layer", "partial_rotary",
                                  "rope_per_layer_type", "swiglu_limit"),
                          qk_norms=("head",), sliding_window=True, moe_keys=True, shared_width=True,
                          any_moe_layers=True, sliding_heads_key="num_sliding_attention_heads", whole_head_rope=True,
                          text_prefix="model.", check=_step3p7, write=_write_step3p7, pieces=_step3p7_pieces),
    # DeepSeek-V3.2's MLA and indexer written as deepseek2's, the layers marked "shared" reusing the previous indexer's
    # choice, sink logits and a sigmoid gate per value channel; DeepSeek-V3's routing without groups, a shared expert
    # and leading dense layers; hyper-connections; tensors named as glm-dsa's, the hyper-connections' in _hy_v4_pieces
    "hy_v4": GgufFamily(_arch("GLM_DSA", "n_routed_experts"), SIGMOID_BIASED | dict(n_group=1),
                        extras=("sparse_attention", "shared_indexer", "sigmoid_gate", "swiglu_gate_limit",
                                "hyper_connections"),
                        dense_first=True, moe_keys=True, mla=True, check=_hy_v4, write=_write_hy_v4,
                        pieces=_hy_v4_pieces, name="hy_v4", renames=HY_V4_RENAMES),
    # MiniMax-M3's text model: minimax-m2's attention with (1 + w) norms, block-sparse on the MoE layers; DeepSeek-V3's
    # routing without groups, a shared expert and leading dense layers, gpt-oss's SwiGLU on all of them; tensors named
    # as minimax-m2's, the indexer's, the dense MLPs' and the shared expert's in _minimax_m3_pieces
    "minimax_m3_vl": GgufFamily(_arch("MINIMAXM2", "num_local_experts"),
                                SIGMOID_BIASED | dict(normalise=True, n_group=1),
                                extras=("norm_offset", "clamped_mlps", "partial_rotary", "block_sparse_attention"),
                                qk_norms=("head",), dense_first=True, moe_keys=True,
                                dense_width_key="dense_intermediate_size", check=_minimax_m3, write=_write_minimax_m3,
                                pieces=_minimax_m3_pieces, name="minimax-m3", renames=MINIMAX_M3_RENAMES),
    # Dots3-Note's text model: DeepSeek-V3's MLA with its latents scaled and its rotary key normalised, DeepSeek-V3.2's
    # indexer on the indexed layers, sliding layers of their own MLA sizes, heads and rotary base, a sigmoid gate per
    # head; DeepSeek-V3's routing without groups, shared experts and leading dense layers; tensors named as glm-dsa's,
    # the rotary key's norm and the gate in _dots3_note_pieces
    "dots3_note": GgufFamily(_arch("GLM_DSA", "n_routed_experts"), SIGMOID_BIASED | dict(n_group=1),
                             extras=("interleaved_rotary", "latent_scale", "rope_key_norm", "sigmoid_gate",
                                     "sparse_attention", "indexer_interleaved_rotary", "mla_per_layer_type",
                                     "heads_per_layer", "rope_per_layer_type"),
                             dense_first=True, sliding_window=True, moe_keys=True, mla=True, layer_config_heads=True,
                             text_prefix="model.", check=_dots3_note, write=_write_dots3_note,
                             pieces=_dots3_note_pieces, name="dots3note"),
    # one key/value head whose keys are its values, sink logits, the grouped output, sliding and compressed layers;
    # sqrtsoftplus scores chosen with the correction bias, a shared expert, SwiGLU clamped; hyper-connections; the
    # release's names (_deepseek_v4_pieces); the hash-routed layers' token-id table I32
    "deepseek_v4": GgufFamily(_arch("GLM_DSA", "n_routed_experts"),
                              dict(custom=DEEPSEEK_V4_ROUTING, correction_bias=True, normalise=True, n_group=1),
                              extras=("shared_kv_head", "grouped_output", "partial_rotary", "interleaved_rotary",
                                      "swiglu_gate_limit", "hyper_connections", "rope_per_layer_type",
                                      "compressed_attention", "hash_routing"),
                              sliding_window=True, one_kv_head=True, check=_deepseek_v4, write=_write_deepseek_v4,
                              pieces=_deepseek_v4_pieces, name="deepseek4"),
}
ARCHITECTURES = {name: f.arch for name, f in FAMILIES.items()}
# qwen4exp: llama.cpp 0.3.36 marks its graph (src/models/qwen4exp.cpp, TAG_QWEN4_REIMPLEMENT) "pending complete
# reimplementation - do not use it as a reference"
QWEN4_EXP = ("llama.cpp's qwen4exp graph is marked pending complete reimplementation, not to be used as a reference, "
             "so an export could not be checked against it")
# families llama.cpp has an architecture for whose graph computes otherwise, or cannot be checked against, refused by
# name with why
REFUSED = {"phimoe": "llama.cpp's phimoe weighs the two chosen experts by a softmax over their logits; transformers' "
                     "phimoe routes with sparsemixer (each chosen expert's weight a softmax over the logits within its "
                     "jitter band, the second chosen with the first masked out)",
           "qwen4_exp": QWEN4_EXP, "qwen4_exp_text": QWEN4_EXP}
# what a router may do beyond the fields a row fixes, refused unless the row allows it
PLAIN_ROUTING = dict(router_bias=False, weight_input=False, custom=None)


def check(name: str, config: dict, desc: ModelDescription, moe_layers: list[int], shapes: dict[str, tuple[int, ...]],
          expert_width: int) -> None:
    """What the family's llama.cpp graph assumes that this config (and the trunk's `shapes`) could contradict."""
    family = FAMILIES[name]
    arch = family.llama_name
    shapes = {family.renamed(key): shape for key, shape in shapes.items()}
    want, takes = moe_layout(family, config, moe_layers)
    require(moe_layers == want, f"{name}: llama.cpp's {arch} takes {takes}; this model's MoE layers are {moe_layers}")
    unsupported = [e for e in desc.extras if e not in family.extras]
    require(not unsupported, f"{name}: llama.cpp's {arch} does not compute {', '.join(unsupported)}")
    require(desc.attention.qk_norm in family.qk_norms,
            f"{name}: q/k norm {desc.attention.qk_norm!r} is not what llama.cpp's {arch} computes")
    require(not family.all_kv_heads or desc.attention.kv_heads == desc.attention.heads,
            f"{name}: llama.cpp's {arch} takes as many key/value heads as heads; this model has "
            f"{desc.attention.kv_heads} for {desc.attention.heads}")
    require(family.attention_bias or not desc.attention.bias, f"{name}: attention biases are not exported to GGUF")
    require(family.sliding_window or not desc.attention.sliding_layers,
            f"{name}: sliding-window attention is not exported to GGUF")
    for key, value in (PLAIN_ROUTING | family.routing).items():
        actual = getattr(desc.routing, key)
        require(actual == value, f"{name}: llama.cpp's {arch} routes with {key} = {value!r}; this model's router has "
                f"{actual!r}")
    require(desc.shared_gate == family.shared_gate,
            f"{name}: shared_gate = {desc.shared_gate} is not what llama.cpp's {arch} computes")
    rope = gguf_mla.rope_parameters(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    require(kind in family.rope_types, f"{name}: RoPE scaling {kind!r} is not exported to GGUF")
    if family.shared_width:
        widths = shared_widths(shapes)
        require(len(widths) <= 1, f"{name}: shared experts of widths {sorted(widths)}; llama.cpp's {arch} takes one")
    else:
        gguf_mla.check_shared_experts(name, arch, shapes, expert_width, desc.shared_experts)
    if family.check:
        family.check(name, config, desc)


def moe_layout(family: GgufFamily, config: dict, moe_layers: list[int]) -> tuple[list[int], str]:
    """The MoE layers the family's graph builds for this config, and how to say so."""
    layers = config["num_hidden_layers"]
    if family.any_moe_layers:
        return moe_layers, "any layout"
    if family.interleaved:
        step = config.get("interleave_moe_layer_step", 1)
        return list(range(step - 1, layers, step)), f"every interleave_moe_layer_step = {step}th layer MoE"
    if family.dense_first:
        return list(range(moe_layers[0] if moe_layers else 0, layers)), "dense layers only before the MoE ones"
    return list(range(layers)), "every layer MoE"


def dense_width(name: str, config: dict, expert_width: int, moe_layers: list[int]) -> int | list[int]:
    """feed_forward_length where the graph reads the experts' width apart: the dense layers' width, or per layer."""
    family = FAMILIES.get(name)
    if family and family.ffn_per_layer:
        return [expert_width if i in moe_layers else 0 for i in range(config["num_hidden_layers"])]
    return config.get(family.dense_width_key if family else "intermediate_size") or expert_width


def kv_heads(name: str, config: dict, desc: ModelDescription) -> int | list[int]:
    """head_count_kv: one number, or per layer where the graph reads a layer without attention as 0 heads."""
    family = FAMILIES.get(name)
    if family and family.sliding_kv_factor != 1:
        sliding = set(desc.attention.sliding_layers)
        return [desc.attention.kv_heads * (family.sliding_kv_factor if i in sliding else 1) for i in range(desc.num_layers)]
    if family and family.global_heads:
        return [o.get("num_key_value_heads", desc.attention.kv_heads) for o in _layer_overrides(config)]
    heads = 1 if family and (family.mla or family.one_kv_head) else desc.attention.kv_heads  # MLA: the latent's
    if family is None or not family.recurrent_kv:
        return heads
    return [0 if i in desc.attention.mixer_layers else heads for i in range(desc.num_layers)]


def head_count(name: str, config: dict) -> int | list[int]:
    """head_count: one number, or per layer where the family's layers have their own."""
    family = FAMILIES.get(name)
    heads = config.get(family.heads_key) if family and family.heads_key else None
    if family and family.layer_config_heads:
        heads = [o.get("num_attention_heads", config["num_attention_heads"]) for o in _layer_overrides(config)]
    if family and family.sliding_heads_key and config.get(family.sliding_heads_key):
        sliding = config[family.sliding_heads_key]
        heads = [sliding if t == "sliding_attention" else config["num_attention_heads"] for t in config.get("layer_types") or ()]
    return list(heads) if heads else config["num_attention_heads"]


def rope_width(name: str, config: dict) -> int | None:
    """rope.dimension_count where the family's graph takes the whole head and halves it itself, else None."""
    family = FAMILIES.get(name)
    return config["head_dim"] if family and family.whole_head_rope else None


def value_width(name: str, config: dict) -> int | None:
    """The value heads' width where the family's differs from head_dim (value_length), else None."""
    family = FAMILIES.get(name)
    return config.get(family.value_width_key) if family and family.value_width_key else None


def has_mla(name: str) -> bool:
    """Whether the family's attention is DeepSeek's MLA, written as deepseek2's (GgufFamily.mla)."""
    return name in FAMILIES and FAMILIES[name].mla


def full_head_dim(name: str, config: dict) -> int | None:
    """The full-attention layers' head width where the family gives them their own (their rotary turns all of it)."""
    family = FAMILIES.get(name)
    return _global_head_dim(config) if family and family.global_heads else None


def shared_widths(shapes: dict[str, tuple[int, ...]]) -> set[int]:
    """The widths of the shared experts in the trunk (their down projections' inputs)."""
    return {shape[-1] for key, shape in shapes.items()
            if any(s in key for s in SHARED_MLPS) and key.endswith(("down_proj.weight", "output_linear.weight"))}


def write(writer: gguf.GGUFWriter, name: str, config: dict, desc: ModelDescription, moe_layers: list[int],
          shapes: dict[str, tuple[int, ...]]) -> None:
    """The metadata the family's graph reads beyond the common keys."""
    family = FAMILIES[name]
    if family.moe_keys:
        gguf_mla.write_moe(writer, desc, moe_layers, config["num_hidden_layers"])
    if family.shared_width and (widths := shared_widths(shapes)):
        writer.add_expert_shared_feed_forward_length(widths.pop())
    if family.write:
        family.write(writer, config, desc, moe_layers)
    if desc.shared_gate and (width := config.get("shared_expert_intermediate_size")):  # qwen2moe
        writer.add_expert_shared_feed_forward_length(width)
    if desc.attention.sliding_layers:
        sliding = set(desc.attention.sliding_layers)
        writer.add_sliding_window(desc.attention.sliding_window)
        writer.add_sliding_window_pattern([i in sliding for i in range(config["num_hidden_layers"])])
    if not family.mla:  # gguf_mla.write_attention writes it
        gguf_mla.write_yarn(writer, gguf_mla.rope_parameters(config))


def pieces(name: str, key: str, shape: tuple[int, ...], config: dict,
           names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    """The GGUF tensor a trunk tensor becomes where these architectures name it their own way (else None); a multimodal
    checkpoint's text model under the text-only names, its vision tower left out (llama.cpp's mmproj file)."""
    family = FAMILIES.get(name)
    if not (family and "text_config" in config):  # config_view's of a multimodal checkpoint's vault keeps text_config
        return _pieces(family, key, shape, config, names)
    key = family.renamed(key)
    if not key.startswith((family.text_prefix, "lm_head.")):
        return []
    key = key.replace(family.text_prefix, "model.", 1)
    if (split := _pieces(family, key, shape, config, names)) is not None:
        return split
    return _as_named(family, key, key, shape, names)


def _pieces(family: GgufFamily | None, key: str, shape: tuple[int, ...], config: dict,
            names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    renamed = family.renamed(key) if family else key
    if (split := _renamed_pieces(family, renamed, shape, config, names)) is not None or renamed == key:
        return split
    return _as_named(family, key, renamed, shape, names)


def _as_named(family: GgufFamily, key: str, renamed: str, shape: tuple[int, ...],
              names: gguf.TensorNameMap) -> list[gguf_mla.Piece]:
    """The trunk tensor `key` whole, under the llama.cpp name of its transformers name `renamed`."""
    tensor = names.get_name(renamed, try_suffixes=(".weight", ".bias"))
    require(tensor is not None, f"trunk tensor {key}: no llama.cpp name for it in {family.llama_name}")
    return [(tensor, shape, lambda t: t)]


def _renamed_pieces(family: GgufFamily | None, key: str, shape: tuple[int, ...], config: dict,
                    names: gguf.TensorNameMap) -> list[gguf_mla.Piece] | None:
    if family and family.pieces and (split := family.pieces(key, shape, config, names)) is not None:
        return split
    layer = key.split(".")[2] if key.startswith("model.layers.") else None
    name = lambda tensor: gguf.TENSOR_NAMES[tensor].format(bid=int(layer))
    for suffix in (CORRECTION_BIAS, EXPERT_BIAS):  # ERNIE's is [1, E]: llama.cpp reads [E]
        if key.endswith(suffix):
            flat = (int(np.prod(shape)),)
            return [(f"{name(gguf.MODEL_TENSOR.FFN_EXP_PROBS_B)}.bias", flat, lambda t: t.reshape(-1))]
    if key.endswith(SINKS):
        return [(f"{name(gguf.MODEL_TENSOR.ATTN_SINKS)}.weight", shape, lambda t: t)]
    if key.endswith(GRANITE_SHARED_IN):
        half = (shape[0] // 2, *shape[1:])
        return [(f"{name(gguf.MODEL_TENSOR.FFN_GATE_SHEXP)}.weight", half, lambda t: t[: half[0]].contiguous()),
                (f"{name(gguf.MODEL_TENSOR.FFN_UP_SHEXP)}.weight", half, lambda t: t[half[0]:].contiguous())]
    return None
