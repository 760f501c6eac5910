"""Lightning attention (MiniMax's linear-attention layers) run one chunk at a time, from the state the chunk before
left.

The layer's state is one (head_dim, head_dim) matrix per head, the decayed sum of k^T v over the tokens so far:
S_t = exp(-slope) S_{t-1} + k_t^T v_t, and token t's output is q_t S_t. The layer computes it in blocks of
``block_size`` tokens (the block's own tokens through its decayed scores, the tokens before through the state),
and that blocked form is the recurrence exactly for blocks of any length, each taking the first rows of the
layer's decay buffers: so a chunk runs its own blocks from its start, whatever its border's place in the layer's
blocks, and hands on the state after its last token. Projections, buffers, norm, output gate and output
projection are the layer's own, in its order of operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .carried_state import CarriedState


def initial_state(layer: nn.Module, batch: int) -> CarriedState:
    """Zeros before a sequence's first token: recurrent (B, heads, head_dim, head_dim), the state transformers
    starts from, in the layer's dtype (the values' dtype without autocast); no convolution."""
    weight = layer.qkv_proj.weight
    shape = (batch, layer.num_attention_heads, layer.head_dim, layer.head_dim)
    return CarriedState(recurrent=torch.zeros(shape, dtype=weight.dtype, device=weight.device))


def _qkv(layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values, each (B, heads, T, head_dim), as the layer projects and activates them."""
    batch, tokens, _ = hidden.shape
    qkv = layer.act_fn(layer.qkv_proj(hidden)).reshape(batch, tokens, layer.num_attention_heads, 3 * layer.head_dim)
    return tuple(t.transpose(1, 2) for t in torch.split(qkv, layer.head_dim, dim=3))


def _block(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of n <= block_size tokens (q, k, v: (B, heads, n, head_dim)) from the state ``kv`` before it:
    the block's output (B, heads, n, head_dim) and the state after it."""
    n = q.shape[2]
    intra = torch.matmul(torch.matmul(q, k.transpose(-1, -2)) * layer.diagonal_decay[:, :, :n, :n], v)
    inter = torch.matmul(q * layer.query_decay[:, :n], kv)
    after = kv * torch.exp(-layer.slope_rate * n) + torch.matmul((k * layer.key_decay[:, -n:]).transpose(-1, -2), v)
    return inter + intra, after


def lightning_attention_chunk(layer: nn.Module, hidden: torch.Tensor,
                              state: CarriedState) -> tuple[torch.Tensor, CarriedState]:
    """One chunk of a lightning-attention ``layer`` (``MiniMaxLightningAttention``) from ``state``.

    hidden: (B, T, hidden_size), the chunk's input to the layer. Returns the layer's output (B, T, hidden_size)
    and the state after the chunk's last token."""
    batch, tokens, _ = hidden.shape
    q, k, v = _qkv(layer, hidden)
    kv, outputs = state.recurrent, []
    for start in range(0, tokens, layer.block_size):
        end = min(start + layer.block_size, tokens)
        out, kv = _block(layer, q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], kv)
        outputs.append(out)
    out = torch.cat(outputs, dim=-2).transpose(1, 2).reshape(batch, tokens, -1)
    out = F.sigmoid(layer.output_gate(hidden)) * layer.norm(out)
    return layer.out_proj(out), CarriedState(recurrent=kv)


def with_no_weights(out: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The layer's forward returns its output and its state; the decoder layer keeps the output alone."""
    return out, None
