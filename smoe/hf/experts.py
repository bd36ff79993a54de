"""The routed experts inside transformers models: our implementation in transformers' experts registry,
and stand-ins for the MoE blocks the registry does not reach.

Every experts module decorated with transformers' `use_experts_implementation` calls the function
registered under the model's `experts_implementation`. Ours forwards to the object `attach_routed` put
on the module (the runtime's RoutedExperts, or calibration's recorder), which computes with the
vault's experts.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from transformers.integrations.moe import ExpertsInterface

EXPERTS_IMPLEMENTATION = "smoe"
LAYER_RE = re.compile(r"\.(?:layers|blocks|h)\.(\d+)\.")


def register(name: str, forward) -> None:
    """Make `forward(module, hidden_states, top_k_index, top_k_weights)` the experts implementation `name`."""
    ExpertsInterface.register(name, forward)


def attach_routed(module: torch.nn.Module, layer: int, routed) -> None:
    """Route the experts module of `layer` to `routed.forward(module, hidden_states, top_k_index, top_k_weights)`."""
    module.smoe_layer = layer
    module.smoe_routed = routed


def layer_of(name: str) -> int | None:
    """The decoder layer a module's qualified name lies in."""
    match = LAYER_RE.search(f".{name}.")
    return int(match.group(1)) if match else None


def smoe_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The registered experts implementation: module.smoe_routed computes with the vault's experts."""
    return module.smoe_routed.forward(module, hidden_states, top_k_index, top_k_weights)


register(EXPERTS_IMPLEMENTATION, smoe_experts_forward)


