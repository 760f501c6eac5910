"""Hopper forward over the stored past, warp-specialised by hand (Gluon).

The Triton forward (:mod:`.chunk_attention`) runs a 128-row query tile in two warp groups that meet at
block-wide barriers around every bulk copy, so one group's softmax never overlaps the other's matmuls and
the tensor cores idle through both. Here each (query tile, query head) program splits into three
partitions that only meet at mbarriers:

- a load warp: looks up each past tile's page and copies its K and V rows into a ring of shared-memory
  stages (bulk copies, one mbarrier per stage and operand);
- two softmax warp groups, 64 query rows each: S = Q K^T and O += P V on the tensor cores (wgmma), the
  online softmax in fp32 between them; each frees a stage when its P V has read it, and the load warp
  refills the stage once both have.

The two warp groups drift apart, so one's exponentials run while the other's matmuls do.

Contract: continue the online-softmax state of the chunk's own keys (``state`` = out (B, H_q, T, D) fp32
normalised to 1 at lse, lse (B, H_q, T) fp32, natural log) over the stored keys [0, past_end), whole
tiles of ``BLOCK_N`` rows that never cross a page, and write the final out (q's dtype) and lse. Head dim
64 or 128, bf16 or fp16, sm_90. :func:`supported` says when it applies; :mod:`.chunk_attention` runs
everything else.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..core.pages import LayerStore

BLOCK_M = 128  # query rows per program: 64 per softmax warp group
BLOCK_N = 128  # key rows per stage
STAGES = 2
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@gluon.jit
def _load_partition(k_desc, v_desc, SLOTS, slot_row, hk, n_tiles, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                    PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr):
    """Copy the past's key tiles [j * BLOCK_N, (j + 1) * BLOCK_N) of KV head hk into the stage ring."""
    col = hk * HEAD_DIM
    next_slot = gl.load(SLOTS + slot_row)
    for j in range(n_tiles):
        lo = j * BLOCK_N
        slot = next_slot
        # The page of the next tile, fetched while this one's copies are in flight.
        next_slot = gl.load(SLOTS + slot_row + ((lo + BLOCK_N) // PAGE_SIZE), mask=j + 1 < n_tiles, other=0)
        row = slot * PAGE_SIZE + lo % PAGE_SIZE
        stage = j % STAGES
        # A stage starts free: its first wait (phase 1) passes at once.
        mbarrier.wait(kv_free.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(stage), k_bufs.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(stage), v_bufs.index(stage))


@gluon.jit
def _softmax_partition(Q, OUT, STATE, LSE, q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                       q_row, o_row, s_row, lse_row, sq_t, so_t, ss_t, T, m0, n_tiles, qk_scale,
                       HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr):
    """Rows [m0 + 64 * HALF, m0 + 64 * HALF + 64) of one query head: carry the state over every past tile."""
    ROWS: gl.constexpr = 64
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, HEAD_DIM, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, o_mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, o_mma)
    s_row_layout: gl.constexpr = gl.SliceLayout(1, s_mma)

    rows = m0 + HALF * ROWS + gl.arange(0, ROWS, layout=row_layout)
    cols = gl.arange(0, HEAD_DIM, layout=col_layout)
    row_ok = rows < T
    mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)

    # Q goes through shared memory, where wgmma reads it; rows past T read as zero.
    q = gl.load(Q + q_row + rows[:, None].to(gl.int64) * sq_t + cols[None, :], mask=mask, other=0.0)
    q_smem.store(q)
    fence_async_shared()
    gl.thread_barrier()

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
def _past_forward_kernel(
    Q, OUT, STATE, LSE, SLOTS, k_desc, v_desc,
    sq_b, sq_h, sq_t, so_b, so_h, so_t, ss_b, ss_h, ss_t, sl_b, sl_h, ssl_b,
    T, n_tiles, qk_scale,
    H_Q: gl.constexpr, GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    m0 = gl.program_id(0) * 128
    bh = gl.program_id(1)
    b = (bh // H_Q).to(gl.int64)
    h = bh % H_Q
    hk = h // GROUP

    dtype: gl.constexpr = k_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
    q_lower = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], q_layout)
    q_upper = gl.allocate_shared_memory(dtype, [64, HEAD_DIM], q_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)  # one arrival per softmax warp group

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
        (_load_partition, (k_desc, v_desc, SLOTS, b * ssl_b, hk, n_tiles, k_bufs, v_bufs, k_ready, v_ready, kv_free,
                           PAGE_SIZE, BLOCK_N, HEAD_DIM, STAGES)),
    ], [4, 1], [240, 24])


def supported(q: torch.Tensor, store: LayerStore, past_end: int) -> bool:
    """Whether :func:`forward_past` can run a launch on an sm_90 GPU (the caller checks the device): bf16 or
    fp16, head dim 64 or 128, pages of whole key tiles in a pool whose (page, offset) rows are contiguous,
    and at least one whole past tile."""
    d = store.k.shape[-1]
    return (q.dtype in (torch.bfloat16, torch.float16) and d in (64, 128) and store.page_size % BLOCK_N == 0
            and past_end >= BLOCK_N and past_end % BLOCK_N == 0
            and all(x.is_contiguous() for x in (store.k, store.v)) and store.table.slots.stride(1) == 1)


def forward_past(q: torch.Tensor, store: LayerStore, past_end: int, scale: float,
                 state: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Continue ``state`` (out (B, H_q, T, D) fp32, lse (B, H_q, T) fp32) over the stored keys [0, past_end)
    and write the final output into ``out`` (B, H_q, T, D), q's dtype; lse is updated in place.
    Returns out."""
    b, hq, t, d = q.shape
    n, ps, hkv, _ = store.k.shape
    state_out, lse = state
    slots = store.table.slots
    if slots.dtype != torch.int32:
        slots = slots.to(torch.int32)
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16)
    # The pool as (pages x page rows, KV heads x head dim): one 2-D box per (tile, KV head).
    k_desc, v_desc = (TensorDescriptor(x, [n * ps, hkv * d], [hkv * d, 1], [BLOCK_N, d], layout)
                      for x in (store.k, store.v))
    grid = (triton.cdiv(t, BLOCK_M), b * hq)
    with torch.cuda.device(q.device):
        _past_forward_kernel[grid](
            q, out, state_out, lse, slots, k_desc, v_desc,
            q.stride(0), q.stride(1), q.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            state_out.stride(0), state_out.stride(1), state_out.stride(2),
            lse.stride(0), lse.stride(1), slots.stride(0),
            t, past_end // BLOCK_N, scale * LOG2E,
            H_Q=hq, GROUP=hq // hkv, PAGE_SIZE=ps, HEAD_DIM=d, BLOCK_N=BLOCK_N, STAGES=STAGES,
            num_warps=4, maxnreg=168,
        )
    return out
