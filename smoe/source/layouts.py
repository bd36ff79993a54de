"""Where routed experts live: the contract the matcher hands on (ProjectionSource, BiasSource, ExpertMap)
and the layouts a family's experts are stored in (Stored, Layout, and the helpers building the usual ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GATED = ("gate", "up", "down")
NON_GATED = ("up", "down")


# ----- the contract (docs/ARCHITECTURE.md) ---------------------------------------------------------


@dataclass(frozen=True)
class ProjectionSource:
    """Where one projection of one routed expert lives."""

    role: str  # "gate" | "up" | "down"
    name: str  # logical checkpoint tensor name
    expert_index: int | None  # dim-0 index into a fused [E, ...] tensor; None for a per-expert tensor
    transpose: bool  # stored [in, out] -> transpose to [out, in]
    part: int = 0  # after transpose, rows split into `parts` pieces (concatenated gate_up):
    parts: int = 1  # take piece `part`
    interleaved: bool = False  # pieces interleaved row-wise (rows part::parts) instead of contiguous chunks
    stacked: int = 0  # >0: a 2-D tensor stacking this many experts' blocks along dim 0 (dbrx);
    #                   expert_index picks the block, before any transpose


@dataclass(frozen=True)
class BiasSource:
    """Per-expert bias (gpt-oss), same addressing as ProjectionSource, 1-D result [out]."""

    role: str
    name: str
    expert_index: int | None
    part: int = 0
    parts: int = 1
    interleaved: bool = False


@dataclass
class ExpertMap:
    family: str  # canonical family name, e.g. "qwen3_moe"
    model_type: str  # as in config, e.g. "kimi_k2" for the deepseek_v3 family
    moe_layers: list[int]
    num_experts: int
    top_k: int | None
    roles: tuple[str, ...]  # ("gate", "up", "down") or ("up", "down")
    experts: dict[tuple[int, int], list[ProjectionSource]]  # (layer, expert) -> projections in `roles` order
    biases: dict[tuple[int, int], list[BiasSource]]  # empty unless the family has expert biases
    expert_names: set[str]  # logical names that belong to routed experts (the rest is trunk)
    hidden_size: int | None = None
    expert_intermediate_size: int | None = None
    expert_input_size: int | None = None  # hidden_size, or a latent size where experts work in one

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """role -> (out, in), from config; {} when the config lacks the sizes."""
        inner, outer = self.expert_intermediate_size, self.expert_input_size or self.hidden_size
        if not inner or not outer:
            return {}
        shapes = {"gate": (inner, outer), "up": (inner, outer), "down": (outer, inner)}
        return {role: shapes[role] for role in self.roles}


# ----- layouts: how one family's experts may be stored ------------------------------------------


@dataclass(frozen=True)
class Stored:
    """How one role (or bias) is stored, as a name relative to the decoder layer.

    "{e}" in `template` marks a per-expert tensor; without it the tensor holds every expert
    (fused [E, ...], or `stacked` along dim 0 of a 2-D tensor).
    """

    template: str
    transpose: bool = False
    part: int = 0
    parts: int = 1
    interleaved: bool = False
    stacked: bool = False


@dataclass(frozen=True)
class Layout:
    what: str  # a few words for messages
    roles: dict[str, Stored]
    biases: dict[str, Stored] = field(default_factory=dict)
    marker: str | None = None  # a tensor the layer must hold to be MoE (moondream: dense and MoE blocks share names)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def per_expert(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
               experts: str = "experts", gated: bool = True) -> Layout:
    """experts.{e}.<proj>.weight, each [out, in] (the Hugging Face release layout of most families)."""
    names = {"gate": gate, "up": up, "down": down} if gated else {"up": up, "down": down}
    base = _join(block, experts, "{e}")
    return Layout(
        f"per-expert {_join(block, experts)}.E.*",
        {role: Stored(f"{base}.{proj}.weight") for role, proj in names.items()},
        {role: Stored(f"{base}.{proj}.bias") for role, proj in names.items()},
    )


def fused_gate_up(container: str, gate_up: str = "gate_up_proj", down: str = "down_proj",
                  transpose: bool = False, interleaved: bool = False, bias: str | None = None) -> Layout:
    """gate_up [E, 2I, H] + down [E, H, I]; transpose=True: [E, H, 2I] + [E, I, H]."""
    roles = {
        "gate": Stored(_join(container, gate_up), transpose, 0, 2, interleaved),
        "up": Stored(_join(container, gate_up), transpose, 1, 2, interleaved),
        "down": Stored(_join(container, down), transpose),
    }
    biases = {}
    if bias is not None:
        biases = {
            "gate": Stored(_join(container, gate_up + bias), False, 0, 2, interleaved),
            "up": Stored(_join(container, gate_up + bias), False, 1, 2, interleaved),
            "down": Stored(_join(container, down + bias)),
        }
    return Layout(f"fused {_join(container, gate_up)}", roles, biases)


def fused_each(container: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
               gated: bool = True, suffix: str = ".weight", transpose: bool = False) -> Layout:
    """One [E, out, in] tensor per role (MLX switch_mlp; transformers' non-gated experts)."""
    names = {"gate": gate, "up": up, "down": down} if gated else {"up": up, "down": down}
    roles = {role: Stored(_join(container, proj) + suffix, transpose) for role, proj in names.items()}
    biases = {role: Stored(_join(container, proj) + ".bias") for role, proj in names.items()} if suffix else {}
    return Layout(f"fused {container}.*", roles, biases)


def standard(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
             fused_transpose: bool = False) -> tuple[Layout, ...]:
    """A gated family: per-expert release layout, transformers-v5 fused layout, MLX switch_mlp."""
    return (
        per_expert(block, gate, up, down),
        fused_gate_up(_join(block, "experts"), transpose=fused_transpose),
        fused_each(_join(block, "switch_mlp")),
    )
