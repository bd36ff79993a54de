"""The device backend seam: what an opened vault asks of the device it runs on.

A backend owns the one expert cache of its device and the fast decoder over it, and says how large
that cache is by default, what it counts, and how many sequences its decoder holds at once. The
OpenedVault asks only this interface; `open_backend` is the one place that maps a device and a decoder
to a backend, so a new device (MLX, say) is one more class here and a row in BACKENDS:

- "cpu": an ExpertStore of experts prepared for the CPU, behind both the family's transformers
  modules (RoutedExperts) and the fast CPU decoder (the compiled step reads the same store);
- "cuda" with the generic decoder: the trunk moved to the GPU, an ExpertStore of experts decoded there;
- "cuda" with the fast decoder: the GPU decoder and its slot cache, fed from a pinned host tier.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from smoe.errors import SmoeError
from smoe.hf.experts import attach_routed, empty_parameters
from smoe.hf.model import experts_modules
from smoe.moe.dispatch import routed_sum
from smoe.runtime.cpu import kernels as kernels_cpu
from smoe.runtime.cpu.store import ExpertStore, default_cache_bytes
from smoe.runtime.kv import grown_capacity


class Backend(Protocol):
    store: ExpertStore | None  # the experts the transformers modules read (None: the fast decoder's own cache)
    max_sequences: int  # sequences the fast decoder holds states for at once

    def fast_decoder(self, sm, positions: int):
        """The device's fast decoder over the cache, made on first use (None for the generic decoder)."""

    def stats(self) -> dict:
        """The cache's counters (smoe.runtime.blobs.CacheStats) and its capacity in bytes."""

    def close(self) -> None:
        ...


