"""Plain-PyTorch chunk attention over the paged store: the oracle every kernel is tested against.

Queries of one chunk, q (B, H_q, T, D), attend to the stored past (tokens [0, start) of the store) and
causally to the chunk's own keys k (B, H_kv, T, D) and values v (B, H_kv, T, D_v), key tile by key tile with
an online softmax in float32 (the output is D_v wide, like the values): memory O(T x tile), never O(T x L).
The query heads are viewed as (H_kv, g) against each KV head; K/V are never repeated. Packed documents (``doc_start`` (B, T) int32): query i sees only keys from
doc_start[:, i] on, whole tiles before the earliest start skipped; ``one_document``: an unpacked chunk over
the keys from that start. ``softcap``: scores soft-capped as transformers' eager attention caps them,
softcap * tanh(q.k * scale / softcap), before the mask.
"""

from __future__ import annotations

import torch

from ..kernels.page_table import LayerStore


def _grouped(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    b, hq, t, d = x.shape
    return x.float().view(b, n_kv_heads, hq // n_kv_heads, t, d)


def _key_tiles(past_lo: int, past_hi: int, t: int, tile: int, chunk_start: int, doc_start: torch.Tensor | None):
    """(is_past, lo, hi) for the stored tiles [past_lo, past_hi) then the current chunk's tiles [0, t), less
    the tiles that end before every query's document starts."""
    # The oracle reads the earliest start on the host (a wait for the GPU there; the kernels read it themselves).
    first = 0 if doc_start is None else int(doc_start.min())
    for lo in range(past_lo, past_hi, tile):
        if min(lo + tile, past_hi) > first:
            yield True, lo, min(lo + tile, past_hi)
    for lo in range(0, t, tile):
        if chunk_start + min(lo + tile, t) > first:
            yield False, lo, min(lo + tile, t)


def _hidden_keys(t: int, lo: int, hi: int, is_past: bool, chunk_start: int, doc_start: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor | None:
    """True where a query of the chunk may not see key j of [lo, hi) (stored tokens, or the chunk's own
    counted from its start): (T, n), or (B, 1, 1, T, n) with documents; None when all are seen."""
    keys = torch.arange(lo, hi, device=device)
    hidden = None if is_past else keys[None, :] > torch.arange(t, device=device)[:, None]
    if doc_start is None:
        return hidden
    before = (keys if is_past else keys + chunk_start)[None, None, :] < doc_start[:, :, None]  # (B, T, n)
    if hidden is not None:
        before = before | hidden
    return before[:, None, None]


def capped_scores(qg: torch.Tensor, kt: torch.Tensor, scale: float,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores of queries qg (B, H_kv, G, T, D) against keys kt (B, H_kv, n, D), tanh of the capped scores or
    None): q.k * scale, soft-capped where asked; the dense and the sparse reference both score with it."""
    s = torch.einsum("bhgtd,bhnd->bhgtn", qg, kt) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def forward_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    store: LayerStore,
    past_lo: int,
    past_hi: int,
    scale: float,
    chunk: bool,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    doc_start: torch.Tensor | None = None,
    chunk_start: int = 0,
    softcap: float | None = None,
    tile: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend q (B, H_q, T, D) to the stored tokens [past_lo, past_hi) and, with ``chunk``, causally to the
    chunk's own k (B, H_kv, T, D), v (B, H_kv, T, D_v) at tokens [chunk_start, chunk_start + T), continuing the
    online softmax of ``state``; with doc_start (B, T) int32, only to keys at or after each query's document start.

    state: (out, lse) of the keys attended so far, out (B, H_q, T, D_v) float32 normalised, lse (B, H_q, T)
    float32 natural log; updated in place. None starts from no keys. Returns (out, lse).
    """
    b, hq, t, d = q.shape
    h = k.shape[1]
    qg = _grouped(q, h)
    if state is None:
        m = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
        denom = torch.zeros_like(m)
        acc = torch.zeros(qg.shape[:-1] + (v.shape[-1],), device=q.device)
    else:
        # (out, lse) is the running state with its sum normalised to 1 at max lse.
        acc = state[0].view(b, h, hq // h, t, -1).clone()
        m = state[1].view(b, h, hq // h, t).clone()
        denom = torch.ones_like(m)
    for is_past, lo, hi in _key_tiles(past_lo, past_hi, t if chunk else 0, tile, chunk_start, doc_start):
        kt, vt = store.read(lo, hi) if is_past else (k[:, :, lo:hi], v[:, :, lo:hi])
        s, _ = capped_scores(qg, kt.float(), scale, softcap)
        hidden = _hidden_keys(t, lo, hi, is_past, chunk_start, doc_start, q.device)
        if hidden is not None:
            s = s.masked_fill(hidden, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # A query none of whose keys so far is in its document has m_new = -inf: shifting by 0 instead keeps
        # its (empty) state, where exp(-inf - -inf) would be NaN.
        shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(m - shift)
        p = torch.exp(s - shift[..., None])
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bhgtn,bhnd->bhgtd", p, vt.float())
        m = m_new
    out = (acc / denom[..., None]).view(b, hq, t, -1)
    lse = (m + torch.log(denom)).view(b, hq, t)
    if state is None:
        return out, lse
    state[0].copy_(out)
    state[1].copy_(lse)
    return state


def backward_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) of out, dout (B, H_q, T, D_v): (B, H_q, T) float32, the softmax-backward term shared by
    every key range."""
    return (dout.float() * out.float()).sum(-1)


def backward_part(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    store: LayerStore,
    past_lo: int,
    past_hi: int,
    chunk_start: int,
    scale: float,
    chunk: bool,
    dq: torch.Tensor,
    doc_start: torch.Tensor | None = None,
    softcap: float | None = None,
    tile: int = 256,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Gradients through the keys [past_lo, past_hi) of the store and, with ``chunk``, the chunk's own.

    Adds into dq (B, H_q, T, D) float32 and into the store's gradient pages of [past_lo, past_hi). With
    ``chunk`` returns the chunk's dk, dv (like k, v): its share plus what later chunks stored for tokens
    [chunk_start, chunk_start + T); else None. doc_start: as in ``forward_state``.
    """
    b, hq, t, d = q.shape
    h = k.shape[1]
    qg = _grouped(q, h)
    dog = _grouped(dout, h)
    lse_g = lse.view(b, h, hq // h, t)
    delta_g = delta.view(b, h, hq // h, t)
    dq_g = dq.view(b, h, hq // h, t, d)
    if chunk:
        dk_cur, dv_cur = store.read(chunk_start, chunk_start + t, grads=True)
        dk_cur, dv_cur = dk_cur.float(), dv_cur.float()
    for is_past, lo, hi in _key_tiles(past_lo, past_hi, t if chunk else 0, tile, chunk_start, doc_start):
        kt, vt = store.read(lo, hi) if is_past else (k[:, :, lo:hi], v[:, :, lo:hi])
        kt, vt = kt.float(), vt.float()
        s, capped = capped_scores(qg, kt, scale, softcap)
        hidden = _hidden_keys(t, lo, hi, is_past, chunk_start, doc_start, q.device)
        if hidden is not None:
            s = s.masked_fill(hidden, float("-inf"))
        p = torch.exp(s - lse_g[..., None])
        dv_t = torch.einsum("bhgtn,bhgtd->bhnd", p, dog)
        ds = p * (torch.einsum("bhgtd,bhnd->bhgtn", dog, vt) - delta_g[..., None])
        if capped is not None:  # d(softcap * tanh(x / softcap))/dx
            ds = ds * (1.0 - capped * capped)
        dq_g += torch.einsum("bhgtn,bhnd->bhgtd", ds, kt) * scale
        dk_t = torch.einsum("bhgtn,bhgtd->bhnd", ds, qg) * scale
        if is_past:
            store.accumulate_grads(dk_t, dv_t, lo)
        else:
            dk_cur[:, :, lo:hi] += dk_t
            dv_cur[:, :, lo:hi] += dv_t
    return (dk_cur.to(k.dtype), dv_cur.to(v.dtype)) if chunk else None


def _documents(doc_start: torch.Tensor | None, one_document: int | None) -> tuple[int, torch.Tensor | None]:
    """(first stored key, doc_start) of a whole chunk's attention: a chunk in one document is an unpacked
    chunk over the keys from the document's start."""
    return (0, doc_start) if one_document is None else (one_document, None)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    store: LayerStore,
    start: int,
    scale: float,
    doc_start: torch.Tensor | None = None,
    one_document: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (B, H_q, T, D_v) in q's dtype and lse (B, H_q, T) in float32 (natural log)."""
    past_lo, doc_start = _documents(doc_start, one_document)
    out, lse = forward_state(q, k, v, store, past_lo, start, scale, chunk=True, doc_start=doc_start,
                             chunk_start=start, softcap=softcap)
    return out.to(q.dtype), lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    store: LayerStore,
    start: int,
    scale: float,
    doc_start: torch.Tensor | None = None,
    one_document: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the chunk attention.

    Adds dK, dV of the past tokens [0, start) into the store's gradient pages, and returns
    dq (like q), and dk, dv (like k, v) of the chunk's own tokens: this chunk's share plus what later
    chunks already accumulated for them in the store.
    """
    past_lo, doc_start = _documents(doc_start, one_document)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = backward_part(dout, q, k, v, lse, backward_delta(out, dout), store, past_lo, start, start, scale, True,
                           dq, doc_start, softcap=softcap)
    return dq.to(q.dtype), dk, dv
