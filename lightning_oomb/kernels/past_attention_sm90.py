"""Hopper forward, dQ and dK/dV over the stored past (or the selected pages), warp-specialised by hand (Gluon).

Each program splits into a load warp, which copies tiles into a ring of shared-memory stages, and two warp
groups of 64 rows on the tensor cores, meeting only at mbarriers: one group's exponentials run while the
other's matmuls do. Forward and dQ continue what :mod:`.chunk_attention` computed over the chunk's own keys;
dK/dV is key-stationary, without atomics. :func:`supported` says when a launch qualifies (whole tiles that
never cross a page, one head dim of 64 or 128 for keys and values, bf16 or fp16, sm_90); docs/architecture.md,
"The attention kernels".
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .page_table import LayerStore

# Gluon is experimental and renames things: Triton 3.6 (the H200's) has ``thread_barrier`` and
# ``tma.async_copy_global_to_shared``, later releases ``barrier`` and ``tma.async_load``.
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_M = 128  # query rows per program: 64 per softmax warp group
BLOCK_N = 128  # key rows per stage
STAGES = 2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@gluon.jit
def _tile_row(SLOTS, slot_row, SEL, sel_row, ssel_k, j, valid, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
              SPARSE: gl.constexpr):
    """Pool row of the first key of past tile j: the stored keys [j * BLOCK_N, (j + 1) * BLOCK_N), or with
    SPARSE the j-th page of the query tile's selection (a tile is a page then)."""
    if SPARSE:
        page = gl.load(SEL + sel_row + j * ssel_k, mask=valid, other=0)
        return gl.load(SLOTS + slot_row + page, mask=valid, other=0) * PAGE_SIZE
    else:
        lo = j * BLOCK_N
        return gl.load(SLOTS + slot_row + lo // PAGE_SIZE, mask=valid, other=0) * PAGE_SIZE + lo % PAGE_SIZE


@gluon.jit
def _load_partition(k_desc, v_desc, SLOTS, slot_row, SEL, sel_row, ssel_k, hk, n_tiles, k_bufs, v_bufs, k_ready,
                    v_ready, kv_free, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, SPARSE: gl.constexpr):
    """Copy the past's key tiles of KV head hk into the stage ring, one after another."""
    col = hk * HEAD_DIM
    next_row = _tile_row(SLOTS, slot_row, SEL, sel_row, ssel_k, 0, True, PAGE_SIZE, BLOCK_N, SPARSE)
    for j in range(n_tiles):
        row = next_row
        # The next tile's page, looked up while this one's copies are in flight.
        next_row = _tile_row(SLOTS, slot_row, SEL, sel_row, ssel_k, j + 1, j + 1 < n_tiles, PAGE_SIZE, BLOCK_N,
                             SPARSE)
        stage = j % STAGES
        # A stage starts free: its first wait (phase 1) passes at once.
        mbarrier.wait(kv_free.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        _tma_load(k_desc, [row, col], k_ready.index(stage), k_bufs.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        _tma_load(v_desc, [row, col], v_ready.index(stage), v_bufs.index(stage))


@gluon.constexpr_function
def _wgmma_layout(n):
    """Accumulator layout of one warp group's 64 x n wgmma (instructions of 16 x n x 16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _rows_to_shared(X, base, rows, cols, stride_t, mask, smem):
    """Rows ``rows`` of a (T, D) matrix at X + base (zero where masked) into smem, where wgmma reads them."""
    smem.store(gl.load(X + base + rows[:, None].to(gl.int64) * stride_t + cols[None, :], mask=mask, other=0.0))


@gluon.jit
def _softmax_partition(Q, OUT, STATE, LSE, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                       q_row, o_row, s_row, lse_row, sq_t, so_t, ss_t, T, m0, n_tiles, qk_scale,
                       HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr):
    """Rows [m0 + 64 * HALF, m0 + 64 * HALF + 64) of one query head: carry the state over every past tile."""
    ROWS: gl.constexpr = 64
    s_mma: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_mma: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, o_mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, o_mma)
    s_row_layout: gl.constexpr = gl.SliceLayout(1, s_mma)

    rows = m0 + HALF * ROWS + gl.arange(0, ROWS, layout=row_layout)
    cols = gl.arange(0, HEAD_DIM, layout=col_layout)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)

    _rows_to_shared(Q, q_row, rows, cols, sq_t, mask, q_smem)  # rows past T read as zero
    fence_async_shared()
    _partition_barrier()

    # The chunk's own keys were attended first: continue their softmax at its max (lse) with sum 1.
    acc = gl.load(STATE + s_row + rows[:, None].to(gl.int64) * ss_t + cols[None, :], mask=mask, other=0.0)
    m_i = gl.load(LSE + lse_row + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    l_i = gl.full([ROWS], 1.0, gl.float32, layout=row_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_mma)

    for j in range(n_tiles):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        k_buf = k_bufs.index(stage)
        v_buf = v_bufs.index(stage)
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s, _, _ = warpgroup_mma_wait(0, deps=(s, q_smem, k_buf))

        m_new = gl.maximum(m_i, gl.convert_layout(gl.max(s, 1), row_layout) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.convert_layout(m_new, s_row_layout)[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.convert_layout(gl.sum(p, 1), row_layout)
        acc = acc * alpha[:, None]
        m_i = m_new

        p = gl.convert_layout(p.to(Q.dtype.element_ty), p_operand)
        mbarrier.wait(v_ready.index(stage), phase)
        acc = warpgroup_mma(p, v_buf, acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=(acc, v_buf))
        mbarrier.arrive(kv_free.index(stage), count=1)

    out = acc / l_i[:, None]
    gl.store(OUT + o_row + rows[:, None].to(gl.int64) * so_t + cols[None, :], out.to(OUT.dtype.element_ty),
             mask=mask)
    gl.store(LSE + lse_row + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


@gluon.jit
def _softmax_partition_upper(Q, OUT, STATE, LSE, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                             q_row, o_row, s_row, lse_row, sq_t, so_t, ss_t, T, m0, n_tiles, qk_scale,
                             HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _softmax_partition(Q, OUT, STATE, LSE, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                       q_row, o_row, s_row, lse_row, sq_t, so_t, ss_t, T, m0, n_tiles, qk_scale,
                       1, HEAD_DIM, BLOCK_N, STAGES)


@gluon.jit
def _program(H_Q: gl.constexpr, GROUP: gl.constexpr):
    """(first query row, sequence, query head, KV head) of this (query tile, sequence x query head) program."""
    bh = gl.program_id(1)
    h = bh % H_Q
    return gl.program_id(0) * 128, (bh // H_Q).to(gl.int64), h, h // GROUP


@gluon.jit
def _kv_ring(k_desc, v_desc, STAGES: gl.constexpr):
    """The shared-memory stages of the load warp's K and V tiles and their mbarriers: ready (set by the
    copies' bytes) and free (one arrival per softmax warp group)."""
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)
    return k_bufs, v_bufs, k_ready, v_ready, kv_free


@gluon.jit
def _past_forward_kernel(
    Q, OUT, STATE, LSE, SLOTS, SEL, k_desc, v_desc,
    sq_b, sq_h, sq_t, so_b, so_h, so_t, ss_b, ss_h, ss_t, sl_b, sl_h, ssl_b, ssel_b, ssel_h, ssel_i, ssel_k,
    T, n_tiles, qk_scale,
    H_Q: gl.constexpr, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
):
    m0, b, h, hk = _program(H_Q, GROUP)
    dtype: gl.constexpr = k_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    q_lower = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], q_layout)
    q_upper = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], q_layout)
    k_bufs, v_bufs, k_ready, v_ready, kv_free = _kv_ring(k_desc, v_desc, STAGES)

    q_row = b * sq_b + h * sq_h
    o_row = b * so_b + h * so_h
    s_row = b * ss_b + h * ss_h
    lse_row = b * sl_b + h * sl_h
    gl.warp_specialize([
        (_softmax_partition, (Q, OUT, STATE, LSE, q_lower, k_bufs, v_bufs, k_ready, v_ready, kv_free, q_row, o_row,
                              s_row, lse_row, sq_t, so_t, ss_t, T, m0, n_tiles, qk_scale, 0, HEAD_DIM, BLOCK_N,
                              STAGES)),
        (_softmax_partition_upper, (Q, OUT, STATE, LSE, q_upper, k_bufs, v_bufs, k_ready, v_ready, kv_free, q_row,
                                    o_row, s_row, lse_row, sq_t, so_t, ss_t, T, m0, n_tiles, qk_scale, HEAD_DIM,
                                    BLOCK_N, STAGES)),
        (_load_partition, (k_desc, v_desc, SLOTS, b * ssl_b, SEL, b * ssel_b + hk * ssel_h + gl.program_id(0) * ssel_i,
                           ssel_k, hk, n_tiles, k_bufs, v_bufs, k_ready, v_ready, kv_free, PAGE_SIZE, BLOCK_N,
                           HEAD_DIM, STAGES, SPARSE)),
    ], [4, 1], [240, 24])


