"""Gated DeltaNet layers (Qwen3-Next's, Qwen3.5's) run one chunk at a time, from the state the chunk before left.

transformers runs the layer over a whole sequence, or one token at a time from its cache; a chunk of several
tokens that continues a sequence needs both at once: the short convolution's last ``kernel - 1`` inputs before
the chunk, and the recurrent matrix of every value head. ``gated_delta_chunk`` takes them, runs the layer's own
projections, convolution weights, gated norm and transformers' chunked gated delta rule (the kernel transformers
itself calls: flash-linear-attention's where installed, its torch path otherwise) on the chunk, and returns the
output with the state the next chunk starts from. Differentiable in the state: a chunk's backward hands the
gradient of its initial state to the chunk before it. Chained over a sequence's chunks from ``initial_state``, it
computes what the layer computes on the whole sequence.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from .carried_state import CarriedState, causal_conv_from


def initial_state(layer: nn.Module, batch: int) -> CarriedState:
    """The state before a sequence's first token: zeros (what the layer's own zero-padded convolution and its
    delta rule without an initial state start from). conv (B, conv_dim, kernel - 1) in the layer's dtype: the
    q, k, v projections of the last kernel - 1 tokens; recurrent (B, num_v_heads, head_k_dim, head_v_dim)
    float32: the delta rule's state."""
    return CarriedState.zeros(layer.conv1d, batch, (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim))


def _delta_rule(layer: nn.Module):
    """transformers' chunked gated delta rule as the layer's modeling module defines it."""
    return sys.modules[type(layer).__module__].torch_chunk_gated_delta_rule


def _projections(layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed (B, conv_dim, T): the convolution's q, k, v inputs; z (B, T, num_v_heads, head_v_dim): the output
    gate; b, a (B, T, num_v_heads)) as the layer projects them: Qwen3-Next in two fused projections whose
    outputs it reorders, Qwen3.5 in four."""
    batch, tokens, _ = hidden.shape
    if hasattr(layer, "in_proj_qkvz"):
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden),
                                                                        layer.in_proj_ba(hidden))
        mixed = torch.cat([x.reshape(batch, tokens, -1) for x in (query, key, value)], dim=-1)
    else:
        mixed = layer.in_proj_qkv(hidden)
        z = layer.in_proj_z(hidden).reshape(batch, tokens, -1, layer.head_v_dim)
        b, a = layer.in_proj_b(hidden), layer.in_proj_a(hidden)
    return mixed.transpose(1, 2), z, b, a


def gated_delta_chunk(layer: nn.Module, hidden: torch.Tensor,
                      state: CarriedState) -> tuple[torch.Tensor, CarriedState]:
    """One chunk of a Gated DeltaNet ``layer`` (``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``) from
    ``state``.

    hidden: (B, T, hidden_size), the chunk's input to the layer. Returns the layer's output (B, T, hidden_size)
    and the state after the chunk's last token."""
    batch, tokens, _ = hidden.shape
    mixed, z, b, a = _projections(layer, hidden)
    conv, tail = causal_conv_from(state.conv, mixed, layer.conv1d, layer.activation)
    query, key, value = torch.split(conv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(batch, tokens, -1, layer.head_k_dim)
    key = key.reshape(batch, tokens, -1, layer.head_k_dim)
    value = value.reshape(batch, tokens, -1, layer.head_v_dim)
    if layer.num_v_heads > layer.num_k_heads:
        # Each query and key head serves num_v_heads // num_k_heads consecutive value heads. Older transformers
        # repeat them in the layer, newer ones in the kernel (which skips it once the heads match).
        query = query.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
        key = key.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    out, recurrent = _delta_rule(layer)(query, key, value, g=g, beta=beta, initial_state=state.recurrent,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    z_shape = z.shape
    out = layer.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1])).reshape(z_shape)
    out = layer.out_proj(out.reshape(batch, tokens, -1))
    return out, CarriedState(conv=tail, recurrent=recurrent)
