"""Mamba-2 mixers (Mamba-2's, Bamba's, Granite 4's, Nemotron-H's, Falcon-H1's) run one chunk at a time, from the
state the chunk before left.

The mixer's input projection gives the gate, the convolution's inputs (x, B, C) and the time steps; the short
convolution continues from the last ``kernel - 1`` inputs before the chunk, and transformers' chunked scan
(``mamba2_chunk_scan``: mamba-ssm's kernel where installed, its torch path otherwise) starts from the SSM state
the chunk before left and returns the one after. The gated norm and the output projection are the mixer's own.
Falcon-H1's mixer scales its input by ``ssm_in_multiplier`` and its projection by its muP vector, and may gate
without a norm.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .carried_state import CarriedState, causal_conv_from


def initial_state(layer: nn.Module, batch: int) -> CarriedState:
    """Zeros before a sequence's first token. conv (B, conv_dim, kernel - 1) in the layer's dtype: x, B and C of
    the last kernel - 1 tokens; recurrent (B, num_heads, head_dim, ssm_state_size) float32: the SSM state."""
    return CarriedState.zeros(layer.conv1d, batch, (layer.num_heads, layer.head_dim, layer.ssm_state_size))


def _projected(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The input projection (B, T, intermediate + conv_dim + num_heads) of ``hidden`` (B, T, hidden_size), with
    Falcon-H1's multipliers where the mixer has them (its muP vector scales the gate, x, B, C and dt apart)."""
    if hasattr(layer, "mup_vector"):
        return layer.in_proj(hidden * layer.ssm_in_multiplier) * layer.mup_vector
    return layer.in_proj(hidden)


def _gated(layer: nn.Module, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The scan's output (B, T, intermediate) gated: by the mixer's gated norm, or by silu(gate) alone where its
    norm is the identity (Falcon-H1 with ``mamba_rms_norm`` off)."""
    if isinstance(layer.norm, nn.Identity):
        return out * F.silu(gate)
    return layer.norm(out, gate)


def mamba2_chunk(layer: nn.Module, hidden: torch.Tensor, state: CarriedState) -> tuple[torch.Tensor, CarriedState]:
    """One chunk of a Mamba-2 ``layer`` (``Mamba2Mixer``, ``BambaMixer``, ``GraniteMoeHybridMambaLayer``,
    ``NemotronHMamba2Mixer``, ``FalconH1Mixer``) from ``state``.

    hidden: (B, T, hidden_size), the chunk's input to the mixer. Returns the mixer's output (B, T, hidden_size)
    and the state after the chunk's last token."""
    batch, tokens, _ = hidden.shape
    gate, inputs, dt = _projected(layer, hidden).split([layer.intermediate_size, layer.conv_dim, layer.num_heads],
                                                       dim=-1)
    conv, tail = causal_conv_from(state.conv, inputs.transpose(1, 2), layer.conv1d, layer.activation)
    groups = layer.n_groups * layer.ssm_state_size
    x, b, c = torch.split(conv, [layer.intermediate_size, groups, groups], dim=-1)
    scan = sys.modules[type(layer).__module__].mamba2_chunk_scan
    out, recurrent = scan(
        x.reshape(batch, tokens, layer.num_heads, layer.head_dim), dt, -torch.exp(layer.A_log.float()),
        b.reshape(batch, tokens, layer.n_groups, layer.ssm_state_size),
        c.reshape(batch, tokens, layer.n_groups, layer.ssm_state_size),
        chunk_size=layer.chunk_size, D=layer.D, z=None, return_final_states=True, dt_bias=layer.dt_bias,
        dt_softplus=True, initial_states=state.recurrent, dt_limit=layer.time_step_limit,
    )
    out = _gated(layer, out.reshape(batch, tokens, -1), gate)
    return layer.out_proj(out.to(hidden.dtype)), CarriedState(conv=tail, recurrent=recurrent)