@gluon.jit
def _dq_partition(Q, DO, LSE, DELTA, DQ, DQ_OUT, q_smem, do_smem, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                  q_row, do_row, dq_row, lse_row, sq_t, sdo_t, sdq_t, T, m0, n_tiles, qk_scale, scale,
                  HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """dQ of rows [m0 + 64 * HALF, +64) of one query head over every past tile: P = exp(S - lse),
    dS = P * (dO V^T - delta), dQ += dS K; written to DQ_OUT (in its dtype) times ``scale`` plus the partial
    dQ (fp32) of the other keys in DQ (DQ_OUT has DQ's strides)."""
    ROWS: gl.constexpr = 64
    s_mma: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_mma: gl.constexpr = _wgmma_layout(HEAD_DIM)
    ds_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, o_mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, o_mma)
    s_row_layout: gl.constexpr = gl.SliceLayout(1, s_mma)

    rows = m0 + HALF * ROWS + gl.arange(0, ROWS, layout=row_layout)
    cols = gl.arange(0, HEAD_DIM, layout=col_layout)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
    _rows_to_shared(Q, q_row, rows, cols, sq_t, mask, q_smem)
    _rows_to_shared(DO, do_row, rows, cols, sdo_t, mask, do_smem)
    fence_async_shared()
    _partition_barrier()

    s_rows = m0 + HALF * ROWS + gl.arange(0, ROWS, layout=s_row_layout)
    s_ok = s_rows < T
    # Rows past T: lse = +inf makes P = 0.
    lse2 = gl.load(LSE + lse_row + s_rows, mask=s_ok, other=float("inf")) * 1.4426950408889634
    delta = gl.load(DELTA + lse_row + s_rows, mask=s_ok, other=0.0)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_mma)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_mma)

    for j in range(n_tiles):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        k_buf = k_bufs.index(stage)
        v_buf = v_bufs.index(stage)
        mbarrier.wait(k_ready.index(stage), phase)
        s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp = warpgroup_mma(do_smem, v_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # dO V^T runs on the tensor cores while P is computed.
        s, _, _ = warpgroup_mma_wait(1, deps=(s, q_smem, k_buf))
        p = gl.exp2(s * qk_scale - lse2[:, None])
        dp, _, _ = warpgroup_mma_wait(0, deps=(dp, do_smem, v_buf))
        ds = gl.convert_layout((p * (dp - delta[:, None])).to(Q.dtype.element_ty), ds_operand)
        dq = warpgroup_mma(ds, k_buf, dq, is_async=True)
        dq, _ = warpgroup_mma_wait(0, deps=(dq, k_buf))
        mbarrier.arrive(kv_free.index(stage), count=1)

    dq_offs = dq_row + rows[:, None].to(gl.int64) * sdq_t + cols[None, :]
    dq = dq * scale + gl.load(DQ + dq_offs, mask=mask, other=0.0)
    gl.store(DQ_OUT + dq_offs, dq.to(DQ_OUT.dtype.element_ty), mask=mask)


@gluon.jit
def _dq_partition_upper(Q, DO, LSE, DELTA, DQ, DQ_OUT, q_smem, do_smem, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                        q_row, do_row, dq_row, lse_row, sq_t, sdo_t, sdq_t, T, m0, n_tiles, qk_scale, scale,
                        HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _dq_partition(Q, DO, LSE, DELTA, DQ, DQ_OUT, q_smem, do_smem, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                  q_row, do_row, dq_row, lse_row, sq_t, sdo_t, sdq_t, T, m0, n_tiles, qk_scale, scale,
                  1, HEAD_DIM, BLOCK_N, STAGES)


@gluon.jit
def _past_dq_kernel(
    Q, DO, LSE, DELTA, DQ, DQ_OUT, SLOTS, SEL, k_desc, v_desc,
    sq_b, sq_h, sq_t, sdo_b, sdo_h, sdo_t, sdq_b, sdq_h, sdq_t, sl_b, sl_h, ssl_b, ssel_b, ssel_h, ssel_i, ssel_k,
    T, n_tiles, qk_scale, scale,
    H_Q: gl.constexpr, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
):
    m0, b, h, hk = _program(H_Q, GROUP)
    dtype: gl.constexpr = k_desc.dtype
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    q_lower = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], row_layout)
    q_upper = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], row_layout)
    do_lower = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], row_layout)
    do_upper = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], row_layout)
    k_bufs, v_bufs, k_ready, v_ready, kv_free = _kv_ring(k_desc, v_desc, STAGES)

    q_row = b * sq_b + h * sq_h
    do_row = b * sdo_b + h * sdo_h
    dq_row = b * sdq_b + h * sdq_h
    lse_row = b * sl_b + h * sl_h
    gl.warp_specialize([
        (_dq_partition, (Q, DO, LSE, DELTA, DQ, DQ_OUT, q_lower, do_lower, k_bufs, v_bufs, k_ready, v_ready, kv_free, q_row,
                         do_row, dq_row, lse_row, sq_t, sdo_t, sdq_t, T, m0, n_tiles, qk_scale, scale, 0, HEAD_DIM,
                         BLOCK_N, STAGES)),
        (_dq_partition_upper, (Q, DO, LSE, DELTA, DQ, DQ_OUT, q_upper, do_upper, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                               q_row, do_row, dq_row, lse_row, sq_t, sdo_t, sdq_t, T, m0, n_tiles, qk_scale, scale,
                               HEAD_DIM, BLOCK_N, STAGES)),
        (_load_partition, (k_desc, v_desc, SLOTS, b * ssl_b, SEL, b * ssel_b + hk * ssel_h + gl.program_id(0) * ssel_i,
                           ssel_k, hk, n_tiles, k_bufs, v_bufs, k_ready, v_ready, kv_free, PAGE_SIZE, BLOCK_N,
                           HEAD_DIM, STAGES, SPARSE)),
    ], [4, 1], [240, 24])


