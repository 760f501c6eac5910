"""OOMBDDPStrategy: data parallel over several devices, each rank running the chunk-recurrent schedule on its own
sequences (docs/architecture.md, "Several GPUs").

torch's DistributedDataParallel cannot wrap the model: its reducer expects each parameter's gradient once per
backward, and stage 2 runs one backward per chunk. The model stays unwrapped; the strategy broadcasts rank 0's
weights at set-up and averages the gradients once, after stage 2, in float32 buckets.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ..core.ranks import GRADIENT_BUCKET_BYTES, DataParallelRanks
from .strategy import OOMBStrategyMixin

def broadcast_weights(module: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)


def average_gradients(params: list[nn.Parameter], device: torch.device) -> None:
    """Replace each ``param.grad`` by its mean over the ranks, through float32 buckets of GRADIENT_BUCKET_BYTES (cut
    across parameters, so that a large embedding needs no copy of its own size).

    A parameter without a gradient here adds zeros, so that every rank issues the same all-reduces; it gets a
    gradient where any rank has one and stays None where none has, as one process would leave it (an
    optimizer skips such a parameter)."""
    had = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(had)
    for p, anywhere in zip(params, had.tolist()):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)
    params = [p for p in params if p.grad is not None]
    world = dist.get_world_size()
    total = sum(p.numel() for p in params)
    bucket = torch.empty(min(GRADIENT_BUCKET_BYTES // 4, total), dtype=torch.float32, device=device)
    pieces: list[tuple[torch.Tensor, int, int]] = []  # (flat gradient, start, end) of what the bucket holds
    used = 0

    def reduce() -> None:
        flat = bucket[:used]
        dist.all_reduce(flat)
        flat.div_(world)
        at = 0
        for grad, start, end in pieces:
            grad[start:end].copy_(flat[at : at + end - start])
            at += end - start
        pieces.clear()

    for p in params:
        grad = p.grad.view(-1)
        start = 0
        while start < grad.numel():
            end = min(grad.numel(), start + bucket.numel() - used)
            bucket[used : used + end - start].copy_(grad[start:end])
            pieces.append((grad, start, end))
            used += end - start
            start = end
            if used == bucket.numel():
                reduce()
                used = 0
    if used:
        reduce()


class AveragedAfterBackward:
    """For a data-parallel strategy: ``averaged_params()``' gradients are averaged over the ranks after each
    backward, except inside Lightning's ``block_backward_sync`` (the micro-batches of an accumulation before
    the last), where ``_average_after_backward`` is False."""

    _average_after_backward = True

    def averaged_params(self) -> list[nn.Parameter]:
        raise NotImplementedError

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        self._average_after_backward = False
        try:
            yield
        finally:
            self._average_after_backward = True

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._average_after_backward:
            average_gradients(self.averaged_params(), self.root_device)


class OOMBDDPStrategy(AveragedAfterBackward, OOMBStrategyMixin, DDPStrategy):
    """``OOMBStrategyMixin`` on several devices, one process each, data parallel ("oomb_ddp"): every rank trains
    on its own sequences and the gradients are averaged once per optimizer step, after stage 2 and before
    clipping, so that an update is one process's update of all ranks' batches together. The model is not wrapped
    in DistributedDataParallel (its reducer would fire once per chunk); hooks see the averaged gradients from
    ``on_before_optimizer_step`` on. docs/architecture.md, "Several GPUs", says how.

    Args: ``OOMBStrategyMixin``'s (chunk_size, page_size, attention, ...) and DDPStrategy's process arguments
    (accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
    process_group_backend, timeout, start_method); DDPStrategy's options for the DDP wrapper and its
    communication hooks do not apply.
    """

    strategy_name = "oomb_ddp"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        wrapper = dict(self._ddp_kwargs, ddp_comm_state=self._ddp_comm_state, ddp_comm_hook=self._ddp_comm_hook,
                       ddp_comm_wrapper=self._ddp_comm_wrapper, model_averaging_period=self._model_averaging_period)
        # The Lightning CLI (jsonargparse) follows **kwargs down to DistributedDataParallel's signature and passes
        # its defaults: a default asks for nothing.
        defaults = {name: p.default for name, p in inspect.signature(DistributedDataParallel.__init__).parameters.items()}
        unused = [name for name, value in wrapper.items() if value is not None and value != defaults.get(name)]
        if unused:
            raise TypeError(f"OOMBDDPStrategy does not wrap the model in DistributedDataParallel, so "
                            f"{', '.join(unused)} do not apply; remove them")

    @property
    @override
    def ranks(self) -> DataParallelRanks:
        return DataParallelRanks(self.root_device)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._share_host_budget(self.num_processes)

    @override
    def configure_ddp(self) -> None:
        broadcast_weights(self.model)

    @override
    def averaged_params(self) -> list[nn.Parameter]:
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("oomb_ddp", "popen"), ("oomb_ddp_spawn", "spawn")):
            strategy_registry.register(name, cls, description=f"{cls.__name__} with start_method {start_method!r}",
                                       start_method=start_method, override=True)


OOMBDDPStrategy.register_strategies(StrategyRegistry)
