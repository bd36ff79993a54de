"""The routed experts inside transformers models: our implementation in transformers' experts registry,
and stand-ins for the MoE blocks the registry does not reach.

Every experts module decorated with transformers' `use_experts_implementation` calls the function
registered under the model's `experts_implementation`. Ours forwards to the object `attach_routed` put
on the module (the runtime's RoutedExperts, or calibration's recorder), which computes with the
vault's experts.
"""

from __future__ import annotations

import re

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
    reach: same call (hidden_states, top_k_index, top_k_weights), gated SwiGLU-style experts."""

    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True

    def __init__(self, act_fn, scale_input: bool = False):
        super().__init__()
        self.act_fn = act_fn
        self.smoe_scale_input = scale_input

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = self.smoe_routed.forward(self, flat, top_k_index.reshape(flat.shape[0], -1),
                                       top_k_weights.reshape(flat.shape[0], -1))
        return out.view(hidden_states.shape)


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