@gluon.jit
def _dkdv_step(TILES, tiles_row, st_j, i, hk, n_q_tiles, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr,
               BLOCK_M: gl.constexpr, SPARSE: gl.constexpr):
    """(query head, first query row) of step i of a dK/dV program: each query head of the group over every
    query tile of the chunk; with SPARSE over the query tiles (pages) that chose the program's page, listed
    at TILES + tiles_row (stride st_j), each PAGE_SIZE // BLOCK_M steps per head."""
    if SPARSE:
        BLOCKS: gl.constexpr = PAGE_SIZE // BLOCK_M
        tile = gl.load(TILES + tiles_row + (i // (GROUP * BLOCKS)) * st_j)
        return hk * GROUP + (i // BLOCKS) % GROUP, tile * PAGE_SIZE + (i % BLOCKS) * BLOCK_M
    else:
        return hk * GROUP + i // n_q_tiles, (i % n_q_tiles) * BLOCK_M


@gluon.jit
def _rows_load_partition(q_desc, do_desc, TILES, tiles_row, st_j, b, hk, n_steps, n_q_tiles, q_bufs, do_bufs,
                         ready, free, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_M: gl.constexpr,
                         STAGES: gl.constexpr, SPARSE: gl.constexpr):
    """Copy the query rows and output gradients of each step in turn."""
    for i in range(n_steps):
        h, m0 = _dkdv_step(TILES, tiles_row, st_j, i, hk, n_q_tiles, GROUP, PAGE_SIZE, BLOCK_M, SPARSE)
        stage = i % STAGES
        mbarrier.wait(free.index(stage), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, m0, 0], ready.index(stage), q_bufs.index(stage))
        _tma_load(do_desc, [b, h, m0, 0], ready.index(stage), do_bufs.index(stage))


@gluon.jit
def _dkdv_partition(KP, VP, DKP, DVP, LSE2, SDELTA, TILES, tiles_row, st_j, k_smem, v_smem, q_bufs, do_bufs,
                    ready, free, kv_row, g_row, b, hk, T, n_steps, n_q_tiles, sp_off, sg_off, qk_scale, scale,
                    HALF: gl.constexpr, H_Q: gl.constexpr, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
                    STAGED: gl.constexpr):
    """dV = P^T dO and dK = dS^T Q of the program's keys 64 * HALF .. +64 (rows from kv_row, stride sp_off)
    over its steps; the stored gradient (rows from g_row) is added after, or with STAGED the sums go to a
    staging area alone. A program without steps (a page nobody chose) reads and writes nothing.
    LSE2, SDELTA: the row terms of ``attention_blocks.softmax_row_terms`` (lse in log2 units, delta times scale)."""
    KEYS: gl.constexpr = 64
    s_mma: gl.constexpr = _wgmma_layout(BLOCK_M)
    o_mma: gl.constexpr = _wgmma_layout(HEAD_DIM)
    a_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    key_layout: gl.constexpr = gl.SliceLayout(1, o_mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, o_mma)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_mma)
    dtype: gl.constexpr = k_smem.dtype

    keys = HALF * KEYS + gl.arange(0, KEYS, layout=key_layout)
    cols = gl.arange(0, HEAD_DIM, layout=col_layout)
    live = (keys[:, None] >= 0) & (cols[None, :] < HEAD_DIM) & (n_steps > 0)
    kv_rows = kv_row + keys.to(gl.int64) * sp_off
    k_smem.store(gl.load(KP + kv_rows[:, None] + cols[None, :], mask=live, other=0.0))
    v_smem.store(gl.load(VP + kv_rows[:, None] + cols[None, :], mask=live, other=0.0))
    fence_async_shared()
    _partition_barrier()

    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=o_mma)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=o_mma)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_mma)
    queries = gl.arange(0, BLOCK_M, layout=query_layout)
    for i in range(n_steps):
        h, m0 = _dkdv_step(TILES, tiles_row, st_j, i, hk, n_q_tiles, GROUP, PAGE_SIZE, BLOCK_M, SPARSE)
        m = m0 + queries
        row_terms = (b * H_Q + h).to(gl.int64) * T + m
        # Queries past T: lse = +inf makes their probabilities 0 (their rows read as zeros).
        lse2 = gl.load(LSE2 + row_terms, mask=m < T, other=float("inf"))
        sdelta = gl.load(SDELTA + row_terms, mask=m < T, other=0.0)
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        q_buf = q_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
        do_buf = do_bufs.index(stage).reshape([BLOCK_M, HEAD_DIM])
        s_t = warpgroup_mma(k_smem, q_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_t, _, _ = warpgroup_mma_wait(1, deps=(s_t, k_smem, q_buf))
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_operand), do_buf, dv, is_async=True)
        dp_t, _, _ = warpgroup_mma_wait(1, deps=(dp_t, v_smem, do_buf))
        ds_t = p_t * (dp_t * scale - sdelta[None, :])
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_operand), q_buf, dk, is_async=True)
        dv, dk, _, _ = warpgroup_mma_wait(0, deps=(dv, dk, q_buf, do_buf))
        mbarrier.arrive(free.index(stage), count=1)

    g_ptrs = g_row + keys.to(gl.int64)[:, None] * sg_off + cols[None, :]
    if not STAGED:
        # The stored gradient after the chunk's whole share, as the staged path adds them (the Triton page
        # kernel does the same): a page's gradient has the same bits wherever its layer's pages live.
        dk += gl.load(DKP + g_ptrs, mask=live, other=0.0).to(gl.float32)
        dv += gl.load(DVP + g_ptrs, mask=live, other=0.0).to(gl.float32)
    gl.store(DKP + g_ptrs, dk.to(DKP.dtype.element_ty), mask=live)
    gl.store(DVP + g_ptrs, dv.to(DVP.dtype.element_ty), mask=live)


