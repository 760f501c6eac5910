"""What a state-carrying layer's chunk keeps for backward, counted on the meta device: no memory, no arithmetic.

The kernels transformers runs for these layers where no fused kernel is installed (the torch paths of the gated
delta rule, the SSD scan, lightning attention) keep many float32 tensors per token and head for backward: for
Qwen3-Next's Gated DeltaNet about 84 times what its hidden state takes. A formula per kernel and transformers
release would drift; the layer's own chunk function, run on meta tensors, says exactly what it saves.
"""

from __future__ import annotations

import torch
from torch import nn

from . import carried_kind


def saved_bytes(layer: nn.Module, tokens: int, hidden_size: int) -> int:
    """Bytes the chunk function of ``layer`` (a state-carrying layer on the meta device) saves for backward over a
    chunk of ``tokens`` tokens of one sequence, its input (1, tokens, hidden_size), its parameters requiring grad
    (as in full training; LoRA and frozen weights save no more), in the layer's dtype; each storage counted once,
    parameters not at all."""
    kind = carried_kind(layer)
    if kind is None:
        raise ValueError(f"{type(layer).__name__} is not a state-carrying layer")
    weight = next(layer.parameters())
    params = {id(p) for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
        return t

    hidden = torch.empty(1, tokens, hidden_size, dtype=weight.dtype, device=weight.device, requires_grad=True)
    start = kind.start(layer, 1)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kind.chunk(layer, hidden, start)
    return sum(saved.values())

