"""Cross-entropy of the output layer computed in pieces of rows, so full logits never exist.

transformers computes ``cross_entropy(lm_head(h).float(), labels, reduction="sum") / n_valid``: the
logits in the model (or autocast) dtype, the softmax in float32. We do the same per piece of rows and
compute the gradients with respect to h and the weight in the same pass (as Liger-Kernel's fused
linear cross-entropy does), so backward is a multiply by the incoming gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOGITS_BUDGET_BYTES = 1 << 29  # float32 logits of one piece: 512 MiB


def piece_rows(vocab_size: int) -> int:
    """Rows per piece so that one piece's float32 logits stay within LOGITS_BUDGET_BYTES."""
    return max(1, LOGITS_BUDGET_BYTES // (4 * vocab_size))


def _pieces(n: int, vocab_size: int):
    step = piece_rows(vocab_size)
    for lo in range(0, n, step):
        yield slice(lo, min(lo + step, n))


def _add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w (V, d) float32 += g.T @ h, with g (n, V) and h (n, d) of one dtype."""
    if grad_w.is_cuda and g.dtype in (torch.bfloat16, torch.float16):
        # cuBLAS accumulates into the float32 sum itself: no rounded half-precision partial per piece and
        # no separate cast and add passes over a (V, d) matrix.
        torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)
    else:  # torch has no mixed-dtype matmul on the CPU
        grad_w += (g.t() @ h).float()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, normalizer: float):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for rows in _pieces(hidden.shape[0], weight.shape[0]):
            h = hidden[rows]
            logits = F.linear(h, weight, bias)
            logp = torch.log_softmax(logits.float(), dim=-1)
            tgt = targets[rows]
            total -= logp.gather(1, tgt[:, None]).sum()
            if need_h or need_w or need_b:
                g = logp.exp_()
                g[torch.arange(g.shape[0], device=g.device), tgt] -= 1.0
                g = (g / normalizer).to(logits.dtype)
                if need_h:
                    grad_h[rows] = (g @ weight.to(g.dtype)).to(hidden.dtype)
                if need_w:
                    _add_weight_grad(grad_w, g, h.to(g.dtype))
                if need_b:
                    grad_b += g.float().sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = grad_out.float()
        # In place: backward runs once, and a scaled copy of the (V, d) float32 accumulator would cost GBs.
        return (
            None if grad_h is None else grad_h.mul_(scale.to(grad_h.dtype)),
            None if grad_w is None else grad_w.mul_(scale).to(w_dtype),
            None if grad_b is None else grad_b.mul_(scale).to(b_dtype),
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    normalizer: float,
) -> torch.Tensor:
    """sum_i CE(hidden[i] @ weight.T + bias, targets[i]) / normalizer, a float32 scalar.

    hidden (N, d), weight (V, d), targets (N,) int64 with no ignored entries; differentiable in hidden,
    weight and bias. Peak extra memory: one piece of logits (``piece_rows`` rows) plus dL/dh (N, d) and,
    when the weight is trained, a float32 (V, d) accumulator.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, float(normalizer))
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in _pieces(hidden.shape[0], weight.shape[0]):
            logits = F.linear(hidden[rows], weight, bias).float()
            total += F.cross_entropy(logits, targets[rows], reduction="sum")
        return total / normalizer
