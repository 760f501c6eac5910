"""Page-level sparse attention: page summaries, the selection, and the plain-PyTorch reference.

Each query tile (``page_size`` queries from the chunk start) attends causally to the whole chunk and to the
past pages its selection names: all of them up to ``budget_pages``, else the sink pages, the local pages and
the top-scored others, per (query tile, KV head) or shared by the heads; scores compare the tile's mean query
with per-page key summaries ("mean": the page's mean key; "minmax": Quest's bound from its element-wise min
and max). A selection is an int32 tensor (B, H_sel, n_tiles, K) of logical page numbers, sorted ascending, -1
for no page (packed documents). ``attention_forward`` / ``attention_backward`` are the oracle of
``kernels.sparse_attention``. docs/architecture.md, "Page-level sparse attention", has the rest.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.page_table import LayerStore, gather_rows, scatter_rows
from .config import SparseConfig
from .reference_attention import capped_scores


# == page summaries ==========================================================================================


def update_summaries(store: LayerStore, summaries: tuple[torch.Tensor, ...], score: str, start: int, end: int) -> None:
    """Recompute the key summaries of the pages that tokens [start, end) touch, from the store's K.

    ``summaries`` are this layer's (num_pages, n_kv_heads, D) tensors: (mean,) in float32, or (min, max).
    A page's summary covers its tokens below ``end``: after a chunk is written, the straddling page's
    summary is that of its past part, which is what the next chunk selects from.
    """
    ps = store.page_size
    p0, p1 = start // ps, -(-end // ps)
    k, _ = store.read(p0 * ps, end)  # (B, H, n, D)
    b, h, n, d = k.shape
    pad = (p1 - p0) * ps - n
    k = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(b, h, p1 - p0, ps, d)
    valid = (torch.arange((p1 - p0) * ps, device=k.device) < n).view(1, 1, p1 - p0, ps, 1)
    slots = store.table.slots[:, p0:p1].long()  # (B, pages)
    if score == "mean":
        count = valid.sum(3).clamp_min(1)
        mean = (k * valid).sum(3) / count  # (B, H, pages, D)
        scatter_rows(summaries[0], slots, mean.transpose(1, 2).to(summaries[0].dtype))
    else:
        lo = k.masked_fill(~valid, float("inf")).amin(3)
        hi = k.masked_fill(~valid, float("-inf")).amax(3)
        scatter_rows(summaries[0], slots, lo.transpose(1, 2).to(summaries[0].dtype))
        scatter_rows(summaries[1], slots, hi.transpose(1, 2).to(summaries[1].dtype))


def summary_shapes(score: str) -> int:
    """Number of (num_pages, n_kv_heads, D) summary tensors per layer a score needs."""
    return 1 if score == "mean" else 2


# == selection ==============================================================================================


def tile_queries(q: torch.Tensor, page_size: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Mean query of each tile: q (B, H_q, T, D) -> (B, H_q, n_tiles, D) in float32; with ``rows`` (B, T)
    bool, the mean over the rows it marks (a tile without any: zeros)."""
    b, hq, t, d = q.shape
    n = -(-t // page_size)
    pad = n * page_size - t
    if rows is not None:
        weights = torch.nn.functional.pad(rows.float(), (0, pad)).view(b, 1, n, page_size, 1)
        padded = torch.nn.functional.pad(q.float(), (0, 0, 0, pad)).view(b, hq, n, page_size, d)
        return (padded * weights).sum(3) / weights.sum(3).clamp_min(1)
    padded = torch.nn.functional.pad(q.float(), (0, 0, 0, pad)).view(b, hq, n, page_size, d)
    # Rows per tile, the last one partial; built on the device (writing a Python number into a CUDA tensor
    # would make the host wait, once per layer and chunk).
    counts = (t - page_size * torch.arange(n, device=q.device)).clamp(max=page_size).float()
    return padded.sum(3) / counts[:, None]


def page_scores(
    q: torch.Tensor, store: LayerStore, summaries: tuple[torch.Tensor, ...], config: SparseConfig, start: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores (B, H_sel, n_tiles, P) of every past page for every query tile (from the mean of its ``rows``,
    (B, T) bool, when given: ``tile_queries``)."""
    ps = store.page_size
    n_past = -(-start // ps)
    b, hq, t, d = q.shape
    h = summaries[0].shape[1]
    qbar = tile_queries(q, ps, rows).view(b, h, hq // h, -1, d).mean(2)  # (B, H_kv, n_tiles, D)
    slots = store.table.slots[:, :n_past].long()  # (B, P)
    if config.score == "mean":
        kbar = gather_rows(summaries[0], slots).float().transpose(1, 2)  # (B, H_kv, P, D)
        scores = torch.einsum("bhnd,bhpd->bhnp", qbar, kbar)
    else:
        lo = gather_rows(summaries[0], slots).float().transpose(1, 2)
        hi = gather_rows(summaries[1], slots).float().transpose(1, 2)
        scores = torch.einsum("bhnd,bhpd->bhnp", qbar.clamp_min(0), hi) + torch.einsum(
            "bhnd,bhpd->bhnp", qbar.clamp_max(0), lo
        )
    if not config.per_kv_head:
        scores = scores.mean(1, keepdim=True)
    return scores


def select_pages(
    q: torch.Tensor, store: LayerStore, summaries: tuple[torch.Tensor, ...], config: SparseConfig, start: int,
    doc_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """The selection (B, H_sel, n_tiles, K) int32 of the chunk at [start, start + T) (docs/architecture.md,
    "Page-level sparse attention"; ties resolved by torch.topk, then sorted ascending).

    doc_start: None, or (B, T) int32 each query's first visible key (packed documents' starts, sliding
    windows): a tile then selects among the past pages from that of its earliest first key on, and entries it
    cannot fill are -1. With ``config.per_query_tile`` False one selection, made for the chunk's mean query
    among the pages its first query may see, serves every tile (each query's kernel masks the keys before its
    own first key); None (a SparseConfig that no ChunkConfig has decided) selects per tile, as a step with
    its pages on the GPU does."""
    ps = store.page_size
    if config.per_query_tile is False:
        n_tiles = -(-q.shape[2] // ps)
        # The chunk's mean query as one tile of all its rows: the mean of the tiles' means, weighted by rows.
        whole = q.float().mean(2, keepdim=True).expand(-1, -1, ps, -1)
        first = None if doc_start is None else doc_start[:, :1].expand(-1, ps)
        one = select_pages(whole, store, summaries, dataclasses.replace(config, per_query_tile=True), start, first)
        return one.expand(-1, -1, n_tiles, -1)  # a view: stage 2 keeps one list per chunk, not per tile
    n_past = -(-start // ps)
    b, hq, t, _ = q.shape
    n_tiles = -(-t // ps)
    h_sel = summaries[0].shape[1] if config.per_kv_head else 1
    device = q.device
    if doc_start is not None:
        return _select_in_documents(q, store, summaries, config, start, doc_start, h_sel)
    if n_past <= config.budget_pages:
        return torch.arange(n_past, dtype=torch.int32, device=device).expand(b, h_sel, n_tiles, n_past).contiguous()
    scores = page_scores(q, store, summaries, config, start)
    # n_past > budget >= sink + local: the sink and local ranges are disjoint, known here without asking the
    # GPU (a host sync per layer and chunk would leave the GPU idle while Python catches up).
    local_start = n_past - config.local_pages
    always = torch.cat([
        torch.arange(config.sink_pages, dtype=torch.int32, device=device),
        torch.arange(local_start, n_past, dtype=torch.int32, device=device),
    ])
    always = always.expand(b, h_sel, n_tiles, always.numel())
    top = config.budget_pages - config.sink_pages - config.local_pages
    if top == 0:
        return always.contiguous()
    forced = torch.zeros(n_past, dtype=torch.bool, device=device)
    forced[: config.sink_pages] = True
    forced[local_start:] = True
    chosen = scores.masked_fill(forced, float("-inf")).topk(top, dim=-1).indices.to(torch.int32)
    return torch.cat([always, chosen], dim=-1).sort(dim=-1).values.contiguous()


def _select_in_documents(
    q: torch.Tensor, store: LayerStore, summaries: tuple[torch.Tensor, ...], config: SparseConfig, start: int,
    doc_start: torch.Tensor, h_sel: int,
) -> torch.Tensor:
    """``select_pages`` over packed documents, per tile on the device (no host sync): the pages a tile may see
    are [first, P) with first the page of its earliest document start (its first row's: starts only grow),
    none when that start is in the chunk. A tile that sees at most K of them takes them all, its other entries
    -1 (sorted first); else its sink pages are the first ``sink_pages`` of [first, P), its local pages the
    last ``local_pages``, and the top-scored of the pages between."""
    ps = store.page_size
    n_past = -(-start // ps)
    b, _, t, _ = q.shape
    k = min(n_past, config.budget_pages)
    device = q.device
    earliest = doc_start[:, ::ps].long()  # (B, n_tiles)
    first = torch.where(earliest < start, earliest // ps, n_past)[:, None, :, None]  # (B, 1, n_tiles, 1)
    # Seeing at most K pages: the last K pages, of which those before `first` are no page.
    last_k = torch.arange(n_past - k, n_past, device=device)
    dense = torch.where(last_k >= first, last_k, -1)
    if n_past <= config.budget_pages:
        return dense.expand(b, h_sel, -1, k).to(torch.int32).contiguous()
    # Rows of a document that starts inside the chunk see no past page: the tile's score leaves them out.
    scores = page_scores(q, store, summaries, config, start, rows=doc_start < start)  # (B, H_sel, n_tiles, P)
    page = torch.arange(n_past, device=device)
    # Seeing more than K >= sink + local pages: sink and local ranges are disjoint and inside [first, P).
    local_start = n_past - config.local_pages
    sink = first + torch.arange(config.sink_pages, device=device)
    local = torch.arange(local_start, n_past, device=device).expand(*first.shape[:3], config.local_pages)
    always = torch.cat([sink, local], dim=-1)
    top = config.budget_pages - config.sink_pages - config.local_pages
    if top:
        free = (page >= first + config.sink_pages) & (page < local_start)
        chosen = scores.masked_fill(~free, float("-inf")).topk(top, dim=-1).indices
        sparse = torch.cat([always.expand(b, h_sel, -1, -1), chosen], dim=-1).sort(dim=-1).values
    else:
        sparse = always.expand(b, h_sel, -1, -1)
    sees_all = (n_past - first) <= k
    return torch.where(sees_all, dense, sparse).expand(b, h_sel, -1, k).to(torch.int32).contiguous()


# == reference attention over a selection ===================================================================


def _page_rows(slots: torch.Tensor, pages: torch.Tensor, start: int, ps: int):
    """Pool rows (B, H_kv, K*ps) of the tokens of pages (B, H_kv, K) under page table ``slots``, which of
    them are of a page (not -1) and lie before ``start`` (valid; the others are clamped to a valid row), and
    the tokens (B, H_kv, K*ps)."""
    tok = (pages.long()[..., None] * ps + torch.arange(ps, device=pages.device)).flatten(-2)
    valid = (tok < start) & (tok >= 0)
    tok = tok.clamp(0, start - 1)
    b = torch.arange(pages.shape[0], device=pages.device)[:, None, None]
    return slots[b, tok // ps].long() * ps + tok % ps, valid, tok


def _gather_pages(store: LayerStore, pages: torch.Tensor, start: int):
    """K, V of the selected pages: pages (B, H_kv, K) logical pages -> k (B, H_kv, K*ps, D), v (..., D_v) in float32
    (zero where not valid), valid and the tokens (B, H_kv, K*ps)."""
    rows, valid, tok = _page_rows(store.table.slots, pages, start, store.page_size)
    heads = torch.arange(pages.shape[1], device=pages.device)[None, :, None]
    a, c = store.k, store.v
    ka = a.view(-1, *a.shape[2:])[rows, heads].float()
    va = c.view(-1, *c.shape[2:])[rows, heads].float()
    zero = torch.zeros((), device=ka.device)
    return torch.where(valid[..., None], ka, zero), torch.where(valid[..., None], va, zero), valid, tok


def _tile_keys(q, k, v, store, start, selection, i, doc_start):
    """Keys of query tile i: its selected past pages then the chunk's keys [0, hi), with the mask, and the
    rows of the past pages' gradients. doc_start: None, or (B, T) the queries' document starts (token
    positions): keys before a query's start are masked for it."""
    ps = store.page_size
    t = q.shape[2]
    h = k.shape[1]
    lo, hi = i * ps, min((i + 1) * ps, t)
    if start > 0:
        pages = selection[:, :, i].expand(q.shape[0], h, selection.shape[-1])
        kp, vp, valid, tok = _gather_pages(store, pages, start)
        grad_rows, _, _ = _page_rows(store.grad_slots, pages, start, ps)
    else:
        kp = k.new_zeros(q.shape[0], h, 0, k.shape[-1], dtype=torch.float32)
        vp = v.new_zeros(q.shape[0], h, 0, v.shape[-1], dtype=torch.float32)
        grad_rows = valid = None
        tok = torch.zeros(q.shape[0], h, 0, dtype=torch.long, device=q.device)
    kc, vc = k[:, :, :hi].float(), v[:, :, :hi].float()
    causal = torch.arange(hi, device=q.device)[None, :] <= torch.arange(lo, hi, device=q.device)[:, None]
    past_ok = valid[:, :, None, None, :] if valid is not None else kp.new_ones(1, 1, 1, 1, 0, dtype=torch.bool)
    mask = torch.cat(
        [past_ok.expand(q.shape[0], h, 1, hi - lo, -1), causal.expand(q.shape[0], h, 1, hi - lo, hi)], dim=-1
    )
    if doc_start is not None:
        # Every key's token position against every query's document start: (B, H_kv, 1, rows, keys).
        keys = torch.cat([tok, (start + torch.arange(hi, device=q.device)).expand(q.shape[0], h, hi)], dim=-1)
        mask = mask & (keys[:, :, None, None, :] >= doc_start[:, None, None, lo:hi, None])
    return lo, hi, torch.cat([kp, kc], 2), torch.cat([vp, vc], 2), mask, grad_rows, valid


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, start: int, scale: float,
    selection: torch.Tensor, doc_start: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse chunk attention of q (B, H_q, T, D), k (B, H_kv, T, D), v (B, H_kv, T, D_v): out (B, H_q, T, D_v)
    in q's dtype and lse (B, H_q, T) float32 (natural log). doc_start: None, or (B, T) int32 each query's
    document start (packed documents); softcap: None, or the scores' soft cap, softcap * tanh(q.k * scale /
    softcap)."""
    b, hq, t, d = q.shape
    h = k.shape[1]
    g = hq // h
    qg = q.float().view(b, h, g, t, d)
    out = torch.empty(b, h, g, t, v.shape[-1], device=q.device)
    lse = torch.empty(b, h, g, t, device=q.device)
    for i in range(-(-t // store.page_size)):
        lo, hi, kt, vt, mask, _, _ = _tile_keys(q, k, v, store, start, selection, i, doc_start)
        s, _ = capped_scores(qg[:, :, :, lo:hi], kt, scale, softcap)
        s = s.masked_fill(~mask, float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        out[:, :, :, lo:hi] = torch.einsum("bhgtn,bhnd->bhgtd", p / denom, vt)
        lse[:, :, :, lo:hi] = (m + torch.log(denom)).squeeze(-1)
    return out.view(b, hq, t, -1).to(q.dtype), lse.view(b, hq, t)


def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    store: LayerStore, start: int, scale: float, selection: torch.Tensor, doc_start: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the sparse chunk attention.

    Adds dK, dV of the selected past pages into the store's gradient pages (index_put_ with accumulate: a
    page chosen by several tiles receives the sum), and returns dq, and dk, dv of the chunk's own tokens
    (this chunk's share plus what later chunks stored for them).
    """
    b, hq, t, d = q.shape
    h = k.shape[1]
    g = hq // h
    qg = q.float().view(b, h, g, t, d)
    dog = dout.float().view(b, h, g, t, -1)
    lse_g = lse.view(b, h, g, t)
    delta = (dog * out.float().view(b, h, g, t, -1)).sum(-1)
    dq = torch.zeros_like(qg)
    dk_cur, dv_cur = store.read(start, start + t, grads=True)
    dk_cur, dv_cur = dk_cur.float().clone(), dv_cur.float().clone()
    fdk, fdv = store.dk.view(-1, *store.dk.shape[2:]), store.dv.view(-1, *store.dv.shape[2:])
    heads = torch.arange(h, device=q.device)[None, :, None]
    for i in range(-(-t // store.page_size)):
        lo, hi, kt, vt, mask, rows, valid = _tile_keys(q, k, v, store, start, selection, i, doc_start)
        s, capped = capped_scores(qg[:, :, :, lo:hi], kt, scale, softcap)
        p = torch.exp(s - lse_g[:, :, :, lo:hi, None]).masked_fill(~mask, 0.0)
        do = dog[:, :, :, lo:hi]
        dv_t = torch.einsum("bhgtn,bhgtd->bhnd", p, do)
        ds = p * (torch.einsum("bhgtd,bhnd->bhgtn", do, vt) - delta[:, :, :, lo:hi, None])
        if capped is not None:  # d(softcap * tanh(x / softcap))/dx
            ds = ds * (1.0 - capped * capped)
        dq[:, :, :, lo:hi] = torch.einsum("bhgtn,bhnd->bhgtd", ds, kt) * scale
        dk_t = torch.einsum("bhgtn,bhgtd->bhnd", ds, qg[:, :, :, lo:hi]) * scale
        n_past = kt.shape[2] - hi
        if n_past:
            keep = valid[..., None]
            zero = torch.zeros((), device=q.device)
            idx = (rows.expand(b, h, n_past), heads.expand(b, h, n_past))
            fdk.index_put_(idx, torch.where(keep, dk_t[:, :, :n_past], zero).to(fdk.dtype), accumulate=True)
            fdv.index_put_(idx, torch.where(keep, dv_t[:, :, :n_past], zero).to(fdv.dtype), accumulate=True)
        dk_cur[:, :, :hi] += dk_t[:, :, n_past:]
        dv_cur[:, :, :hi] += dv_t[:, :, n_past:]
    return dq.view(b, hq, t, d).to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype)