def is_experts_module(module: torch.nn.Module) -> bool:
    """Modules decorated with transformers' `use_experts_implementation` (and ours) carry these flags."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


class StreamingExperts(torch.nn.Module):
    """Stands in, through `set_submodule`, for an experts module that transformers' registry does not
    reach: same call (hidden_states, top_k_index, top_k_weights), gated SwiGLU-style experts, clamped
    as the module clamps them where it has a `limit` (Step-3.7: act(gate) at most `limit`, up within
    ±limit; infinite where a layer is not clamped). Ids from `identity_from` on are identity experts
    (LongCat's "zero" experts): the token itself, weighted, with no weights to fetch."""

    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True

    def __init__(self, act_fn, scale_input: bool = False, limit: float = float("inf"),
                 identity_from: int | None = None):
        super().__init__()
        self.act_fn = act_fn
        self.smoe_scale_input = scale_input
        self.limit = limit
        self.identity_from = identity_from

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit == float("inf"):
            return self.act_fn(gate) * up
        return self.act_fn(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        index, weights = top_k_index.reshape(flat.shape[0], -1), top_k_weights.reshape(flat.shape[0], -1)
        if self.identity_from is None:
            return self.smoe_routed.forward(self, flat, index, weights).view(hidden_states.shape)
        return self._with_identity(flat, index, weights).view(hidden_states.shape)

    def _with_identity(self, flat, index, weights):
        """Routed slots as one row each (a token's slots may be any mix of routed and identity experts),
        identity slots as the token times their summed weight."""
        routed = index < self.identity_from
        tokens, slots = torch.where(routed)
        out = flat * (weights * ~routed).sum(-1, keepdim=True).to(flat.dtype)
        if tokens.numel():
            rows = self.smoe_routed.forward(self, flat[tokens], index[tokens, slots, None], weights[tokens, slots, None])
            out = out.index_add(0, tokens, rows.to(out.dtype))
        return out


class StreamingLlama4Moe(torch.nn.Module):
    """Llama 4's MoE block with routed experts streamed. Llama 4 computes every expert densely and
    scales each expert's input (not its output) by the sigmoid router score; only the top-k have a
    non-zero score, so running just those experts on scaled inputs gives the same result."""

    def __init__(self, block):
        super().__init__()
        self.router, self.shared_expert, self.top_k = block.router, block.shared_expert, block.top_k
        self.experts = StreamingExperts(block.experts.act_fn, scale_input=True)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        router_scores, router_logits = self.router(hidden_states)
        top_k_index = torch.topk(router_logits, self.top_k, dim=-1).indices
        routed = self.experts(hidden_states, top_k_index, router_scores.gather(1, top_k_index))
        return self.shared_expert(hidden_states) + routed, router_logits


def replace_unregistered_moe_blocks(model) -> None:
    """Swap the MoE blocks of families whose experts bypass the registry (by transformers class name)."""
    replacements = {
        "DbrxExperts": lambda m: StreamingExperts(m.mlp.activation_fn),
        "Llama4TextMoe": StreamingLlama4Moe,
        "Step3p7Experts": lambda m: StreamingExperts(m.act_fn, limit=m.limit),
        "LongcatFlashExperts": lambda m: StreamingExperts(m.act_fn, identity_from=m.num_routed_experts),
    }
    for name, module in list(model.named_modules()):
        make = replacements.get(type(module).__name__)
        if make is not None:
            model.set_submodule(name, make(module))


def empty_parameters(module: torch.nn.Module) -> list[str]:
    """The routed experts' weights live in experts.bin: the module's own parameters become empty
    placeholders (on no device's memory; transformers' weight initialisation still finds them).
    Returns their names, relative to the module."""
    names = list(module._parameters)
    for name in names:
        old = module._parameters[name]
        module._parameters[name] = torch.nn.Parameter(torch.empty(0, dtype=old.dtype), requires_grad=False)
    return names


# --- the experts modules' own parameter layout ---------------------------------------------------
# transformers stacks a layer's experts into fused parameters (gate_up_proj or up_proj, down_proj, with
# _bias) whose orientation and gate/up order its flags give; DBRX and Llama 4 keep their own. Only this
# section reads or writes those names: calibration runs the source model's experts through
# expert_linear, dequantisation and the sensitivity measurement write them through parameters_of.

# the fused parameters of each unit of an expert: its first projection(s), and down
UNIT_PARAMETERS = {"gate_up": ("gate_up_proj", "up_proj", "gate_up_proj_bias", "up_proj_bias"),
                   "down": ("down_proj", "down_proj_bias")}


def first_projection(module) -> str:
    return "gate_up_proj" if module.has_gate else "up_proj"


def expert_linear(module, which: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    """x through one expert's `which` projection ("gate_up": gate and up fused, or up alone; "down"),
    read from the module's fused parameters in their own orientation."""
    name = first_projection(module) if which == "gate_up" else "down_proj"
    w = getattr(module, name)[expert]
    y = x @ w if module.is_transposed else x @ w.t()
    return y + getattr(module, name + "_bias")[expert] if module.has_bias else y


def experts_input_sizes(module) -> dict[str, int]:
    """Input widths of the first projection(s) and of down, from the fused parameters' shapes."""
    first, down = getattr(module, first_projection(module)), module.down_proj
    hidden = first.shape[1] if module.is_transposed else first.shape[2]
    inner = down.shape[1] if module.is_transposed else down.shape[2]
    return {"gate_up": int(hidden), "down": int(inner)}


def expert_parameters(module, decoded: list[dict[str, torch.Tensor]], biases: list[dict[str, torch.Tensor]]) -> dict:
    """Stack per-expert [out, in] matrices into the module's own parameter layout (its flags say which)."""

    def orient(w):  # [E, out, in] -> the module's layout
        return w.transpose(1, 2) if module.is_transposed else w

    def fuse(a, b, dim):  # gate and up, concatenated or interleaved along the output dimension
        return torch.cat([a, b], dim=dim) if module.is_concatenated else torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)

    stack = lambda role, src: torch.stack([d[role] for d in src])
    params = {"down_proj": orient(stack("down", decoded))}
    if module.has_gate:
        params["gate_up_proj"] = orient(fuse(stack("gate", decoded), stack("up", decoded), 1))
    else:
        params["up_proj"] = orient(stack("up", decoded))
    if module.has_bias:
        params["down_proj_bias"] = stack("down", biases)
        if module.has_gate:
            params["gate_up_proj_bias"] = fuse(stack("gate", biases), stack("up", biases), 1)
        else:
            params["up_proj_bias"] = stack("up", biases)
    return params


def dbrx_parameters(module, decoded, biases) -> dict:
    """DBRX keeps experts stacked along rows: w1/v1 [E*I, H], and w2 transposed, also [E*I, H]."""
    cat = lambda role, t=False: torch.cat([d[role].t() if t else d[role] for d in decoded])
    return {"mlp.w1": cat("gate"), "mlp.v1": cat("up"), "mlp.w2": cat("down", t=True)}


def llama4_parameters(module, decoded, biases) -> dict:
    """Llama 4: gate_up_proj [E, H, 2I] (transposed, gate half first), down_proj [E, I, H]."""
    gate_up = torch.stack([torch.cat([d["gate"], d["up"]]).t() for d in decoded])
    return {"gate_up_proj": gate_up, "down_proj": torch.stack([d["down"].t() for d in decoded])}


# transformers' fused layout, for a module that does not carry the registry's flags saying so
FUSED_LAYOUT = SimpleNamespace(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True)


def unflagged_parameters(module, decoded, biases) -> dict:
    """transformers' fused layout in a module without the registry's flags (Step-3.7, LongCat). The rows
    LongCat's gate_up allots its identity experts, after the routed ones, are never read: zeros."""
    params = expert_parameters(FUSED_LAYOUT, decoded, biases)
    gate_up = params["gate_up_proj"]
    spare = module.gate_up_proj.shape[0] - gate_up.shape[0]
    params["gate_up_proj"] = torch.cat([gate_up, gate_up.new_zeros(spare, *gate_up.shape[1:])])
    return params


# experts modules outside transformers' registry, by class name; the rest follow their registry flags
PARAMETER_WRITERS = {
    "DbrxExperts": dbrx_parameters,
    "Llama4TextExperts": llama4_parameters,
    "Step3p7Experts": unflagged_parameters,
    "LongcatFlashExperts": unflagged_parameters,
}


def parameters_of(module, decoded: list[dict[str, torch.Tensor]], biases: list[dict[str, torch.Tensor]]) -> dict:
    """{parameter name relative to the module: value} holding the per-expert matrices `decoded` (and biases)."""
    return PARAMETER_WRITERS.get(type(module).__name__, expert_parameters)(module, decoded, biases)


def is_dequantizable(module) -> bool:
    """An experts module whose parameters parameters_of can write."""
    return type(module).__name__ in PARAMETER_WRITERS or is_experts_module(module)
