"""The KV state of one sequence: per layer, what attention keeps of the tokens seen so far.

A decoder computes; a `SequenceState` remembers. Each layer holds one kind of state, chosen from the
model description:

- `KeyValues`: keys and values per KV head (GQA and multi-head attention), [kv_heads, positions, head_dim];
- `Latents`: MLA's compressed cache, per position the normalised K/V latent (latent_dim) and the rotary key
  all heads share (rope_key_dim), from which the absorbed attention computes without ever
  expanding K and V per head;
- `ModuleLayers`: the layers a family's own modules run (linear attention, state-space mixers): their state
  lives in that family's cache object, one per sequence, made by the decoder at the sequence's start.

Growing a state (`reserve`) reallocates its tensors only, keeping what they hold: the trunk and the
expert cache are untouched. Other kinds (a sliding window's ring, recurrent and convolution state,
an indexer's key cache, fixed-size blocks for paged batching) are further classes with the same
members: `capacity`, `position_bytes` and `grow`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from smoe.source.description import ModelDescription


@dataclass
class KeyValues:
    k: torch.Tensor  # [kv_heads, capacity, head_dim]
    v: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def position_bytes(self) -> int:
        return 2 * self.k.shape[0] * self.k.shape[2] * self.k.element_size()

    def grow(self, capacity: int, held: int) -> None:
        self.k, self.v = (regrown(t, 1, capacity, held) for t in (self.k, self.v))


@dataclass
class Latents:
    rows: torch.Tensor  # [capacity, latent_dim + rope_key_dim]: kv_a_layernorm(the compressed K/V), then the
    latent_dim: int     # rotated key every head shares; one row is the one K/V head absorbed attention reads

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @property
    def position_bytes(self) -> int:
        return self.rows.shape[1] * self.rows.element_size()

    def grow(self, capacity: int, held: int) -> None:
        self.rows = regrown(self.rows, 0, capacity, held)


@dataclass
class ModuleLayers:
    """The state of the layers a sequence runs through the family's own modules: one cache object of the
    family's (transformers' Cache) that all those layers share; a fixed size per sequence, so it never grows."""

    cache: object = None
    length: int = -1  # the positions the cache holds (-1: none made yet)

    capacity = sys.maxsize
    position_bytes = 0

    def grow(self, capacity: int, held: int) -> None:
        pass


def regrown(t: torch.Tensor, dim: int, capacity: int, held: int) -> torch.Tensor:
    """t with `capacity` positions along dim, its first `held` positions kept."""
    shape = list(t.shape)
    shape[dim] = capacity
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, held).copy_(t.narrow(dim, 0, held))
    return out


@dataclass
class SequenceState:
    """One sequence's per-layer state and how many of its tokens it holds."""

    layers: list[KeyValues | Latents | ModuleLayers]
    limit: int | None = None  # the model's context: growth by doubling stops there (None: no limit)
    length: int = 0
    generation: int = field(default=0, compare=False)  # bumped on every growth: views of the tensors are stale

    @property
    def capacity(self) -> int:
        return min(layer.capacity for layer in self.layers)

    def reserve(self, positions: int) -> None:
        """Room for `positions` tokens, keeping what is held (grown_capacity: teacher-forced rows may be longer
        than the context, as the generic decoder allows; generation refuses them first)."""
        if positions <= self.capacity:
            return
        capacity = grown_capacity(self.capacity, positions, self.limit)
        for layer in self.layers:
            layer.grow(capacity, self.length)
        self.generation += 1


class HoldsSequence:
    """A decoder that runs one sequence state at a time: one a caller passes in (`use`), or its own (for
    callers that hold none). Where it is and how far it may go are that state's."""

    state: SequenceState  # the state it runs now
    own: SequenceState

    def use(self, state: SequenceState | None) -> None:
        """Run `state` from now on (None: the decoder's own)."""
        self.state = state if state is not None else self.own

    @property
    def pos(self) -> int:
        return self.state.length

    @property
    def max_positions(self) -> int:
        return self.state.capacity

    def reset(self) -> None:
        """A new sequence from position 0 (the state's tensors are kept and overwritten)."""
        self.state.length = 0


def grown_capacity(current: int, positions: int, limit: int | None) -> int:
    """Positions for a state of `current` that must hold `positions`: doubling, at least 1,024, not past the
    model's context `limit` unless `positions` itself is."""
    capacity = max(positions, 2 * current, 1024)
    return capacity if limit is None else min(capacity, max(limit, positions))


def sequence_state(description: ModelDescription, capacity: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", limit: int | None = None) -> SequenceState:
    """An empty state for the model of `description` with room for `capacity` positions."""
    a = description.attention

    def layer_state():
        if a.kind == "mla":
            return Latents(torch.zeros(capacity, a.latent_dim + a.rope_key_dim, dtype=dtype, device=device), a.latent_dim)
        shape = (a.kv_heads, capacity, a.head_dim)
        return KeyValues(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    modules = ModuleLayers()
    return SequenceState([modules if i in a.mixer_layers else layer_state() for i in range(description.num_layers)],
                         limit=limit)