@gluon.jit
def _dkdv_partition_upper(KP, VP, DKP, DVP, LSE2, SDELTA, TILES, tiles_row, st_j, k_smem, v_smem, q_bufs, do_bufs,
                          ready, free, kv_row, g_row, b, hk, T, n_steps, n_q_tiles, sp_off, sg_off, qk_scale,
                          scale, H_Q: gl.constexpr, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr,
                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                          SPARSE: gl.constexpr, STAGED: gl.constexpr):
    _dkdv_partition(KP, VP, DKP, DVP, LSE2, SDELTA, TILES, tiles_row, st_j, k_smem, v_smem, q_bufs, do_bufs,
                    ready, free, kv_row, g_row, b, hk, T, n_steps, n_q_tiles, sp_off, sg_off, qk_scale, scale,
                    1, H_Q, GROUP, PAGE_SIZE, HEAD_DIM, BLOCK_M, STAGES, SPARSE, STAGED)


@gluon.jit
def _past_dkdv_kernel(
    q_desc, do_desc, KP, VP, DKP, DVP, SLOTS, GRAD_SLOTS, LSE2, SDELTA, PAGES, TILES, TCOUNT,
    sp_page, sp_off, sp_h, sg_page, sg_off, sg_h, ssl_b, spg_b, spg_h, spg_i, st_b, st_h, st_i, st_j,
    n_bh, staged_pages, T, n_q_tiles, qk_scale, scale,
    H_Q: gl.constexpr, H_KV: gl.constexpr, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr,
    STAGED: gl.constexpr,
):
    # 128 stored keys of one KV head per program, 64 per warp group. Dense: grid (past tiles, B x H_kv).
    # SPARSE: one program per (entry of the inverted selection, B x H_kv), entries outermost, so that every
    # head's most-chosen pages (its longest programs) start in the first wave.
    if SPARSE:
        idx = gl.program_id(0) // n_bh
        bh = gl.program_id(0) % n_bh
    else:
        idx = gl.program_id(0)
        bh = gl.program_id(1)
    b = bh // H_KV
    hk = bh % H_KV
    if SPARSE:
        entry = b.to(gl.int64) * spg_b + hk * spg_h + idx * spg_i
        page = gl.load(PAGES + entry)
        n_steps = gl.load(TCOUNT + entry) * GROUP * (PAGE_SIZE // BLOCK_M)
        tiles_row = b.to(gl.int64) * st_b + hk * st_h + idx * st_i
        slot_at = b.to(gl.int64) * ssl_b + page
        in_page = 0
    else:
        key0 = idx * 128
        n_steps = GROUP * n_q_tiles
        tiles_row = 0
        slot_at = b.to(gl.int64) * ssl_b + key0 // PAGE_SIZE
        in_page = key0 % PAGE_SIZE
    slot = gl.load(SLOTS + slot_at).to(gl.int64)
    # STAGED: DKP/DVP are a (B, H_kv, staged_pages, PAGE_SIZE, D) float32 staging area (sg_h 0) that receives
    # this chunk's share alone; kernels.host_pages adds it into the host-resident pages later. Otherwise the
    # page's gradient lives in its GRAD_SLOTS slot (a layer moved into dead pages has its own).
    if STAGED:
        g_slot = (b * H_KV + hk).to(gl.int64) * staged_pages + idx
    else:
        g_slot = gl.load(GRAD_SLOTS + slot_at).to(gl.int64)
    kv_row = slot * sp_page + in_page * sp_off + hk * sp_h
    g_row = g_slot * sg_page + in_page * sg_off + hk * sg_h

    dtype: gl.constexpr = q_desc.dtype
    key_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    k_lower = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], key_layout)
    k_upper = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], key_layout)
    v_lower = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], key_layout)
    v_upper = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], key_layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # one arrival per warp group

    gl.warp_specialize([
        (_dkdv_partition, (KP, VP, DKP, DVP, LSE2, SDELTA, TILES, tiles_row, st_j, k_lower, v_lower, q_bufs, do_bufs,
                           ready, free, kv_row, g_row, b, hk, T, n_steps, n_q_tiles, sp_off, sg_off, qk_scale,
                           scale, 0, H_Q, GROUP, PAGE_SIZE, HEAD_DIM, BLOCK_M, STAGES, SPARSE, STAGED)),
        (_dkdv_partition_upper, (KP, VP, DKP, DVP, LSE2, SDELTA, TILES, tiles_row, st_j, k_upper, v_upper, q_bufs,
                                 do_bufs, ready, free, kv_row, g_row, b, hk, T, n_steps, n_q_tiles, sp_off, sg_off,
                                 qk_scale, scale, H_Q, GROUP, PAGE_SIZE, HEAD_DIM, BLOCK_M, STAGES, SPARSE,
                                 STAGED)),
        (_rows_load_partition, (q_desc, do_desc, TILES, tiles_row, st_j, b, hk, n_steps, n_q_tiles, q_bufs, do_bufs,
                                ready, free, GROUP, PAGE_SIZE, BLOCK_M, STAGES, SPARSE)),
    ], [4, 1], [240, 24])


