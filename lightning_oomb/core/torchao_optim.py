"""torchao's AdamW classes as ``model.optimizer`` builds them: their compiled step made with one fixed kernel
configuration on CUDA.

Inductor tries several configurations of a Triton kernel at its first launch. Before it does so for a kernel
that writes into its inputs (an optimizer step writes the weights and the moments), it copies those inputs,
and where the GPU has no room for the copies (a long-context step leaves none) it copies them to pinned host
memory, which torch's pinned allocator rounds up to powers of two and keeps for the life of the process:
13 GiB for a Qwen2.5-7B update with adamw8bit-kahan and 8 GiB with adamw8bit, measured on an H100, enough to
get a run killed that its plan said would fit (docs/optimizers.md). With one configuration per kernel
(Inductor's deterministic mode, pointwise autotuning off) nothing is tried and nothing copied; the measured
step time is the same. The moments' reductions are maxima, so the configuration does not change the result.

The 8-bit moments' step holds each moment in float32 before quantizing it again, and the compensated step its
float32 weight: 12 bytes per element for adamw8bit-kahan, 2 GiB apiece for Qwen2.5-7B's embedding, which ran a
79 GiB step's first update out of GPU memory. ``SlicedStep`` updates a large parameter SLICE_ELEMENTS elements
at a time (rows that fill whole 8-bit blocks, so each slice's moments are those rows' own), the same arithmetic.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
from torchao.optim import _AdamW as _TorchaoAdamW
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit

from .optimizer_slices import row_slices

# Inductor settings under which a compiled optimizer step is built; keys an older torch lacks are left out
# (without ``deterministic`` its reductions are still tried, and copied, at their first launch).
ONE_CONFIG_INDUCTOR = {"triton.autotune_pointwise": False, "deterministic": True}


def one_config_inductor() -> contextlib.AbstractContextManager:
    """A context in which ``torch.compile`` builds each Triton kernel at one configuration (ONE_CONFIG_INDUCTOR,
    the keys this torch has)."""
    import torch._inductor.config as inductor

    settings = {}
    for key, value in ONE_CONFIG_INDUCTOR.items():
        owner, _, name = key.rpartition(".")
        if hasattr(getattr(inductor, owner) if owner else inductor, name):
            settings[key] = value
    return inductor.patch(settings)


class OneConfigStep:
    """Mixed in front of a torchao optimizer: its steps on CUDA run under ``one_config_inductor`` (on the CPU,
    where Inductor writes C++ and tries nothing, as they are)."""

    def step(self, closure=None):
        on_cuda = any(p.is_cuda for group in self.param_groups for p in group["params"])
        with one_config_inductor() if on_cuda else contextlib.nullcontext():
            return super().step(closure)




def rows_of(t: Tensor, rows: slice | None) -> Tensor:
    """``t[rows]``, a view; ``t`` itself for None. An 8-bit state's rows come as a new state holding copies of
    its codes and scales (torch.compile takes no view of one): ``put_rows`` writes them back."""
    if rows is None:
        return t
    if isinstance(t, OptimState8bit):
        return OptimState8bit(t.codes[rows].clone(), t.scale[_scale_rows(t, rows)].clone(), t.qmap, t.signed)
    return t[rows]


def _scale_rows(t: OptimState8bit, rows: slice) -> slice:
    """The scales (one per block) of rows ``rows`` of ``t``, which start and end on block boundaries."""
    row = t.codes[0].numel()
    return slice(rows.start * row // t.block_size, rows.stop * row // t.block_size)


def put_rows(t: Tensor, rows: slice | None, part: Tensor) -> None:
    """Write an 8-bit state's rows taken by ``rows_of`` back into it (other tensors' rows are views)."""
    if rows is not None and isinstance(t, OptimState8bit):
        t.codes[rows].copy_(part.codes)
        t.scale[_scale_rows(t, rows)].copy_(part.scale)


class SlicedStep:
    """torchao's AdamW step loop (its state, its ``single_param_adam``, compiled on CUDA), each parameter updated
    in ``row_slices``; ``_update`` is one slice's update (overridden for compensated weights)."""

    compiled_on_cpu = True  # torchao compiles its step on every device

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("sparse gradients are not supported")
                    state = self.state[p]
                    if not state:
                        self._init_state(p, state, group)
                    state["step"] += 1
                    names = [k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in state]
                    # A sharded (DTensor) weight is stepped whole, as torchao steps it.
                    for rows in [None] if isinstance(p, DTensor) else row_slices(p, self.block_size):
                        parts = {k: rows_of(state[k], rows) for k in names}
                        self._update(rows_of(p.detach(), rows), rows_of(p.grad, rows), parts, state, group, rows)
                        for k in names:
                            put_rows(state[k], rows, parts[k])
        return loss

    def _init_state(self, p: Tensor, state: dict, group: dict) -> None:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = self._new_buffer(p, True)
        state["exp_avg_sq"] = self._new_buffer(p, False)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = self._new_buffer(p, False)

    def _moments(self, parts: dict, state: dict, group: dict) -> tuple:
        """single_param_adam's arguments after the weight and gradient: ``parts``, the moments' rows."""
        return (state["step"], parts["exp_avg"], parts["exp_avg_sq"], parts.get("max_exp_avg_sq"), group["lr"],
                group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], self.is_adamw)

    def _update(self, p: Tensor, grad: Tensor, parts: dict, state: dict, group: dict, rows: slice | None) -> None:
        compiled = p.is_cuda or self.compiled_on_cpu
        single = torch.compile(single_param_adam, fullgraph=True, dynamic=False) if compiled else single_param_adam
        single(p, grad, *self._moments(parts, state, group), False)


class AdamW8bit(OneConfigStep, SlicedStep, _TorchaoAdamW8bit):
    """torchao's AdamW8bit (8-bit moments), large parameters updated in slices (SlicedStep)."""


class AdamW(OneConfigStep, _TorchaoAdamW):
    """torchao's AdamW (moments in the weights' dtype; ``bf16_stochastic_round`` for adamw-sr)."""

