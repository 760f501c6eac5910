"""What the dense and the sparse attention kernels share: the Triton building blocks of their programs (the
start of a query-stationary one, tile loads and stores through a page table, one online-softmax step, one dQ
step, one dK/dV step, the chunk's own causal keys) and the launch-side helpers (tile shapes, tensor
descriptors for Hopper's bulk copies, input checks). ``chunk_attention`` and ``sparse_attention`` build their
kernels from these; neither imports the other's private names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .page_table import LayerStore
from .tanh import tanh

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


# --------------------------------------------------------------------------------------------------------
# Triton building blocks
# --------------------------------------------------------------------------------------------------------


@triton.jit
def load_tile(ptrs, row_ok, offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Load a (rows, D_PAD) tile; rows where ``row_ok`` is false (None: all rows valid) and the padding
    columns [HEAD_DIM, D_PAD) read as 0, so they add nothing to any dot product."""
    if row_ok is None:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return x


@triton.jit
def store_tile(ptrs, x, row_ok, offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    if HEAD_DIM == D_PAD:
        tl.store(ptrs, x, mask=row_ok[:, None])
    else:
        tl.store(ptrs, x, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def pool_rows(slots_b, ss_p, tok, valid, PAGE_SIZE: tl.constexpr, s_page, s_off):
    """Element offsets (int64) of the rows of tokens ``tok`` (BLOCK,) of one sequence in a pool tensor
    laid out as (num_pages, PAGE_SIZE, H, D); rows where ``valid`` is false point at slot 0."""
    slot = tl.load(slots_b + (tok // PAGE_SIZE) * ss_p, mask=valid, other=0)
    return slot.to(tl.int64) * s_page + (tok % PAGE_SIZE) * s_off


@triton.jit
def past_tile(desc, pool, slots_b, ss_p, lo, offs_n, offs_d, hk, PAGE_SIZE: tl.constexpr, sp_page, sp_off,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGED_TMA: tl.constexpr):
    """The whole tile of stored rows [lo, lo + BLOCK_N) of KV head hk from a (num_pages, PAGE_SIZE, H, D)
    pool. PAGED_TMA (tiles never cross a page): one bulk copy through ``desc``, a descriptor of the pool
    as (num_pages * PAGE_SIZE, H, D) rows; else one gathered row per key (``pool`` points at head hk)."""
    if PAGED_TMA:
        slot = tl.load(slots_b + (lo // PAGE_SIZE) * ss_p)
        x = desc.load([slot * PAGE_SIZE + lo % PAGE_SIZE, hk, 0]).reshape(BLOCK_N, D_PAD)
    else:
        rows = pool_rows(slots_b, ss_p, lo + offs_n, offs_n >= 0, PAGE_SIZE, sp_page, sp_off)
        x = load_tile(pool + rows[:, None] + offs_d[None, :], None, offs_d, HEAD_DIM, D_PAD)
    return x


@triton.jit
def fwd_step(acc, m_i, l_i, q, k, v, qk_scale, mask, PRECISION: tl.constexpr, softcap):
    """One key tile of the online softmax in the log2 domain: m_i is the running max of s * qk_scale
    (qk_scale = scale * log2 e > 0), so each probability costs one FMA and one exp2. Soft-capped scores
    (softcap not None; ``score_terms``): s = softcap * tanh(q.k * qk_scale), already in log2 units."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if softcap is not None:
        s = softcap * tanh(s * qk_scale)
        qk_scale = 1.0
    if mask is not None:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    shift = m_new
    if mask is not None:
        # A row with no key seen yet (another document's keys only) has m_new = -inf: shifting by 0 keeps
        # its empty state, where exp2(-inf - -inf) would be NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - shift[:, None])
    alpha = tl.math.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def dq_step(dq, q, do, k, v, lse2, delta, qk_scale, mask, PRECISION: tl.constexpr, softcap):
    """dQ += dS K for one key tile, with P = exp(S - lse) and dS = P * (dO V^T - delta); soft-capped scores
    (as ``fwd_step``) times their derivative 1 - tanh^2."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if softcap is not None:
        t = tanh(s)
        s = softcap * t
    p = tl.math.exp2(s - lse2[:, None])
    if mask is not None:
        p = tl.where(mask, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    if softcap is not None:
        ds = ds * (1.0 - t * t)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.jit
def query_program(Q, sq_b, sq_h, sq_t, m0, m_end, H_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The start of a query-stationary program (forward, dQ): query rows [m0, m_end) of sequence b and query
    head h, named by grid axis 1 as bh = b * H_Q + h; h reads KV head hk. Returns (bh, b, h, hk, offs_m,
    offs_n, offs_d, m_valid, q): q is the (BLOCK_M, D_PAD) tile of Q (B, H_Q, T, D), rows from m_end on 0."""
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = bh % H_Q
    hk = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    m_valid = offs_m < m_end
    q = load_tile(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :], m_valid, offs_d,
                   HEAD_DIM, D_PAD)
    return bh, b, h, hk, offs_m, offs_n, offs_d, m_valid, q


@triton.jit
def query_rows(src, b, h, t0, m0, s_t, T, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                ROWS_TMA: tl.constexpr):
    """Query rows [t0 + m0, t0 + m0 + BLOCK_M) of head h of sequence b of a (B, H_q, T, D) tensor.

    ROWS_TMA: one bulk copy through the descriptor ``src``; rows past the tensor's end read as 0, rows past
    the bound T (counted from t0) are read as they are and the caller's masks give them no weight. Else
    ``src`` points at row t0 of head h of sequence b and rows from the bound T on read as 0."""
    if ROWS_TMA:
        x = src.load([b.to(tl.int32), h, t0 + m0, 0]).reshape(BLOCK_M, D_PAD)
    else:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        x = load_tile(src + offs_m[:, None] * s_t + offs_d[None, :], offs_m < T, offs_d, HEAD_DIM, D_PAD)
    return x


@triton.jit
def dkdv_step(
    dk, dv, k, v, q_src, do_src, lse2_ptr, delta_ptr, doc_ptr, key_tok, b, h, t0, m0, offs_n, T, sq_t, sdo_t,
    qk_scale, scale, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, ROWS_TMA: tl.constexpr,
    EVEN: tl.constexpr, softcap,
):
    """dV += P^T dO and dK += dS^T Q for the query rows [m0, m0 + BLOCK_M) (counted from t0, bound T) of query head
    h; q_src, do_src as in ``query_rows`` (q's rows HEAD_DIM wide, dO's V_DIM); lse2_ptr, delta_ptr point at row t0
    of head h of the row terms of ``softmax_row_terms`` (lse in log2 units, delta times the softmax scale), so that
    no step rescales them. EVEN: every row of every step is below its bound (no masked loads). doc_ptr: None, or the
    document starts (token positions) of the rows from t0: keys at token positions key_tok (BLOCK_N,) before a row's
    start get no weight from it (packed documents). softcap: as ``fwd_step``'s."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = query_rows(q_src, b, h, t0, m0, sq_t, T, HEAD_DIM, D_PAD, BLOCK_M, ROWS_TMA)
    do = query_rows(do_src, b, h, t0, m0, sdo_t, T, V_DIM, V_PAD, BLOCK_M, ROWS_TMA)
    if EVEN:
        lse2 = tl.load(lse2_ptr + offs_m)
        delta = tl.load(delta_ptr + offs_m)
    else:
        # Queries past the end get lse = +inf: their probabilities are exactly 0, no extra mask needed.
        m_valid = offs_m < T
        lse2 = tl.load(lse2_ptr + offs_m, mask=m_valid, other=float("inf"))
        delta = tl.load(delta_ptr + offs_m, mask=m_valid, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    if softcap is not None:
        t_t = tanh(s_t * qk_scale)
        p_t = tl.math.exp2(softcap * t_t - lse2[None, :])
    else:
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    if CAUSAL:
        p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
    if doc_ptr is not None:
        doc = tl.load(doc_ptr + offs_m, mask=offs_m < T, other=0)
        p_t = tl.where(key_tok[:, None] >= doc[None, :], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t * scale - delta[None, :])
    if softcap is not None:
        ds_t = ds_t * (1.0 - t_t * t_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def doc_rows(DOC, b, T, m0, offs_m, m_valid, BLOCK_M: tl.constexpr):
    """The document starts (token positions) of query rows offs_m of sequence b (DOC: (B, T) int32), and the
    least and greatest of the tile's: starts only grow along a sequence, so its first and last row's."""
    row = DOC + b * T
    key_lo = tl.load(row + offs_m, mask=m_valid, other=0)
    return key_lo, tl.load(row + m0), tl.load(row + tl.minimum(m0 + BLOCK_M, T) - 1)


@triton.jit
def doc_tiles(lo, key_first, key_last, bound, BLOCK_N: tl.constexpr):
    """Key tiles [lo + i * BLOCK_N, ...) below ``bound`` for queries whose document starts lie in
    [key_first, key_last] (counted like the keys): (first, masked_end). Tiles before ``first`` end before
    every query's document (skipped); tiles in [first, masked_end) straddle some query's start (masked per
    element); the rest are seen whole."""
    first = lo + tl.maximum(key_first - lo, 0) // BLOCK_N * BLOCK_N
    masked_end = lo + tl.cdiv(tl.maximum(key_last - lo, 0), BLOCK_N) * BLOCK_N
    return tl.minimum(first, bound), tl.minimum(tl.maximum(masked_end, first), bound)


@triton.jit
def fwd_chunk(acc, m_i, l_i, q, kc, vc, sk_t, sv_t, m0, m_end, T, offs_m, offs_n, offs_d, offs_dv, qk_scale,
               key_lo, key_first, key_last, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_DIM: tl.constexpr,
               V_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, softcap):
    """The online softmax over the chunk's own keys for queries [m0, m_end) (keys HEAD_DIM wide, values V_DIM): key
    tiles wholly at or before every query unmasked, then the diagonal ones. Chunk key 0 is visible to every query,
    so no row is ever fully masked at the end. key_lo: None, or (BLOCK_M,) each query's document start counted from
    the chunk start (key_first, key_last: its least and greatest): tiles before key_first are skipped, those that
    straddle a start masked."""
    # A block of a short last tile can start past T (m_end < m0): its loops then stay below T.
    diag_lo = tl.minimum((m0 + 1) // BLOCK_N, m_end // BLOCK_N) * BLOCK_N
    whole_lo = 0
    if key_lo is not None:
        whole_lo, masked_end = doc_tiles(0, key_first, key_last, diag_lo, BLOCK_N)
        for lo in range(whole_lo, masked_end, BLOCK_N):
            n = lo + offs_n
            k = load_tile(kc + n[:, None] * sk_t + offs_d[None, :], None, offs_d, HEAD_DIM, D_PAD)
            v = load_tile(vc + n[:, None] * sv_t + offs_dv[None, :], None, offs_dv, V_DIM, V_PAD)
            acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, n[None, :] >= key_lo[:, None], PRECISION,
                                     softcap)
        whole_lo = masked_end
    for lo in range(whole_lo, diag_lo, BLOCK_N):
        n = lo + offs_n
        k = load_tile(kc + n[:, None] * sk_t + offs_d[None, :], None, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(vc + n[:, None] * sv_t + offs_dv[None, :], None, offs_dv, V_DIM, V_PAD)
        acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, None, PRECISION, softcap)
    for lo in range(diag_lo, m_end, BLOCK_N):
        n = lo + offs_n
        k = load_tile(kc + n[:, None] * sk_t + offs_d[None, :], n < T, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(vc + n[:, None] * sv_t + offs_dv[None, :], n < T, offs_dv, V_DIM, V_PAD)
        seen = n[None, :] <= offs_m[:, None]
        if key_lo is not None:
            seen = seen & (n[None, :] >= key_lo[:, None])
        acc, m_i, l_i = fwd_step(acc, m_i, l_i, q, k, v, qk_scale, seen, PRECISION, softcap)
    return acc, m_i, l_i


@triton.jit
def dq_chunk(dq, q, do, lse2, delta, kc, vc, sk_t, sv_t, m0, m_end, T, offs_m, offs_n, offs_d, offs_dv, qk_scale,
              key_lo, key_first, key_last, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_DIM: tl.constexpr,
              V_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, softcap):
    """dQ over the chunk's own keys for queries [m0, m_end), with the loops of ``fwd_chunk``."""
    # A block of a short last tile can start past T (m_end < m0): its loops then stay below T.
    diag_lo = tl.minimum((m0 + 1) // BLOCK_N, m_end // BLOCK_N) * BLOCK_N
    whole_lo = 0
    if key_lo is not None:
        whole_lo, masked_end = doc_tiles(0, key_first, key_last, diag_lo, BLOCK_N)
        for lo in range(whole_lo, masked_end, BLOCK_N):
            n = lo + offs_n
            k = load_tile(kc + n[:, None] * sk_t + offs_d[None, :], None, offs_d, HEAD_DIM, D_PAD)
            v = load_tile(vc + n[:, None] * sv_t + offs_dv[None, :], None, offs_dv, V_DIM, V_PAD)
            dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, n[None, :] >= key_lo[:, None], PRECISION,
                         softcap)
        whole_lo = masked_end
    for lo in range(whole_lo, diag_lo, BLOCK_N):
        n = lo + offs_n
        k = load_tile(kc + n[:, None] * sk_t + offs_d[None, :], None, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(vc + n[:, None] * sv_t + offs_dv[None, :], None, offs_dv, V_DIM, V_PAD)
        dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, None, PRECISION, softcap)
    for lo in range(diag_lo, m_end, BLOCK_N):
        n = lo + offs_n
        k = load_tile(kc + n[:, None] * sk_t + offs_d[None, :], n < T, offs_d, HEAD_DIM, D_PAD)
        v = load_tile(vc + n[:, None] * sv_t + offs_dv[None, :], n < T, offs_dv, V_DIM, V_PAD)
        seen = n[None, :] <= offs_m[:, None]
        if key_lo is not None:
            seen = seen & (n[None, :] >= key_lo[:, None])
        dq = dq_step(dq, q, do, k, v, lse2, delta, qk_scale, seen, PRECISION, softcap)
    return dq


# --------------------------------------------------------------------------------------------------------
# Launch-side helpers
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one kernel: BLOCK_M query rows x BLOCK_N key rows per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelTiles:
    fwd: Tiles
    dkdv: Tiles
    dq: Tiles
    # Programs per chunk key tile in dK/dV (a divisor of the GQA group); None: chosen by _chunk_split.
    chunk_split: int | None = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def copy_engine(t: torch.Tensor) -> bool:
    """Whether Triton can read t through a tensor descriptor (Hopper's bulk copy engine, or the interpreter
    that emulates it): 16-byte aligned base and strides, contiguous rows."""
    if t.is_cuda:
        if torch.cuda.get_device_capability(t.device)[0] < 9:
            return False
    elif not interpreting():
        return False
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st in t.stride()[:-1]))


def pool_descriptors(store: LayerStore, past_lo: int, block_n: int) -> tuple | None:
    """Descriptors of the K and V pools as (num_pages * page_size, H_kv, D or D_v) rows with (block_n, 1, padded
    width) boxes, when whole key tiles of the past never cross a page; None otherwise (gathered loads)."""
    pools = (store.k, store.v)
    if store.page_size % block_n or past_lo % block_n or not all(copy_engine(x) for x in pools):
        return None
    if any(x.stride(0) != x.shape[1] * x.stride(1) for x in pools):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(x, [x.shape[0] * x.shape[1], x.shape[2], x.shape[3]], [x.stride(1), x.stride(2), 1],
                                  [block_n, 1, padded_head_dim(x.shape[3])]) for x in pools)


def query_descriptors(block_m: int, *xs: torch.Tensor) -> tuple | None:
    """Descriptors of (B, H_q, T, width) tensors with (1, 1, block_m, padded width) boxes (bulk copies of query
    tiles); None unless every one of them can take one."""
    if not all(copy_engine(x) for x in xs):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, block_m, padded_head_dim(x.shape[-1])])
                 for x in xs)


def output_like(q: torch.Tensor, width: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty (B, H_q, T, width) tensor laid out like q (B, H_q, T, D): where q is the model's (B, T, H_q, D) rows
    seen as (B, H_q, T, D), so is it, and transformers' transpose back to (B, T, H_q, width) copies nothing."""
    dtype = q.dtype if dtype is None else dtype
    if width == q.shape[-1]:
        return torch.empty_like(q, dtype=dtype)
    b, h, t, _ = q.shape
    if q.stride(1) < q.stride(2):
        return torch.empty((b, t, h, width), dtype=dtype, device=q.device).transpose(1, 2)
    return torch.empty((b, h, t, width), dtype=dtype, device=q.device)


def same_layout(*pairs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether each (K-side, V-side) pair of tensors has one width and one layout: the kernels then address the
    values with the keys' offsets (their V_SAME), compiling as they did before values had a width of their own."""
    return all(a.shape[-1] == b.shape[-1] and a.stride() == b.stride() for a, b in pairs)


def kernel_width(q: torch.Tensor, v: torch.Tensor) -> int:
    """The head dim that chooses the tiles: the wider of the keys' (q's) and the values'."""
    return max(q.shape[-1], v.shape[-1])


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def check_chunk_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store: LayerStore, start: int) -> None:
    b, hq, t, d = q.shape
    dv = v.shape[-1]
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[2] != t or k.shape[3] != d or v.dim() != 4:
        raise ValueError(f"k, v must be (B, H_kv, T, D), (B, H_kv, T, D_v) matching q {tuple(q.shape)}; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({k.shape[1]})")
    if not (1 <= d <= 256 and 1 <= dv <= 256):
        raise ValueError(f"head dims must be in [1, 256], got {d} (keys) and {dv} (values)")
    if t < 1 or start < 0:
        raise ValueError(f"need T >= 1 and start >= 0, got T={t}, start={start}")
    if not (q.dtype == k.dtype == v.dtype == store.k.dtype == store.v.dtype):
        raise ValueError(
            f"q, k, v and the store must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {store.k.dtype}"
        )
    slots = store.table.slots
    if slots.shape[0] != b or slots.shape[1] * store.page_size < start + t:
        raise ValueError(
            f"the page table ({tuple(slots.shape)} pages of {store.page_size}) does not cover "
            f"batch {b} x tokens [0, {start + t})"
        )
    for pages, width in ((store.k, d), (store.v, dv)):
        if pages.shape[-2:] != (k.shape[1], width) or pages.stride(-1) != 1:
            raise ValueError(f"store pages {tuple(pages.shape)} do not hold {k.shape[1]} heads of dim {width} "
                             "contiguously")


def padded_head_dim(d: int) -> int:
    # Tiles are powers of two and tl.dot needs K >= 16: other head dims run padded, masked columns read 0.
    return max(16, triton.next_power_of_2(d))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (no TF32), so fp32 tests compare at ~1e-6.
    return "ieee" if dtype == torch.float32 else "tf32"


def score_terms(scale: float, softcap: float | None) -> tuple[float, float | None]:
    """(qk_scale, softcap) as the building blocks take them, for scores q.k * scale, or soft-capped ones
    cap * tanh(q.k * scale / cap) (softcap = cap): (scale * log2 e, None), or (scale / cap, cap * log2 e), so
    that the blocks' scores are in log2 units either way (None compiles the cap out)."""
    if softcap is None:
        return scale * 1.4426950408889634, None
    return scale / softcap, softcap * 1.4426950408889634


def softmax_row_terms(lse: torch.Tensor, delta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-query terms of the dK/dV loops, (B, H_q, T) float32 each: lse in log2 units and delta times
    the softmax scale. Scaled here once rather than in every step of every key tile that reads them (a
    measurable share of those loops' instructions)."""
    return lse * 1.4426950408889634, delta * scale


def is_sm90(t: torch.Tensor) -> bool:
    """Whether t lives on an sm_90 GPU (H100, H200), where the warp-specialised Gluon kernels run."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device) == (9, 0)