def _pool_ok(q: torch.Tensor, store: LayerStore) -> bool:
    # One head dim for keys and values: values of another width run in the Triton kernels.
    return (q.dtype in (torch.bfloat16, torch.float16) and store.k.shape[-1] in (64, 128)
            and store.v.shape[-1] == store.k.shape[-1] and store.page_size % BLOCK_N == 0
            and all(x.is_contiguous() for x in (store.k, store.v)) and store.table.slots.stride(1) == 1)


def supported(q: torch.Tensor, store: LayerStore, past_end: int) -> bool:
    """Whether the kernels here can run the stored keys [0, past_end) on an sm_90 GPU (the caller checks
    the device): bf16 or fp16, head dim 64 or 128 for keys and values alike, pages of whole key tiles in a pool
    whose (page, offset) rows are contiguous, and at least one whole past tile."""
    return _pool_ok(q, store) and past_end >= BLOCK_N and past_end % BLOCK_N == 0


def supported_pages(q: torch.Tensor, store: LayerStore, start: int, selection: torch.Tensor) -> bool:
    """Whether the kernels here can run the selected pages of a sparse chunk at ``start`` (as
    :func:`supported`): pages of one key tile and one query tile each, the chunk starting on a page."""
    return (_pool_ok(q, store) and store.page_size == BLOCK_N == BLOCK_M and start % BLOCK_N == 0
            and selection.shape[-1] >= 1)


