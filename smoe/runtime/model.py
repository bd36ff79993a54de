"""Run a vault: the transformers model holds the resident trunk; routed experts come from the store.

The model is built on the meta device from the vault's config (smoe.hf.model), so expert parameters
are never allocated. Its experts modules forward, through transformers' experts registry
(smoe.hf.experts), to `RoutedExperts`, which asks the store for the experts the router picked, all at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from smoe.devices import resolve_device
from smoe.errors import SmoeError
from smoe.format.dtypes import TORCH_NAMES
from smoe.format.vault import Vault
from smoe.hf.experts import attach_routed, empty_parameters
from smoe.hf.model import build_model, experts_modules, load_trunk, model_config
from smoe.moe.dispatch import routed_sum
from smoe.runtime.cpu import kernels as kernels_cpu
from smoe.runtime.cpu.store import ExpertStore, default_cache_bytes
from smoe.runtime.decoder import SequenceStep, open_decoder
from smoe.runtime.kv import grown_capacity
from smoe.runtime.weights import fast_decoder_gap
from smoe.source.description import describe_model

DECODERS = ("auto", "fast", "generic")
FREE_STATES = 4  # sequence states an opened vault keeps for reuse


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


class OpenedVault:
    """A vault opened for inference: trunk resident on the device, routed experts streamed through the
    one expert cache of that device.

    The decoder is chosen when the vault is opened, because it decides which cache exists: "fast"
    (the compiled CPU step, or the GPU's Triton kernels and CUDA graphs, which read experts from the GPU
    slot cache) or "generic" (the family's transformers modules, with experts from an ExpertStore
    that prepares them for the device). "auto" takes the fast one where the family has it.
    """

    def __init__(self, vault_dir, dtype: str | torch.dtype = "bfloat16", cache_bytes: int | None = None,
                 threads: int = 16, direct_io: bool = False, kernel_path: str = "auto", device: str = "cpu",
                 gpu_cache_bytes: int | None = None, decoder: str = "auto", model=None):
        if decoder not in DECODERS:
            raise SmoeError(f"unknown decoder {decoder!r} ({', '.join(DECODERS)})")
        self.device = resolve_device(device)
        self.vault = Vault(vault_dir)
        self.store = self.gpu = None
        self.free_states = []  # returned sequence states, reused by the next sequences
        try:
            self._open(dtype, cache_bytes, threads, direct_io, kernel_path, device, gpu_cache_bytes, decoder, model)
        except BaseException:  # a failed open holds no file, thread or GPU memory: callers may retry
            self.close()
            raise

    def _open(self, dtype, cache_bytes, threads, direct_io, kernel_path, device, gpu_cache_bytes, decoder,
              model) -> None:
        self.dtype = TORCH_NAMES[dtype] if isinstance(dtype, str) else dtype
        self.config = model_config(self.vault)
        self.description = describe_model(self.vault.config)
        if model is None:
            self.model = build_model(self.config, self.dtype, where=str(self.vault.dir / "config.json"))
            self.vault.check_trunk()
            load_trunk(self.model, self.vault, self.dtype)
        else:  # from_pretrained built it and loaded the trunk (checked by the quantizer)
            self.model = model
        self.model.requires_grad_(False)  # inference only: no autograd graph, also when called directly
        if self.device.type == "cuda" and device == "auto" and not gpu_preferred(self, decoder):
            self.device = torch.device("cpu")  # auto: the GPU only where it measured faster (BENCHMARKS.md)
        self.decoder = pick_decoder(self, decoder)
        if self.device.type == "cuda" and self.decoder == "fast":
            self.gpu = GpuRuntime(self, gpu_cache_bytes, host_cache_bytes=cache_bytes or 0, threads=threads,
                                  direct_io=direct_io)
            return
        if self.device.type == "cuda":  # the generic decoder on the GPU: the trunk moves there
            for module in experts_modules(self.model, self.vault).values():
                empty_parameters(module)  # meta placeholders cannot move; the experts come from the store
            self.model.to(self.device)
        prepare = expert_preparer(self.dtype, kernel_path, self.device)
        self.store = ExpertStore(self.vault, cache_bytes or 0, prepare, threads=threads, direct_io=direct_io)
        self.routed = RoutedExperts(self.store, tuple(self.vault.meta["roles"]))
        self.attach_experts()
        if cache_bytes is None:  # the default counts experts in their prepared (compute) size
            self.store.cache_bytes = default_store_bytes(self)
        self.check_budget()

    def attach_experts(self) -> None:
        for layer, module in experts_modules(self.model, self.vault).items():
            attach_routed(module, layer, self.routed)

    def check_budget(self) -> None:
        top_k = self.vault.meta.get("top_k") or 1
        need = self.store.min_budget(top_k)
        if self.store.cache_bytes < need:
            raise SmoeError(f"an expert cache of {self.store.cache_bytes:,} bytes (--cache-gb) is smaller than one "
                            f"token's {top_k} experts of a layer: at least {need / 1e9:.4g} GB ({need:,} bytes) is needed")

    def fast_decoder(self, positions: int):
        """The device's fast decoder when this family has one (else None) on its own sequence state, reset,
        with room for `positions` tokens. It is made once; a state grows in place (doubling) when a longer
        sequence comes, keeping the trunk bundle and the expert cache."""
        dec = self.running_decoder(positions)
        if dec is not None:
            dec.use(None)
            dec.reset()
            dec.reserve(positions)
        return dec

    def running_decoder(self, positions: int = 1):
        """The device's fast decoder as it is (else None), made on first use."""
        from smoe.runtime.cpu import compiled as fast_decode

        if self.gpu is not None:
            return self.gpu.decoder()
        if self.decoder != "fast":
            return None
        if getattr(self, "_fast", None) is None:
            self._fast = fast_decode.FastCpuDecoder(self, grown_capacity(0, positions, self.max_positions))
        return self._fast

    def take_state(self, positions: int):
        """A sequence state for a decoder-contract sequence, empty, with room for `positions` tokens: a
        returned one when there is one (on the GPU the same tensors keep its captured graphs), else new."""
        dec = self.running_decoder(positions)
        state = self.free_states.pop() if self.free_states else dec.new_state(positions)
        state.length = 0
        return state

    def return_states(self, states) -> None:
        """States a sequence no longer needs, kept for the next (at most a few: each holds its KV memory)."""
        self.free_states.extend(states)
        del self.free_states[FREE_STATES:]

    @property
    def max_positions(self) -> int | None:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return getattr(text, "max_position_embeddings", None)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, T, V] in fp32 (on the CPU), each row a sequence run by the decoder
        the vault was opened with (the one describe() names), through the decoder contract."""
        decoder = open_decoder(self, "auto", input_ids.shape[-1])
        rows = []
        for i, row in enumerate(input_ids.tolist()):
            rows.append(decoder.forward([SequenceStep(i, row, 0)])[0])
            decoder.release(i)
        return torch.stack(rows)

    def cache_stats(self) -> dict:
        """The counters of the one expert cache (smoe.runtime.blobs.CacheStats) and its capacity."""
        if self.gpu is not None:
            return self.gpu.decoder_stats()
        return self.store.stats.as_dict() | {"capacity_bytes": self.store.cache_bytes}

    def describe(self) -> dict:
        """Which decoder runs on which device, for generate --json, eval --json and /metrics."""
        return {"decoder": self.decoder, "device": str(self.device)}

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
        if self.store is not None:
            self.store.close()
        self.vault.close()


class GpuRuntime:
    """The GPU side of a OpenedVault: one GpuDecoder (trunk on the GPU, GPU expert cache), made at open; a
    longer sequence grows its sequence state in place."""

    def __init__(self, sm: OpenedVault, gpu_cache_bytes: int | None, host_cache_bytes: int, threads: int,
                 direct_io: bool):
        from smoe.runtime.gpu.decode import GpuDecoder

        self.gpu_cache_bytes = gpu_cache_bytes if gpu_cache_bytes is not None else default_gpu_cache_bytes(sm)
        # made now, so a budget too small or out of memory fails the open
        self._decoder = GpuDecoder(sm, sm.device, self.gpu_cache_bytes, grown_capacity(0, 1, sm.max_positions),
                                   host_cache_bytes, threads=threads, direct_io=direct_io)

    def decoder(self):
        return self._decoder

    def decoder_stats(self) -> dict:
        cache = self._decoder.cache
        return cache.stats.as_dict() | {"capacity_bytes": cache.n_slots * cache.slot_bytes}

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()


def has_fast_decoder(sm: OpenedVault) -> bool:
    """Whether the fast decoder of the vault's device covers the model's description."""
    return fast_decoder_gap(sm.description, sm.device.type) is None


def gpu_preferred(sm: OpenedVault, decoder: str) -> bool:
    """--device auto's rule, from the measured crossovers (BENCHMARKS.md, "Choosing the device"): the
    GPU when its fast decoder runs every MoE layer on the Triton kernels. Where a layer's experts fall
    back to decode-then-matmul (e.g. widths that are not multiples of 64), or the family has only the
    generic decoder, the CPU measured faster."""
    from smoe.runtime.gpu.decode import kernels_cover

    return decoder != "generic" and has_fast_decoder(sm) and kernels_cover(sm.vault)


def pick_decoder(sm: OpenedVault, decoder: str) -> str:
    fast = has_fast_decoder(sm)
    if decoder == "fast" and not fast:
        raise SmoeError(f"no fast decoder for the {sm.vault.meta['family']} family: it has "
                        f"{fast_decoder_gap(sm.description, sm.device.type)} (use --decoder generic)")
    return "fast" if decoder != "generic" and fast else "generic"


def expert_preparer(dtype: torch.dtype, kernel_path: str, device: torch.device):
    """prepare(tensors, biases) -> (compute form, bytes) for the device's ExpertStore. On a GPU the
    generic decoder computes with dense weights decoded there (torch ops; the Triton kernels belong to
    the fast decoder's slot cache)."""
    if device.type == "cpu":
        return lambda tensors, biases: as_sized(kernels_cpu.prepare_expert(tensors, biases, dtype, kernel_path,
                                                                          fuse=True))

    def prepare(tensors, biases):
        moved = [replace(t, codes=t.codes.to(device), scales=t.scales.to(device)) for t in tensors]
        return as_sized(kernels_cpu.prepare_expert(moved, {r: b.to(device) for r, b in biases.items()}, dtype,
                                                   "dequant", fuse=True))

    return prepare


def default_store_bytes(sm: OpenedVault) -> int:
    """CPU: half the available RAM; GPU: 80% of the GPU memory free with the trunk on it; at most
    every expert in its prepared size either way."""
    if sm.device.type == "cuda":
        everything = sm.store.prepare_ratio() * sum(e.size for e in sm.vault.entries.values())
        return int(min(everything, 0.8 * torch.cuda.mem_get_info(sm.device)[0]))
    return default_cache_bytes(sm.vault, sm.store.prepare_ratio())


def default_gpu_cache_bytes(sm: OpenedVault) -> int:
    """Every expert when they fit in 80% of the GPU memory free after the trunk, else that 80%."""
    from smoe.runtime.gpu.cache import blob_slot_bytes

    everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
    free, _ = torch.cuda.mem_get_info(sm.device)
    trunk = sum(p.numel() * p.element_size() for p in sm.model.parameters() if p.device.type != "meta")
    return int(min(everything, 0.8 * max(free - trunk, 0)))


def as_sized(prepared) -> tuple[object, int]:
    return prepared, prepared.nbytes

