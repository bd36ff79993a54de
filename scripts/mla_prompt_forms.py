"""A prompt's MLA attention in its two forms, alternating in one process: expanded (each head's keys and values made
from the latents, causal SDPA; what smoe.runtime.layers.mla_attention runs for a prompt that starts its sequence)
and absorbed (one head of width latent + rope over the rows, forced here by an explicit causal mask; what it ran
before). Random weights of DeepSeek-V2-Lite's attention shapes (16 heads, latent 512, rope 64, nope 128, v 128,
hidden 2048).

Usage: python scripts/mla_prompt_forms.py [--lengths 512,2048] [--dtype bfloat16] [--rounds 3] [--device cpu]
Prints, per length, each form's median milliseconds over the rounds and absorbed / expanded.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from smoe.runtime.kv import Latents
from smoe.runtime.layers import MlaWeights, eager_step, mla_attention
from smoe.source.description import describe_model

V2_LITE = dict(model_type="deepseek_v2", hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_hidden_layers=2, n_routed_experts=64,
               num_experts_per_tok=6, moe_intermediate_size=1408, intermediate_size=10944, vocab_size=102400,
               first_k_dense_replace=1, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192)


def weights(cfg: dict, dtype, device) -> MlaWeights:
    heads, hidden, latent = cfg["num_attention_heads"], cfg["hidden_size"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device=device, dtype=dtype)

    return MlaWeights(q=rand(heads * (nope + rope), hidden), q_a=None, q_a_norm=None, q_b=None,
                      kv_a=rand(latent + rope, hidden), kv_a_norm=torch.ones(latent, device=device),
                      kv_b=rand(heads, nope + v, latent), nope=nope, o=rand(hidden, heads * v),
                      scale=(nope + rope) ** -0.5)


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    d = describe_model(V2_LITE)
    a = d.attention
    w = weights(V2_LITE, dtype, device)
    for t in (int(x) for x in args.lengths.split(",")):
        cos, sin = (x.to(device) for x in rope_tables_for(d, t))
        h = torch.randn(t, d.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
        expanded = eager_step(0, t, cos, sin, 1e-6, True)
        absorbed = dataclasses.replace(expanded, mask=torch.ones(t, t, dtype=torch.bool, device=device).tril())
        state = Latents(torch.zeros(t, a.latent_dim + a.rope_key_dim, dtype=dtype, device=device), a.latent_dim)
        times = {"expanded": [], "absorbed": []}
        with torch.inference_mode():
            for r in range(args.rounds + 1):  # the first round warms up, untimed
                for name, step in (("expanded", expanded), ("absorbed", absorbed)):
                    ms = timed(lambda: mla_attention(d, w, h, state, step), device)
                    if r:
                        times[name].append(ms)
        e, b = statistics.median(times["expanded"]), statistics.median(times["absorbed"])
        print(f"{t} tokens, {args.dtype}, {device}: expanded {e:.2f} ms ({' / '.join(f'{x:.2f}' for x in times['expanded'])}), "
              f"absorbed {b:.2f} ms ({' / '.join(f'{x:.2f}' for x in times['absorbed'])}); absorbed / expanded {b / e:.2f}",
              flush=True)


def rope_tables_for(d, t: int):
    """Plain rotary tables [t, 1, rope] (the form's cost does not depend on their values)."""
    dim = d.attention.rope_key_dim
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), 10000.0 ** (-torch.arange(0, dim, 2) / dim))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


if __name__ == "__main__":
    main()
