"""A transformers model run one decoder layer at a time from its checkpoint, for models bigger than memory.

The model is built on the meta device. The decoder's tensors outside its layers (embeddings, rotary
tables) are loaded for one pass that records, per batch of windows, the hidden states entering the first
layer and the arguments the model's own forward gives each layer (masks, rotary tables, per-layer
attention kinds: stand-ins take the layers' place for that pass), and are freed again. Then each layer's
tensors are read, converted as transformers converts them on load, run over every batch and freed, so
that peak memory is one layer plus the hidden states, whatever the depth (with malloc's mmap threshold fixed,
so that freed layers' blocks leave no holes behind: `fix_mmap_threshold`). The language-model head and
any vision or audio tower are never read.

`variants` runs the same pass with, beside the source's hidden states, those of variants of the model that
differ from it in one layer each (the sensitivity sweep's trials: one expert tensor quantised): a variant's
states start at its layer, from the source's states entering it, and the layers after it run on them as they
are loaded, so each layer is read once for all of them. `head` then turns any of them into log-probabilities
through the model's own forward (final norm, head, any logit scaling), reading the head only for that.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
import tempfile
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import torch
from transformers import AutoConfig

from smoe.errors import SmoeError
from smoe.hf.model import build_model, cast_as, convert_trunk, rebuild_meta_buffers
from smoe.source.checkpoint import Checkpoint

BATCH_TOKENS = 4096  # windows of one length run together up to this many tokens: fewer passes over each layer
IN_MEMORY_BYTES = 512 << 20  # hidden states beyond this go to disk between layers
MMAP_THRESHOLD = 1 << 20  # glibc malloc: blocks from this size on get a mapping of their own, unmapped when freed


class Caught(Exception):
    """Raised by the last stand-in: the recording pass needs nothing after it."""


class LayerByLayer:
    """The checkpoint at `model_dir`'s decoder, run over `windows` ([1, T] token ids) one layer at a time."""

    def __init__(self, model_dir, windows: list[torch.Tensor], implementation: str | None = None,
                 device: str | torch.device = "cpu"):
        fix_mmap_threshold()  # else the heap grows layer after layer: see there
        self.ckpt = Checkpoint(model_dir)
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(self.ckpt.dir)
        self.model = build_model(config, torch.float32, streaming=False, where=str(self.ckpt.dir / "config.json"))
        if implementation:
            self.model.set_experts_implementation(implementation)
        rebuild_meta_buffers(self.model)
        self.decoder = self.model.get_decoder()
        self.layers = getattr(self.decoder, "layers", None)
        if not isinstance(self.layers, torch.nn.ModuleList):
            raise SmoeError(f"{config.model_type}: its decoder keeps no list of layers (`layers`), so it cannot be "
                            "run one layer at a time")
        self.keys = self.keys_by_layer()
        self.batches = batches(windows)

    def keys_by_layer(self) -> dict[int | str | None, list[str]]:
        """Checkpoint keys per decoder layer (None: the decoder's other tensors, "head": the output embeddings),
        grouped by where transformers' conversions put them; other tensors (towers) are left out."""
        names = self.ckpt.names()
        shapes = {n: torch.empty(self.ckpt.shape(n), dtype=self.ckpt.dtype(n), device="meta") for n in names}
        converted = convert_trunk(self.model, shapes, "the checkpoint")
        prefix = module_name(self.model, self.decoder)
        head = self.model.get_output_embeddings()
        head_prefix = module_name(self.model, head) if head is not None else None
        layers = f"{prefix}layers."
        keys: dict[int | str | None, list[str]] = {}
        for name, (sources, _) in converted.items():
            if name.startswith(prefix):
                layer = int(name[len(layers):].split(".", 1)[0]) if name.startswith(layers) else None
            elif head_prefix is not None and name.startswith(head_prefix):
                layer = "head"
            else:
                continue
            keys.setdefault(layer, []).extend(k for k in sources if k not in keys.get(layer, ()))
        return keys

    def load(self, modules: list[torch.nn.Module], layer: int | str | None) -> None:
        """Read the checkpoint tensors of `layer` (None: the decoder's others, "head") into `modules`, on the
        device."""
        tensors = {k: self.ckpt.load(k) for k in self.keys.get(layer, [])}
        converted = convert_trunk(self.model, tensors, "the checkpoint")
        expected = self.model.state_dict()
        state = {n: cast_as(t, expected[n]).to(self.device) for n, (_, t) in converted.items()}
        self.model.load_state_dict(state, strict=False, assign=True)
        missing = [n for m in modules for n, p in m.named_parameters() if p.is_meta]
        if missing:
            where = {None: "the decoder", "head": "the output embeddings"}.get(layer, f"layer {layer}")
            raise SmoeError(f"{self.ckpt.dir}: the checkpoint holds no tensor for {len(missing)} parameters of "
                            f"{where} (first: {missing[:2]})")
        for module in modules:
            module.to(self.device)  # buffers computed at construction (rotary tables) go along

    def run(self) -> Iterator[int]:
        """Run every layer over every batch in order, yielding each layer's index once it has run on all
        batches (its tensors are freed when the caller asks for the next)."""
        hidden, arguments = self.record()
        with tempfile.TemporaryDirectory(prefix="smoe-hidden-") as spill:
            yield from self.passes(HiddenStates(hidden, Path(spill)), arguments)

    def passes(self, states: HiddenStates, arguments: list[list[tuple]], beside=None) -> Iterator[int]:
        """Each layer read, run over every batch of `states` and freed, in order, yielding its index while it is
        loaded; `beside(i, layer, step)` runs first, where step(b, h) is the layer's output for batch b's
        states h (entering the layer)."""
        for i, layer in enumerate(self.layers):
            self.load([layer], i)

            def step(b, h, layer=layer, i=i):
                return output(layer(h, *arguments[b][i][0], **arguments[b][i][1]))

            if beside is not None:
                beside(i, layer, step)
            states.update(step)
            yield i
            layer.to("meta")

    @contextlib.contextmanager
    def variants(self, alter: dict[int, list[tuple[Hashable, Callable]]], done: Callable[[int], None] | None = None):
        """As run(), and beside the source each variant of `alter` (layer -> (name, change) pairs; `change(layer)`
        a context manager within which the loaded layer computes that variant's layer). Yields (the source's
        hidden states after the last layer, {name: the variant's}); they are kept, in memory or spilled to disk
        together past IN_MEMORY_BYTES, until the context ends. `done(i)` is called as each layer is finished."""
        hidden, arguments = self.record()
        count = 1 + sum(len(v) for v in alter.values())
        on_disk = count * sum(h.numel() * h.element_size() for h in hidden) > IN_MEMORY_BYTES
        with tempfile.TemporaryDirectory(prefix="smoe-hidden-") as spill, torch.inference_mode():
            source = HiddenStates(hidden, Path(spill) / "source", on_disk)
            branches: dict[Hashable, HiddenStates] = {}

            def beside(i, layer, step):  # the variants so far through layer i, then those that start there
                for states in branches.values():
                    states.update(step)
                for name, change in alter.get(i, []):
                    with change(layer):
                        entering = [step(b, source.get(b)) for b in range(len(hidden))]
                    branches[name] = HiddenStates(entering, Path(spill) / f"variant-{len(branches)}", on_disk)

            for i in self.passes(source, arguments, beside):
                if done is not None:
                    done(i)
            yield source, branches

    @contextlib.contextmanager
    def head(self):
        """Within: log_probs. The decoder's tensors outside its layers and the output embeddings are loaded (tied
        to the input embeddings where the model ties them), freed when the context ends."""
        out = self.model.get_output_embeddings()
        if out is None:
            raise SmoeError(f"{self.model.config.model_type}: the model has no output embeddings to score with")
        resident = [m for m in self.decoder.children() if m is not self.layers]
        self.load(resident, None)
        tied = "head" not in self.keys and getattr(self.model.config, "tie_word_embeddings", False)
        if tied:
            out.weight = self.model.get_input_embeddings().weight
        else:
            self.load([out], "head")
        try:
            yield
        finally:
            for module in [*resident, out]:
                free(module)

    @torch.inference_mode()
    def log_probs(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[N, T-1, V] fp64 log-probabilities of each next token of the windows `ids` [N, T] (rows of a batch),
        from their hidden states `h` after the last layer, through the model's own forward (its layers stand
        aside: the first returns `h`, the others what they are given), inside head()."""
        def stand_in(i):
            return (lambda hidden_states, *args, **kwargs: h) if i == 0 else \
                (lambda hidden_states, *args, **kwargs: hidden_states)

        config = self.model.config
        router_logits = config.__dict__.get("output_router_logits")  # no router runs: no load-balancing loss
        for i, layer in enumerate(self.layers):
            layer.forward = stand_in(i)
        try:
            if router_logits:
                config.output_router_logits = False
            logits = self.model(input_ids=ids.to(self.device), use_cache=False).logits
        finally:
            for layer in self.layers:
                del layer.forward
            if router_logits:
                config.output_router_logits = router_logits
        return torch.log_softmax(logits[:, :-1].double(), dim=-1)

    @torch.inference_mode()
    def record(self) -> tuple[list[torch.Tensor], list[list[tuple]]]:
        """(hidden states entering layer 0 per batch, per batch and layer the (args, kwargs) the model gives it)."""
        resident = [m for m in self.decoder.children() if m is not self.layers]
        self.load(resident, None)
        hidden, arguments = [], []
        try:
            for ids in self.batches:
                first, given = self.catch(ids.to(self.device))
                hidden.append(first)
                arguments.append(given)
        finally:
            for module in resident:
                free(module)
        return hidden, arguments

    def catch(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        given: list[tuple] = []
        last = len(self.layers) - 1

        def stand_in(i):
            def forward(hidden_states, *args, **kwargs):
                given.append((args, kwargs))
                if i == last:
                    raise Caught
                return hidden_states
            return forward

        first = []
        for i, layer in enumerate(self.layers):
            layer.forward = stand_in(i)  # an instance attribute: the class's forward is back once it is deleted
        hook = self.layers[0].register_forward_pre_hook(lambda _, args, kwargs: first.append(
            args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        try:
            self.decoder(input_ids=ids, use_cache=False)
        except Caught:
            pass
        finally:
            for layer in self.layers:
                del layer.forward
            hook.remove()
        if len(given) != len(self.layers) or not first:
            raise SmoeError(f"{self.model.config.model_type}: its decoder called {len(given)} of its "
                            f"{len(self.layers)} layers in order, so it cannot be run one layer at a time")
        return first[0], given


class HiddenStates:
    """The batches' hidden states between layers: in memory up to IN_MEMORY_BYTES, else one file per batch."""

    def __init__(self, hidden: list[torch.Tensor], spill: Path, on_disk: bool | None = None):
        self.on_disk = sum(h.numel() * h.element_size() for h in hidden) > IN_MEMORY_BYTES if on_disk is None \
            else on_disk
        self.spill = spill
        if self.on_disk:
            spill.mkdir(parents=True, exist_ok=True)
        self.held = [self.put(b, h) for b, h in enumerate(hidden)]

    def put(self, b: int, h: torch.Tensor):
        if not self.on_disk:
            return h
        path = self.spill / f"batch-{b}.pt"
        torch.save(h.cpu(), path)
        return (path, h.device)

    def get(self, b: int) -> torch.Tensor:
        if not self.on_disk:
            return self.held[b]
        path, device = self.held[b]
        return torch.load(path, weights_only=True).to(device)

    @torch.inference_mode()
    def update(self, step) -> None:
        """Replace each batch's hidden states h by step(b, h)."""
        for b in range(len(self.held)):
            self.held[b] = self.put(b, step(b, self.get(b)))


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> None:
    """Fix glibc malloc's mmap threshold at `threshold` for the rest of the process, which stops it sliding.

    glibc serves a block below its mmap threshold from its heap, and raises the threshold to the size of each
    mapped block freed, up to 32 MB. A layer's temporaries of a few MB (its weights as read and converted, routed
    activations and their fp64 products, encoder buffers) then come from the heap, where the holes one layer
    leaves rarely fit the next one's: the heap grew with depth (`smoe quantize --calib`, 4 experts of 2048 x 768
    a layer: heap 0.30 GB after layer 0, 0.71 GB after layer 7, most of it free; peak RSS 1.09 GB to 1.63 GB).
    Blocks of 1 MB and more mapped on their own go back to the system when freed: heap 0.14 to 0.17 GB, peak
    RSS 1.06 to 1.21 GB and flat from layer 1 on, for about 10% more CPU time (page faults). A 4 MB threshold
    still grew, 16 MB as much as the sliding one."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library, with its own allocator
        return
    m_mmap_threshold = -3  # M_MMAP_THRESHOLD in malloc.h
    mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(threshold))


def batches(windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The windows stacked into [B, T] batches of equal length (no padding) of at most BATCH_TOKENS tokens."""
    by_length: dict[int, list[torch.Tensor]] = {}
    for w in windows:
        by_length.setdefault(w.shape[-1], []).append(w.reshape(1, -1))
    out = []
    for length, group in by_length.items():
        per = max(1, BATCH_TOKENS // length)
        out += [torch.cat(group[i : i + per]) for i in range(0, len(group), per)]
    return out


def free(module: torch.nn.Module) -> None:
    """Put `module`'s parameters back on the meta device, keeping its buffers (rotary tables computed at
    construction, which a later load needs and the checkpoint does not hold)."""
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            m._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)


def output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def module_name(model: torch.nn.Module, target: torch.nn.Module) -> str:
    """`target`'s qualified name in `model`, with a trailing dot ("" for the model itself)."""
    for name, module in model.named_modules():
        if module is target:
            return f"{name}." if name else ""
    raise SmoeError(f"{type(target).__name__} is not part of the model")
