"""The GPU decoder as `smoe bench decode` drives it: recorded routing instead of the router's, host
seconds per phase of a step, and a host tier filled before timing.

The router still runs and the host still reads its top-k (the one sync per layer that streaming
needs), so graphs and host syncs stay as in real decoding; only the experts used come from the
recording, read on the device at the step set by `replay_step`.
"""

from __future__ import annotations

import gc
import time

import torch

from smoe.runtime.cuda.decode import GpuDecoder


class ReplayDecoder(GpuDecoder):
    """GpuDecoder whose layers use `route_replay[replay_step, layer]` ([steps, layers, k] expert ids)."""

    def __init__(self, *args, route_replay: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.route_replay = route_replay.to(device=self.device, dtype=torch.int64)
        self.replay_step = 0
        # the step's recorded routes [layers, k], read inside the graphs: one copy a token on the compute stream,
        # so that a layer's replayed routing costs no indexing kernel (the router's own costs none either)
        self.token_routes = torch.zeros_like(self.route_replay[0])
        # host seconds per phase of step(), and in the garbage collector (whenever it ran during the row)
        self.timing = {"launch": 0.0, "routing_sync": 0.0, "cache": 0.0, "gc": 0.0}
        self.gc_started = 0.0
        gc.callbacks.append(self.gc_clock)

    def gc_clock(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc_started = time.perf_counter()
        else:
            self.timing["gc"] += time.perf_counter() - self.gc_started

    def close(self) -> None:
        if self.gc_clock in gc.callbacks:
            gc.callbacks.remove(self.gc_clock)
        super().close()

    def step(self, token: int) -> torch.Tensor:
        self.token_routes.copy_(self.route_replay[self.replay_step])
        return super().step(token)

    def routed(self, seg: int, top_i):
        return self.token_routes[seg: seg + 1]

    def run_whole_token(self) -> None:
        clock = time.perf_counter()
        super().run_whole_token()
        self.timing["launch"] += time.perf_counter() - clock

    def run_segment(self, seg: int) -> None:
        clock = time.perf_counter()
        super().run_segment(seg)
        self.timing["launch"] += time.perf_counter() - clock

    def load_offsets(self, i: int) -> None:
        s = self.static
        clock = time.perf_counter()
        ids = s.top_i[0].tolist()  # the sync: the host must know which experts to bring
        now = time.perf_counter()
        self.timing["routing_sync"] += now - clock
        s.set_offsets(self.cache.offsets(i, ids))
        self.timing["cache"] += time.perf_counter() - now


def replay(dec: ReplayDecoder, steps: range, token: int = 0) -> tuple[int, float]:
    """Greedy one-token steps at the recorded routing's `steps`, from `token`: (the last token, wall seconds from a
    synchronised start to a synchronised end)."""
    synchronize = torch.cuda.synchronize if dec.device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for t in steps:
        dec.replay_step = t
        token = int(dec.forward([token]).argmax())
    synchronize()
    return token, time.perf_counter() - start
