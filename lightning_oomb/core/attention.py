"""The attention op: ``ChunkAttention``, one autograd function in which a chunk's queries attend to the stored
past plus the chunk itself, causally; the backend interface it calls and ``resolve_backend``.

Backward adds the past's dK, dV into the store's gradient pages and returns the chunk's own dk, dv with what
later chunks stored for them already added (docs/architecture.md, "The algorithm in one page"). The same op
takes a sparse page selection, packed documents (``doc_start``, ``one_document``), pages streamed from the
host (``store.streamer``) and a sparse layer's host K/V pages (``store.kv_stager``): docs/architecture.md,
"The attention backend" and the sections after it.

Attention sinks (GPT-OSS: a learned logit s per head in every softmax's denominator, a key whose value is
zero) need no kernel of their own: with lse' = logaddexp(lse, s) the output is out * exp(lse - lse'), and the
backends' backward given (that output, lse') is the exact backward of attention with the sink; the sink's
own gradient is -sum over queries of exp(s - lse') * rowsum(dout * out).

Soft-capped scores (Gemma 2's ``attn_logit_softcapping``: softcap * tanh(q.k * scale / softcap), forward and
backward) are every backend's own, through a ``softcap`` argument; None computes plain scores at no cost.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import torch

from ..kernels.page_table import LayerStore
from . import reference_attention


@runtime_checkable
class AttentionBackend(Protocol):
    """What the engine calls for dense chunk attention: ``reference_attention`` (plain PyTorch, the oracle)
    and ``kernels.chunk_attention`` (Triton) are modules of these functions (``tests/test_triton_attention.py``
    checks both against it). Shapes: q (B, H_q, T, D), k (B, H_kv, T, D) and v (B, H_kv, T, D_v) of the chunk
    at tokens [start, start + T); out (B, H_q, T, D_v) in q's dtype; lse (B, H_q, T) float32, natural log; the
    past is the store's tokens [0, start). ``forward_state``, ``backward_delta`` and ``backward_part`` take one
    key range of the past at a time, for pages streamed from the host (``core.offload``). doc_start: None, or
    (B, T) int32, the token position of each query's document start: keys before it are not attended (packed
    documents). one_document: None, or the host int that doc_start holds everywhere (all queries in one
    document). softcap: None, or the soft cap of the scores: softcap * tanh(q.k * scale / softcap)."""

    def attention_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore,
                          start: int, scale: float, doc_start: torch.Tensor | None = None,
                          one_document: int | None = None,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse)."""

    def attention_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, store: LayerStore, start: int, scale: float,
                           doc_start: torch.Tensor | None = None, one_document: int | None = None,
                           softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq like q, dk, dv like k, v: the chunk's share plus what later chunks stored for its tokens);
        adds the past's dK, dV into the store's gradient pages."""

    def forward_state(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, past_lo: int,
                      past_hi: int, scale: float, chunk: bool,
                      state: tuple[torch.Tensor, torch.Tensor] | None = None, doc_start: torch.Tensor | None = None,
                      chunk_start: int = 0, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Continue the online softmax ``state`` = (out float32 normalised, lse), updated in place (None:
        a new one), over the stored keys [past_lo, past_hi) and, with ``chunk``, the chunk's own k, v (at
        tokens [chunk_start, chunk_start + T), which doc_start is compared with)."""

    def backward_delta(self, out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
        """rowsum(dout * out): (B, H_q, T) float32, shared by every key range of a chunk's backward."""

    def backward_part(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, store: LayerStore, past_lo: int, past_hi: int,
                      chunk_start: int, scale: float, chunk: bool, dq: torch.Tensor,
                      doc_start: torch.Tensor | None = None,
                      softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Add dQ of the keys [past_lo, past_hi) (and, with ``chunk``, the chunk's own) into dq (float32),
        their dK, dV into the store's gradient pages; with ``chunk`` return the chunk's dk, dv."""


@runtime_checkable
class SparseAttentionBackend(Protocol):
    """What the engine calls for page-level sparse attention: ``core.sparse`` (plain PyTorch) and
    ``kernels.sparse_attention`` (Triton). As ``AttentionBackend``'s two entry points, with the chunk's page
    selection (B, H_sel, n_tiles, K) int32 (``core.sparse.select_pages``) as the last argument: the past is
    only the selected pages of each query tile (entries of -1: no page). doc_start and softcap as
    ``AttentionBackend``'s."""

    def attention_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore,
                          start: int, scale: float, selection: torch.Tensor, doc_start: torch.Tensor | None = None,
                          softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse)."""

    def attention_backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, store: LayerStore, start: int, scale: float,
                           selection: torch.Tensor, doc_start: torch.Tensor | None = None,
                           softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) as the dense backward; adds the selected pages' dK, dV into the gradient pages."""


def uses_triton(impl: str, device: torch.device) -> bool:
    """Whether ``attention=impl`` on ``device`` runs the Triton kernels (attention and the fused ops)."""
    if impl not in ("auto", "reference", "triton"):
        raise ValueError(f"attention must be 'auto', 'reference' or 'triton', got {impl!r}")
    return impl == "triton" or (impl == "auto" and device.type == "cuda")


def resolve_backend(
    impl: str, device: torch.device, sparse: bool = False
) -> AttentionBackend | SparseAttentionBackend:
    """The module implementing ``AttentionBackend`` for ``impl`` on ``device`` (with ``sparse``: a
    ``SparseAttentionBackend``, ``lightning_oomb.core.sparse`` or its Triton kernels)."""
    if not uses_triton(impl, device):
        if sparse:
            from . import sparse as sparse_reference

            return sparse_reference
        return reference_attention
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention='triton' needs a CUDA device, or TRITON_INTERPRET=1 to run the kernels in Triton's "
            "CPU interpreter; use attention='reference' (or 'auto') on CPU"
        )
    if sparse:
        from ..kernels import sparse_attention

        return sparse_attention
    from ..kernels import chunk_attention as triton_attention

    return triton_attention


def _staged(store: LayerStore, selection: torch.Tensor | None, start: int) -> LayerStore:
    # A host K/V layer's selected pages, gathered for this call only: stage 2's backward gathers them again
    # rather than holding every layer's staging from the chunk's forward to its backward.
    return store if store.kv_stager is None else store.kv_stager.stage(store, selection, start)


def _forward(q, k, v, store: LayerStore, start: int, scale: float, backend, selection, doc_start, one_document,
             sinks=None, softcap=None):
    store = _staged(store, selection, start)
    if store.streamer is not None:
        out, lse = store.streamer.forward(backend, q, k, v, store, start, scale, doc_start, softcap=softcap)
    elif selection is not None:
        out, lse = backend.attention_forward(q, k, v, store, start, scale, selection, doc_start, softcap=softcap)
    else:
        out, lse = backend.attention_forward(q, k, v, store, start, scale, doc_start, one_document, softcap=softcap)
    if sinks is None:
        return out, lse
    with_sink = torch.logaddexp(lse, sinks.detach().float()[None, :, None])
    return (out.float() * torch.exp(lse - with_sink)[..., None]).to(out.dtype), with_sink


class ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, store: LayerStore, start: int, scale: float, backend, selection=None, kept=None,
                doc_start=None, one_document=None, sinks=None, softcap=None):
        if kept is None:
            out, lse = _forward(q, k, v, store, start, scale, backend, selection, doc_start, one_document, sinks,
                                softcap)
        else:
            # A new tensor object on the kept storage: autograd attaches this call's history to it, and a
            # layer checkpoint's recompute may call again with the same kept pair.
            out, lse = kept[0].detach(), kept[1]
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.store, ctx.start, ctx.scale, ctx.backend = store, start, scale, backend
        ctx.selection, ctx.doc_start, ctx.one_document, ctx.softcap = selection, doc_start, one_document, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        store = _staged(ctx.store, ctx.selection, ctx.start)
        args = (dout, q, k, v, out, lse, store, ctx.start, ctx.scale)
        if store.streamer is not None:
            dq, dk, dv = store.streamer.backward(ctx.backend, *args, ctx.doc_start, softcap=ctx.softcap)
        elif ctx.selection is not None:
            dq, dk, dv = ctx.backend.attention_backward(*args, ctx.selection, ctx.doc_start, softcap=ctx.softcap)
        else:
            dq, dk, dv = ctx.backend.attention_backward(*args, ctx.doc_start, ctx.one_document, softcap=ctx.softcap)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[11]:
            delta = (dout.float() * out.float()).sum(-1)  # (B, H, T)
            dsinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks, None


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, start: int, scale: float, backend,
    selection: torch.Tensor | None = None, kept: tuple[torch.Tensor, torch.Tensor] | None = None,
    doc_start: torch.Tensor | None = None, one_document: int | None = None, sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (B, H_q, T, D), k (B, H_kv, T, D), v (B, H_kv, T, D_v) of the chunk at tokens [start, start + T) -> out
    (B, H_q, T, D_v) in q's dtype.

    selection: None (dense: every past token) or the chunk's page selection (B, H_sel, n_tiles, K) int32 for a
    sparse ``backend``. kept: (out, lse) of this same attention from ``chunk_attention_with_lse`` (stage 1),
    used instead of computing them again. doc_start: None, or (B, T) int32, each query's document start
    (packed documents); one_document: None, or the start of the one document all the chunk's queries belong
    to (``core.documents.chunk_documents``). sinks: None, or (H_q,) attention-sink logits (module docstring).
    softcap: None, or the scores' soft cap (module docstring).
    """
    grads = q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad)
    if torch.is_grad_enabled() and grads:
        return ChunkAttention.apply(q, k, v, store, start, scale, backend, selection, kept, doc_start, one_document,
                                    sinks, softcap)
    if kept is not None:
        return kept[0]
    return chunk_attention_with_lse(q, k, v, store, start, scale, backend, selection, doc_start, one_document,
                                    sinks, softcap)[0]


def chunk_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, start: int, scale: float, backend,
    selection: torch.Tensor | None = None, doc_start: torch.Tensor | None = None, one_document: int | None = None,
    sinks: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_attention`` without autograd, returning (out (B, H_q, T, D_v), lse (B, H_q, T) float32, natural log; with
    ``sinks``, the sink's term included)."""
    return _forward(q, k, v, store, start, scale, backend, selection, doc_start, one_document, sinks, softcap)
