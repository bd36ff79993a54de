"""On a CUDA machine: the Triton encoder against the CPU reference encoder, bit for bit, at real shapes."""

import sys

import torch

from smoe.format import codec


def cases():
    g = torch.Generator().manual_seed(0)
    yield "gauss 4096x1536 bf16 slice", (torch.randn(64, 1536, generator=g) * 0.02).to(torch.bfloat16)
    w = torch.randn(64 * 300, generator=g) * torch.logspace(-44, 4, 64 * 300)
    w[:64] = 0
    yield "mixed magnitudes", w
    yield "odd shape 37x50", torch.randn(37, 50, generator=g)


def main() -> int:
    bad = 0
    for name, w in cases():
        for bits in codec.DEPTHS:
            ref = codec.encode(w, bits, backend="reference")
            gpu = codec.encode(w.cuda(), bits)
            same = torch.equal(ref[0], gpu[0].cpu()) and torch.equal(ref[1], gpu[1].cpu())
            bad += not same
            print(f"{'OK ' if same else 'BAD'} SMOE-Q{bits} {name}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
