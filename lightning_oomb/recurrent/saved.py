"""What a state-carrying layer's chunk keeps for backward and how many operations it launches, counted on the meta
device: no memory, no arithmetic.

The kernels transformers runs for these layers where no fused kernel is installed (the torch paths of the gated
delta rule, the SSD scan, lightning attention) keep many float32 tensors per token and head for backward: for
Qwen3-Next's Gated DeltaNet about 84 times what its hidden state takes. They also loop in Python over blocks of
64 tokens, each block a few dozen small operations: about 2,500 in a 4,096-token chunk's forward, 3,700 in its
backward, each a kernel the GPU waits for the host to launch. A formula per kernel and transformers release would
drift; the layer's own chunk function, run on meta tensors, says exactly what it saves and launches.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import carried_kind


def saved_bytes(layer: nn.Module, tokens: int, hidden_size: int) -> int:
    """Bytes the chunk function of ``layer`` (a state-carrying layer on the meta device) saves for backward over a
    chunk of ``tokens`` tokens of one sequence, its input (1, tokens, hidden_size), its parameters requiring grad
    (as in full training; LoRA and frozen weights save no more), in the layer's dtype; each storage counted once,
    parameters not at all."""
    weight = next(layer.parameters())
    params = {id(p) for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
        return t

    hidden = torch.empty(1, tokens, hidden_size, dtype=weight.dtype, device=weight.device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run_chunk(layer, hidden)
    return sum(saved.values())


class _CountOps(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active: on a GPU, one kernel launch each or fewer."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def launched_ops(layer: nn.Module, tokens: int, hidden_size: int) -> tuple[int, int]:
    """ATen operations the chunk function of ``layer`` (a state-carrying layer on the meta device) runs over a
    chunk of ``tokens`` tokens of one sequence, its input (1, tokens, hidden_size): (in its forward, in the
    backward of the output)."""
    weight = next(layer.parameters())
    hidden = torch.empty(1, tokens, hidden_size, dtype=weight.dtype, device=weight.device, requires_grad=True)
    with _CountOps() as forward:
        output = _run_chunk(layer, hidden)
    with _CountOps() as backward:
        output.backward(torch.empty_like(output))
    return forward.count, backward.count


def _run_chunk(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The chunk's output (1, T, d) of ``layer`` from the state a sequence starts with, with its autograd graph."""
    kind = carried_kind(layer)
    if kind is None:
        raise ValueError(f"{type(layer).__name__} is not a state-carrying layer")
    with torch.enable_grad():
        output, _ = kind.chunk(layer, hidden, kind.start(layer, 1))
    return output
