"""Misses read in place: when pinned host RAM holds every expert, the kernels read a missed expert straight
from it over the link, and the GPU slots hold the experts routed most often, moved between tokens.

The per-layer path (GpuExpertCache.offsets) makes the host wait for each layer's top-k, decide, and copy
the misses before the layer's experts run: one sync, a dozen copy calls and their host time per layer,
the link idle in between. Here a token is one graph, as with every expert resident: a device table gives
each expert's offset from the pool's start — its GPU slot, or its host slot (with unified addressing a
pinned host pointer is a device pointer) — and the graph counts how often each expert was routed. A missed
expert's bytes cross the link once either way (read by the kernel instead of copied first), so the link
carries the same bytes with no host in the loop.

Every `every` tokens the host reads the counts, scores each expert by its decayed routing count, and moves
the best-scored experts into GPU slots (at most `max_moves` a time, and only where the newcomer's score
beats the one it evicts by a margin, so that ties do not churn). A move is two-phase so that no graph
reads a slot while it is overwritten: the evicted expert's table entry points at its host copy before the
copy into its slot is issued (on the side stream, after the compute stream's work so far), and the
newcomer's entry points at the slot only once that copy's event has passed (at a later look).

Counts are accounted into the cache's stats (hits, misses, bytes read in place) with the residency they
ran under: residency changes only at a look, after the counts of the tokens before it are read.
"""

from __future__ import annotations

import numpy as np
import torch

from smoe.runtime.cuda.cache import GpuExpertCache

EVERY = 4  # tokens between looks: a look is one sync and a few µs of host work
DECAY = 0.9  # per look: a score is a count over the last ~10 looks
MARGIN = 1.25  # a newcomer's score must beat the evicted expert's by this factor (plus one routing)


