"""Fused SwiGLU product ``silu(gate) * up``, the middle of transformers' MLP
(``down_proj(act_fn(gate_proj(x)) * up_proj(x))``): one flat pass each way, in fp32, rounded once.

Backward gets gate and up only and recomputes s = sigmoid(g), where autograd would keep silu(gate) too (the
block's largest activation):  dgate = dout * u * s * (1 + g * (1 - s)),  dup = dout * g * s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import on_device_of

# Elements per program: 16 per thread at 8 warps, enough bytes in flight per SM to stay bandwidth-bound.
_BLOCK = 4096
_NUM_WARPS = 8


@triton.jit
def _silu_mul_fwd_kernel(G, U, OUT, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(DOUT, G, U, DG, DU, OUT, n_elements, BLOCK: tl.constexpr, WRITE_OUT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + offs, (dout * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dout * g * s).to(DU.dtype.element_ty), mask=mask)
    if WRITE_OUT:  # the forward's expression, so the forward's bits
        tl.store(OUT + offs, (g * s * u).to(OUT.dtype.element_ty), mask=mask)


def check_gate_up(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Refuse gate, up that the SwiGLU kernels cannot take (not floating point, or of other shapes, dtypes, devices)."""
    if not gate.is_floating_point() or not up.is_floating_point():
        raise ValueError(f"silu_mul needs floating-point gate and up, got {gate.dtype} and {up.dtype}")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have one dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on one device, got {gate.device} and {up.device}")


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of contiguous gate, up (one shape and dtype), without autograd."""
    out = torch.empty_like(gate)
    if out.numel():
        with on_device_of(gate):
            _silu_mul_fwd_kernel[_grid(out.numel())](gate, up, out, out.numel(), BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    return out


def _backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor,
              out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    dup = torch.empty_like(up)
    if dout.numel():
        with on_device_of(gate):
            _silu_mul_bwd_kernel[_grid(dout.numel())](
                dout, gate, up, dgate, dup, dout if out is None else out, dout.numel(),
                BLOCK=_BLOCK, WRITE_OUT=out is not None, num_warps=_NUM_WARPS,
            )
    return dgate, dup


def silu_mul_backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of ``silu(gate) * up`` for contiguous gate, up and the output gradient ``dout``."""
    dout = dout.contiguous()
    return _backward(dout, gate, up, torch.empty_like(gate), None)


def silu_mul_backward_and_product(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, dup, silu(gate) * up) in one pass, for a backward that needs the product again (the down
    projection's weight gradient): the product has the forward's bits. ``dout`` (contiguous, of gate's
    shape and dtype) is consumed: dgate is written into its memory, so the pass allocates what
    ``silu_mul_backward`` plus a separate ``silu_mul_forward`` would, and reads gate and up once."""
    if not dout.is_contiguous() or dout.shape != gate.shape or dout.dtype != gate.dtype:
        raise ValueError(f"dout must be contiguous of gate's shape {tuple(gate.shape)} and dtype {gate.dtype}, "
                         f"got {tuple(dout.shape)} {dout.dtype}")
    out = torch.empty_like(gate)
    dgate, dup = _backward(dout, gate, up, dout, out)
    return dgate, dup, out


class SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # Linear outputs are contiguous already; anything else is read through a contiguous copy.
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        return silu_mul_backward(dout, *ctx.saved_tensors)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, rounded once to the inputs' dtype.

    gate, up: one shape (e.g. (B, T, intermediate)), dtype and device; contiguous, as Linear outputs are
    (others are copied). Returns that shape and dtype, contiguous. Saves gate and up for backward (not
    silu(gate): backward recomputes it).
    """
    check_gate_up(gate, up)
    return SiluMulFunction.apply(gate, up)
