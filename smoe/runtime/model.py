"""Run a vault: the transformers model holds the resident trunk; routed experts come from the device's backend.

The model is built on the meta device from the vault's config (smoe.hf.model), so expert parameters
are never allocated. Its experts modules forward, through transformers' experts registry
(smoe.hf.experts), to the backend's `RoutedExperts`, which asks the store for the experts the router
picked, all at once; the fast decoders read the same backend's cache (smoe.runtime.backends).
"""

from __future__ import annotations

import torch

from smoe.devices import resolve_device
from smoe.errors import SmoeError
from smoe.format.dtypes import TORCH_NAMES
from smoe.format.vault import Vault
from smoe.hf.model import build_model, load_trunk, model_config
from smoe.runtime.backends import Options, gpu_preferred, open_backend
from smoe.runtime.decoder import SequenceStep, open_decoder
from smoe.runtime.weights import fast_decoder_gap, module_layers
from smoe.source.description import describe_model

DECODERS = ("auto", "fast", "generic")
FREE_STATES = 4  # sequence states an opened vault keeps for reuse


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
        self.backend = None
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
        if device == "auto" and self.device.type != "cpu" and not gpu_preferred(self, decoder):
            self.device = torch.device("cpu")  # auto: the GPU only where it measured faster (BENCHMARKS.md)
        self.decoder = pick_decoder(self, decoder)
        self.backend = open_backend(self, self.decoder, Options(cache_bytes, gpu_cache_bytes, threads, direct_io,
                                                                kernel_path))

    @property
    def store(self):
        """The ExpertStore the transformers modules read (None where the fast decoder has its own cache)."""
        return self.backend.store if self.backend is not None else None

    @property
    def routed(self):
        return getattr(self.backend, "routed", None)

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
        return self.backend.fast_decoder(self, positions)

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
        return self.backend.stats()

    def describe(self) -> dict:
        """Which decoder runs on which device, for generate --json, eval --json and /metrics; where the fast
        decoder runs layers through the family's own transformers modules, which ("transformers_layers": layer
        type -> layer indices)."""
        out = {"decoder": self.decoder, "device": str(self.device)}
        by_modules = module_layers(self.description) if self.decoder == "fast" else ()
        if by_modules:
            types = getattr(self.config.get_text_config(), "layer_types", None) or []
            kind = lambda i: str(types[i]) if i < len(types) else "mixer"
            out["transformers_layers"] = {t: [i for i in by_modules if kind(i) == t] for t in map(kind, by_modules)}
        return out

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
        self.vault.close()


def has_fast_decoder(sm: OpenedVault) -> bool:
    """Whether the fast decoder of the vault's device covers the model's description."""
    return fast_decoder_gap(sm.description, sm.device.type) is None


def pick_decoder(sm: OpenedVault, decoder: str) -> str:
    fast = has_fast_decoder(sm)
    if decoder == "fast" and not fast:
        raise SmoeError(f"no fast decoder for the {sm.vault.meta['family']} family: it has "
                        f"{fast_decoder_gap(sm.description, sm.device.type)} (use --decoder generic)")
    return "fast" if decoder != "generic" and fast else "generic"