class Placement:
    """table [layers, experts] (int64, on the device): each expert's offset from the pool's start, read by the
    whole-token graph; counts [layers, experts]: how often each was routed since the last look (added to by the
    graph). after_token() once per token."""

    def __init__(self, cache: GpuExpertCache, layers: int, every: int = EVERY, max_moves: int | None = None):
        self.cache, self.every = cache, every
        experts = 1 + max(e for _, e in cache.vault.entries)
        self.shape = (layers, experts)
        self.known = np.zeros(self.shape, dtype=bool)  # the (layer, expert) pairs the vault has
        self.sizes = np.zeros(self.shape, dtype=np.int64)
        for (layer, e), entry in cache.vault.entries.items():
            self.known[layer, e], self.sizes[layer, e] = True, entry.size
        self.max_moves = max_moves or max(8, cache.n_slots // 8)  # a warm-up fills the slots in a few looks
        self.score = np.zeros(self.shape)
        device = cache.device
        self.counts = torch.zeros(self.shape, dtype=torch.int32, device=device)
        self.ones = torch.ones(64, dtype=torch.int32, device=device)  # index_add_'s source, any top-k up to 64
        self.table = torch.zeros(self.shape, dtype=torch.int64, device=device)
        self.staged = torch.zeros(self.shape, dtype=torch.int64, pin_memory=cache.cuda)
        self.pending: list[tuple[object, list]] = []  # (event, experts copied) not yet in the table
        self.uploaded = None  # the event after the last upload out of `staged`
        self.tokens = 0
        self.rebuild()

    # --- in the graph ----------------------------------------------------------------------------

    def record(self, layer: int, top_i: torch.Tensor) -> None:
        """Count layer's routed experts top_i [k] (captured: runs on the device every token)."""
        self.counts[layer].index_add_(0, top_i, self.ones[: top_i.numel()])

    # --- between tokens --------------------------------------------------------------------------

    def after_token(self) -> None:
        self.tokens += 1
        if self.tokens % self.every == 0:
            self.look()

    def look(self) -> None:
        """Account the counts since the last look, finish the moves whose copies are done, start new ones."""
        self.score *= DECAY
        self.account()
        done = self.finished()
        incoming, outgoing = self.moves()
        event = self.cache.place(incoming, outgoing) if incoming else None
        self.staging_free()
        for key in outgoing:  # points at the host copy before the next graph runs
            self.staged[key] = self.cache.offset_of(key)
        if event is None:  # no copies in flight (a CPU device copies at once): the newcomers' slots are ready
            done += incoming
        else:
            self.pending.append((event, incoming))
        for key in done:
            self.staged[key] = self.cache.offset_of(key)
        if done or outgoing:
            self.upload()

    def account(self) -> None:
        """The counts since the last look (zeroed on the device) into the scores and the cache's stats, under the
        residency they ran with: experts whose table entry pointed at a GPU slot were hits, the others read in
        place. Also for whoever reads the stats between looks."""
        counts = self.counts.cpu().numpy().astype(np.int64)  # the sync (every `every` tokens)
        self.counts.zero_()
        in_slot = self.in_table_slots()
        stats = self.cache.stats
        stats.hits += int(counts[in_slot].sum())
        stats.misses += int(counts[~in_slot].sum())
        stats.bytes_in_place += int((counts * self.sizes)[~in_slot].sum())
        self.score += counts

    def in_table_slots(self) -> np.ndarray:
        """[layers, experts] bool: the experts whose table entry points at a GPU slot (not those whose copy is
        still in flight)."""
        mask = np.zeros(self.shape, dtype=bool)
        for key in self.cache.gpu.slots:
            mask[key] = True
        for _, keys in self.pending:
            for key in keys:
                mask[key] = False
        return mask

    def finished(self) -> list:
        """The experts of the pending moves whose copies are done (their slots may now be read)."""
        done, still = [], []
        for event, keys in self.pending:
            if event.query():
                done.extend(keys)
            else:
                still.append((event, keys))
        self.pending = still
        return done

    def moves(self) -> tuple[list, list]:
        """(incoming, outgoing): the best-scored experts not resident, into free slots first, then in place of the
        worst-scored resident ones where they beat them by the margin; at most max_moves."""
        resident = np.zeros(self.shape, dtype=bool)
        for key in self.cache.gpu.slots:
            resident[key] = True
        busy = {key for _, keys in self.pending for key in keys}  # in flight: neither moved again nor evicted
        candidates = [key for key in self.ranked(self.known & ~resident & (self.score > 0))]
        free = len(self.cache.gpu.free)
        incoming, outgoing = candidates[:min(free, self.max_moves)], []
        victims = [key for key in reversed(self.ranked(resident)) if key not in busy]
        for key, victim in zip(candidates[len(incoming):], victims):
            if len(incoming) >= self.max_moves or self.score[key] <= MARGIN * self.score[victim] + 1:
                break
            incoming.append(key)
            outgoing.append(victim)
        return incoming, outgoing

    def ranked(self, mask: np.ndarray) -> list:
        """The (layer, expert) pairs of mask, best score first."""
        rows, cols = np.nonzero(mask)
        order = np.argsort(-self.score[rows, cols], kind="stable")
        return [(int(rows[i]), int(cols[i])) for i in order]

    # --- the table -------------------------------------------------------------------------------

    def rebuild(self) -> None:
        """Every entry from the cache as it is (after work that moved experts outside this object: a prompt)."""
        self.settle()
        self.staging_free()
        for key in self.cache.vault.entries:
            self.staged[key] = self.cache.offset_of(key)
        self.upload()

    def settle(self) -> None:
        """Wait for the moves in flight and point the table at their slots."""
        self.staging_free()
        for event, keys in self.pending:
            event.synchronize()
            for key in keys:
                self.staged[key] = self.cache.offset_of(key)
        if self.pending:
            self.pending = []
            self.upload()

    def upload(self) -> None:
        """`staged` to the device table, ordered on the compute stream before the next graph."""
        self.table.copy_(self.staged, non_blocking=self.cache.cuda)
        if self.cache.cuda:
            self.uploaded = torch.cuda.Event()
            self.uploaded.record()

    def staging_free(self) -> None:
        """Wait until the last upload has read `staged` (before writing it again)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
            self.uploaded = None
