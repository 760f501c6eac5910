"""The states of a sequence's state-carrying layers across its chunks, for one two-stage step.

Stage 1 runs the chunks in order: each layer starts a chunk from the state the chunk before it left, and the
state at every chunk border is kept (on the states' device) for stage 2. Stage 2 runs the chunks in reverse:
each layer reruns its chunk from the kept border state, now a leaf that requires grad, and backpropagates the
chunk's output gradient together with the gradient of its final state that the next chunk's backward handed
back; the gradient its initial state receives is handed back to the chunk before. Summed over the chunks,
every parameter gradient is the whole sequence's. The border states of a step take what
``border_state_bytes`` says: per chunk and layer, independent of the context.
"""

from __future__ import annotations

import torch
from torch import nn

from . import carried_kind
from .carried_state import CarriedState


class _HandBack(torch.autograd.Function):
    """Identity on a chunk's output whose backward also sends the gradient handed back by the next chunk into
    the chunk's final state (None at the sequence's last chunk)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, states: "ChunkStates", key: int, *final: torch.Tensor) -> torch.Tensor:
        ctx.states, ctx.key, ctx.n_final = states, key, len(final)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        handed = ctx.states.handed_back.pop(ctx.key, {})
        return (grad_out, None, None, *(handed.get(i) for i in range(ctx.n_final)))


class ChunkStates:
    """Border states and handed-back gradients of every state-carrying layer of a batch of ``batch`` sequences."""

    def __init__(self, batch: int):
        self.batch = batch
        self.current: dict[int, CarriedState] = {}  # by layer: the state the next chunk starts from (stage 1)
        self.borders: dict[tuple[int, int], CarriedState] = {}  # by (chunk, layer): the state the chunk started from
        self.handed_back: dict[int, dict[int, torch.Tensor]] = {}  # by layer: d(loss)/d(initial state) of the
        # chunk whose backward ran last, by the state's tensor index

    def run(self, layer: nn.Module, hidden: torch.Tensor, chunk: int, keep_borders: bool,
            recompute: bool) -> torch.Tensor:
        """``layer``'s output (B, T, d) for chunk ``chunk`` of the sequence, its input ``hidden`` (B, T, d).
        Stage 1 (``recompute`` False) starts from the state the chunk before left and keeps it when
        ``keep_borders``; stage 2 starts from the kept one. With autograd on, the chunk's graph takes the
        handed-back gradient and hands its own back."""
        kind = carried_kind(layer)
        key = layer.layer_idx
        if recompute:
            start = self.borders[(chunk, key)]
        else:
            start = self.current.get(key)
            if start is None:
                start = kind.start(layer, self.batch)
            if keep_borders:
                self.borders[(chunk, key)] = start.kept()
        if torch.is_grad_enabled():
            begin = start.detach().requires_grad_()
            for i, t in enumerate(begin.tensors()):
                t.register_hook(self._hand_back(key, i))
            out, final = kind.chunk(layer, hidden, begin)
            out = _HandBack.apply(out, self, key, *final.tensors())
        else:
            out, final = kind.chunk(layer, hidden, start)
        if not recompute:
            self.current[key] = final.kept()
        return out

    def _hand_back(self, key: int, index: int):
        def hook(grad: torch.Tensor) -> None:
            self.handed_back.setdefault(key, {})[index] = grad
        return hook

    def done(self, chunk: int) -> None:
        """Stage 2 finished ``chunk``: its border states are no longer needed."""
        for key in [k for k in self.borders if k[0] == chunk]:
            del self.borders[key]

    def clear(self) -> None:
        self.current.clear()
        self.borders.clear()
        self.handed_back.clear()
