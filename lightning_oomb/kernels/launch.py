"""What every kernel launch needs: the tensor's device made current (Triton launches on the current device)."""

from __future__ import annotations

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    """A context making ``t``'s CUDA device current; nothing for a CPU tensor (Triton's interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
