"""Fused RMSNorm: one pass over x forward, one over (x, dy) backward.

Computes what transformers' ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` computes, in its rounding order: normalise in
fp32, round the normalised row to x's dtype, multiply by the weight in fp32 and round once to
``promote_types(weight.dtype, x.dtype)``. It saves x and one fp32 rstd per row (the HF module keeps an fp32
copy of x and the rounded row); dweight is summed per program into fp32 partials that torch adds in a fixed
order: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import on_device_of

# Elements of x one program holds at once: whole rows of a wide hidden size, several rows of a narrow one
# (Qwen3's per-head norm over D = 128 runs on B * T * H rows of 128).
# Backward tiles are smaller: the loop over a program's rows keeps x, dy and a dweight accumulator live.
_FWD_TILE = 4096
_BWD_TILE = 1024


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, n_rows, sx_row, sy_row, eps,
    N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * sx_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    # HF rounds the normalised row to x's dtype before the weight multiplies it; the product is then
    # taken in fp32 and rounded once, as torch does for a half-precision product.
    h = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows64[:, None] * sy_row + cols[None, :], (w[None, :] * h).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, rows_per_program, sdy_row, sx_row, sdx_row,
    N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE_DW: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    # Summed over rows once, after the loop: a cross-warp reduction per tile would cost more than the loads.
    dw = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    # rows_per_program is a multiple of BLOCK_R: no tile reaches into the next program's rows.
    first = pid * rows_per_program
    for r0 in range(first, tl.minimum(first + rows_per_program, n_rows), BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * sx_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * sdy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        # dx = rstd * (g - h * mean(g * h)), passing the forward's rounding of h straight through, as autograd
        # passes a gradient through ``.to()``.
        h = x * rstd[:, None]
        g = dy * w[None, :]
        dx = rstd[:, None] * (g - h * (tl.sum(g * h, axis=1) / N)[:, None])
        tl.store(DX + rows64[:, None] * sdx_row + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            # Same rstd, same product: bit for bit the rounded row the forward multiplied by the weight.
            dw += dy * h.to(X.dtype.element_ty).to(tl.float32)
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, tl.sum(dw, axis=0), mask=col_ok)


def _tiles(n: int, tile_elems: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, num_warps) for rows of n elements: a tile of about tile_elems elements."""
    block_n = triton.next_power_of_2(n)
    block_r = max(1, tile_elems // block_n)
    # About 16 elements per thread: 4 warps up to 2048-element tiles, 16 from 8192 (a row of 8192).
    num_warps = min(16, max(4, block_r * block_n // 512))
    return block_r, block_n, num_warps


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"rms_norm needs floating-point x and weight, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D (N,), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x must be (..., N) with N = weight's {weight.shape[0]}, got shape {tuple(x.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("rms_norm needs N >= 1")


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as (rows, n) with a unit column stride: a view wherever one exists."""
    t = t.reshape(-1, n)
    return t if t.stride(1) == 1 else t.contiguous()


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (rows, N), weight (N,) -> y (rows, N) in promote_types(weight, x), rstd (rows,) fp32."""
    n_rows, n = x.shape
    y = torch.empty((n_rows, n), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block_r, block_n, num_warps = _tiles(n, _FWD_TILE)
        with on_device_of(x):
            _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
                x, weight, y, rstd, n_rows, x.stride(0), y.stride(0), eps,
                N=n, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=num_warps,
            )
    return y, rstd


def _backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy, x (rows, N), weight (N,), rstd (rows,) -> dx (rows, N) in x's dtype, dweight (N,) in weight's
    dtype (None unless compute_dw)."""
    n_rows, n = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n_rows == 0:
        return dx, torch.zeros_like(weight) if compute_dw else None
    block_r, block_n, num_warps = _tiles(n, _BWD_TILE)
    n_tiles = triton.cdiv(n_rows, block_r)
    # Several programs per SM keep enough loads in flight; but with wide rows the fp32 partials of dweight,
    # (programs, N), cost a write and a read that grow with the program count. Measured on an H200 (bf16,
    # N = 128 ... 8192): 3.0-3.4 TB/s with dweight, 3.5-4.1 TB/s without.
    per_sm = 2 if compute_dw and block_n > 2048 else 8
    max_programs = per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    tiles_per_program = triton.cdiv(n_tiles, min(n_tiles, max_programs))
    programs = triton.cdiv(n_tiles, tiles_per_program)
    partial = torch.empty((programs, n) if compute_dw else (1,), dtype=torch.float32, device=x.device)
    with on_device_of(x):
        _rms_norm_bwd_kernel[(programs,)](
            dy, x, weight, rstd, dx, partial, n_rows, tiles_per_program * block_r,
            dy.stride(0), x.stride(0), dx.stride(0),
            N=n, BLOCK_R=block_r, BLOCK_N=block_n, COMPUTE_DW=compute_dw, num_warps=num_warps,
        )
    return dx, partial.sum(0).to(weight.dtype) if compute_dw else None


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n = x.shape[-1]
        x2, w = _rows(x, n), weight.contiguous()
        y, rstd = _forward(x2, w, eps)
        ctx.save_for_backward(x2, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w, rstd = ctx.saved_tensors
        dx, dw = _backward(_rows(dy, x2.shape[1]), x2, w, rstd, ctx.needs_input_grad[1])
        return dx.view(dy.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim, statistics in fp32, as
    transformers' ``Qwen2RMSNorm`` / ``LlamaRMSNorm`` forward computes it.

    x: (..., N), any float dtype (rows are read with their stride; a copy only where x's rows cannot be
    viewed as (rows, N) with unit column stride). weight: (N,). Returns (..., N) contiguous in
    ``promote_types(weight.dtype, x.dtype)``. Saves x and one fp32 rstd per row for backward.
    """
    _check(x, weight)
    return RMSNormFunction.apply(x, weight, float(eps))