def _pool_descriptors(q: torch.Tensor, store: LayerStore) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The K and V pools as (pages x page rows, KV heads x head dim): one 2-D box per (tile, KV head)."""
    n, ps, hkv, d = store.k.shape
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16)
    return tuple(TensorDescriptor(x, [n * ps, hkv * d], [hkv * d, 1], [BLOCK_N, d], layout) for x in (store.k, store.v))


def _past_args(store: LayerStore, past_end: int, selection: torch.Tensor | None) -> tuple:
    """The kernels' description of the past: (slots, page lists, their 4 strides, tiles per query tile,
    SPARSE). Dense: the tiles [0, past_end); sparse: the selection (B, 1 or H_kv, query tiles, pages)."""
    slots = store.table.slots
    slots = slots if slots.dtype == torch.int32 else slots.to(torch.int32)
    if selection is None:
        return slots, slots, (0, 0, 0, 0), past_end // BLOCK_N, False
    sel = selection if selection.dtype == torch.int32 else selection.to(torch.int32)
    strides = list(sel.stride())
    if sel.shape[1] == 1:
        strides[1] = 0  # one list shared by all KV heads
    return slots, sel, tuple(strides), sel.shape[-1], True


def forward_past(q: torch.Tensor, store: LayerStore, scale: float, state: tuple[torch.Tensor, torch.Tensor],
                 out: torch.Tensor, past_end: int = 0, selection: torch.Tensor | None = None) -> torch.Tensor:
    """Continue ``state`` (out (B, H_q, T, D) fp32, lse (B, H_q, T) fp32) over the stored keys [0, past_end),
    or with ``selection`` over each query tile's selected pages, and write the final output into ``out``
    (B, H_q, T, D), q's dtype; lse is updated in place. Returns out."""
    b, hq, t, d = q.shape
    state_out, lse = state
    slots, sel, ssel, n_tiles, sparse = _past_args(store, past_end, selection)
    k_desc, v_desc = _pool_descriptors(q, store)
    with torch.cuda.device(q.device):
        _past_forward_kernel[(triton.cdiv(t, BLOCK_M), b * hq)](
            q, out, state_out, lse, slots, sel, k_desc, v_desc,
            q.stride(0), q.stride(1), q.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            state_out.stride(0), state_out.stride(1), state_out.stride(2),
            lse.stride(0), lse.stride(1), slots.stride(0), *ssel,
            t, n_tiles, scale * LOG2E,
            H_Q=hq, GROUP=hq // store.k.shape[2], PAGE_SIZE=store.page_size, HEAD_DIM=d, BLOCK_N=BLOCK_N,
            STAGES=STAGES, SPARSE=sparse, num_warps=4, maxnreg=168,
        )
    return out


