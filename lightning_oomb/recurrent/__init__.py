"""Layers that carry a state from one chunk to the next (linear attention, state-space layers, short
convolutions), run one chunk at a time from the state the previous chunk left. Each kind has a chunk function
``(layer, hidden (B, T, d), state) -> (output (B, T, d), state after the chunk)`` and the state a sequence starts
from; ``CARRIED`` holds them by the layer's transformers class name. This room imports nothing of the package."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from . import gated_delta, lightning_attention, mamba1, mamba2, short_conv


def _alone(out: Any) -> Any:
    return out


@dataclass(frozen=True)
class CarriedKind:
    """How one kind of state-carrying layer runs a chunk (``chunk``), what a sequence starts from
    (``start(layer, batch)``), the function of the layer's transformers modeling module it calls (``needs``:
    transformers releases before it have none; None: it calls none), and what the layer's forward returns made
    of the chunk's output (``returns``: the output alone, or the tuple its decoder layer unpacks)."""

    chunk: Callable[..., tuple[Any, Any]]
    start: Callable[[nn.Module, int], Any]
    needs: str | None
    returns: Callable[[Any], Any] = _alone


_GATED_DELTA = CarriedKind(gated_delta.gated_delta_chunk, gated_delta.initial_state, "torch_chunk_gated_delta_rule")
_MAMBA2 = CarriedKind(mamba2.mamba2_chunk, mamba2.initial_state, "mamba2_chunk_scan")
_MAMBA1 = CarriedKind(mamba1.mamba1_chunk, mamba1.initial_state, None)  # transformers' scan takes no start
_SHORT_CONV = CarriedKind(short_conv.short_conv_chunk, short_conv.initial_state, None)
_LIGHTNING = CarriedKind(lightning_attention.lightning_attention_chunk, lightning_attention.initial_state, None,
                         lightning_attention.with_no_weights)
CARRIED = {"Qwen3NextGatedDeltaNet": _GATED_DELTA, "Qwen3_5GatedDeltaNet": _GATED_DELTA,
           "Qwen3_5MoeGatedDeltaNet": _GATED_DELTA, "BambaMixer": _MAMBA2, "NemotronHMamba2Mixer": _MAMBA2,
           "GraniteMoeHybridMambaLayer": _MAMBA2, "Lfm2ShortConv": _SHORT_CONV, "Lfm2MoeShortConv": _SHORT_CONV,
           "MiniMaxLightningAttention": _LIGHTNING, "FalconH1Mixer": _MAMBA2, "JambaMambaMixer": _MAMBA1,
           "MambaMixer": _MAMBA1, "FalconMambaMixer": _MAMBA1, "Mamba2Mixer": _MAMBA2}


def carried_kind(module: nn.Module) -> CarriedKind | None:
    """The kind of state-carrying layer ``module`` is, None for any other module."""
    return CARRIED.get(type(module).__name__)


def missing_function(layer: nn.Module) -> str | None:
    """The function a state-carrying layer's chunks call that its modeling module lacks (an older transformers),
    else None."""
    kind = carried_kind(layer)
    modeling = sys.modules.get(type(layer).__module__)
    return None if kind is None or kind.needs is None or hasattr(modeling, kind.needs) else kind.needs


def carried_layers(model: nn.Module) -> list[nn.Module]:
    """The state-carrying layers in ``model`` that this room runs chunk by chunk, in module order."""
    return [m for m in model.modules() if carried_kind(m) is not None]


def border_state_bytes(model: nn.Module, batch: int, chunks: int) -> int:
    """Bytes the border states of a step of ``chunks`` chunks over ``batch`` sequences hold at most: stage 1 keeps
    one state per chunk and state-carrying layer until stage 2 has run that chunk."""
    per_chunk = sum(t.numel() * t.element_size() for m in carried_layers(model)
                    for t in carried_kind(m).start(m, batch).tensors())
    return chunks * per_chunk
