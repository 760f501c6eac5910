"""Gated short convolutions (LFM2's, LFM2-MoE's) run one chunk at a time, from the inputs the chunk before left.

The layer projects each token to B, C and x, convolves B * x depthwise and causally over the last ``kernel``
tokens, gates the result by C and projects it out. Nothing recurs: what a chunk needs from the tokens before it is
the convolution's last ``kernel - 1`` inputs, which ``causal_conv_from`` continues from.
"""

from __future__ import annotations

import torch
from torch import nn

from .carried_state import CarriedState, causal_conv_from


def initial_state(layer: nn.Module, batch: int) -> CarriedState:
    """Zeros before a sequence's first token (the layer's own zero padding): conv (B, hidden_size, kernel - 1) in
    the layer's dtype, the B * x of the last kernel - 1 tokens; no recurrence."""
    return CarriedState.zeros(layer.conv, batch)


def short_conv_chunk(layer: nn.Module, hidden: torch.Tensor, state: CarriedState) -> tuple[torch.Tensor, CarriedState]:
    """One chunk of a gated short convolution ``layer`` (``Lfm2ShortConv``, ``Lfm2MoeShortConv``) from ``state``.

    hidden: (B, T, hidden_size), the chunk's input to the layer. Returns the layer's output (B, T, hidden_size)
    and the state after the chunk's last token."""
    b, c, x = layer.in_proj(hidden).transpose(-1, -2).chunk(3, dim=-2)  # each (B, hidden_size, T)
    conv, tail = causal_conv_from(state.conv, b * x, layer.conv, None)  # no activation: the layer has none
    out = c.transpose(-1, -2) * conv
    return layer.out_proj(out.contiguous()), CarriedState(conv=tail)
