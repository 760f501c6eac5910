"""AdamW with Kahan-compensated bf16 weights: torchao's AdamW arithmetic on weight + compensation.

Each bf16 weight ``p`` has a bf16 buffer ``c`` with what rounding the last update left out; a step runs
torchao's ``single_param_adam`` on ``p + c`` in float32 and writes back ``p = bf16(hi)``, ``c = bf16(hi - p)``,
so updates far below bf16's spacing accumulate (docs/optimizers.md). On CUDA the per-tensor step is one
``torch.compile`` kernel that keeps that round trip (``emulate_precision_casts``), built at one kernel
configuration (core/torchao_optim.py says why); on the CPU it runs eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchao.optim import AdamW8bit, _AdamW
from torchao.optim.adam import single_param_adam

from .errors import SetupError
from .torchao_optim import OneConfigStep, SlicedStep, rows_of


def compensated_adam_step(
    hi: Tensor, p: Tensor, compensation: Tensor, grad: Tensor, step: Tensor, exp_avg: Tensor,
    exp_avg_sq: Tensor, max_exp_avg_sq: Tensor | None, lr: Tensor, beta1: float, beta2: float,
    weight_decay: float, eps: float, is_adamw: bool,
) -> None:
    """One AdamW update of bf16 ``p`` (any shape) with its bf16 ``compensation`` (same shape), in place.

    ``hi``: a float32 scratch tensor of ``p``'s shape (an input, so that compiled code writes it). The moments
    are torchao's (plain or 8-bit subclass tensors), updated in place by ``single_param_adam``."""
    hi.copy_(p.float() + compensation.float())
    single_param_adam(hi, grad, step, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, weight_decay, eps,
                      is_adamw, False)
    rounded = hi.to(p.dtype)
    p.copy_(rounded)
    compensation.copy_(hi - rounded.float())


_compiled_step = torch.compile(compensated_adam_step, fullgraph=True, dynamic=False,
                               options={"emulate_precision_casts": True})


class _Kahan(SlicedStep):
    """SlicedStep with compensated bf16 weights (mixed into torchao's AdamW classes below)."""

    compiled_on_cpu = False

    def _check_params(self) -> None:
        for group in self.param_groups:
            if any(isinstance(p, DTensor) for p in group["params"]):
                raise SetupError(f"{type(self).__name__} steps whole tensors, not sharded (DTensor) weights: "
                                 "use adamw8bit or adamw-sr with oomb_model_parallel")

    def _init_state(self, p: Tensor, state: dict, group: dict) -> None:
        super()._init_state(p, state, group)
        if p.dtype == torch.bfloat16:
            state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, p: Tensor, grad: Tensor, parts: dict, state: dict, group: dict, rows: slice | None) -> None:
        if "compensation" not in state:
            return super()._update(p, grad, parts, state, group, rows)
        step = _compiled_step if p.is_cuda else compensated_adam_step
        hi = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        step(hi, p, rows_of(state["compensation"], rows), grad, *self._moments(parts, state, group))


class KahanAdamW(OneConfigStep, _Kahan, _AdamW):
    """torchao's AdamW (moments in the weights' dtype) with compensated bf16 weights."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)
        self._check_params()


class KahanAdamW8bit(OneConfigStep, _Kahan, AdamW8bit):
    """torchao's AdamW8bit (8-bit moments) with compensated bf16 weights."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 block_size=256):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, block_size=block_size)
        self._check_params()
