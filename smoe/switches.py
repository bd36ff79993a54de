"""Environment switches: every SMOE_* variable smoe reads, with its default, in one table.

The README's table of switches lists exactly these (a test compares the two). Switches are for
measuring one path against another and for choosing the demo's model; options a user sets for a
run are command-line flags instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    effect: str

    def value(self) -> str:
        return os.environ.get(self.name, self.default)

    def on(self) -> bool:
        return self.value() == "1"


CPU_COMPILED = Switch("SMOE_CPU_COMPILED", "1",
                      "0 runs the CPU fast decoder's eager torch ops instead of its compiled (numba) step")
GPU_INDUCTOR = Switch("SMOE_GPU_INDUCTOR", "1",
                      "0 runs the GPU decoder's attention block eagerly instead of compiled by torch inductor")
GPU_IN_PLACE = Switch("SMOE_GPU_IN_PLACE", "1",
                      "0 copies each missed expert into the GPU cache before its layer runs instead of reading it in "
                      "place from pinned host RAM (when that holds every expert)")
GPU_PROMPT_GRAPHS = Switch("SMOE_GPU_PROMPT_GRAPHS", "1",
                           "0 runs a prompt's layers eagerly on the GPU instead of padded to a captured length and "
                           "replayed as a CUDA graph (when every expert is resident)")
GPU_ATTENTION_KERNEL = Switch("SMOE_GPU_ATTENTION_KERNEL", "1",
                              "0 runs a one-token step's attention on the GPU as torch ops (SDPA over the whole KV "
                              "cache under a mask) instead of the decode-attention kernels")
GPU_GEMV = Switch("SMOE_GPU_GEMV", "1",
                  "0 runs a one-token step's trunk projections (q/k/v, o, router, LM head) on the GPU through "
                  "cuBLAS instead of the one-row Triton kernel")
PREFETCH = Switch("SMOE_PREFETCH", "0",
                  "1 guesses the next layer's experts from the current hidden state and reads them early")
DEMO_MODEL = Switch("SMOE_DEMO_MODEL", "",
                    "a model directory `smoe demo` runs on instead of the shipped models/smoe-demo-6m")
SWITCHES = (CPU_COMPILED, GPU_INDUCTOR, GPU_IN_PLACE, GPU_PROMPT_GRAPHS, GPU_ATTENTION_KERNEL, GPU_GEMV, PREFETCH,
            DEMO_MODEL)
