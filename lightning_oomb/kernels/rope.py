"""Fused rotary position embedding, with the semantics of transformers'
``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``; per half of the head dim (lo, hi):

    out_lo = x_lo * cos_lo - x_hi * sin_lo,    out_hi = x_hi * cos_hi + x_lo * sin_hi

in fp32, rounded once. q and k are the model's non-contiguous views: the kernel reads and writes through
their strides, nothing is copied. One program per (batch, token) rotates every query and key head with that
token's cos/sin. Only cos and sin are saved (the map is linear in q, k); the backward is the same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import on_device_of

# Elements of one half of the head dim across heads that one program rotates at a time.
_TILE_ELEMS = 1024


@triton.jit
def _rotate_heads(
    X, OUT, sx_h, sx_d, so_h, so_d, cos_lo, cos_hi, sin_lo, sin_hi,
    H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Rotate the H heads (H, D) of one token at X (strides sx_h, sx_d) into OUT."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HALF
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < H)[:, None] & d_ok[None, :]
        x_ptr = X + offs_h[:, None] * sx_h + offs_d[None, :] * sx_d
        o_ptr = OUT + offs_h[:, None] * so_h + offs_d[None, :] * so_d
        x_lo = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + HALF * sx_d, mask=mask, other=0.0).to(tl.float32)
        out_lo = x_lo * cos_lo[None, :] - x_hi * sin_lo[None, :]
        out_hi = x_hi * cos_hi[None, :] + x_lo * sin_hi[None, :]
        tl.store(o_ptr, out_lo.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_ptr + HALF * so_d, out_hi.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, T,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_t, sk_d,
    sqo_b, sqo_h, sqo_t, sqo_d,
    sko_b, sko_h, sko_t, sko_d,
    sc_b, sc_t, sc_d,
    ss_b, ss_t, ss_d,
    H_Q: tl.constexpr, H_KV: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    bt = tl.program_id(0)
    b = (bt // T).to(tl.int64)
    t = (bt % T).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HALF
    cos = COS + b * sc_b + t * sc_t + offs_d * sc_d
    sin = SIN + b * ss_b + t * ss_t + offs_d * ss_d
    cos_lo = tl.load(cos, mask=d_ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos + HALF * sc_d, mask=d_ok, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin, mask=d_ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin + HALF * ss_d, mask=d_ok, other=0.0).to(tl.float32)
    if TRANSPOSE:
        # The backward is the transposed rotation, dx = dout * cos + rotate_half^T(dout * sin) with
        # rotate_half^T(y) = cat(y[..., D/2:], -y[..., :D/2]): the same formula with these sin halves.
        sin_lo, sin_hi = -sin_hi, -sin_lo
    _rotate_heads(
        Q + b * sq_b + t * sq_t, QO + b * sqo_b + t * sqo_t, sq_h, sq_d, sqo_h, sqo_d,
        cos_lo, cos_hi, sin_lo, sin_hi, H_Q, HALF, BLOCK_HQ, BLOCK_D,
    )
    _rotate_heads(
        K + b * sk_b + t * sk_t, KO + b * sko_b + t * sko_t, sk_h, sk_d, sko_h, sko_d,
        cos_lo, cos_hi, sin_lo, sin_hi, H_KV, HALF, BLOCK_HK, BLOCK_D,
    )


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not t.is_floating_point():
            raise ValueError(f"apply_rope needs floating-point tensors, got {name} of {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"q, k, cos and sin must be on one device, got {name} on {t.device} and q on {q.device}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, T, D), got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)} must be (B, H_kv, T, D) matching q {tuple(q.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have one dtype, got {q.dtype} and {k.dtype}")
    if d % 2:
        raise ValueError(f"the head dim must be even, got {d}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1:] != (t, d):
        raise ValueError(f"cos and sin must be ({b} or 1, {t}, {d}) for q {tuple(q.shape)}, got {tuple(cos.shape)}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rope gives no gradient to cos and sin: pass them detached (no requires_grad)")


def _launch(
    q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, transpose: bool,
) -> None:
    """Rotate q (B, H_q, T, D) into q_out and k (B, H_kv, T, D) into k_out, any strides; cos, sin
    (B or 1, T, D). transpose: apply the transposed rotation (the backward)."""
    b, h_q, t, d = q.shape
    h_kv = k.shape[1]
    if b * t == 0 or d == 0:
        return
    half = d // 2
    block_d = triton.next_power_of_2(half)
    block_hq = min(triton.next_power_of_2(h_q), max(1, _TILE_ELEMS // block_d))
    block_hk = min(triton.next_power_of_2(h_kv), max(1, _TILE_ELEMS // block_d))
    num_warps = 4 if block_hq * block_d <= 1024 else 8
    # A batch-broadcast cos/sin (1, T, D) is read at batch stride 0.
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    ss_b = sin.stride(0) if sin.shape[0] > 1 else 0
    with on_device_of(q):
        _rope_kernel[(b * t,)](
            q, k, q_out, k_out, cos, sin, t,
            *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
            sc_b, cos.stride(1), cos.stride(2),
            ss_b, sin.stride(1), sin.stride(2),
            H_Q=h_q, H_KV=h_kv, HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
            TRANSPOSE=transpose, num_warps=num_warps,
        )


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out_dtype: torch.dtype | None = None):
        # HF's q * cos promotes: cos in fp32 with bf16 q gives an fp32 q_embed there too.
        dtype = out_dtype or torch.promote_types(q.dtype, cos.dtype)
        q_out, k_out = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)
        _launch(q, k, q_out, k_out, cos, sin, transpose=False)
        ctx.save_for_backward(cos, sin)
        ctx.in_dtype = q.dtype
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out: torch.Tensor, dk_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = torch.empty_like(dq_out, dtype=ctx.in_dtype), torch.empty_like(dk_out, dtype=ctx.in_dtype)
        _launch(dq_out, dk_out, dq, dk, cos, sin, transpose=True)
        return dq, dk, None, None, None


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, fused.

    q (B, H_q, T, D), k (B, H_kv, T, D): any strides (the model's transposed views are read in place), one
    float dtype, D even. cos, sin: (B, T, D) or (1, T, D) (broadcast over the batch), not requiring grad.
    Returns (q_embed, k_embed) laid out like q and k, in ``out_dtype`` (None: ``promote_types(q.dtype,
    cos.dtype)``, as Llama's code gives; OLMo 2's casts back to q's), computed in fp32 and rounded once.
    Saves only cos and sin for backward.
    """
    _check(q, k, cos, sin)
    return RopeFunction.apply(q, k, cos, sin, out_dtype)
