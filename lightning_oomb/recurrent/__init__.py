"""Layers that carry a state from one chunk to the next (linear attention, state-space layers, short
convolutions), run one chunk at a time from the state the previous chunk left. Each kind has a chunk function
``(layer, hidden (B, T, d), state) -> (output (B, T, d), state after the chunk)`` and the state a sequence starts
from; ``CARRIED`` holds them by the layer's transformers class name. This room imports nothing of the package."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .gated_delta import gated_delta_chunk, initial_state


@dataclass(frozen=True)
class CarriedKind:
    """How one kind of state-carrying layer runs a chunk (``chunk``) and what a sequence starts from
    (``start(layer, batch)``)."""

    chunk: Callable[..., tuple[Any, Any]]
    start: Callable[[nn.Module, int], Any]


CARRIED = {"Qwen3NextGatedDeltaNet": CarriedKind(gated_delta_chunk, initial_state)}


def carried_kind(module: nn.Module) -> CarriedKind | None:
    """The kind of state-carrying layer ``module`` is, None for any other module."""
    return CARRIED.get(type(module).__name__)


def carried_layers(model: nn.Module) -> list[nn.Module]:
    """The state-carrying layers in ``model`` that this room runs chunk by chunk, in module order."""
    return [m for m in model.modules() if carried_kind(m) is not None]
