"""Fused cross-entropy over rows of logits: the loss of each row and, in place of the logits, its gradient.

One program per row reads its logits twice in their own dtype and writes the gradient once, all arithmetic
in float32 as the unfused ``core.loss`` path (about seven passes over a float32 copy of each piece):

    lse   = max + log(sum_j exp(x_j - max))        (online over blocks of the row)
    loss  = lse - x[target]
    grad  = (exp(x - lse) - onehot(target)) * weight / normalizer,   rounded once to the logits' dtype

where x is the row's logits as the model's head makes them from lm_head's (integrations.transformers.LogitHead):
times ``multiplier``, then ``softcap * tanh(x / softcap)``, and the gradient is taken back through both. None for
either compiles it out; so does None for the rows' weights (then 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import on_device_of
from .tanh import tanh

# Columns per step of a row: 16 KB of bf16 logits over 8 warps.
_BLOCK = 8192
_NUM_WARPS = 8


@triton.jit
def _head(x, multiplier, softcap):
    """The model's logits from lm_head's x (float32): times multiplier, then soft-capped."""
    if multiplier is not None:
        x = x * multiplier
    if softcap is not None:
        x = softcap * tanh(x / softcap)
    return x


@triton.jit
def _cross_entropy_kernel(LOGITS, TARGETS, LOSS, WEIGHTS, n_cols, stride_row, normalizer, multiplier, softcap,
                          WITH_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = LOGITS + tl.program_id(0).to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK)
    running_max = float("-inf")
    sum_exp = 0.0
    for start in range(0, n_cols, BLOCK):
        if multiplier is None and softcap is None:
            x = tl.load(row + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        else:  # the padding columns stay -inf: a capped -inf would be -softcap
            mask = start + cols < n_cols
            x = tl.load(row + start + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.where(mask, _head(x, multiplier, softcap), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        sum_exp = sum_exp * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(sum_exp)
    target = tl.load(TARGETS + tl.program_id(0)).to(tl.int32)
    tl.store(LOSS + tl.program_id(0), lse - _head(tl.load(row + target).to(tl.float32), multiplier, softcap))
    if WITH_GRAD:
        if WEIGHTS is not None:
            weight = tl.load(WEIGHTS + tl.program_id(0)).to(tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if multiplier is not None:
                x = x * multiplier
            if softcap is not None:
                t = tanh(x / softcap)
                x = softcap * t
            grad = tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)
            if softcap is not None:  # d(cap tanh(x / cap))/dx
                grad = grad * (1.0 - t * t)
            if multiplier is not None:
                grad = grad * multiplier
            if WEIGHTS is not None:
                grad = grad * weight
            tl.store(row + start + cols, (grad / normalizer).to(LOGITS.dtype.element_ty), mask=mask)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, normalizer: float, grad: bool,
                       multiplier: float | None = None, softcap: float | None = None,
                       weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row cross-entropy (N,) float32 of logits (N, V) (unit column stride) against targets (N,) int64
    in [0, V), unweighted. With ``grad``, the logits are overwritten with d(sum of weight x loss)/normalizer /
    dlogits. multiplier, softcap: the model's head on the logits (module docstring), None for none. weights:
    (N,) float32 per row, None for all 1."""
    n, vocab = logits.shape
    if logits.stride(1) != 1 or targets.shape != (n,) or (weights is not None and weights.shape != (n,)):
        raise ValueError(f"logits must be (N, V) with unit column stride and targets and weights (N,), got "
                         f"{tuple(logits.shape)} (strides {logits.stride()}), {tuple(targets.shape)} and "
                         f"{None if weights is None else tuple(weights.shape)}")
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        with on_device_of(logits):
            _cross_entropy_kernel[(n,)](
                logits, targets, loss, weights, vocab, logits.stride(0), float(normalizer),
                None if multiplier is None else float(multiplier), None if softcap is None else float(softcap),
                WITH_GRAD=grad, BLOCK=min(_BLOCK, triton.next_power_of_2(vocab)), num_warps=_NUM_WARPS,
            )
    return loss
