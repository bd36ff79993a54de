"""Calibration: what the routed experts actually see, measured on a text file.

The source model runs in fp32 through transformers, its experts computed by an implementation
registered in transformers' experts registry (`ExpertsInterface`) that records, per MoE layer and
expert, the second moments of the inputs of each projection: H = sum over routed tokens of x xᵀ,
for the input of gate/up (the hidden state) and for the input of down (the gated activation), with
the number of tokens routed. Encoders weigh quantisation error by H, so that error lands where the
inputs are small. (Weighting tokens by their squared routing weight measured worse on our models.)

Experts that calibration routes few tokens to would get a noisy H; every H is therefore blended
with a neutral prior worth PRIOR_TOKENS tokens: for gate/up the second moment of all tokens that
enter the layer (the same hidden states, unrouted), for down an isotropic matrix of the layer's
mean activation energy.

Collected with a `balance` above 0, the statistics also hold each expert's down input over every token entering
the layer, routed or not (llm-compressor's rule: every calibration token passes through every expert, for
the statistics only); `balance` b then gives H = (1 - b)·routed + b·every-token. The default, 0, is the
routed H: the every-token one measured worse (QUALITY.md, "Better bits where they matter").
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from smoe.convert.encoders import CALIB_TOKENS
from smoe.errors import SmoeError
from smoe.format.vault import file_checksum
from smoe.hf.experts import expert_linear, experts_input_sizes, is_experts_module, layer_of, register
from smoe.hf.layerwise import LayerByLayer
from smoe.hf.model import load_pretrained
from smoe.hf.tokenizer import load_tokenizer
from smoe.moe.dispatch import routed_sum
from smoe.progress import bar
from smoe.source.text import WINDOW, read_text, token_stream, windows

IMPLEMENTATION = "smoe_calibrate"
INPUTS = ("gate_up", "down")  # the two inputs a routed expert's projections see
ROLE_INPUT = {"gate": "gate_up", "up": "gate_up", "down": "down"}
DEFAULT_TOKENS = CALIB_TOKENS  # kept in smoe.convert.encoders, which the CLI's help reads without importing transformers
PRIOR_TOKENS = 16  # weight of the neutral prior, in tokens
MIN_TOKENS = 8  # an expert routed fewer tokens than this counts as not covered
MIN_COVERAGE = 0.9  # warn below this share of covered experts
MAX_CALIB_CHARS = 1 << 28  # read at most this much of the calibration file
CHARS_PER_WINDOW = WINDOW * 12  # enough text for a window of tokens


@dataclass
class CalibrationStats:
    """Raw sums per MoE layer: sums[layer][input] is [E, n, n] (fp64), counts[layer] is [E]."""

    num_experts: int
    tokens: int
    text_hash: str
    sums: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    counts: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_sums: dict[int, torch.Tensor] = field(default_factory=dict)  # all tokens entering the layer: [n, n]
    layer_tokens: dict[int, int] = field(default_factory=dict)
    unrouted: dict[int, torch.Tensor] = field(default_factory=dict)  # down inputs of every token, each expert: [E, n, n]
    balance: float = 0.0  # share of the every-token second moment in second_moment (needs `unrouted`)

    @property
    def layers(self) -> list[int]:
        return sorted(self.counts)

    def coverage(self) -> float:
        """Share of (layer, expert) pairs routed at least MIN_TOKENS calibration tokens."""
        counts = torch.stack([self.counts[layer] for layer in self.layers])
        return float((counts >= MIN_TOKENS).double().mean())

    def second_moment(self, layer: int, expert: int, role: str) -> torch.Tensor:
        """E[x xᵀ] of the input of `role` (gate, up, down or an INPUTS name) for one expert, with the prior, fp32."""
        which = ROLE_INPUT.get(role, role)
        n = float(self.counts[layer][expert])
        routed = (self.sums[layer][which][expert] + PRIOR_TOKENS * self.prior(layer, which)) / (n + PRIOR_TOKENS)
        if not self.balance:
            return routed.to(torch.float32)
        return ((1 - self.balance) * routed + self.balance * self.every_token(layer, expert, which)).to(torch.float32)

    def every_token(self, layer: int, expert: int, which: str) -> torch.Tensor:
        """E[x xᵀ] of the input `which` over every token entering the layer, as if all were routed to `expert`."""
        if which == "gate_up":
            return self.layer_sums[layer] / max(self.layer_tokens[layer], 1)
        if layer not in self.unrouted:
            raise SmoeError("balanced calibration needs statistics collected with a balance above 0 (every token's "
                            "down inputs through every expert)")
        return self.unrouted[layer][expert] / max(self.layer_tokens[layer], 1)

    def importance(self, layer: int, expert: int, role: str) -> torch.Tensor:
        """Per input channel E[x_j²]: the diagonal of `second_moment`."""
        return torch.diagonal(self.second_moment(layer, expert, role)).clone()

    def prior(self, layer: int, which: str) -> torch.Tensor:
        """A per-token second moment that assumes nothing about one expert."""
        if which == "gate_up":  # all tokens entering the layer, routed or not
            return self.layer_sums[layer] / max(self.layer_tokens[layer], 1)
        sums, counts = self.sums[layer][which], self.counts[layer].double()
        energy = torch.diagonal(sums, dim1=1, dim2=2).sum() / max(float(counts.sum()), 1.0) / sums.shape[-1]
        eye = torch.eye(sums.shape[-1], dtype=sums.dtype)
        return eye * (energy if energy > 0 else 1.0)

    def to(self, device: str | torch.device) -> CalibrationStats:
        moved = lambda d: {k: v.to(device) if isinstance(v, torch.Tensor) else moved(v) for k, v in d.items()}
        return replace(self, sums=moved(self.sums), counts=moved(self.counts), layer_sums=moved(self.layer_sums),
                       unrouted=moved(self.unrouted))

    def merge(self, other: CalibrationStats) -> CalibrationStats:
        """These statistics and another's, of other layers, together."""
        return replace(self, sums=self.sums | other.sums, counts=self.counts | other.counts,
                       layer_sums=self.layer_sums | other.layer_sums, layer_tokens=self.layer_tokens | other.layer_tokens,
                       unrouted=self.unrouted | other.unrouted)

    def save(self, path: Path, source: str = "") -> None:
        """Written under a temporary name, then renamed: a run stopped midway leaves no half file. `source`:
        what the statistics were collected from (a fingerprint of model, text and tokens), checked by load."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            torch.save(self.__dict__ | {"source": source}, tmp)
            checksum_path(path).write_text(file_checksum(tmp))
        except (OSError, RuntimeError) as e:  # torch reports a full disk or a read-only directory as RuntimeError
            tmp.unlink(missing_ok=True)
            reason = f" ({e.strerror})" if isinstance(e, OSError) and e.strerror else ""
            raise SmoeError(f"{path}: the calibration statistics could not be written{reason}: is the disk full "
                            f"or read-only?") from None
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, source: str | None = None) -> CalibrationStats | None:
        """The statistics saved at path, or None when they were collected from another source than `source`
        or the file cannot be read as statistics (it is then collected again: it is a cache)."""
        try:
            if checksum_path(path).read_text() != file_checksum(path):  # changed since written: not these
                return None
            saved = torch.load(path, weights_only=True)
            if source is not None and saved.pop("source", None) != source:
                return None
            saved.pop("source", None)
            return cls(**saved)
        except Exception:  # noqa: BLE001 - truncated, crafted or of another version: not these statistics
            return None


def checksum_path(path: Path) -> Path:
    """Where the checksum of saved statistics is kept (the vault's file checksum), so that load trusts only the
    bytes save wrote."""
    return path.with_name(path.name + ".checksum")


def file_hash(path: str | Path) -> str:
    """sha256 of the calibration file's bytes (it names the calibration in fingerprints)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise SmoeError(f"{path}: cannot read the calibration file ({e.strerror})") from None
    return h.hexdigest()[:16]


def calibration_windows(model_dir, text_path, tokens: int = DEFAULT_TOKENS) -> list[torch.Tensor]:
    """The first `tokens` tokens of the text, as windows of smoe eval's size (512)."""
    if not Path(text_path).is_file():
        raise SmoeError(f"{text_path}: no such calibration file")
    tokenizer = load_tokenizer(model_dir, "for calibration")
    text, more = read_text(text_path, MAX_CALIB_CHARS)
    count = -(-tokens // WINDOW)
    if more or len(text) > 4 * CHARS_PER_WINDOW * count:
        found = spread_windows(tokenizer, text, count)
    else:  # a short text: its first tokens, in order
        found = windows(token_stream(tokenizer, text_path, tokens))
    if not found:
        raise SmoeError(f"{text_path}: the calibration text gave fewer than 2 tokens")
    return found


def spread_windows(tokenizer, text: str, count: int) -> list[torch.Tensor]:
    """`count` windows of WINDOW tokens taken at evenly spaced places of the text (each starting at a
    line break), so that calibration sees the whole file rather than its first pages."""
    found = []
    step = max(len(text) // count, 1)
    for k in range(count):
        start = text.find("\n", k * step)
        start = k * step if start < 0 else start + 1
        piece = text[start : start + CHARS_PER_WINDOW]
        ids = tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"][:WINDOW]
        if len(ids) > 1:
            found.append(torch.tensor([ids]))
    return found


# --- running the source model --------------------------------------------------------------------


def experts_forward(module, hidden_states, top_k_index, top_k_weights, observe=None):
    """The routed experts as transformers computes them (from the module's fused parameters and its own
    gating); `observe(expert, input_name, x)` sees each projection input first."""

    def run(e, x):
        if observe:
            observe(e, "gate_up", x)
        h = down_input(module, e, x)
        if observe:
            observe(e, "down", h)
        y = expert_linear(module, "down", e, h)
        return module.post_expert_norm(y) if getattr(module, "has_post_expert_norm", False) else y

    fetch = lambda group: {e: (lambda x, e=e: run(e, x)) for e in group}
    return routed_sum(hidden_states, top_k_index, top_k_weights, fetch, num_experts=module.num_experts)


def down_input(module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """What `down` of one expert sees for inputs x: the gated activation of gate/up."""
    h = expert_linear(module, "gate_up", expert, x)
    return module._apply_gate(h) if module.has_gate else module.act_fn(h)


def calibration_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The registered implementation: a recorder attached to the module sees every input."""
    recorder = getattr(module, "smoe_recorder", None)
    if recorder is not None:
        recorder.layer_input(module.smoe_layer, hidden_states)
        if recorder.every_token:  # for the statistics only: the layer's output stays the routed one
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            for e in range(module.num_experts):
                recorder.add_unrouted(module.smoe_layer, e, down_input(module, e, x))
    observe = (lambda e, which, x: recorder.add(module.smoe_layer, e, which, x)) if recorder else None
    return experts_forward(module, hidden_states, top_k_index, top_k_weights, observe)


register(IMPLEMENTATION, calibration_experts_forward)


class Recorder:
    def __init__(self, stats: CalibrationStats, sizes: dict[str, int], every_token: bool = False):
        self.stats, self.sizes, self.every_token = stats, sizes, every_token

    def _layer(self, layer: int, device: torch.device) -> None:
        s = self.stats
        if layer not in s.counts:
            s.counts[layer] = torch.zeros(s.num_experts, dtype=torch.int64, device=device)
            s.sums[layer] = {k: torch.zeros(s.num_experts, n, n, dtype=torch.float64, device=device)
                             for k, n in self.sizes.items()}
            s.layer_sums[layer] = torch.zeros(self.sizes["gate_up"], self.sizes["gate_up"], dtype=torch.float64,
                                              device=device)
            s.layer_tokens[layer] = 0
            if self.every_token:
                n = self.sizes["down"]
                s.unrouted[layer] = torch.zeros(s.num_experts, n, n, dtype=torch.float64, device=device)

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        self._layer(layer, x.device)
        x = x.reshape(-1, x.shape[-1]).double()
        self.stats.layer_sums[layer] += x.t() @ x
        self.stats.layer_tokens[layer] += x.shape[0]

    def add(self, layer: int, expert: int, which: str, x: torch.Tensor) -> None:
        x = x.double()
        self.stats.sums[layer][which][expert] += x.t() @ x
        if which == "gate_up":
            self.stats.counts[layer][expert] += x.shape[0]

    def add_unrouted(self, layer: int, expert: int, x: torch.Tensor) -> None:
        x = x.double()
        self.stats.unrouted[layer][expert] += x.t() @ x


def experts_modules(model) -> dict[int, torch.nn.Module]:
    """layer -> the model's experts module, each told its layer; an error where the family's experts do not run
    through transformers' experts registry (calibration records through it)."""
    modules = {}
    for name, module in model.named_modules():
        if is_experts_module(module) and layer_of(name) is not None:
            module.smoe_layer = layer_of(name)
            modules[module.smoe_layer] = module
    if not modules:
        raise SmoeError(f"{model.config.model_type}: calibration needs experts that run through transformers' experts "
                        "registry, and this family's do not")
    return modules


def load_source_model(model_dir, implementation: str | None = None):
    """The source model in fp32 through transformers (families whose experts use the registry)."""
    model = load_pretrained(model_dir, torch.float32, implementation, "for calibration")
    return model, experts_modules(model)


def collect_layers(model_dir, text_path, tokens: int = DEFAULT_TOKENS, progress: bool = True, warn=None,
                   device: str | torch.device = "cpu", balance: float = 0.0) -> Iterator[CalibrationStats]:
    """The calibration windows through the source model, run one decoder layer at a time (smoe.hf.layerwise:
    memory holds one layer and the windows' hidden states, whatever the depth); yields each MoE layer's raw
    second-moment sums, on the CPU, as a CalibrationStats of that layer alone, once the layer has run.
    `balance` > 0 also collects every token's down inputs through every expert, and blends them in that share."""
    if not 0 <= balance <= 1:
        raise SmoeError(f"calibration balance {balance} is not between 0 and 1")
    chunks = calibration_windows(model_dir, text_path, tokens)
    runner = LayerByLayer(model_dir, chunks, IMPLEMENTATION, device)
    modules = experts_modules(runner.model)
    some = next(iter(modules.values()))
    header = {"num_experts": some.num_experts, "tokens": sum(w.shape[1] for w in chunks),
              "text_hash": file_hash(text_path), "balance": balance}
    recorder = Recorder(CalibrationStats(**header), experts_input_sizes(some), every_token=balance > 0)
    for module in modules.values():
        module.smoe_recorder = recorder
    counts = {}
    for layer in bar(runner.run(), progress, total=len(runner.layers), desc="calibrate", unit="layer"):
        if layer not in recorder.stats.counts:
            continue
        recorder.stats = recorder.stats.to("cpu")
        counts |= recorder.stats.counts
        if layer == max(modules):
            warn_if_sparse(CalibrationStats(**header, counts=counts), warn)
        yield recorder.stats
        recorder.stats = CalibrationStats(**header)  # the layer yielded is the caller's alone: freed when it lets go


def collect(model_dir, text_path, tokens: int = DEFAULT_TOKENS, progress: bool = True, warn=None,
            device: str | torch.device = "cpu", balance: float = 0.0) -> CalibrationStats:
    """Every MoE layer's raw second-moment sums, held together (StreamedStats holds one layer at a time)."""
    stats = None
    for one in collect_layers(model_dir, text_path, tokens, progress, warn, device, balance):
        stats = one if stats is None else stats.merge(one)
    return stats


class StreamedStats:
    """Calibration statistics collected as they are asked for, one MoE layer at a time: asking for a layer runs
    the source model up to it and forgets the layer before, so layers must be asked for in increasing order (as
    the sculptor encodes them). Memory: one layer's sums, whatever the depth."""

    def __init__(self, model_dir, text_path, tokens: int = DEFAULT_TOKENS, progress: bool = True, warn=None,
                 device: str | torch.device = "cpu", balance: float = 0.0):
        self.ahead = collect_layers(model_dir, text_path, tokens, progress, warn, device, balance)
        self.held: CalibrationStats | None = None

    def second_moment(self, layer: int, expert: int, role: str) -> torch.Tensor:
        return self.at(layer).second_moment(layer, expert, role)

    def importance(self, layer: int, expert: int, role: str) -> torch.Tensor:
        return self.at(layer).importance(layer, expert, role)

    def at(self, layer: int) -> CalibrationStats:
        while self.held is None or self.held.layers[0] < layer:
            self.held = None  # before the next layer's sums are made: one layer's in memory, not two
            self.held = next(self.ahead, None)
            if self.held is None:
                raise SmoeError(f"calibration has no statistics for layer {layer}: the source model has no experts "
                                "module there")
        if self.held.layers[0] != layer:
            raise SmoeError(f"calibration statistics of layer {layer} asked for after those of layer "
                            f"{self.held.layers[0]} (they are collected in layer order)")
        return self.held


def warn_if_sparse(stats: CalibrationStats, warn=None) -> None:
    coverage = stats.coverage()
    if coverage < MIN_COVERAGE:
        message = (f"smoe: warning: calibration ({stats.tokens} tokens) routed at least {MIN_TOKENS} tokens to only "
                   f"{100 * coverage:.0f}% of experts; the others use a neutral prior (give a longer text)")
        (warn or (lambda m: print(m, file=sys.stderr)))(message)
