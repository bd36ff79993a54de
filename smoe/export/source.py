"""`smoe export`: a vault rewritten for the runtimes people already have.

Both targets hold SMOE's codes as they are: SMOE is affine per group (weight = code·s/h − s), which
is what llama.cpp's Q4_1 (d, m) and mlx-lm's affine quantisation (scale, bias) store. Only the
step s/h is rounded to fp16, so every exported weight is SMOE's up to s/1024.

This module holds what both exporters share: the vault's tensors read one layer at a time, the
codes unpacked, and the atomic write of the output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.dtypes import FLOATS, SAFETENSORS, SAFETENSORS_NAMES
from smoe.format.safetensors_io import read_tensor
from smoe.format.vault import Vault
from smoe.source.config_checks import check_vault_config

TRUNK_DTYPES = {SAFETENSORS_NAMES[t]: t for t in FLOATS.values()}


# DeepSeek-V4's hash-routed layers' token-id table (the suffix of its trunk name), the one integer trunk tensor an export
# reads (GGUF writes it I32)
HASH_TABLE = ".ffn.gate.tid2eid"

@dataclass
class ExpertTensor:
    """One projection of one expert as stored: packed codes and fp16 scales (a layer's experts are
    held at their stored size; codes are unpacked one tensor at a time)."""

    packed: torch.Tensor  # uint8 [G, 64·bits/8], as in the vault
    scales: np.ndarray  # float16 [G]
    bits: int
    shape: tuple[int, int]  # (out, in)

    @property
    def codes(self) -> np.ndarray:
        """uint8 [G · 64], one code per weight; the tail past out·in is padding."""
        return codec.unpack_codes(self.packed, self.bits).numpy().reshape(-1)

    def decoded(self) -> np.ndarray:
        """fp32 [out, in]: SMOE's own decode."""
        h = codec.half_range(self.bits)
        w = (self.codes.reshape(-1, codec.GROUP_SIZE).astype(np.float32) - h) * (self.scales.astype(np.float32)[:, None] / h)
        out, inp = self.shape
        return w.reshape(-1)[: out * inp].reshape(out, inp)


class ExportSource:
    """A vault opened for export: its config, its trunk tensors by name, its experts one layer at a time."""

    def __init__(self, vault_dir):
        self.vault = Vault(vault_dir)
        try:
            self._open()
        except BaseException:
            self.vault.close()
            raise

    def _open(self) -> None:
        self.meta = self.vault.meta
        self.family = self.meta.get("family", "?")
        self.model_type = self.meta.get("model_type", self.family)
        self.num_experts = self.meta["num_experts"]
        self.roles = tuple(self.meta["roles"])
        self._layer: tuple[int, list[tuple[dict[str, ExpertTensor], dict[str, torch.Tensor]]]] | None = None
        self.has_biases = any(e.biases for e in self.vault.entries.values())  # gpt-oss; each target says if it takes them
        if self.vault.config is None:
            raise SmoeError(f"{self.vault.dir}: no config.json")
        check_vault_config(self.vault.config, self.vault.meta, self.vault.dir)
        self._trunk = self.vault.check_trunk()
        # every exported trunk tensor is a weight (an int8 norm is damage) but DeepSeek-V4's hash-routed layers'
        # token-id table tid2eid, whose integers choose each token's experts (its GGUF export writes it I32)
        for name, stored in self._trunk.items():
            require(SAFETENSORS[stored.dtype].is_floating_point or name.endswith(HASH_TABLE),
                    f"trunk tensor {name}: {stored.dtype} in the vault, the exports take floating trunk tensors only")
        self._trunk_fd = os.open(self.vault.trunk_path, os.O_RDONLY)

    @property
    def dir(self) -> Path:
        return self.vault.dir

    def trunk_names(self) -> list[str]:
        return list(self._trunk.keys())

    def trunk_tensor(self, name: str) -> torch.Tensor:
        return read_tensor(self._trunk_fd, self._trunk[name])

    def trunk_shape(self, name: str) -> tuple[int, ...]:
        return self._trunk[name].shape

    def trunk_dtype(self, name: str) -> torch.dtype | None:
        return TRUNK_DTYPES.get(self._trunk[name].dtype)

    def experts(self, layer: int, role: str) -> list[ExpertTensor]:
        """Every expert's `role` projection in `layer`; a layer's blobs are read once for all roles."""
        return [tensors[role] for tensors, _ in self._experts_of(layer)]

    def expert_biases(self, layer: int, role: str) -> list[torch.Tensor]:
        """Every expert's `role` bias [out] in `layer` (vaults whose experts have biases)."""
        return [biases[role] for _, biases in self._experts_of(layer)]

    def _experts_of(self, layer: int) -> list[tuple[dict[str, ExpertTensor], dict[str, torch.Tensor]]]:
        if self._layer is None or self._layer[0] != layer:
            self._layer = (layer, [self._read(layer, e) for e in range(self.num_experts)])
        return self._layer[1]

    def _read(self, layer: int, expert: int) -> tuple[dict[str, ExpertTensor], dict[str, torch.Tensor]]:
        tensors, biases = self.vault.read_expert(layer, expert)
        return {t.role: ExpertTensor(t.codes, t.scales.numpy(), t.bits, tuple(t.shape)) for t in tensors}, biases

    def expert_shape(self, role: str) -> tuple[int, int]:
        return tuple(self.meta["expert_shapes"][role])

    def role_bits(self, layer: int, role: str) -> int:
        """The deepest depth any expert of `layer` stores `role` at (mixed-depth vaults are allowed)."""
        return max(t.bits for e in range(self.num_experts) for t in self.vault.entry(layer, e).tensors if t.role == role)

    def close(self) -> None:
        self._layer = None
        os.close(self._trunk_fd)
        self.vault.close()


def scales_over(expert: ExpertTensor, width: int) -> np.ndarray:
    """The group scale s of every run of `width` weights (64, or 32 = half a group), padding dropped."""
    per_group = codec.GROUP_SIZE // width
    out, inp = expert.shape
    return np.repeat(expert.scales, per_group)[: out * inp // width]


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SmoeError(message)


@dataclass
class Planned:
    """A tensor of the output, known by name, type and shape before any data is produced."""

    name: str
    dtype: object  # the target's type tag
    shape: tuple[int, ...]
    nbytes: int
    load: Callable[[], np.ndarray]


def produce(plan: list[Planned], progress: bool = False) -> Iterator[tuple[Planned, np.ndarray]]:
    """Each planned tensor's data in order, checked against the plan."""
    items = plan
    if progress:
        from smoe.progress import bar

        items = bar(plan, unit="tensor", desc="export")
    for p in items:
        data = np.ascontiguousarray(p.load())
        if data.nbytes != p.nbytes:
            raise SmoeError(f"internal: {p.name} has {data.nbytes} bytes, planned {p.nbytes}")
        yield p, data
