"""Triton sparse chunk attention over per-tile page lists, with the contract of :mod:`lightning_oomb.core.sparse`.

Query tile i (``page_size`` queries from the chunk start) of KV head h attends to the past pages
``selection[b, h or 0, i, :]`` (logical page numbers found through the page table; -1 is no page) and
causally to the whole chunk; with packed documents (``doc_start``, None compiles it out) each query sees only
keys from its document's start. Forward and dQ are query-stationary over blocks of one tile, the chunk's own
dK/dV is the dense key-stationary kernel, and the selected pages' dK/dV is page-stationary: one program per
(selected page, KV head) sums every tile that chose it, so no atomics and bit-reproducible gradients.
Soft-capped scores (``softcap``) run in these kernels only (the Gluon ones take none).
docs/architecture.md, "Page-level sparse attention" and "The attention kernels", says how and why.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_blocks import (
    LN2, LOG2E, KernelTiles, Tiles, check_chunk_inputs, dkdv_step, doc_rows, dot_precision, dq_chunk, dq_step,
    fwd_chunk, fwd_step, interpreting, is_sm90, kernel_width, last_dim_contiguous, load_tile, output_like,
    padded_head_dim, pool_descriptors, query_descriptors, query_program, same_layout, score_terms,
    softmax_row_terms, store_tile,
)
from .chunk_attention import default_tiles as dense_tiles
from .chunk_attention import launch_delta, launch_dkdv, launch_dq, launch_forward
from .launch import on_device_of
from .page_table import LayerStore


# --------------------------------------------------------------------------------------------------------
# Forward and dQ (query-stationary)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _query_block(pid, T, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr):
    """(tile index, first query, end of the block's queries) of query block ``pid``."""
    tile = pid // SUB
    m0 = tile * PAGE_SIZE + (pid % SUB) * BLOCK_M
    m_end = tl.minimum(tl.minimum(m0 + BLOCK_M, tile * PAGE_SIZE + PAGE_SIZE), T)
    return tile, m0, m_end


@triton.jit
def _page_block(it, sel, ssel_k, slots, ss_p, kp, vp, kd, vd, hk, sp_page, sp_off, svp_page, svp_off, start, offs_n,
                offs_d, offs_dv, PAGE_SIZE: tl.constexpr, PAGE_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr,
                V_SAME: tl.constexpr, PAGED_TMA: tl.constexpr):
    """K (HEAD_DIM wide), V (V_DIM wide), the row mask and the token positions of key block ``it`` of a tile's page
    list: block it % PAGE_BLOCKS of page ``sel[it // PAGE_BLOCKS]``. Rows at or past ``start`` (the straddling
    page's chunk part) are masked.
    PAGED_TMA (whole pages only, blocks that divide them): bulk copies through the pool descriptors kd, vd
    of KV head hk, and every row is valid; else gathered rows from kp, vp (pointing at head hk)."""
    page = tl.load(sel + (it // PAGE_BLOCKS) * ssel_k)
    slot = tl.load(slots + page * ss_p)
    n0 = (it % PAGE_BLOCKS) * BLOCK_N
    tok = page * PAGE_SIZE + n0 + offs_n
    if PAGED_TMA:
        k = kd.load([slot * PAGE_SIZE + n0, hk, 0]).reshape(BLOCK_N, D_PAD)
        v = vd.load([slot * PAGE_SIZE + n0, hk, 0]).reshape(BLOCK_N, V_PAD)
        valid = offs_n >= 0
    else:
        valid = (n0 + offs_n < PAGE_SIZE) & (tok < start)
        rows = slot.to(tl.int64) * sp_page + (n0 + offs_n) * sp_off
        if V_SAME:
            v_rows = rows
        else:
            v_rows = slot.to(tl.int64) * svp_page + (n0 + offs_n) * svp_off
        k = load_tile(kp + rows[:, None] + offs_d[None, :], valid, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(vp + v_rows[:, None] + offs_dv[None, :], valid, offs_dv, V_DIM, V_PAD)
    return k, v, valid, tok


@triton.jit
def _first_page(sel, ssel_k, n_sel, BLOCK: tl.constexpr):
    """How many entries of a page list are -1 (no page; sorted first): the index of its first page."""
    n = tl.full([], 0, tl.int32)
    for j0 in range(0, n_sel, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        n += tl.sum((tl.load(sel + j * ssel_k, mask=j < n_sel, other=0) < 0).to(tl.int32), 0)
    return n


@triton.jit
def _document_rows(DOC, b, T, m0, offs_m, m_valid, sel, ssel_k, n_sel, BLOCK_M: tl.constexpr,
                   PAGE_BLOCKS: tl.constexpr):
    """Packed documents, for a query block of the forward or dQ: (key_lo, doc_first, doc_last) of ``doc_rows``
    and the first key block of the tile's page list, past its -1 entries (no page). Keys before a row's
    document start are masked for it, so a row may see no past key: fwd_step's and dq_step's masks keep its
    m_i = -inf state. (The last tile's blocks may start past T: their first row is read at T - 1, in bounds.)"""
    key_lo, doc_first, doc_last = doc_rows(DOC, b, T, tl.minimum(m0, T - 1), offs_m, m_valid, BLOCK_M)
    return key_lo, doc_first, doc_last, _first_page(sel, ssel_k, n_sel, 64) * PAGE_BLOCKS


@triton.jit
def _sparse_fwd_kernel(
    Q, K, V, KP, VP, KD, VD, SLOTS, SEL, OUT, LSE, DOC,
    sq_b, sq_h, sq_t,
    sk_b, sk_h, sk_t,
    sv_b, sv_h, sv_t,
    sp_page, sp_off, sp_h,
    svp_page, svp_off, svp_h,
    ss_b, ss_p,
    ssel_b, ssel_h, ssel_i, ssel_k,
    so_b, so_h, so_t,
    T, start, n_sel, qk_scale, softcap,
    H_Q: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, SUB: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, V_SAME: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PAGE_BLOCKS: tl.constexpr, PAGED_TMA: tl.constexpr,
):
    # Queries and keys HEAD_DIM wide, values and the output V_DIM (sp_*, svp_*: the K and V pools' strides; V_SAME:
    # the V pool has the K pool's width and strides).
    tile, m0, m_end = _query_block(tl.program_id(0), T, PAGE_SIZE, BLOCK_M, SUB)
    bh, b, h, hk, offs_m, offs_n, offs_d, m_valid, q = query_program(Q, sq_b, sq_h, sq_t, m0, m_end, H_Q, GROUP,
                                                                     HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N)
    if V_SAME:  # values laid out as keys: the keys' offsets, so that one width compiles as it always did
        offs_dv = offs_d
        svp_page, svp_off, svp_h = sp_page, sp_off, sp_h
    else:
        offs_dv = tl.arange(0, V_PAD)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)

    # The tile's selected past pages, one key block after another in ONE loop (so that Triton's pipeliner
    # overlaps the next block's page lookup and loads with this block's math). The first page's first block
    # holds a past row, so m_i turns finite on it and no row sees exp(-inf + inf).
    sel = SEL + b * ssel_b + hk * ssel_h + tile * ssel_i
    kp = KP + hk * sp_h
    vp = VP + hk * svp_h
    first_it = 0
    key_lo = None
    doc_first = 0
    doc_last = 0
    if DOC is not None:
        key_lo, doc_first, doc_last, first_it = _document_rows(DOC, b, T, m0, offs_m, m_valid, sel, ssel_k, n_sel,
                                                               BLOCK_M, PAGE_BLOCKS)
    for it in range(first_it, n_sel * PAGE_BLOCKS):
        k, v, valid, tok = _page_block(it, sel, ssel_k, SLOTS + b * ss_b, ss_p, kp, vp, KD, VD, hk, sp_page,
                                       sp_off, svp_page, svp_off, start, offs_n, offs_d, offs_dv, PAGE_SIZE,
                                       PAGE_BLOCKS, BLOCK_N, HEAD_DIM, D_PAD, V_DIM, V_PAD, V_SAME, PAGED_TMA)
        if DOC is not None:
            seen = valid[None, :] & (tok[None, :] >= key_lo[:, None])
            acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, seen, PRECISION, softcap)
        elif PAGED_TMA:
            acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, None, PRECISION, softcap)
        else:
            acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, valid[None, :], PRECISION, softcap)

    # The chunk, causally, as the dense kernel (document starts counted from the chunk start).
    if DOC is not None:
        key_lo, doc_first, doc_last = key_lo - start, doc_first - start, doc_last - start
    acc, m_i, l_i = fwd_chunk(acc, m_i, l_i, q, K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, sk_t, sv_t,
                               m0, m_end, T, offs_m, offs_n, offs_d, offs_dv, qk_scale, key_lo, doc_first, doc_last,
                               HEAD_DIM, D_PAD, V_DIM, V_PAD, BLOCK_N, PRECISION, softcap)

    out = acc / l_i[:, None]
    store_tile(OUT + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_dv[None, :],
                out.to(OUT.dtype.element_ty), m_valid, offs_dv, V_DIM, V_PAD)
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, (m_i + tl.math.log2(l_i)) * LN2, mask=m_valid)


