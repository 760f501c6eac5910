"""What a state-carrying layer hands from one chunk to the next: the last inputs of its short convolution and the
state of its recurrence, either of which a layer kind may lack (a short convolution alone; a recurrence alone)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class CarriedState:
    """One layer's state at a chunk border, for a batch of B sequences; a part the layer kind lacks is None.

    conv: (B, channels, kernel - 1): the convolution's inputs of the last ``kernel - 1`` tokens before the border
        (zeros before the sequence's start), in the layer's dtype.
    recurrent: the recurrence's state after the last token (shape and dtype the layer kind's).
    """

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None

    @classmethod
    def zeros(cls, conv: nn.Conv1d, batch: int, recurrent: tuple[int, ...] | None = None) -> CarriedState:
        """The state before a sequence's first token: zero inputs before it for ``conv`` (in its weight's dtype)
        and, unless ``recurrent`` is None (a convolution alone), a zero float32 recurrence state of shape
        (batch, *recurrent)."""
        weight = conv.weight
        return cls(
            conv=torch.zeros(batch, conv.in_channels, conv.kernel_size[0] - 1, dtype=weight.dtype,
                             device=weight.device),
            recurrent=None if recurrent is None else torch.zeros(batch, *recurrent, dtype=torch.float32,
                                                                 device=weight.device),
        )

    def detach(self) -> CarriedState:
        return CarriedState(*(None if t is None else t.detach() for t in (self.conv, self.recurrent)))

    def kept(self) -> CarriedState:
        """A detached copy that holds only its own bytes: a convolution's tail is a view of the chunk's whole
        input (B, C, T + kernel - 1), and a state kept at every border must not keep every chunk's input alive."""
        return CarriedState(*(None if t is None else _own(t.detach()) for t in (self.conv, self.recurrent)))

    def requires_grad_(self) -> CarriedState:
        for t in self.tensors():
            t.requires_grad_()
        return self

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The parts the layer kind has, conv before recurrent: the same number and order at every border."""
        return tuple(t for t in (self.conv, self.recurrent) if t is not None)


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its storage holds nothing more, else a compact copy."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def causal_conv_from(tail: torch.Tensor, inputs: torch.Tensor, conv: nn.Conv1d,
                     activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's depthwise causal convolution (``conv``, then ``activation`` unless None) over a chunk's
    ``inputs`` (B, C, T), continued from ``tail`` (B, C, kernel - 1), the inputs of the tokens before the chunk:
    the whole-sequence layer's zero padding at the sequence's start, and its window across the border later.
    Returns the output (B, T, C) and the tail the next chunk continues from."""
    from transformers.activations import ACT2FN

    padded = torch.cat([tail.to(inputs.dtype), inputs], dim=2)
    out = F.conv1d(padded, conv.weight, conv.bias, groups=conv.groups)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.transpose(1, 2), padded[:, :, padded.shape[2] - (conv.kernel_size[0] - 1):]