def dq_past(dout: torch.Tensor, q: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, store: LayerStore,
            scale: float, partial: torch.Tensor, dq: torch.Tensor, past_end: int = 0,
            selection: torch.Tensor | None = None) -> torch.Tensor:
    """dQ through the stored keys [0, past_end) (or, with ``selection``, each query tile's selected pages)
    plus ``partial`` (B, H_q, T, D) fp32, the dQ of the other keys, written into ``dq`` (like ``partial``,
    q's dtype). lse, delta: the chunk's (B, H_q, T) fp32 row terms (natural-log lse, rowsum(dO * O)).
    Returns dq."""
    b, hq, t, d = q.shape
    if partial.stride() != dq.stride() or lse.stride() != delta.stride():
        raise ValueError("dq_past needs partial and dq, lse and delta, with one layout each")
    slots, sel, ssel, n_tiles, sparse = _past_args(store, past_end, selection)
    k_desc, v_desc = _pool_descriptors(q, store)
    with torch.cuda.device(q.device):
        _past_dq_kernel[(triton.cdiv(t, BLOCK_M), b * hq)](
            q, dout, lse, delta, partial, dq, slots, sel, k_desc, v_desc,
            q.stride(0), q.stride(1), q.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            lse.stride(0), lse.stride(1), slots.stride(0), *ssel,
            t, n_tiles, scale * LOG2E, scale,
            H_Q=hq, GROUP=hq // store.k.shape[2], PAGE_SIZE=store.page_size, HEAD_DIM=d, BLOCK_N=BLOCK_N,
            STAGES=STAGES, SPARSE=sparse, num_warps=4, maxnreg=168,
        )
    return dq