@triton.jit
def _sparse_dq_kernel(
    Q, K, V, DO, LSE, DELTA, KP, VP, KD, VD, SLOTS, SEL, DQ, DOC,
    sq_b, sq_h, sq_t,
    sk_b, sk_h, sk_t,
    sv_b, sv_h, sv_t,
    sdo_b, sdo_h, sdo_t,
    sp_page, sp_off, sp_h,
    svp_page, svp_off, svp_h,
    ss_b, ss_p,
    ssel_b, ssel_h, ssel_i, ssel_k,
    sdq_b, sdq_h, sdq_t,
    T, start, n_sel, qk_scale, scale, softcap,
    H_Q: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, SUB: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, V_SAME: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PAGE_BLOCKS: tl.constexpr, PAGED_TMA: tl.constexpr,
):
    # Q, K and dQ HEAD_DIM wide, V and dO V_DIM.
    tile, m0, m_end = _query_block(tl.program_id(0), T, PAGE_SIZE, BLOCK_M, SUB)
    bh, b, h, hk, offs_m, offs_n, offs_d, m_valid, q = query_program(Q, sq_b, sq_h, sq_t, m0, m_end, H_Q, GROUP,
                                                                     HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N)
    if V_SAME:  # values laid out as keys: the keys' offsets, so that one width compiles as it always did
        offs_dv = offs_d
        svp_page, svp_off, svp_h = sp_page, sp_off, sp_h
    else:
        offs_dv = tl.arange(0, V_PAD)
    # The same loads as chunk_attention._dq_kernel's, kept inline in both: as one jit helper they give the same
    # PTX but another ptxas schedule for the dense dQ's sm_90 build with packed documents (performance-critical).
    do = load_tile(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_t + offs_dv[None, :], m_valid, offs_dv,
                    V_DIM, V_PAD)
    lse2 = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=m_valid, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=m_valid, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    sel = SEL + b * ssel_b + hk * ssel_h + tile * ssel_i
    kp = KP + hk * sp_h
    vp = VP + hk * svp_h
    first_it = 0
    key_lo = None
    doc_first = 0
    doc_last = 0
    if DOC is not None:
        key_lo, doc_first, doc_last, first_it = _document_rows(DOC, b, T, m0, offs_m, m_valid, sel, ssel_k, n_sel,
                                                               BLOCK_M, PAGE_BLOCKS)
    for it in range(first_it, n_sel * PAGE_BLOCKS):
        k, v, valid, tok = _page_block(it, sel, ssel_k, SLOTS + b * ss_b, ss_p, kp, vp, KD, VD, hk, sp_page,
                                       sp_off, svp_page, svp_off, start, offs_n, offs_d, offs_dv, PAGE_SIZE,
                                       PAGE_BLOCKS, BLOCK_N, HEAD_DIM, D_PAD, V_DIM, V_PAD, V_SAME, PAGED_TMA)
        if DOC is not None:
            dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, valid[None, :] & (tok[None, :] >= key_lo[:, None]),
                         PRECISION, softcap)
        elif PAGED_TMA:
            dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, None, PRECISION, softcap)
        else:
            dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, valid[None, :], PRECISION, softcap)

    if DOC is not None:  # as in the forward
        key_lo, doc_first, doc_last = key_lo - start, doc_first - start, doc_last - start
    dq = dq_chunk(dq, q, do, lse2, delta, K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, sk_t, sv_t,
                   m0, m_end, T, offs_m, offs_n, offs_d, offs_dv, qk_scale, key_lo, doc_first, doc_last, HEAD_DIM,
                   D_PAD, V_DIM, V_PAD, BLOCK_N, PRECISION, softcap)

    store_tile(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_t + offs_d[None, :],
                (dq * scale).to(DQ.dtype.element_ty), m_valid, offs_d, HEAD_DIM, D_PAD)


