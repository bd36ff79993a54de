"""The experts' activation, for every kind a model description states (smoe.source.description.Experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from smoe.source.description import Experts

ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu, "relu2": lambda x: torch.square(F.relu(x)),
}


def activate(experts: Experts, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    """The down projection's input from the gate and up projections' outputs (gate None when the
    experts are not gated): act(gate) * up, act(up), or gpt-oss's clamped SwiGLU."""
    if experts.clamp is not None:
        alpha, limit = experts.clamp
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(alpha * gate))
    act = ACTIVATIONS[experts.activation]
    return act(gate) * up if experts.gated else act(up)
