"""Triton chunk attention over the paged KV store, with the contract of :mod:`lightning_oomb.core.reference_attention`.

The queries q (B, H_q, T, D) of the chunk at tokens [start, start + T) attend to the stored past [0, start), read
through the page table, and causally to the chunk's own k (B, H_kv, T, D) and v (B, H_kv, T, D_v); query head h
reads KV head h // (H_q // H_kv), K/V are never repeated; the output is D_v wide (where values are laid out as keys,
V_SAME, the kernels address them with the keys' offsets and compile as for one width). Forward query-stationary;
backward in three launches (delta, key-stationary dK/dV, query-stationary dQ), so that every gradient row has one
writer: no atomics, deterministic. On sm_90 the whole past tiles run in :mod:`.past_attention_sm90`, and these
kernels cover the chunk's own keys and the past's last partial tile. Soft-capped scores (``softcap``) run in these
kernels only (the Gluon ones take none). docs/architecture.md, "The attention kernels", says how.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_blocks import (
    LN2, LOG2E, KernelTiles, Tiles, check_chunk_inputs, dkdv_step, doc_rows, doc_tiles, dot_precision, dq_chunk,
    dq_step, fwd_chunk, fwd_step, interpreting, is_sm90, kernel_width, last_dim_contiguous, load_tile, output_like,
    padded_head_dim, past_tile, pool_descriptors, pool_rows, query_descriptors, query_program, same_layout,
    score_terms, softmax_row_terms, store_tile,
)
from .launch import on_device_of
from .page_table import LayerStore


# --------------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    Q, K, V, KP, VP, KD, VD, SLOTS, OUT, LSE, DOC,
    sq_b, sq_h, sq_t,
    sk_b, sk_h, sk_t,
    sv_b, sv_h, sv_t,
    sp_page, sp_off, sp_h,
    svp_page, svp_off, svp_h,
    ss_b, ss_p,
    so_b, so_h, so_t,
    T, past_lo, past_hi, chunk_start, qk_scale, softcap,
    H_Q: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, V_SAME: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr, CARRY: tl.constexpr,
    PAGED_TMA: tl.constexpr,
):
    # Tiles with the longest causal part first, so the last wave of the grid is the cheapest. Queries and keys
    # are HEAD_DIM wide, values and the output V_DIM (sp_* and svp_* the K and V pools' strides; V_SAME: the V
    # pool has the K pool's width and strides).
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh, b, h, hk, offs_m, offs_n, offs_d, m_valid, q = query_program(Q, sq_b, sq_h, sq_t, m0, T, H_Q, GROUP, HEAD_DIM,
                                                                     D_PAD, BLOCK_M, BLOCK_N)
    if V_SAME:  # values laid out as keys: the keys' offsets, so that one width compiles as it always did
        offs_dv = offs_d
        svp_page, svp_off, svp_h = sp_page, sp_off, sp_h
    else:
        offs_dv = tl.arange(0, V_PAD)

    out_ptrs = OUT + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_dv[None, :]
    lse_ptrs = LSE + bh.to(tl.int64) * T + offs_m
    if CARRY:
        # Continue the softmax of earlier key ranges: (out, lse) is the running state with its sum
        # normalised to 1 at the running max lse (OUT holds it in fp32).
        acc = load_tile(out_ptrs, m_valid, offs_dv, V_DIM, V_PAD).to(tl.float32)
        m_i = tl.load(lse_ptrs, mask=m_valid, other=0.0) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)

    # The stored keys [past_lo, past_hi), all visible: whole tiles unmasked, then at most one partial tile.
    # Packed documents (DOC): tiles before the earliest document start of the query tile are skipped, those
    # straddling a start masked per element.
    slots_b = SLOTS + b * ss_b
    kp = KP + hk * sp_h
    vp = VP + hk * svp_h
    past_whole = past_lo + ((past_hi - past_lo) // BLOCK_N) * BLOCK_N
    whole_lo = past_lo
    key_lo = None
    doc_first = 0
    doc_last = 0
    if DOC is not None:
        key_lo, doc_first, doc_last = doc_rows(DOC, b, T, m0, offs_m, m_valid, BLOCK_M)
        whole_lo, masked_end = doc_tiles(past_lo, doc_first, doc_last, past_whole, BLOCK_N)
        for lo in range(whole_lo, masked_end, BLOCK_N):
            k = past_tile(KD, kp, slots_b, ss_p, lo, offs_n, offs_d, hk, PAGE_SIZE, sp_page, sp_off, HEAD_DIM,
                           D_PAD, BLOCK_N, PAGED_TMA)
            v = past_tile(VD, vp, slots_b, ss_p, lo, offs_n, offs_dv, hk, PAGE_SIZE, svp_page, svp_off, V_DIM,
                           V_PAD, BLOCK_N, PAGED_TMA)
            acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, lo + offs_n[None, :] >= key_lo[:, None],
                                     PRECISION, softcap)
        whole_lo = masked_end
    for lo in range(whole_lo, past_whole, BLOCK_N):
        k = past_tile(KD, kp, slots_b, ss_p, lo, offs_n, offs_d, hk, PAGE_SIZE, sp_page, sp_off, HEAD_DIM, D_PAD,
                       BLOCK_N, PAGED_TMA)
        v = past_tile(VD, vp, slots_b, ss_p, lo, offs_n, offs_dv, hk, PAGE_SIZE, svp_page, svp_off, V_DIM, V_PAD,
                       BLOCK_N, PAGED_TMA)
        acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, None, PRECISION, softcap)
    for lo in range(past_whole, past_hi, BLOCK_N):
        valid = lo + offs_n < past_hi
        rows = pool_rows(slots_b, ss_p, lo + offs_n, valid, PAGE_SIZE, sp_page, sp_off)
        if V_SAME:
            v_rows = rows
        else:
            v_rows = pool_rows(slots_b, ss_p, lo + offs_n, valid, PAGE_SIZE, svp_page, svp_off)
        k = load_tile(kp + rows[:, None] + offs_d[None, :], valid, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(vp + v_rows[:, None] + offs_dv[None, :], valid, offs_dv, V_DIM, V_PAD)
        seen = valid[None, :]
        if DOC is not None:
            seen = seen & (lo + offs_n[None, :] >= key_lo[:, None])
        acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, seen, PRECISION, softcap)

    if CHUNK:
        if DOC is not None:  # the chunk's keys count from its start
            key_lo, doc_first, doc_last = key_lo - chunk_start, doc_first - chunk_start, doc_last - chunk_start
        acc, m_i, l_i = fwd_chunk(acc, m_i, l_i, q, K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, sk_t, sv_t,
                                   m0, tl.minimum(m0 + BLOCK_M, T), T, offs_m, offs_n, offs_d, offs_dv, qk_scale,
                                   key_lo, doc_first, doc_last, HEAD_DIM, D_PAD, V_DIM, V_PAD, BLOCK_N, PRECISION,
                                   softcap)

    out = acc / l_i[:, None]
    store_tile(out_ptrs, out.to(OUT.dtype.element_ty), m_valid, offs_dv, V_DIM, V_PAD)
    tl.store(lse_ptrs, (m_i + tl.math.log2(l_i)) * LN2, mask=m_valid)


# --------------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------------


@triton.jit
def _delta_kernel(
    O, DO, DELTA, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t, T,
    H_Q: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta[b, h, t] = sum_d dO * O, the softmax-backward row term, in fp32."""
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = bh % H_Q
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_valid = offs_m < T
    o = load_tile(O + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :], m_valid, offs_d,
                   HEAD_DIM, D_PAD)
    do = load_tile(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_t + offs_d[None, :], m_valid, offs_d,
                    HEAD_DIM, D_PAD)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=m_valid)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE2, SDELTA, KP, VP, DKP, DVP, SLOTS, GSLOTS, DK, DV, DOC, Q_SEEN,
    sq_b, sq_h, sq_t,
    sk_b, sk_h, sk_t,
    sv_b, sv_h, sv_t,
    sdo_b, sdo_h, sdo_t,
    sp_page, sp_off, sp_h,
    svp_page, svp_off, svp_h,
    sg_page, sg_off, sg_h,
    sgv_page, sgv_off, sgv_h,
    ss_b, ss_p,
    sdk_s, sdk_b, sdk_h, sdk_t,
    sdv_s, sdv_b, sdv_h, sdv_t,
    T, past_lo, past_hi, chunk_start, n_past_tiles, qk_scale, scale, softcap,
    H_Q: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, V_SAME: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    ROWS_TMA: tl.constexpr, EVEN: tl.constexpr,
):
    # LSE2, SDELTA: the row terms of ``softmax_row_terms``. EVEN: T is a multiple of BLOCK_M. K, dK rows are
    # HEAD_DIM wide, V, dV and dO rows V_DIM (sp_/svp_: the K/V pools' strides, sg_/sgv_: dK/dV pages',
    # sdk_/sdv_: the chunk's dK/dV outputs'; V_SAME: each V tensor has its K tensor's width and strides).
    # Program ids [0, n_past_tiles) own past key tiles, the rest the chunk's own: past tiles are seen by
    # every query, so they are the heaviest and go first; chunk tiles get heavier towards the start.
    # With CHUNK_SPLIT > 1 each chunk tile is shared by CHUNK_SPLIT programs, each over GROUP / CHUNK_SPLIT
    # query heads, writing fp32 partial sums to DK/DV[split] (summed by the launcher): more programs,
    # better balanced, when a short past leaves too few key tiles to fill the GPU.
    # Packed documents (DOC: the chunk's queries' document starts, (B, T) int32): Q_SEEN (2, B, tiles) int32
    # holds per key tile how many of the chunk's first queries see its first key / any of its keys (starts
    # only grow along a sequence, so both are prefixes): queries from the second on are skipped, those
    # between masked per element; a past tile no query sees is neither read nor written.
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_KV).to(tl.int64)
    hk = bh % H_KV
    is_past = tile < n_past_tiles
    lo = tl.where(is_past, past_lo + tile * BLOCK_N, (tile - n_past_tiles) // CHUNK_SPLIT * BLOCK_N)
    split = tl.where(is_past, 0, (tile - n_past_tiles) % CHUNK_SPLIT)
    n_heads = tl.where(is_past, GROUP, GROUP // CHUNK_SPLIT)
    offs_n = lo + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    if V_SAME:  # values laid out as keys: the keys' offsets, so that one width compiles as it always did
        offs_dv = offs_d
    else:
        offs_dv = tl.arange(0, V_PAD)
    q_end = T
    if DOC is not None:
        seen = Q_SEEN + b * tl.num_programs(0) + tile
        q_whole = tl.load(seen)
        q_end = tl.load(seen + tl.num_programs(0) * (tl.num_programs(1) // H_KV))
    past_rows = offs_n < tl.where(is_past & (q_end > 0), past_hi, 0)
    chunk_rows = offs_n < tl.where(is_past, 0, T)
    n_valid = past_rows | chunk_rows

    # Page-table rows of these keys' tokens: the past token itself, or the chunk token whose gradient
    # later chunks already accumulated in the store.
    tok = offs_n + tl.where(is_past, 0, chunk_start)
    slot = tl.load(SLOTS + b * ss_b + (tok // PAGE_SIZE) * ss_p, mask=n_valid, other=0).to(tl.int64)
    in_page = tok % PAGE_SIZE
    kv_rows = slot * sp_page + in_page * sp_off + hk * sp_h
    if V_SAME:
        v_rows = kv_rows
    else:
        v_rows = slot * svp_page + in_page * svp_off + hk * svp_h

    # K, V from the pool for a past tile, from the chunk's own k, v otherwise (the other load is all
    # masked off, so it costs no memory traffic).
    chunk_off = b * sk_b + hk * sk_h + offs_n[:, None] * sk_t + offs_d[None, :]
    k = tl.where(is_past,
                 load_tile(KP + kv_rows[:, None] + offs_d[None, :], past_rows, offs_d, HEAD_DIM, D_PAD),
                 load_tile(K + chunk_off, chunk_rows, offs_d, HEAD_DIM, D_PAD))
    chunk_off = b * sv_b + hk * sv_h + offs_n[:, None] * sv_t + offs_dv[None, :]
    v = tl.where(is_past,
                 load_tile(VP + v_rows[:, None] + offs_dv[None, :], past_rows, offs_dv, V_DIM, V_PAD),
                 load_tile(V + chunk_off, chunk_rows, offs_dv, V_DIM, V_PAD))

    # Start from what is already stored for these rows (other chunks' share for past tokens, later
    # chunks' share for the chunk's own): loaded here, while registers are free, rather than after the
    # loop next to two live accumulators. No other program touches these rows: race free. The gradient
    # pages have their own table (GSLOTS: SLOTS itself unless a host layer moved into dead K/V pages).
    gslot = tl.load(GSLOTS + b * ss_b + (tok // PAGE_SIZE) * ss_p, mask=n_valid, other=0).to(tl.int64)
    grad_rows = gslot * sg_page + in_page * sg_off + hk * sg_h
    if V_SAME:
        grad_v_rows = grad_rows
    else:
        grad_v_rows = gslot * sgv_page + in_page * sgv_off + hk * sgv_h
    # (Split chunk tiles start from zero: the launcher adds the stored share once.)
    if CHUNK_SPLIT == 1:
        init_rows = n_valid
    else:
        init_rows = past_rows
    dk = load_tile(DKP + grad_rows[:, None] + offs_d[None, :], init_rows, offs_d, HEAD_DIM, D_PAD).to(tl.float32)
    dv = load_tile(DVP + grad_v_rows[:, None] + offs_dv[None, :], init_rows, offs_dv, V_DIM, V_PAD).to(tl.float32)
    # Queries that see these keys: all of them for a past tile, those at or after `lo` for a chunk tile.
    # From `m_free` on, every query of a tile is at or after the tile's last key: no causal mask there.
    m_begin = tl.where(is_past, 0, (lo // BLOCK_M) * BLOCK_M)
    m_free = tl.where(is_past, 0, tl.cdiv(lo + BLOCK_N - 1, BLOCK_M) * BLOCK_M)
    m_diag_end = tl.minimum(m_free, q_end)
    m_doc = T
    doc_rows = None
    if DOC is not None:  # query tiles wholly before q_whole see every key of this tile, later ones some
        m_doc = tl.maximum(tl.minimum(q_whole // BLOCK_M * BLOCK_M, q_end), m_free)
        doc_rows = DOC + b * T
    for g in range(split * n_heads, (split + 1) * n_heads):
        h = hk * GROUP + g
        q_src = Q if ROWS_TMA else Q + b * sq_b + h * sq_h
        do_src = DO if ROWS_TMA else DO + b * sdo_b + h * sdo_h
        lse2_ptr = LSE2 + (b * H_Q + h) * T
        delta_ptr = SDELTA + (b * H_Q + h) * T
        for m0 in range(m_begin, m_diag_end, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, q_src, do_src, lse2_ptr, delta_ptr, doc_rows, tok, b, h, 0, m0, offs_n,
                                T, sq_t, sdo_t, qk_scale, scale, HEAD_DIM, D_PAD, V_DIM, V_PAD, BLOCK_M, True,
                                PRECISION, ROWS_TMA, EVEN, softcap)
        for m0 in range(m_free, m_doc, BLOCK_M):
            dk, dv = dkdv_step(dk, dv, k, v, q_src, do_src, lse2_ptr, delta_ptr, None, None, b, h, 0, m0, offs_n, T,
                                sq_t, sdo_t, qk_scale, scale, HEAD_DIM, D_PAD, V_DIM, V_PAD, BLOCK_M, False, PRECISION,
                                ROWS_TMA, EVEN, softcap)
        if DOC is not None:
            for m0 in range(m_doc, q_end, BLOCK_M):
                dk, dv = dkdv_step(dk, dv, k, v, q_src, do_src, lse2_ptr, delta_ptr, doc_rows, tok, b, h, 0, m0,
                                    offs_n, T, sq_t, sdo_t, qk_scale, scale, HEAD_DIM, D_PAD, V_DIM, V_PAD, BLOCK_M,
                                    False, PRECISION, ROWS_TMA, EVEN, softcap)

    g_ptrs = grad_rows[:, None] + offs_d[None, :]
    out_off = split * sdk_s + b * sdk_b + hk * sdk_h + offs_n[:, None] * sdk_t + offs_d[None, :]
    if V_SAME:
        gv_ptrs = g_ptrs
        out_v_off = out_off
    else:
        gv_ptrs = grad_v_rows[:, None] + offs_dv[None, :]
        out_v_off = split * sdv_s + b * sdv_b + hk * sdv_h + offs_n[:, None] * sdv_t + offs_dv[None, :]
    store_tile(DKP + g_ptrs, dk.to(DKP.dtype.element_ty), past_rows, offs_d, HEAD_DIM, D_PAD)
    store_tile(DVP + gv_ptrs, dv.to(DVP.dtype.element_ty), past_rows, offs_dv, V_DIM, V_PAD)
    store_tile(DK + out_off, dk.to(DK.dtype.element_ty), chunk_rows, offs_d, HEAD_DIM, D_PAD)
    store_tile(DV + out_v_off, dv.to(DV.dtype.element_ty), chunk_rows, offs_dv, V_DIM, V_PAD)


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DELTA, KP, VP, KD, VD, SLOTS, DQ, DOC,
    sq_b, sq_h, sq_t,
    sk_b, sk_h, sk_t,
    sv_b, sv_h, sv_t,
    sdo_b, sdo_h, sdo_t,
    sp_page, sp_off, sp_h,
    svp_page, svp_off, svp_h,
    ss_b, ss_p,
    sdq_b, sdq_h, sdq_t,
    T, past_lo, past_hi, chunk_start, qk_scale, scale, softcap,
    H_Q: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, V_SAME: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr, ACCUMULATE: tl.constexpr,
    PAGED_TMA: tl.constexpr,
):
    # Q, K and dQ HEAD_DIM wide, V and dO V_DIM (as in _fwd_kernel).
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh, b, h, hk, offs_m, offs_n, offs_d, m_valid, q = query_program(Q, sq_b, sq_h, sq_t, m0, T, H_Q, GROUP, HEAD_DIM,
                                                                     D_PAD, BLOCK_M, BLOCK_N)
    if V_SAME:  # values laid out as keys: the keys' offsets, so that one width compiles as it always did
        offs_dv = offs_d
        svp_page, svp_off, svp_h = sp_page, sp_off, sp_h
    else:
        offs_dv = tl.arange(0, V_PAD)
    # The same loads as sparse_attention._sparse_dq_kernel's, kept inline in both: as one jit helper they give the same
    # PTX but another ptxas schedule for the dense dQ's sm_90 build with packed documents (performance-critical).
    do = load_tile(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_t + offs_dv[None, :], m_valid, offs_dv,
                    V_DIM, V_PAD)
    lse2 = tl.load(LSE + bh.to(tl.int64) * T + offs_m, mask=m_valid, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + bh.to(tl.int64) * T + offs_m, mask=m_valid, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    slots_b = SLOTS + b * ss_b
    kp = KP + hk * sp_h
    vp = VP + hk * svp_h
    past_whole = past_lo + ((past_hi - past_lo) // BLOCK_N) * BLOCK_N
    whole_lo = past_lo
    key_lo = None
    doc_first = 0
    doc_last = 0
    if DOC is not None:  # packed documents: the forward's skipping and masking
        key_lo, doc_first, doc_last = doc_rows(DOC, b, T, m0, offs_m, m_valid, BLOCK_M)
        whole_lo, masked_end = doc_tiles(past_lo, doc_first, doc_last, past_whole, BLOCK_N)
        for lo in range(whole_lo, masked_end, BLOCK_N):
            k = past_tile(KD, kp, slots_b, ss_p, lo, offs_n, offs_d, hk, PAGE_SIZE, sp_page, sp_off, HEAD_DIM,
                           D_PAD, BLOCK_N, PAGED_TMA)
            v = past_tile(VD, vp, slots_b, ss_p, lo, offs_n, offs_dv, hk, PAGE_SIZE, svp_page, svp_off, V_DIM,
                           V_PAD, BLOCK_N, PAGED_TMA)
            dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, lo + offs_n[None, :] >= key_lo[:, None], PRECISION,
                         softcap)
        whole_lo = masked_end
    for lo in range(whole_lo, past_whole, BLOCK_N):
        k = past_tile(KD, kp, slots_b, ss_p, lo, offs_n, offs_d, hk, PAGE_SIZE, sp_page, sp_off, HEAD_DIM, D_PAD,
                       BLOCK_N, PAGED_TMA)
        v = past_tile(VD, vp, slots_b, ss_p, lo, offs_n, offs_dv, hk, PAGE_SIZE, svp_page, svp_off, V_DIM, V_PAD,
                       BLOCK_N, PAGED_TMA)
        dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, None, PRECISION, softcap)
    for lo in range(past_whole, past_hi, BLOCK_N):
        valid = lo + offs_n < past_hi
        rows = pool_rows(slots_b, ss_p, lo + offs_n, valid, PAGE_SIZE, sp_page, sp_off)
        if V_SAME:
            v_rows = rows
        else:
            v_rows = pool_rows(slots_b, ss_p, lo + offs_n, valid, PAGE_SIZE, svp_page, svp_off)
        k = load_tile(kp + rows[:, None] + offs_d[None, :], valid, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(vp + v_rows[:, None] + offs_dv[None, :], valid, offs_dv, V_DIM, V_PAD)
        seen = valid[None, :]
        if DOC is not None:
            seen = seen & (lo + offs_n[None, :] >= key_lo[:, None])
        dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, seen, PRECISION, softcap)

    if CHUNK:
        if DOC is not None:  # the chunk's keys count from its start
            key_lo, doc_first, doc_last = key_lo - chunk_start, doc_first - chunk_start, doc_last - chunk_start
        dq = dq_chunk(dq, q, do, lse2, delta, K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, sk_t, sv_t,
                       m0, tl.minimum(m0 + BLOCK_M, T), T, offs_m, offs_n, offs_d, offs_dv, qk_scale,
                       key_lo, doc_first, doc_last, HEAD_DIM, D_PAD, V_DIM, V_PAD, BLOCK_N, PRECISION,
                       softcap)

    dq_ptrs = DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_t + offs_d[None, :]
    dq = dq * scale
    if ACCUMULATE:  # the sum over key ranges, kept in fp32 by the caller
        dq += load_tile(dq_ptrs, m_valid, offs_d, HEAD_DIM, D_PAD).to(tl.float32)
    store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), m_valid, offs_d, HEAD_DIM, D_PAD)


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------


def default_tiles(head_dim: int, dtype: torch.dtype) -> KernelTiles:
    """Tile shapes per kernel (block_m = query rows, block_n = key rows): 16 x 16 in the interpreter, so that
    small tests cross many tiles and pages; the H200's fastest for 16-bit inputs (docs/architecture.md, "The
    attention kernels"); small tiles of exact products for fp32 inputs, a path for correctness, not speed.
    """
    if interpreting():
        t = Tiles(16, 16)
        return KernelTiles(t, t, t)
    if dtype == torch.float32:
        return KernelTiles(Tiles(64, 32, 4, 2), Tiles(16, 64, 4, 2), Tiles(64, 32, 4, 2))
    if padded_head_dim(head_dim) > 128:
        # Heads padded to 256 (DeepSeek's keys of 192, Gemma 3's of 256): the tiles below overflow sm_90's shared
        # memory there; these fit it (tests/compile_kernels_sm90.py), their speed not measured.
        return KernelTiles(Tiles(128, 64, 8, 2), Tiles(32, 64, 8, 2), Tiles(128, 32, 8, 2))
    if padded_head_dim(head_dim) > 64:  # measured on an H200 (lightning_oomb.bench.kernels --sweep, --chunk-sweep)
        # dQ: on sm_90 this kernel only sees the chunk's own keys (the Gluon kernel takes the past), where
        # 128 x 64 in 3 stages does not spill and beat 128 x 128 in 2 (0.352 against 0.385 ms).
        return KernelTiles(Tiles(128, 128, 8, 3), Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3))
    return KernelTiles(Tiles(128, 64, 4, 3), Tiles(32, 128, 8, 3), Tiles(128, 64, 8, 3))


def _chunk_split(tiles: KernelTiles, past_programs: int, group: int, device: torch.device) -> int:
    """Split the chunk's key tiles over the query heads when the past's tiles cannot fill the GPU."""
    if tiles.chunk_split is not None:
        if group % tiles.chunk_split:
            raise ValueError(f"chunk_split {tiles.chunk_split} must divide the GQA group {group}")
        return tiles.chunk_split
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return group if past_programs < 4 * sms else 1


def launch_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, past_lo: int, past_hi: int,
    scale: float, tiles: Tiles, chunk: bool, out: torch.Tensor, lse: torch.Tensor, carry: bool,
    doc_start: torch.Tensor | None = None, chunk_start: int = 0, softcap: float | None = None,
) -> None:
    """The forward over the stored keys [past_lo, past_hi) and, with ``chunk``, the chunk's own, into out
    (B, H_q, T, D_v) and lse (B, H_q, T) float32; with ``carry`` continuing the state they hold."""
    b, hq, t, d = q.shape
    dv = v.shape[-1]
    slots = store.table.slots.to(torch.int32)
    grid = (triton.cdiv(t, tiles.block_m), b * hq)
    descs = pool_descriptors(store, past_lo, tiles.block_n)
    with on_device_of(q):
        _fwd_kernel[grid](
            q, k, v, store.k, store.v, *(descs or (store.k, store.v)), slots, out, lse, _rows(doc_start),
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            store.k.stride(0), store.k.stride(1), store.k.stride(2),
            store.v.stride(0), store.v.stride(1), store.v.stride(2),
            slots.stride(0), slots.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            t, past_lo, past_hi, chunk_start, *score_terms(scale, softcap),
            H_Q=hq, GROUP=hq // k.shape[1], PAGE_SIZE=store.page_size, HEAD_DIM=d, D_PAD=padded_head_dim(d),
            V_DIM=dv, V_PAD=padded_head_dim(dv), V_SAME=same_layout((store.k, store.v)), BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, PRECISION=dot_precision(q.dtype), CHUNK=chunk, CARRY=carry,
            PAGED_TMA=descs is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )


def _rows(doc_start: torch.Tensor | None) -> torch.Tensor | None:
    """Document starts (B, T) as the kernels index them: int32, one row after the other."""
    return None if doc_start is None else doc_start.to(torch.int32).contiguous()


def _queries_seeing(doc_start: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """(2, B, n) int32: per key tile of tokens [first, last] (each (n,)), how many of the chunk's first
    queries have their document start at or before its first key, and at or before its last (starts grow
    along a sequence: sorted rows, so a search; on the device, no wait for it)."""
    rows = _rows(doc_start)
    keys = torch.stack([first, last]).to(torch.int32)[:, None, :].expand(2, rows.shape[0], -1)
    return torch.stack([torch.searchsorted(rows, keys[i].contiguous(), right=True, out_int32=True)
                        for i in range(2)])


def _check_grads(store: LayerStore) -> None:
    if store.dk is None or store.dv is None:
        raise ValueError("attention backward needs a page pool built with_grads=True")
    if store.dk.stride(-1) != 1 or store.dv.stride(-1) != 1:
        raise ValueError("store.dk and store.dv must hold contiguous heads")


def launch_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO * O) of out, dout (B, H_q, T, D_v): (B, H_q, T) float32."""
    b, hq, t, d = out.shape
    delta = torch.empty((b, hq, t), dtype=torch.float32, device=out.device)
    block = 64 if padded_head_dim(d) <= 64 else 32
    with on_device_of(out):
        _delta_kernel[(triton.cdiv(t, block), b * hq)](
            out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2), t,
            H_Q=hq, HEAD_DIM=d, D_PAD=padded_head_dim(d), BLOCK_M=block,
        )
    return delta


def launch_dkdv(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse2: torch.Tensor,
    sdelta: torch.Tensor, store: LayerStore, past_lo: int, past_hi: int, chunk_start: int, scale: float,
    tiles: KernelTiles, chunk: bool, doc_start: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Key-stationary dK/dV: adds the stored keys [past_lo, past_hi)'s share into store.dk/dv; with
    ``chunk`` also returns the chunk's dk, dv (its share plus the store's rows [chunk_start, chunk_start + T)).
    lse2, sdelta: the chunk's row terms (``softmax_row_terms``); doc_start: the queries' document starts;
    softcap: the scores' soft cap, or None."""
    b, hq, t, d = q.shape
    d_v = v.shape[-1]
    hkv = k.shape[1]
    group = hq // hkv
    slots = store.table.slots.to(torch.int32)
    grad_slots = store.grad_slots.to(torch.int32)
    kt = tiles.dkdv
    n_past_tiles = triton.cdiv(past_hi - past_lo, kt.block_n)
    split = _chunk_split(tiles, n_past_tiles * b * hkv, group, q.device) if chunk else 1
    if not chunk or split == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dk_out, dv_out, s_strides = dk, dv, (0, 0)
    else:
        dk_out = torch.empty((split, *k.shape), dtype=torch.float32, device=k.device)
        dv_out = torch.empty((split, *v.shape), dtype=torch.float32, device=v.device)
        s_strides = dk_out.stride(0), dv_out.stride(0)
    n_chunk_tiles = triton.cdiv(t, kt.block_n) * split if chunk else 0
    if n_past_tiles + n_chunk_tiles == 0:
        return None
    rows = query_descriptors(kt.block_m, q, dout)
    q_seen = None
    if doc_start is not None:
        tile = torch.arange(n_past_tiles + n_chunk_tiles, device=q.device)
        first = torch.where(tile < n_past_tiles, past_lo + tile * kt.block_n,
                            chunk_start + (tile - n_past_tiles) // split * kt.block_n)
        last = torch.where(tile < n_past_tiles, (first + kt.block_n).clamp(max=past_hi),
                           (first + kt.block_n).clamp(max=chunk_start + t)) - 1
        q_seen = _queries_seeing(doc_start, first, last)
    qk_scale, cap = score_terms(scale, softcap)
    with on_device_of(q):
        _dkdv_kernel[(n_past_tiles + n_chunk_tiles, b * hkv)](
            *((q, k, v, dout) if rows is None else (rows[0], k, v, rows[1])),
            lse2, sdelta, store.k, store.v, store.dk, store.dv, slots, grad_slots, dk_out, dv_out, _rows(doc_start),
            q_seen,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            store.k.stride(0), store.k.stride(1), store.k.stride(2),
            store.v.stride(0), store.v.stride(1), store.v.stride(2),
            store.dk.stride(0), store.dk.stride(1), store.dk.stride(2),
            store.dv.stride(0), store.dv.stride(1), store.dv.stride(2),
            slots.stride(0), slots.stride(1),
            s_strides[0], dk_out.stride(-4), dk_out.stride(-3), dk_out.stride(-2),
            s_strides[1], dv_out.stride(-4), dv_out.stride(-3), dv_out.stride(-2),
            t, past_lo, past_hi, chunk_start, n_past_tiles, qk_scale, scale, cap,
            H_Q=hq, H_KV=hkv, GROUP=group, PAGE_SIZE=store.page_size, HEAD_DIM=d, D_PAD=padded_head_dim(d),
            V_DIM=d_v, V_PAD=padded_head_dim(d_v),
            V_SAME=same_layout((store.k, store.v), (store.dk, store.dv), (dk_out, dv_out)), BLOCK_M=kt.block_m,
            BLOCK_N=kt.block_n, CHUNK_SPLIT=split, PRECISION=dot_precision(q.dtype),
            ROWS_TMA=rows is not None, EVEN=t % kt.block_m == 0, num_warps=kt.num_warps, num_stages=kt.num_stages,
        )
    if not chunk:
        return None
    if split > 1:  # partial sums of the chunk's tiles + what later chunks stored: deterministic order
        stored_dk, stored_dv = store.read(chunk_start, chunk_start + t, grads=True)
        dk = (dk_out.sum(0) + stored_dk.float()).to(k.dtype)
        dv = (dv_out.sum(0) + stored_dv.float()).to(v.dtype)
    return dk, dv


def launch_dq(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, store: LayerStore, past_lo: int, past_hi: int, scale: float, tiles: Tiles,
    chunk: bool, dq: torch.Tensor, accumulate: bool, doc_start: torch.Tensor | None = None, chunk_start: int = 0,
    softcap: float | None = None,
) -> None:
    b, hq, t, d = q.shape
    dv = v.shape[-1]
    slots = store.table.slots.to(torch.int32)
    descs = pool_descriptors(store, past_lo, tiles.block_n)
    qk_scale, cap = score_terms(scale, softcap)
    with on_device_of(q):
        _dq_kernel[(triton.cdiv(t, tiles.block_m), b * hq)](
            q, k, v, dout, lse, delta, store.k, store.v, *(descs or (store.k, store.v)), slots, dq, _rows(doc_start),
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            store.k.stride(0), store.k.stride(1), store.k.stride(2),
            store.v.stride(0), store.v.stride(1), store.v.stride(2),
            slots.stride(0), slots.stride(1),
            dq.stride(0), dq.stride(1), dq.stride(2),
            t, past_lo, past_hi, chunk_start, qk_scale, scale, cap,
            H_Q=hq, GROUP=hq // k.shape[1], PAGE_SIZE=store.page_size, HEAD_DIM=d, D_PAD=padded_head_dim(d),
            V_DIM=dv, V_PAD=padded_head_dim(dv), V_SAME=same_layout((store.k, store.v)), BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, PRECISION=dot_precision(q.dtype), CHUNK=chunk,
            ACCUMULATE=accumulate, PAGED_TMA=descs is not None, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )


# --------------------------------------------------------------------------------------------------------
# The interface of lightning_oomb.core.attention (and of its streaming over host pages)
# --------------------------------------------------------------------------------------------------------


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, start: int, scale: float,
    tiles: Tiles, doc_start: torch.Tensor | None = None, one_document: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_chunk_inputs(q, k, v, store, start)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    # Laid out like q (output_like), as dq, dk, dv are in backward: transformers' views of them copy nothing.
    out = output_like(q, v.shape[-1])
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    lo, hi = _warp_specialized_past(q, store, start, doc_start, one_document, softcap)
    if hi:
        # The document's keys before its first whole page, the chunk's own keys and the past's last partial
        # tile first, then the whole past tiles in the warp-specialised kernel, which carries that state on
        # and writes the output.
        from . import past_attention_sm90

        state = output_like(q, v.shape[-1], torch.float32), lse
        head = _head(lo, doc_start, one_document)
        if head:
            launch_forward(q, k, v, store, 0, lo, scale, tiles, False, *state, carry=False, doc_start=doc_start,
                           chunk_start=start)
        launch_forward(q, k, v, store, hi, start, scale, tiles, True, *state, carry=head, doc_start=doc_start,
                       chunk_start=start)
        past_attention_sm90.forward_past(q, store.from_page(lo // store.page_size), scale, state, out,
                                         past_end=hi - lo)
        return out, lse
    launch_forward(q, k, v, store, 0, start, scale, tiles, True, out, lse, carry=False, doc_start=doc_start,
                   chunk_start=start, softcap=softcap)
    return out, lse


def _warp_specialized_past(q: torch.Tensor, store: LayerStore, start: int, doc_start: torch.Tensor | None,
                           one_document: int | None = None, softcap: float | None = None) -> tuple[int, int]:
    """The stored keys [lo, hi) that the warp-specialised kernels run, from a page start to a tile end;
    (0, 0) when they run none. They know no documents: with ``doc_start`` they run only a chunk whose queries
    all belong to one document (``one_document``, its start), from the document's first whole page on. Nor
    soft-capped scores: the Triton kernels here run those whole, the same function."""
    if not is_sm90(q) or (doc_start is not None and one_document is None) or softcap is not None:
        return 0, 0
    from . import past_attention_sm90

    lo = 0 if doc_start is None else -(-one_document // store.page_size) * store.page_size
    hi = start - start % past_attention_sm90.BLOCK_N
    return (lo, hi) if hi > lo and past_attention_sm90.supported(q, store, hi - lo) else (0, 0)


def _warp_specialized_range(q: torch.Tensor, store: LayerStore, past_lo: int, past_hi: int,
                            doc_start: torch.Tensor | None, softcap: float | None) -> int:
    """The end of the whole key tiles from ``past_lo`` on that the warp-specialised kernels run for a call over
    the stored keys [past_lo, past_hi) (a streamed segment), or ``past_lo`` when they run none: on sm_90, with
    no documents and no soft cap, from a page start."""
    if not is_sm90(q) or doc_start is not None or softcap is not None or past_lo % store.page_size:
        return past_lo
    from . import past_attention_sm90

    whole = (past_hi - past_lo) // past_attention_sm90.BLOCK_N * past_attention_sm90.BLOCK_N
    pages = store.from_page(past_lo // store.page_size)
    return past_lo + whole if whole and past_attention_sm90.supported(q, pages, whole) else past_lo


def _head(lo: int, doc_start: torch.Tensor | None, one_document: int | None) -> bool:
    """Whether the chunk's document has keys before ``lo``, the warp-specialised kernels' first page."""
    return doc_start is not None and one_document < lo


def _backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, store: LayerStore, start: int, scale: float, tiles: KernelTiles,
    doc_start: torch.Tensor | None = None, one_document: int | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_chunk_inputs(q, k, v, store, start)
    _check_grads(store)
    q, k, v, out, dout = (last_dim_contiguous(x) for x in (q, k, v, out, dout))
    lse = lse.contiguous()
    delta = launch_delta(out, dout)
    row_terms = softmax_row_terms(lse, delta, scale)
    dq = torch.empty_like(q)  # laid out like q, as out in _forward
    lo, hi = _warp_specialized_past(q, store, start, doc_start, one_document, softcap)
    if not hi:
        dk, dv = launch_dkdv(dout, q, k, v, *row_terms, store, 0, start, start, scale, tiles, chunk=True,
                             doc_start=doc_start, softcap=softcap)
        launch_dq(dout, q, k, v, lse, delta, store, 0, start, scale, tiles.dq, True, dq, accumulate=False,
                  doc_start=doc_start, chunk_start=start, softcap=softcap)
        return dq, dk, dv
    # As in _forward: the whole past tiles in the warp-specialised kernels, the document's keys before them,
    # the chunk and the past's partial tile here (dK/dV: disjoint rows; dQ: a partial sum that the Gluon
    # kernel continues).
    from . import past_attention_sm90

    pages = store.from_page(lo // store.page_size)
    head = _head(lo, doc_start, one_document)
    dkdv_from = 0
    if past_attention_sm90.rows_ok(q, dout):
        past_attention_sm90.dkdv_past(dout, q, *row_terms, pages, scale, past_end=hi - lo)
        if head:
            launch_dkdv(dout, q, k, v, *row_terms, store, 0, lo, start, scale, tiles, chunk=False, doc_start=doc_start)
        dkdv_from = hi
    dk, dv = launch_dkdv(dout, q, k, v, *row_terms, store, dkdv_from, start, start, scale, tiles, chunk=True,
                         doc_start=doc_start)
    partial = torch.empty_like(q, dtype=torch.float32)
    if head:
        launch_dq(dout, q, k, v, lse, delta, store, 0, lo, scale, tiles.dq, False, partial, accumulate=False,
                  doc_start=doc_start, chunk_start=start)
    launch_dq(dout, q, k, v, lse, delta, store, hi, start, scale, tiles.dq, True, partial, accumulate=head,
              doc_start=doc_start, chunk_start=start)
    past_attention_sm90.dq_past(dout, q, lse, delta, pages, scale, partial, dq, past_end=hi - lo)
    return dq, dk, dv


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, start: int, scale: float,
    doc_start: torch.Tensor | None = None, one_document: int | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H_q, T, D), k (B, H_kv, T, D), v (B, H_kv, T, D_v) at tokens [start, start + T) over the stored past
    [0, start);
    doc_start: None, or (B, T) int32 each query's document start (earlier keys unseen); one_document: None,
    or the host int doc_start holds everywhere (then the Hopper kernels can take the document's past);
    softcap: None, or the scores' soft cap, softcap * tanh(q.k * scale / softcap).

    Returns out (B, H_q, T, D_v) in q's dtype and lse (B, H_q, T) float32 (natural log).
    """
    return _forward(q, k, v, store, start, scale, default_tiles(kernel_width(q, v), q.dtype).fwd, doc_start,
                    one_document, softcap)


def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, store: LayerStore, start: int, scale: float, doc_start: torch.Tensor | None = None,
    one_document: int | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dq (like q) and the chunk's dk, dv (like k, v): its own share plus what later chunks stored.

    Adds the past's dK, dV (tokens [0, start)) into ``store.dk``/``store.dv`` in place. doc_start,
    one_document, softcap: as in ``attention_forward``.
    """
    return _backward(dout, q, k, v, out, lse, store, start, scale, default_tiles(kernel_width(q, v), q.dtype),
                     doc_start, one_document, softcap)


def forward_state(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, past_lo: int, past_hi: int,
    scale: float, chunk: bool, state: tuple[torch.Tensor, torch.Tensor] | None = None,
    doc_start: torch.Tensor | None = None, chunk_start: int = 0, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend q to the stored keys [past_lo, past_hi) and, with ``chunk``, causally to k, v, continuing the
    online softmax ``state`` = (out (B, H_q, T, D_v) float32, lse (B, H_q, T) float32), updated in place;
    None starts a new one; doc_start: None, or (B, T) int32 each query's document start, the chunk being at
    tokens [chunk_start, chunk_start + T); softcap: as in ``attention_forward``. Returns the state."""
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    carry = state is not None
    if not carry:
        state = (output_like(q, v.shape[-1], torch.float32),
                 torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))
    tiles = default_tiles(kernel_width(q, v), q.dtype).fwd
    mid = _warp_specialized_range(q, store, past_lo, past_hi, doc_start, softcap) if carry else past_lo
    if mid < past_hi or chunk or not carry:
        launch_forward(q, k, v, store, mid, past_hi, scale, tiles, chunk, *state, carry=carry, doc_start=doc_start,
                       chunk_start=chunk_start, softcap=softcap)
    if mid > past_lo:
        # The whole tiles last: the warp-specialised kernel continues the state and writes it back normalised,
        # in place (each program reads its rows before it writes them).
        from . import past_attention_sm90

        past_attention_sm90.forward_past(q, store.from_page(past_lo // store.page_size), scale, state, state[0],
                                         past_end=mid - past_lo)
    return state


def backward_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O): (B, H_q, T) float32, shared by every key range of one chunk's backward."""
    return launch_delta(last_dim_contiguous(out), last_dim_contiguous(dout))


def backward_part(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
    delta: torch.Tensor, store: LayerStore, past_lo: int, past_hi: int, chunk_start: int, scale: float,
    chunk: bool, dq: torch.Tensor, doc_start: torch.Tensor | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Gradients through the stored keys [past_lo, past_hi) (added into store.dk/dv) and, with ``chunk``,
    the chunk's own (returned, plus the store's rows [chunk_start, chunk_start + T)); dQ of those keys is
    added into dq (B, H_q, T, D) float32. doc_start, softcap: as in ``forward_state``."""
    _check_grads(store)
    q, k, v, dout = (last_dim_contiguous(x) for x in (q, k, v, dout))
    tiles = default_tiles(kernel_width(q, v), q.dtype)
    lse = lse.contiguous()
    row_terms = softmax_row_terms(lse, delta, scale)
    mid = _warp_specialized_range(q, store, past_lo, past_hi, doc_start, softcap)
    if mid == past_lo:
        grads = launch_dkdv(dout, q, k, v, *row_terms, store, past_lo, past_hi, chunk_start, scale, tiles, chunk,
                            doc_start, softcap)
        launch_dq(dout, q, k, v, lse, delta, store, past_lo, past_hi, scale, tiles.dq, chunk, dq, accumulate=True,
                  doc_start=doc_start, chunk_start=chunk_start, softcap=softcap)
        return grads
    # The whole tiles [past_lo, mid) in the warp-specialised kernels (dK/dV: disjoint rows; dQ: added to dq in
    # place, after the Triton kernel's share of the rest), the partial tile and the chunk's own keys here.
    from . import past_attention_sm90

    pages = store.from_page(past_lo // store.page_size)
    dkdv_from = past_lo
    if past_attention_sm90.rows_ok(q, dout):
        past_attention_sm90.dkdv_past(dout, q, *row_terms, pages, scale, past_end=mid - past_lo)
        dkdv_from = mid
    grads = None
    if dkdv_from < past_hi or chunk:
        grads = launch_dkdv(dout, q, k, v, *row_terms, store, dkdv_from, past_hi, chunk_start, scale, tiles, chunk,
                            doc_start, softcap)
    if mid < past_hi or chunk:
        launch_dq(dout, q, k, v, lse, delta, store, mid, past_hi, scale, tiles.dq, chunk, dq, accumulate=True,
                  doc_start=doc_start, chunk_start=chunk_start, softcap=softcap)
    past_attention_sm90.dq_past(dout, q, lse, delta, pages, scale, dq, dq, past_end=mid - past_lo)
    return grads
