"""The decoder contract: a batch of sequences in, logits per sequence out.

Every decoder takes a list of `SequenceStep`s, each a sequence's new tokens and the position they
start at, and returns the logits of those tokens per step. A decoder holds each sequence's KV cache
until `release`. A step whose start is not the number of tokens the decoder holds for that sequence
is refused (a silent mismatch would compute with the wrong context); start 0 begins a sequence.

- `GenericDecoder` runs the family's transformers modules, one KV cache per sequence, up to
  `max_sequences` sequences at once; the steps of a batch run one after another.
- `FastDecoder` runs the fast decoder of the device (the compiled CPU step, the GPU's CUDA graphs) with a
  sequence state per sequence, up to 16 on the CPU and 1 on the GPU; the steps of a batch run one after
  another.

Batched serving fills in batches that run together; the contract stays.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from smoe.errors import SmoeError
from smoe.hf.model import forward_with_cache


@dataclass(frozen=True)
class SequenceStep:
    sequence: Hashable  # the caller's name for the sequence
    tokens: list[int]  # its new tokens
    start: int  # the position of tokens[0]: how many tokens of the sequence came before


class Decoder:
    name: str
    max_sequences: int

    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        """Logits [len(step.tokens), V] (fp32, on the CPU) for each step, in order."""
        raise NotImplementedError

    def release(self, sequence: Hashable) -> None:
        """Forget a sequence: its KV cache is freed and its name may start a new one."""
        raise NotImplementedError

    def check(self, steps: Sequence[SequenceStep], held: dict) -> None:
        """Refuse batches beyond max_sequences and steps that do not continue what is held."""
        names = {s.sequence for s in steps}
        if len(names) != len(steps):
            raise SmoeError("a batch holds one step per sequence")
        if len(names | set(held)) > self.max_sequences:
            raise SmoeError(f"the {self.name} decoder holds at most {self.max_sequences} sequence(s) at once; "
                            "release one first")
        for s in steps:
            if not s.tokens:
                raise SmoeError(f"sequence {s.sequence!r}: a step needs at least one token")
            have = held.get(s.sequence, 0)
            if s.start != 0 and s.start != have:
                raise SmoeError(f"sequence {s.sequence!r}: step starts at position {s.start}, but {have} tokens "
                                "are held for it")


class GenericDecoder(Decoder):
    """The transformers modules with a KV cache per sequence; every family, either device."""

    name = "generic"

    def __init__(self, sm, max_sequences: int = 16):
        if sm.store is None:  # the GPU's fast decoder holds the one expert cache: the generic one has none
            raise SmoeError("this vault was opened for the fast GPU decoder; open it with --decoder generic")
        self.sm, self.max_sequences = sm, max_sequences
        self.caches: dict[Hashable, object] = {}  # sequence -> the model's KV cache object
        self.lengths: dict[Hashable, int] = {}

    @torch.inference_mode()
    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        self.check(steps, self.lengths)
        out = []
        for s in steps:
            ids = torch.tensor([s.tokens], device=self.sm.device)
            logits, cache = forward_with_cache(self.sm.model, ids, self.caches.get(s.sequence) if s.start else None)
            self.caches[s.sequence], self.lengths[s.sequence] = cache, s.start + len(s.tokens)
            out.append(logits[0].float().cpu())
        return out

    def release(self, sequence: Hashable) -> None:
        self.caches.pop(sequence, None)
        self.lengths.pop(sequence, None)


class FastDecoder(Decoder):
    """The device's fast decoder (OpenedVault.running_decoder) with one sequence state per sequence
    (smoe.runtime.kv.SequenceState), taken from the opened vault and returned on release or when this object
    goes: the steps of a batch run one after another, each on its own state, so no other user of the vault
    disturbs a sequence. The GPU holds one sequence at a time (each state is GPU memory, and its CUDA graphs
    are captured over one state's tensors)."""

    name = "fast"

    def __init__(self, sm, positions: int):
        self.sm, self.positions = sm, positions
        self.max_sequences = sm.backend.max_sequences
        self.states: dict[Hashable, object] = {}
        weakref.finalize(self, sm.return_states, self.states.values())

    @torch.inference_mode()
    def forward(self, steps: Sequence[SequenceStep]) -> list[torch.Tensor]:
        restarted = {s.sequence for s in steps if s.start == 0}  # a sequence begun again starts afresh
        self.check(steps, {name: st.length for name, st in self.states.items() if name not in restarted})
        decoder, out = self.sm.running_decoder(self.positions), []
        for s in steps:
            state = self.states.get(s.sequence)
            if state is None:
                state = self.states[s.sequence] = self.sm.take_state(max(self.positions, len(s.tokens)))
            elif s.start == 0:
                state.length = 0
            decoder.use(state)
            out.append(decoder.forward(s.tokens).float().cpu())
        return out

    def release(self, sequence: Hashable) -> None:
        state = self.states.pop(sequence, None)
        if state is not None:
            self.sm.return_states([state])


def open_decoder(sm, decoder: str, positions: int) -> Decoder:
    """The decoder named ("fast" | "generic" | "auto": the one the vault was opened with) over sm,
    with room for sequences of `positions` tokens."""
    decoder = sm.decoder if decoder == "auto" else decoder
    if decoder == "generic":
        return GenericDecoder(sm)
    if sm.decoder != "fast":
        raise SmoeError(f"no fast decoder for the {sm.vault.meta['family']} family (use --decoder generic)")
    return FastDecoder(sm, positions)
