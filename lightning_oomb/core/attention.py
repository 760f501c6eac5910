"""One autograd function: a chunk's queries attend to the stored past plus the chunk itself, causally.

Backward adds the past's dK, dV into the store's gradient pages and returns the chunk's own dk, dv with
what later chunks stored for them already added (DESIGN.md section 1, stage 2, step 3).
"""

from __future__ import annotations

import os
from typing import Literal, Protocol

import torch

from . import reference_attention
from .pages import LayerStore

AttentionImpl = Literal["auto", "reference", "triton"]


class AttentionBackend(Protocol):
    def attention_forward(self, q, k, v, store, start, scale): ...  # noqa: E704
    def attention_backward(self, dout, q, k, v, out, lse, store, start, scale): ...  # noqa: E704


def resolve_backend(impl: str, device: torch.device):
    """The module implementing ``attention_forward``/``attention_backward`` for ``impl`` on ``device``."""
    if impl not in ("auto", "reference", "triton"):
        raise ValueError(f"attention must be 'auto', 'reference' or 'triton', got {impl!r}")
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        return reference_attention
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention='triton' needs a CUDA device, or TRITON_INTERPRET=1 to run the kernels in Triton's "
            "CPU interpreter; use attention='reference' (or 'auto') on CPU"
        )
    from ..kernels import chunk_attention as triton_attention

    return triton_attention


class ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, store: LayerStore, start: int, scale: float, backend):
        out, lse = backend.attention_forward(q, k, v, store, start, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.store, ctx.start, ctx.scale, ctx.backend = store, start, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.attention_backward(
            dout.contiguous(), q, k, v, out, lse, ctx.store, ctx.start, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, start: int, scale: float, backend
) -> torch.Tensor:
    """q (B, H_q, T, D), k/v (B, H_kv, T, D) of the chunk at tokens [start, start + T) -> out like q."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return ChunkAttention.apply(q, k, v, store, start, scale, backend)
    return backend.attention_forward(q, k, v, store, start, scale)[0]