DKDV_QUERY_ROWS = 64  # query rows per step of the dK/dV loop
DKDV_STAGES = 3


def rows_ok(*xs: torch.Tensor) -> bool:
    """Whether the copy engine can read query-row tiles of these (B, H_q, T, D) tensors (16-byte aligned
    base and strides, contiguous rows), as :func:`dkdv_past` needs for q and dout."""
    return all(x.stride(-1) == 1 and x.data_ptr() % 16 == 0
               and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1]) for x in xs)


def dkdv_past(dout: torch.Tensor, q: torch.Tensor, lse2: torch.Tensor, sdelta: torch.Tensor, store: LayerStore,
              scale: float, past_end: int = 0, pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              staging: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Add dK, dV of the stored keys [0, past_end) into ``store.dk``/``store.dv`` in place: q, dout
    (B, H_q, T, D); lse2, sdelta the chunk's (B, H_q, T) row terms of ``attention_blocks.softmax_row_terms``.
    Key-stationary: each 128-key tile is read, added to and written by one program (deterministic).

    Sparse: ``pages`` = (pages, tiles, counts) of ``sparse_attention.invert_selection``, one program per
    entry (a selected page of 128 keys and the query tiles that chose it). With ``staging`` = (dk, dv)
    float32 (B, H_kv, entries, PAGE_SIZE, D) the chunk's share of each entry's page goes there alone, for
    ``kernels.host_pages`` to add into host-resident pages."""
    b, hq, t, d = q.shape
    hkv = store.k.shape[2]
    slots = store.table.slots.to(torch.int32)
    grad_slots = store.grad_slots.to(torch.int32)
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    box = [1, 1, DKDV_QUERY_ROWS, d]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl_dtype)
    q_desc, do_desc = (TensorDescriptor(x, list(x.shape), list(x.stride()), box, layout) for x in (q, dout))
    dkp, dvp = staging or (store.dk, store.dv)
    if staging is None:
        g_strides, staged_pages = (store.dk.stride(0), store.dk.stride(1), store.dk.stride(2)), 0
    else:
        g_strides, staged_pages = (dkp.stride(3) * store.page_size, dkp.stride(3), 0), dkp.shape[2]
    if pages is None:
        grid, lists = (past_end // BLOCK_N, b * hkv), (slots, slots, slots, (0,) * 3, (0,) * 4)
    else:
        entries, tiles, counts = pages
        grid, lists = (entries.shape[-1] * b * hkv,), (entries, tiles, counts, entries.stride(), tiles.stride())
    with torch.cuda.device(q.device):
        _past_dkdv_kernel[grid](
            q_desc, do_desc, store.k, store.v, dkp, dvp, slots, grad_slots, lse2, sdelta, *lists[:3],
            store.k.stride(0), store.k.stride(1), store.k.stride(2), *g_strides, slots.stride(0),
            *lists[3], *lists[4], b * hkv, staged_pages, t, triton.cdiv(t, DKDV_QUERY_ROWS), scale * LOG2E, scale,
            H_Q=hq, H_KV=hkv, GROUP=hq // hkv, PAGE_SIZE=store.page_size, HEAD_DIM=d,
            BLOCK_M=DKDV_QUERY_ROWS, STAGES=DKDV_STAGES, SPARSE=pages is not None, STAGED=staging is not None,
            num_warps=4, maxnreg=168,
        )
