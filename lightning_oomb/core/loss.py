"""Cross-entropy of the output layer computed in pieces of rows, so full logits never exist.

transformers computes ``cross_entropy(lm_head(h).float(), labels, reduction="sum") / n_valid``: the
logits in the model (or autocast) dtype, the softmax in float32. We do the same per piece of rows and,
when training, compute the gradients with respect to h and the output layer in the same pass (as
Liger-Kernel's fused linear cross-entropy does). A family's change of the logits before its loss (``LogitHead``:
a scale, a soft cap) is applied to each piece in float32, as the softmax is, and its derivative to the
gradient. The schedule keeps dL/dh of a chunk until its decoder is
backpropagated and sums the output layer's gradient over all chunks in float32 (``HeadGradients``), so
the incoming gradient scale is applied once, at the end, and the layer's weight gradient is rounded once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # not at run time: the planner imports this module without transformers
    from ..integrations.transformers import LogitHead

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


class HeadGradients:
    """float32 sums of the output layer's weight and bias gradients over a step's chunks, delivered once.

    Only for the parameters that require grad; ``deliver(scale)`` multiplies the sums by the incoming
    gradient and hands them to autograd (``AccumulateGrad``: added into ``.grad``, hooks run as usual).
    """

    def __init__(self, head: nn.Linear):
        self.head = head
        self.weight = self._sum_for(head.weight)
        self.bias = self._sum_for(head.bias)

    @staticmethod
    def _sum_for(param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None or not param.requires_grad:
            return None
        return torch.zeros(param.shape, dtype=torch.float32, device=param.device)

    def deliver(self, scale: torch.Tensor) -> None:
        """Add ``scale`` (float32 scalar tensor) times the sums into the parameters' gradients; frees them."""
        params, grads = [], []
        for param, total in ((self.head.weight, self.weight), (self.head.bias, self.bias)):
            if total is not None:
                params.append(param)
                grads.append(total.mul_(scale).to(param.dtype))  # in place: a scaled copy would cost GBs
        self.weight = self.bias = None
        if params:
            torch.autograd.backward(params, grads)


def _head_backward(g: torch.Tensor, z: torch.Tensor, head: LogitHead) -> None:
    """g (n, V) float32, dLoss/d(the model's logits z), becomes dLoss/d(lm_head's logits), in place; z is
    consumed. d(cap tanh(x / cap))/dx = 1 - tanh^2 = 1 - (z / cap)^2."""
    if head.softcap is not None:
        g.mul_(z.div_(head.softcap).square_().neg_().add_(1.0))
    if head.scale != 1.0:
        g.mul_(head.scale)
    if head.divisor != 1.0:
        g.div_(head.divisor)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    normalizer: float,
    head_grads: HeadGradients | None = None,
    with_grad_hidden: bool = False,
    fused: bool = False,
    head: LogitHead | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum_i w_i CE(head(hidden[i] @ weight.T + bias), targets[i]) / normalizer, dLoss/dhidden or None), with
    w_i = ``weights[i]`` ((N,) float32; None: 1).

    hidden (N, d), weight (V, d), targets (N,) int64 with no ignored entries. The loss is a float32 scalar;
    no autograd graph is recorded. With ``head_grads`` the output layer's gradients are added into its
    float32 sums; with ``with_grad_hidden`` dLoss/dhidden (N, d) in hidden's dtype is returned. Peak extra
    memory: one piece of logits (``piece_rows`` rows), its float32 log-probabilities and gradient; with
    ``fused`` (the Triton kernel of ``kernels.cross_entropy``, same float32 arithmetic) only the logits,
    which the kernel overwrites with their gradient. head: what the model does to the logits before its loss
    (None: nothing), applied in float32.
    """
    if head is not None and head.identity:
        head = None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_w = head_grads.weight if head_grads is not None else None
    grad_b = head_grads.bias if head_grads is not None else None
    grad_h = torch.empty_like(hidden) if with_grad_hidden else None
    wants_grad = grad_h is not None or grad_w is not None or grad_b is not None
    with torch.no_grad():
        for rows in _pieces(hidden.shape[0], weight.shape[0]):
            h = hidden[rows]
            logits = F.linear(h, weight, bias)
            tgt = targets[rows]
            w = None if weights is None else weights[rows]
            if fused:
                from ..kernels.cross_entropy import cross_entropy_rows

                multiplier = None if head is None or head.multiplier == 1.0 else head.multiplier
                softcap = None if head is None else head.softcap
                losses = cross_entropy_rows(logits, tgt, normalizer, grad=wants_grad, multiplier=multiplier,
                                            softcap=softcap, weights=w)
                total += losses.sum() if w is None else (losses * w).sum()
                g = logits  # overwritten with dLoss/dlogits
            else:
                z = logits.float() if head is None else head.apply(logits.float(), inplace=True)  # logits unused after
                logp = torch.log_softmax(z, dim=-1)
                picked = logp.gather(1, tgt[:, None])[:, 0]
                total -= picked.sum() if w is None else (picked * w).sum()
                if wants_grad:
                    g = logp.exp_()
                    g[torch.arange(g.shape[0], device=g.device), tgt] -= 1.0
                    if head is not None:
                        _head_backward(g, z, head)
                    if w is not None:
                        g *= w[:, None]
                    g = (g / normalizer).to(logits.dtype)
            if grad_h is not None:
                grad_h[rows] = (g @ weight.to(g.dtype)).to(hidden.dtype)
            if grad_w is not None:
                _add_weight_grad(grad_w, g, h.to(g.dtype))
            if grad_b is not None:
                grad_b += g.float().sum(0)
    return total / normalizer, grad_h