# --------------------------------------------------------------------------------------------------------
# dK/dV of the selected past pages (page-stationary)
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _page_dkdv_kernel(
    Q, DO, LSE2, SDELTA, KP, VP, DKP, DVP, SLOTS, GRAD_SLOTS, PAGES, TILES, TCOUNT, DOC,
    staged_pages, n_bh,
    sq_b, sq_h, sq_t,
    sdo_b, sdo_h, sdo_t,
    sp_page, sp_off, sp_h,
    svp_page, svp_off, svp_h,
    sg_page, sg_off, sg_h,
    sgv_page, sgv_off, sgv_h,
    ss_b, ss_p,
    spg_b, spg_h, spg_i,
    st_b, st_h, st_i, st_j,
    T, start, qk_scale, scale, softcap,
    H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, V_SAME: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, TILE_BLOCKS: tl.constexpr,
    ROWS_TMA: tl.constexpr, STAGED: tl.constexpr, EVEN: tl.constexpr,
):
    # One program per (page list entry, sequence x KV head), entries outermost: every head's longest
    # programs (its first entries) start in the first wave.
    idx = tl.program_id(0) // n_bh
    bh = tl.program_id(0) % n_bh
    b = (bh // H_KV).to(tl.int64)
    hk = bh % H_KV
    count = tl.load(TCOUNT + b * spg_b + hk * spg_h + idx * spg_i)
    page = tl.load(PAGES + b * spg_b + hk * spg_h + idx * spg_i)
    slot = tl.load(SLOTS + b * ss_b + page * ss_p).to(tl.int64)
    # A page nobody chose: no rows, no memory traffic.
    rows_in_page = tl.where(count > 0, tl.minimum(PAGE_SIZE, start - page * PAGE_SIZE), 0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    if V_SAME:  # values laid out as keys: the keys' offsets, so that one width compiles as it always did
        offs_dv = offs_d
    else:
        offs_dv = tl.arange(0, V_PAD)
    tiles = TILES + b * st_b + hk * st_h + idx * st_i
    # LSE2, SDELTA: the row terms of attention_blocks.softmax_row_terms. EVEN: every query tile is a whole page of
    # whole BLOCK_M blocks.
    # K, dK and Q rows are HEAD_DIM wide, V, dV and dO rows V_DIM (sp_/svp_: the K/V pools' strides, sg_/sgv_:
    # the dK/dV pages'; V_SAME: each V tensor has its K tensor's width and strides).
    # STAGED: DKP/DVP are a (B, H_KV, staged_pages, PAGE_SIZE, D or D_v) float32 staging area (sg_h 0) that receives
    # this chunk's share alone; lightning_oomb.kernels.host_pages adds it into host-resident pages later.
    # Otherwise the page's gradient lives in its GRAD_SLOTS slot (a layer moved into dead pages has its own).
    # DOC: None, or the chunk's queries' document starts (B, T) int32: keys before a query's start get no
    # weight from it (a tile chose the page for its earliest document; its later rows may start after it).
    if STAGED:
        g_slot = (b * H_KV + hk) * staged_pages + idx
    else:
        g_slot = tl.load(GRAD_SLOTS + b * ss_b + page * ss_p).to(tl.int64)
    for n0 in range(0, rows_in_page, BLOCK_N):
        valid = n0 + offs_n < rows_in_page
        kv_rows = slot * sp_page + (n0 + offs_n) * sp_off + hk * sp_h
        if V_SAME:
            v_rows = kv_rows
        else:
            v_rows = slot * svp_page + (n0 + offs_n) * svp_off + hk * svp_h
        k = load_tile(KP + kv_rows[:, None] + offs_d[None, :], valid, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(VP + v_rows[:, None] + offs_dv[None, :], valid, offs_dv, V_DIM, V_PAD)
        dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, V_PAD], dtype=tl.float32)
        # (choosing tile, query head of the group, query block of the tile) in ONE loop, so that the
        # pipeliner overlaps the next block's loads with this block's math. A tile shorter than the page
        # (the chunk's last) leaves whole blocks masked: they add exactly 0.
        for it in range(0, count * GROUP * TILE_BLOCKS):
            tile = tl.load(tiles + (it // (GROUP * TILE_BLOCKS)) * st_j)
            h = hk * GROUP + (it // TILE_BLOCKS) % GROUP
            t0 = tile * PAGE_SIZE
            # Rows counted from the tile's first query: dkdv_step's "T" bound is then the tile's end.
            q_src = Q if ROWS_TMA else Q + b * sq_b + h * sq_h + t0 * sq_t
            do_src = DO if ROWS_TMA else DO + b * sdo_b + h * sdo_h + t0 * sdo_t
            lse2_ptr = LSE2 + (b * H_Q + h) * T + t0
            delta_ptr = SDELTA + (b * H_Q + h) * T + t0
            doc_ptr = None
            key_tok = None
            if DOC is not None:
                doc_ptr = DOC + b * T + t0
                key_tok = page * PAGE_SIZE + n0 + offs_n
            m0 = (it % TILE_BLOCKS) * BLOCK_M
            dk, dv = dkdv_step(dk, dv, k, v, q_src, do_src, lse2_ptr, delta_ptr, doc_ptr, key_tok, b, h, t0, m0,
                                offs_n, tl.minimum(PAGE_SIZE, T - t0), sq_t, sdo_t, qk_scale, scale, HEAD_DIM, D_PAD,
                                V_DIM, V_PAD, BLOCK_M, False, PRECISION, ROWS_TMA, EVEN, softcap)
        g_ptrs = (g_slot * sg_page + (n0 + offs_n) * sg_off + hk * sg_h)[:, None] + offs_d[None, :]
        if V_SAME:
            gv_ptrs = g_ptrs
        else:
            gv_ptrs = (g_slot * sgv_page + (n0 + offs_n) * sgv_off + hk * sgv_h)[:, None] + offs_dv[None, :]
        if not STAGED:
            # The stored gradient is added to the chunk's whole share, as the staged path adds them: a page's
            # gradient has the same bits whether its layer's pages live on the GPU or on the host.
            dk += load_tile(DKP + g_ptrs, valid, offs_d, HEAD_DIM, D_PAD).to(tl.float32)
            dv += load_tile(DVP + gv_ptrs, valid, offs_dv, V_DIM, V_PAD).to(tl.float32)
        store_tile(DKP + g_ptrs, dk.to(DKP.dtype.element_ty), valid, offs_d, HEAD_DIM, D_PAD)
        store_tile(DVP + gv_ptrs, dv.to(DVP.dtype.element_ty), valid, offs_dv, V_DIM, V_PAD)


def invert_selection(selection: torch.Tensor, n_kv: int, n_past: int):
    """Per (sequence, KV head): the distinct selected pages, those more query tiles chose first (ties in
    ascending page order), and per page the query tiles that chose it (ascending, first) with their count.
    Torch ops only: no host synchronisation. The order is the page dK/dV kernel's launch order: the sink and
    local pages, which every tile chooses, are its longest programs and must not start last.

    Returns pages (B, H_kv, NP), tiles (B, H_kv, NP, n_tiles), counts (B, H_kv, NP), all int32, with
    NP = min(n_past, n_tiles * K); entries past a (sequence, head)'s distinct pages have count 0. Entries of
    -1 (no page, packed documents) choose nothing.
    """
    b, _, n_tiles, k = selection.shape
    sel = selection.long().expand(b, n_kv, n_tiles, k)
    # -1 lands in an extra column, dropped.
    chosen = torch.zeros(b, n_kv, n_tiles, n_past + 1, dtype=torch.bool, device=selection.device)
    chosen.scatter_(-1, sel % (n_past + 1), True)
    chosen = chosen[..., :n_past].transpose(2, 3)  # (B, H, P, n_tiles)
    n_pages = min(n_past, n_tiles * k)
    counts = chosen.sum(-1)
    pages = torch.argsort(-counts, dim=-1, stable=True)[..., :n_pages]
    per_page = chosen.gather(2, pages[..., None].expand(b, n_kv, n_pages, n_tiles))
    tiles = torch.argsort((~per_page).to(torch.int8), dim=-1, stable=True)
    return pages.int(), tiles.int(), counts.gather(-1, pages).int()


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------


def default_tiles(head_dim: int, dtype: torch.dtype) -> KernelTiles:
    """Forward/dQ: query blocks inside a page tile (BLOCK_M <= a 128-query tile) and key blocks of a page;
    page dK/dV: the dense kernel's key-stationary shape. The chunk's dK/dV use the dense kernel's tiles."""
    if interpreting():
        t = Tiles(16, 16)
        return KernelTiles(t, t, t)
    if dtype == torch.float32:
        return KernelTiles(Tiles(64, 32, 4, 2), Tiles(16, 64, 4, 2), Tiles(64, 32, 4, 2))
    if padded_head_dim(head_dim) > 128:  # as chunk_attention.default_tiles: within shared memory, speed not measured
        return KernelTiles(Tiles(64, 32, 4, 2), Tiles(32, 64, 8, 2), Tiles(128, 32, 8, 2))
    if padded_head_dim(head_dim) > 64:  # measured on an H200 (lightning_oomb.bench.sparse_kernels --sweep)
        return KernelTiles(Tiles(64, 64, 4, 3), Tiles(64, 128, 8, 2), Tiles(128, 128, 8, 2))
    return KernelTiles(Tiles(128, 64, 4, 3), Tiles(32, 128, 8, 3), Tiles(128, 64, 8, 3))


def _check_selection(selection: torch.Tensor, q: torch.Tensor, k: torch.Tensor, store: LayerStore, start: int):
    b, _, t, _ = q.shape
    n_tiles = -(-t // store.page_size)
    n_past = -(-start // store.page_size)
    if (selection.dim() != 4 or selection.shape[0] != b or selection.shape[1] not in (1, k.shape[1])
            or selection.shape[2] != n_tiles or selection.shape[3] > max(n_past, 0)):
        raise ValueError(
            f"selection must be (B={b}, 1 or H_kv={k.shape[1]}, n_tiles={n_tiles}, K<={n_past}), "
            f"got {tuple(selection.shape)}"
        )


def _selection_args(selection: torch.Tensor, n_kv: int):
    sel = selection.to(torch.int32)
    strides = list(sel.stride())
    if sel.shape[1] == 1:
        strides[1] = 0  # one list shared by all KV heads
    return sel, strides


def _whole_page_descriptors(store: LayerStore, start: int, block_n: int) -> tuple | None:
    """The pool descriptors of the dense kernels when every selected page is whole (the chunk starts on a
    page boundary, as it does whenever the chunk size is a multiple of the page size); else None."""
    return pool_descriptors(store, 0, block_n) if start % store.page_size == 0 else None


def _warp_specialized_pages(q: torch.Tensor, store: LayerStore, start: int, selection: torch.Tensor,
                            doc_start: torch.Tensor | None, softcap: float | None = None) -> bool:
    """Whether the warp-specialised kernels run the selected pages (forward and dQ)."""
    if not is_sm90(q) or doc_start is not None or softcap is not None:
        # The Gluon kernels know no documents (nor -1 entries) and no soft cap: those run the kernels here.
        return False
    from . import past_attention_sm90

    return past_attention_sm90.supported_pages(q, store, start, selection)


def _sub_blocks(page_size: int, block_m: int) -> int:
    return triton.cdiv(page_size, block_m)


def _doc_rows(doc_start: torch.Tensor | None) -> torch.Tensor | None:
    """Document starts (B, T) as the kernels index them: int32, one row after the other."""
    return None if doc_start is None else doc_start.to(torch.int32).contiguous()


def _forward(q, k, v, store: LayerStore, start: int, scale: float, selection: torch.Tensor, tiles: Tiles,
             doc_start: torch.Tensor | None, softcap: float | None = None):
    check_chunk_inputs(q, k, v, store, start)
    _check_selection(selection, q, k, store, start)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    b, hq, t, d = q.shape
    dv = v.shape[-1]
    hkv = k.shape[1]
    slots = store.table.slots.to(torch.int32)
    sel, ssel = _selection_args(selection, hkv)
    out = output_like(q, dv)  # laid out like q: see chunk_attention._forward
    lse = torch.empty((b, hq, t), dtype=torch.float32, device=q.device)
    ps = store.page_size
    if _warp_specialized_pages(q, store, start, sel, doc_start, softcap):
        # The chunk's own keys in the dense kernel, then the selected pages in the warp-specialised one,
        # which carries that state on and writes the output.
        from . import past_attention_sm90

        state = output_like(q, dv, torch.float32), lse
        launch_forward(q, k, v, store, start, start, scale, dense_tiles(kernel_width(q, v), q.dtype).fwd, True,
                       *state, carry=False)
        past_attention_sm90.forward_past(q, store, scale, state, out, selection=sel)
        return out, lse
    sub = _sub_blocks(ps, tiles.block_m)
    grid = (triton.cdiv(t, ps) * sub, b * hq)
    descs = _whole_page_descriptors(store, start, tiles.block_n)
    with on_device_of(q):
        _sparse_fwd_kernel[grid](
            q, k, v, store.k, store.v, *(descs or (store.k, store.v)), slots, sel, out, lse, _doc_rows(doc_start),
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            store.k.stride(0), store.k.stride(1), store.k.stride(2),
            store.v.stride(0), store.v.stride(1), store.v.stride(2),
            slots.stride(0), slots.stride(1),
            *ssel,
            out.stride(0), out.stride(1), out.stride(2),
            t, start, sel.shape[-1], *score_terms(scale, softcap),
            H_Q=hq, GROUP=hq // hkv, PAGE_SIZE=ps, SUB=sub, HEAD_DIM=d, D_PAD=padded_head_dim(d), V_DIM=dv,
            V_PAD=padded_head_dim(dv), V_SAME=same_layout((store.k, store.v)), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PRECISION=dot_precision(q.dtype),
            PAGE_BLOCKS=triton.cdiv(ps, tiles.block_n), PAGED_TMA=descs is not None, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return out, lse


def _launch_page_dkdv(dout, q, row_terms, store: LayerStore, slots, inverted, staging, start: int, scale: float,
                      pt: Tiles, doc_rows: torch.Tensor | None, softcap: float | None = None):
    """The Triton page dK/dV kernel over ``inverted`` = invert_selection(...): into the gradient pages (at
    ``store.grad_slots``), or with ``staging`` = (dk, dv) float32 (B, H_kv, entries, PAGE_SIZE, D) into that
    area alone (dV's D_v wide). doc_rows: None, or the queries' document starts (B, T) int32 contiguous;
    softcap: the scores' soft cap, or None."""
    pages, tile_lists, counts = inverted
    b, hq, t, d = q.shape
    dv = dout.shape[-1]
    hkv = store.k.shape[2]
    ps = store.page_size
    rows = query_descriptors(pt.block_m, q, dout)
    grad_slots = store.grad_slots.to(torch.int32)
    if staging is None:
        (dkp, dvp), staged_pages = (store.dk, store.dv), 0
        g_strides = tuple(x.stride(i) for x in (dkp, dvp) for i in range(3))
    else:
        (dkp, dvp), staged_pages = staging, staging[0].shape[2]
        g_strides = tuple(x for g in (dkp, dvp) for x in (g.stride(3) * ps, g.stride(3), 0))
    qk_scale, cap = score_terms(scale, softcap)
    _page_dkdv_kernel[(pages.shape[-1] * b * hkv,)](
        *((q, dout) if rows is None else rows),
        *row_terms, store.k, store.v, dkp, dvp, slots, grad_slots, pages, tile_lists, counts, doc_rows,
        staged_pages, b * hkv,
        q.stride(0), q.stride(1), q.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        store.k.stride(0), store.k.stride(1), store.k.stride(2),
        store.v.stride(0), store.v.stride(1), store.v.stride(2),
        *g_strides,
        slots.stride(0), slots.stride(1),
        pages.stride(0), pages.stride(1), pages.stride(2),
        *tile_lists.stride(),
        t, start, qk_scale, scale, cap,
        H_Q=hq, H_KV=hkv, GROUP=hq // hkv, PAGE_SIZE=ps, HEAD_DIM=d, D_PAD=padded_head_dim(d), V_DIM=dv,
        V_PAD=padded_head_dim(dv), V_SAME=same_layout((store.k, store.v), (dkp, dvp)), BLOCK_M=pt.block_m, BLOCK_N=pt.block_n, PRECISION=dot_precision(q.dtype),
        TILE_BLOCKS=triton.cdiv(ps, pt.block_m), ROWS_TMA=rows is not None, STAGED=staging is not None,
        EVEN=t % ps == 0 and ps % pt.block_m == 0,
        num_warps=pt.num_warps, num_stages=pt.num_stages,
    )


def _backward(dout, q, k, v, out, lse, store: LayerStore, start: int, scale: float, selection: torch.Tensor,
              tiles: KernelTiles, chunk_tiles: KernelTiles, doc_start: torch.Tensor | None,
              softcap: float | None = None):
    check_chunk_inputs(q, k, v, store, start)
    _check_selection(selection, q, k, store, start)
    if store.dk is None or store.dv is None:
        raise ValueError("attention backward needs a page pool built with_grads=True")
    if store.dk.stride(-1) != 1 or store.dv.stride(-1) != 1:
        raise ValueError("store.dk and store.dv must hold contiguous heads")
    q, k, v, out, dout = (last_dim_contiguous(x) for x in (q, k, v, out, dout))
    lse = lse.contiguous()
    b, hq, t, d = q.shape
    dv_width = v.shape[-1]
    hkv = k.shape[1]
    group = hq // hkv
    ps = store.page_size
    slots = store.table.slots.to(torch.int32)
    sel, ssel = _selection_args(selection, hkv)
    precision = dot_precision(q.dtype)
    qk_scale, cap = score_terms(scale, softcap)
    delta = launch_delta(out, dout)
    row_terms = softmax_row_terms(lse, delta, scale)
    dq = torch.empty_like(q)
    n_past = -(-start // ps)
    staging = store.grad_staging
    doc_rows = _doc_rows(doc_start)
    if staging is not None:
        staging.wait_for_layer(store.layer)  # later chunks' shares of this layer are in its host pages
    with on_device_of(q):
        # The chunk's own keys: the dense key-stationary kernel with no past tiles (it starts from the
        # gradient later chunks stored for these tokens).
        dk, dv = launch_dkdv(dout, q, k, v, *row_terms, store, 0, 0, start, scale, chunk_tiles, chunk=True,
                             doc_start=doc_start, softcap=softcap)

        # The selected past pages, page-stationary: each (page, KV head) written by one program.
        warp_specialized = _warp_specialized_pages(q, store, start, sel, doc_start, softcap)
        if warp_specialized:
            from . import past_attention_sm90
        if n_past > 0 and sel.shape[-1] > 0:
            pages, tile_lists, counts = invert_selection(sel, hkv, n_past)
            grads = None if staging is None else staging.buffers(b, hkv, pages.shape[-1], ps, d, dv_width)
            if warp_specialized and past_attention_sm90.rows_ok(q, dout):
                past_attention_sm90.dkdv_past(dout, q, *row_terms, store, scale, pages=(pages, tile_lists, counts),
                                              staging=grads)
            else:
                _launch_page_dkdv(dout, q, row_terms, store, slots, (pages, tile_lists, counts), grads, start,
                                  scale, tiles.dkdv, doc_rows, softcap)
            if staging is not None:
                staging.add_into(store, pages, counts, start)

        if warp_specialized:  # as in _forward
            partial = torch.empty_like(q, dtype=torch.float32)
            launch_dq(dout, q, k, v, lse, delta, store, start, start, scale, chunk_tiles.dq, True, partial,
                       accumulate=False)
            past_attention_sm90.dq_past(dout, q, lse, delta, store, scale, partial, dq, selection=sel)
            return dq, dk, dv
        qt = tiles.dq
        sub = _sub_blocks(ps, qt.block_m)
        descs = _whole_page_descriptors(store, start, qt.block_n)
        _sparse_dq_kernel[(triton.cdiv(t, ps) * sub, b * hq)](
            q, k, v, dout, lse, delta, store.k, store.v, *(descs or (store.k, store.v)), slots, sel, dq, doc_rows,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            store.k.stride(0), store.k.stride(1), store.k.stride(2),
            store.v.stride(0), store.v.stride(1), store.v.stride(2),
            slots.stride(0), slots.stride(1),
            *ssel,
            dq.stride(0), dq.stride(1), dq.stride(2),
            t, start, sel.shape[-1], qk_scale, scale, cap,
            H_Q=hq, GROUP=group, PAGE_SIZE=ps, SUB=sub, HEAD_DIM=d, D_PAD=padded_head_dim(d), V_DIM=dv_width,
            V_PAD=padded_head_dim(dv_width), V_SAME=same_layout((store.k, store.v)), BLOCK_M=qt.block_m, BLOCK_N=qt.block_n, PRECISION=precision,
            PAGE_BLOCKS=triton.cdiv(ps, qt.block_n), PAGED_TMA=descs is not None, num_warps=qt.num_warps,
            num_stages=qt.num_stages,
        )
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------------
# The interface of lightning_oomb.core.attention (sparse backends)
# --------------------------------------------------------------------------------------------------------


def attention_forward(q, k, v, store: LayerStore, start: int, scale: float, selection: torch.Tensor,
                      doc_start: torch.Tensor | None = None, softcap: float | None = None):
    """Sparse chunk attention of q (B, H_q, T, D), k (B, H_kv, T, D), v (B, H_kv, T, D_v): out (B, H_q, T, D_v) in
    q's dtype and lse (B, H_q, T) float32 (natural log). doc_start: None, or (B, T) int32 each query's document
    start (packed documents; earlier keys unseen); softcap: None, or the scores' soft cap, softcap * tanh(q.k *
    scale / softcap)."""
    return _forward(q, k, v, store, start, scale, selection, default_tiles(kernel_width(q, v), q.dtype).fwd,
                    doc_start, softcap)


def attention_backward(dout, q, k, v, out, lse, store: LayerStore, start: int, scale: float, selection: torch.Tensor,
                       doc_start: torch.Tensor | None = None, softcap: float | None = None):
    """dq, and the chunk's dk, dv (its share plus what later chunks stored); adds the selected pages'
    dK, dV into ``store.dk``/``store.dv`` (one program per page and KV head: deterministic). doc_start,
    softcap: as in ``attention_forward``."""
    d = kernel_width(q, v)
    return _backward(dout, q, k, v, out, lse, store, start, scale, selection,
                     default_tiles(d, q.dtype), dense_tiles(d, q.dtype), doc_start, softcap)
