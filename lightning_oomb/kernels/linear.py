"""Linear layers whose weight-gradient matmul adds into ``weight.grad`` in place (``addmm_``, beta = 1).

Stage 2 runs one backward per chunk; autograd would write each chunk's dW into a new tensor and then add it
into ``.grad``: an extra pass over every weight per chunk, rounded twice. Where ``.grad`` does not exist yet
or something expects autograd to deliver the gradient (weight hooks, a DTensor, double backward, a process
group's gradient hooks), it goes through autograd. ``swiglu_linear`` is the MLP's down projection with
``silu(gate) * up`` computed inside: it saves gate and up, not the product. docs/architecture.md, "Fused ops".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import swiglu


def _adds_in_place(weight: torch.Tensor) -> bool:
    grad = weight.grad
    return (
        grad is not None
        and type(weight.data) is torch.Tensor
        and type(grad) is torch.Tensor
        and grad.dtype == weight.dtype
        and grad.shape == weight.shape
        and not grad.requires_grad
        and not weight._backward_hooks
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    )


def _weight_gradient(weight: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
    """dW = dy2^T x2 for (tokens, out) dy2 and (tokens, in) x2: added into ``weight.grad`` in place where it
    can be (then None), else returned for autograd. ``weight`` is the parameter the forward was given, not
    the saved tensor: inside a layer checkpoint (torch.utils.checkpoint, non-reentrant) saved tensors come
    back from the recomputation as detached aliases, whose ``.grad`` is always None."""
    # (grad mode is on here only in a backward with create_graph=True, which needs dW's graph)
    if not torch.is_grad_enabled() and _adds_in_place(weight):
        weight.grad.addmm_(dy2.t(), x2)
        return None
    return dy2.t() @ x2


def _trains_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear layer on x needs its weight's gradient here, outside autocast, in one dtype: the case
    the Functions below take over from ``F.linear``."""
    return (torch.is_grad_enabled() and weight.requires_grad and x.dtype == weight.dtype
            and not torch.is_autocast_enabled(x.device.type))


class _AccumulatingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.parameter = weight  # where .grad lives (see _weight_gradient)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = _weight_gradient(ctx.parameter, dy2, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def accumulating_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (..., in), weight (out, in), bias (out,) -> (..., out). In backward,
    dW is added into an existing ``weight.grad`` by the matmul (see the module docstring). Under autocast,
    or with x and weight in different dtypes, it is ``F.linear`` (whose dW autograd casts and accumulates)."""
    if _trains_weight(x, weight):
        return _AccumulatingLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _SwigluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up, weight)
        ctx.parameter = weight
        ctx.has_bias = bias is not None
        return F.linear(swiglu.silu_mul_forward(gate, up), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = db = None
        d_product = dy @ weight
        if ctx.needs_input_grad[2]:
            # The product comes out of the SwiGLU backward's pass over gate and up (dgate takes the memory of
            # d(product), so no more is held than with a separate recompute).
            dgate, dup, product = swiglu.silu_mul_backward_and_product(d_product, gate, up)
            dw = _weight_gradient(ctx.parameter, dy2, product.reshape(-1, gate.shape[-1]))
        else:
            dgate, dup = swiglu.silu_mul_backward(d_product, gate, up)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy2.sum(0)
        return dgate, dup, dw, db


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)`` with the fused SwiGLU kernel (lightning_oomb.kernels.swiglu):
    gate, up (..., intermediate), weight (out, intermediate) -> (..., out). For a trained weight, backward
    recomputes the product (in the SwiGLU backward's pass) instead of keeping it and adds dW as
    ``accumulating_linear`` does; otherwise (frozen weight, no grad, autocast, mixed dtypes) it is
    ``F.linear`` of ``silu_mul``, which keeps what it needs."""
    swiglu.check_gate_up(gate, up)
    if _trains_weight(gate, weight):
        return _SwigluLinear.apply(gate, up, weight, bias)
    return F.linear(swiglu.silu_mul(gate, up), weight, bias)
