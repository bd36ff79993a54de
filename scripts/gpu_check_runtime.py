"""The GPU runtime against the dequantised reference and the CPU runtime, on real vaults.

Usage: python scripts/gpu_check_runtime.py VAULT [VAULT ...]   (on a CUDA machine)
Per vault: teacher-forced logits (prefill + graph-replayed single-token steps) in fp32 and bf16 at a
GPU cache of 25% (evictions, per-layer segments) and 100% (one graph per token), and greedy tokens
of the GPU runtime against the reference wherever the reference's top-1/top-2 margin exceeds the
tolerance. Errors are max |dlogit| / max |logit|; the bf16 tolerance is twice what transformers
itself gives in bf16 against the fp32 reference.
"""

import sys
import tempfile
from pathlib import Path

import torch

from smoe.convert.dequantize import dequantize
from smoe.quality.evaluate import load_reference
from smoe.runtime.cuda.cache import blob_slot_bytes
from smoe.runtime.cuda.decode import GpuDecoder
from smoe.runtime.model import OpenedVault


def decode_in_pieces(dec, ids):
    pieces = [ids[:24], *[[t] for t in ids[24:40]], ids[40:]]
    return torch.cat([dec.forward(p).reshape(len(p), -1).float().cpu() for p in pieces])


def rel(a, b):
    return float((a - b).abs().max() / a.abs().max())


def greedy(step, prompt, n):
    out, logits = [], step(prompt)
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = step([out[-1]])
    return out


def top1_at_clear_margins(want, got, tol):
    """(positions where the reference's top-1/top-2 margin exceeds tol, how many of them got agrees on)."""
    top2 = torch.topk(want, 2).values
    clear = ((top2[:, 0] - top2[:, 1]) / want.abs().max()) > tol
    return int(clear.sum()), int((want.argmax(-1) == got.argmax(-1))[clear].sum())


def check(vault: Path) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        dequantize(vault, Path(tmp) / "ref", dtype=torch.float32)
        reference = load_reference(Path(tmp) / "ref")
        ids = torch.randint(0, 6000, (56,), generator=torch.Generator().manual_seed(0)).tolist()
        want = reference(torch.tensor([ids]))[0]
        # bf16 tolerance: twice how far transformers itself moves from the fp32 reference in bf16
        in_bf16 = load_reference(Path(tmp) / "ref", dtype=torch.bfloat16)(torch.tensor([ids]))[0].float()
        bf16_tol = 2 * rel(want, in_bf16)
        print(f"{vault.name} transformers bf16 vs its fp32 reference: {bf16_tol / 2:.2e} -> bf16 tolerance {bf16_tol:.2e}")
        for dtype in ("float32", "bfloat16"):
            sm = OpenedVault(vault, dtype=dtype)
            cpu = decode_in_pieces(sm.fast_decoder(128), ids)
            cpu_err = rel(want, cpu)
            tol = 1e-4 if dtype == "float32" else bf16_tol
            print(f"{vault.name} {dtype:8s} CPU runtime: max |dlogit|/max|logit| vs reference {cpu_err:.2e}")
            everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
            for fraction in (0.25, 1.0):
                dec = GpuDecoder(sm, "cuda", int(everything * fraction), 128)
                got = decode_in_pieces(dec, ids)
                err, err_cpu = rel(want, got), rel(cpu, got)
                clear, agree = top1_at_clear_margins(want, got, tol)
                mode = "whole-token graph" if dec.whole_token is not None else "segment graphs" if dec.segments else "eager"
                good = err <= tol and agree == clear
                ok &= good
                print(f"{vault.name} {dtype:8s} GPU cache {fraction:4.0%} ({mode}, hit rate {dec.cache.stats.hit_rate:.2f}): "
                      f"vs reference {err:.2e} (tolerance {tol:.2e}), vs CPU runtime {err_cpu:.2e}; top-1 = reference "
                      f"at {agree}/{clear} clear-margin positions {'OK' if good else 'FAIL'}")
                dec.close()
            if dtype == "bfloat16":
                prompt = ids[:16]
                gpu = GpuDecoder(sm, "cuda", int(everything * 0.25), 128)
                gpu_tokens = greedy(gpu.forward, prompt, 48)
                # the reference's margins along the GPU's own sequence
                seq = prompt + gpu_tokens
                ref_logits = reference(torch.tensor([seq]))[0, len(prompt) - 1: -1]
                top2 = torch.topk(ref_logits, 2).values
                margin = (top2[:, 0] - top2[:, 1]) / ref_logits.abs().max()
                ref_tokens = ref_logits.argmax(-1).tolist()
                clear = [i for i in range(48) if margin[i] > bf16_tol]
                first_clear_diff = next((i for i in clear if gpu_tokens[i] != ref_tokens[i]), None)
                good = first_clear_diff is None
                ok &= good
                print(f"{vault.name} bfloat16 greedy 48 tokens: GPU = reference at all {len(clear)} positions whose "
                      f"margin exceeds {bf16_tol:.3f}: {'OK' if good else f'FAIL at {first_clear_diff}'}")
                gpu.close()
            sm.close()
    return ok


if __name__ == "__main__":
    results = [check(Path(v)) for v in sys.argv[1:]]
    print("ALL OK" if all(results) else "SOME CHECKS FAILED")
    sys.exit(0 if all(results) else 1)