@dataclass
class RoutedExperts:
    """Computes one MoE layer's routed experts for the tokens of a call."""

    store: ExpertStore
    roles: tuple[str, ...]
    largest_expert: int = 0  # prepared bytes of the largest expert; measured on first use (it scans the index)

    def forward(self, module, hidden_states, top_k_index, top_k_weights):
        layer = module.smoe_layer

        def fetch(group):
            prepared = self.store.get(layer, group)
            return {e: (lambda rows, p=prepared[e]: self.expert_output(module, p, rows)) for e in group}

        return routed_sum(hidden_states, top_k_index, top_k_weights, fetch, per_group=self.experts_per_group(),
                          weight_input=getattr(module, "smoe_scale_input", False))

    def experts_per_group(self) -> int:
        """How many experts fit the cache budget together: a long prompt's layer may route to more
        experts than fit, and then reads them group by group (smoe.moe.dispatch.expert_groups)."""
        if not self.largest_expert:
            self.largest_expert = max(self.store.min_budget(1), 1)
        return max(1, self.store.cache_bytes // self.largest_expert)

    def expert_output(self, module, expert, x):
        """One expert as transformers computes it: gate/up, the module's own gating, down."""
        if module.has_gate:
            gate, up = kernels_cpu.gate_and_up(x, expert)
            if module.is_concatenated:
                gate_up = torch.cat([gate, up], dim=-1)
            else:  # interleaved [g0, u0, g1, u1, ...] (gpt-oss)
                gate_up = torch.stack([gate, up], dim=-1).flatten(-2)
            h = module._apply_gate(gate_up)
        else:
            h = module.act_fn(kernels_cpu.linear(x, expert, "up"))
        y = kernels_cpu.linear(h, expert, "down")
        if getattr(module, "has_post_expert_norm", False):
            y = module.post_expert_norm(y)
        return y


@dataclass(frozen=True)
class Options:
    """What the user asked of the caches: every backend takes the same, each reads what concerns it."""

    cache_bytes: int | None  # the store's budget; for the GPU's fast decoder, its pinned host tier
    gpu_cache_bytes: int | None  # the GPU slot cache's budget (the GPU's fast decoder)
    threads: int
    direct_io: bool
    kernel_path: str


class StoreBackend:
    """Experts from an ExpertStore, prepared for the device, behind the family's transformers modules."""

    max_sequences = 16

    def __init__(self, sm, o: Options):
        self.store = ExpertStore(sm.vault, o.cache_bytes or 0, self.preparer(sm.dtype, o.kernel_path, sm.device),
                                 threads=o.threads, direct_io=o.direct_io)
        self.routed = RoutedExperts(self.store, tuple(sm.vault.meta["roles"]))
        for layer, module in experts_modules(sm.model, sm.vault).items():
            attach_routed(module, layer, self.routed)
        if o.cache_bytes is None:  # the default counts experts in their prepared (compute) size
            self.store.cache_bytes = self.default_budget(sm)
        top_k = sm.vault.meta.get("top_k") or 1
        need = self.store.min_budget(top_k)
        if self.store.cache_bytes < need:
            raise SmoeError(f"an expert cache of {self.store.cache_bytes:,} bytes (--cache-gb) is smaller than one "
                            f"token's {top_k} experts of a layer: at least {need / 1e9:.4g} GB ({need:,} bytes) is needed")

    def preparer(self, dtype: torch.dtype, kernel_path: str, device: torch.device):
        """prepare(tensors, biases) -> (compute form, bytes)."""
        return lambda tensors, biases: as_sized(kernels_cpu.prepare_expert(tensors, biases, dtype, kernel_path, fuse=True))

    def default_budget(self, sm) -> int:
        """Half the available RAM, at most every expert in its prepared size."""
        return default_cache_bytes(sm.vault, self.store.prepare_ratio())

    def fast_decoder(self, sm, positions: int):
        return None

    def stats(self) -> dict:
        return self.store.stats.as_dict() | {"capacity_bytes": self.store.cache_bytes}

    def close(self) -> None:
        self.store.close()


class CpuBackend(StoreBackend):
    """The CPU: the store above, and the fast CPU decoder (the compiled step) reading the same store."""

    def __init__(self, sm, o: Options):
        super().__init__(sm, o)
        self._fast = None

    def fast_decoder(self, sm, positions: int):
        from smoe.runtime.cpu.compiled import FastCpuDecoder

        if sm.decoder != "fast":
            return None
        if self._fast is None:
            self._fast = FastCpuDecoder(sm, grown_capacity(0, positions, sm.max_positions))
        return self._fast


class CudaStoreBackend(StoreBackend):
    """The generic decoder on a GPU: the trunk moves there, experts are decoded there to dense weights
    (torch ops; the Triton kernels belong to the fast decoder's slot cache)."""

    def __init__(self, sm, o: Options):
        for module in experts_modules(sm.model, sm.vault).values():
            empty_parameters(module)  # meta placeholders cannot move; the experts come from the store
        sm.model.to(sm.device)
        super().__init__(sm, o)

    def preparer(self, dtype, kernel_path, device):
        def prepare(tensors, biases):
            moved = [replace(t, codes=t.codes.to(device), scales=t.scales.to(device)) for t in tensors]
            return as_sized(kernels_cpu.prepare_expert(moved, {r: b.to(device) for r, b in biases.items()}, dtype,
                                                       "dequant", fuse=True))

        return prepare

    def default_budget(self, sm) -> int:
        """80% of the GPU memory free with the trunk on it, at most every expert in its prepared size."""
        everything = self.store.prepare_ratio() * sum(e.size for e in sm.vault.entries.values())
        return int(min(everything, 0.8 * torch.cuda.mem_get_info(sm.device)[0]))


class CudaBackend:
    """The GPU's fast decoder (trunk on the GPU, experts in its slot cache fed from a pinned host tier and
    the disk), made at open so a budget too small or out of memory fails the open; a longer sequence grows
    its sequence state in place."""

    store = routed = None
    max_sequences = 1

    def __init__(self, sm, o: Options):
        from smoe.runtime.cuda.decode import GpuDecoder

        budget = o.gpu_cache_bytes if o.gpu_cache_bytes is not None else self.default_budget(sm)
        self._decoder = GpuDecoder(sm, sm.device, budget, grown_capacity(0, 1, sm.max_positions), o.cache_bytes or 0,
                                   threads=o.threads, direct_io=o.direct_io)

    @staticmethod
    def default_budget(sm) -> int:
        """Every expert when they fit in 80% of the GPU memory free after the trunk, else that 80%."""
        from smoe.runtime.cuda.cache import blob_slot_bytes

        everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
        free, _ = torch.cuda.mem_get_info(sm.device)
        trunk = sum(p.numel() * p.element_size() for p in sm.model.parameters() if p.device.type != "meta")
        return int(min(everything, 0.8 * max(free - trunk, 0)))

    def fast_decoder(self, sm, positions: int):
        return self._decoder

    def stats(self) -> dict:
        self._decoder.account()
        cache = self._decoder.cache
        return cache.stats.as_dict() | {"capacity_bytes": cache.n_slots * cache.slot_bytes}

    def close(self) -> None:
        self._decoder.close()


BACKENDS = {("cpu", "fast"): CpuBackend, ("cpu", "generic"): CpuBackend, ("cuda", "generic"): CudaStoreBackend,
            ("cuda", "fast"): CudaBackend}


def open_backend(sm, decoder: str, options: Options) -> Backend:
    """The backend of the vault's device for the decoder it runs (`sm.device`, `decoder` already chosen)."""
    backend = BACKENDS.get((sm.device.type, decoder))
    if backend is None:
        raise SmoeError(f"smoe runs on cpu and cuda devices; not on {sm.device.type}")
    return backend(sm, options)


def gpu_preferred(sm, decoder: str) -> bool:
    """--device auto's rule, from the measured crossovers (BENCHMARKS.md, "Choosing the device"): the
    GPU when its fast decoder runs every MoE layer on the Triton kernels. Where a layer's experts fall
    back to decode-then-matmul (e.g. widths that are not multiples of 64), or the family has only the
    generic decoder, the CPU measured faster."""
    from smoe.runtime.cuda.decode import kernels_cover
    from smoe.runtime.weights import fast_decoder_gap

    return decoder != "generic" and fast_decoder_gap(sm.description, "cuda") is None and kernels_cover(sm.vault)


def as_sized(prepared) -> tuple[object, int]:
    return prepared, prepared.nbytes
