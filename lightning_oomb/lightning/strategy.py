"""OOMBStrategy: Lightning training with the chunk-recurrent schedule, around an unchanged LightningModule.

The body is ``OOMBStrategyMixin``, which the single-device ``OOMBStrategy``, the data-parallel
``OOMBDDPStrategy`` (``lightning/ddp.py``) and the sharded ``OOMBModelParallelStrategy``
(``lightning/model_parallel.py``) put in front of Lightning's own strategy classes."""

from __future__ import annotations

import dataclasses
import itertools
import textwrap
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from ..core.config import PER_CHUNK_OVER_DOCUMENTS, ChunkConfig, SparseConfig, option_defaults, option_docs
from ..core.errors import SetupError
from ..core.host_memory import (
    GIB, available_host_memory, host_budget, host_headroom, machine_host_memory, process_host_bytes,
)
from ..core.plan.assumptions import HOST_GROWTH_BYTES
from ..core.ranks import Ranks
from ..core.schedule import ChunkHook
from ..core.served import Serving, serve
from ..core.units import parse_bytes
from ..integrations.transformers import find_causal_lm
from .callback import PagedKVCallback
from .checkpoint import AtomicCheckpointIO
from .summary import in_place_of as summary_in_place_of

SUPPORTED_PRECISION = ("32-true", "bf16-true", "bf16-mixed")
_DEFAULT = option_defaults(ChunkConfig)


def _host_memory(value: int | str) -> int:
    try:
        size = parse_bytes(value)
    except ValueError as e:
        raise SetupError(f"host_memory: {e}") from None
    if size < 1 << 30:
        raise SetupError(f"host_memory is the run's host memory budget in bytes, or a size with its unit such as "
                         f"100GiB; {value!r} is less than 1 GiB")
    # A budget the machine cannot give would only fail later, at a pinned allocation or by the OOM killer, with
    # the placement's plan wrong in between: a budget is of the machine the run trains on.
    ram = machine_host_memory()
    if size > ram:
        given = value if isinstance(value, str) else f"{value} bytes ({size / GIB:.1f} GiB)"
        raise SetupError(f"host_memory {given} is more than this machine's {ram / GIB:.1f} GiB of RAM; give at most "
                         "that, or leave host_memory out to use what the machine has available (`lightning-oomb "
                         "plan --host-memory` plans for another machine)")
    return size


class OOMBStrategyMixin:
    """Trains the transformers causal LM of a LightningModule with exact chunk-recurrent recomputation; put in
    front of a Lightning strategy class, to which the other keyword arguments go.

    The module's ``training_step`` stays as it is: its ``self.model(input_ids=..., labels=...)`` call runs
    stage 1 and returns the loss; ``backward`` on the loss Lightning hands back (scaled for gradient
    accumulation, under the precision plugin) runs stage 2. Validation and test steps get the same
    served forward without gradients.

    The arguments are ``ChunkConfig``'s fields, with its defaults and documentation (below); the rest go
    to the Lightning strategy class. ``sparse`` is overridden by a LightningModule with
    ``SparseAttentionMixin`` whose ``sparse_config`` is not None. ``host_memory`` is of this machine and
    ``gpu_memory`` of the device: a budget above either's memory is refused.
    """

    def __init__(
        self,
        chunk_size: int = _DEFAULT["chunk_size"],
        page_size: int = _DEFAULT["page_size"],
        attention: str = _DEFAULT["attention"],
        checkpoint_layers: bool = _DEFAULT["checkpoint_layers"],
        cross_chunk_gradients: bool = _DEFAULT["cross_chunk_gradients"],
        grad_dtype: str = _DEFAULT["grad_dtype"],
        sparse: SparseConfig | dict | None = _DEFAULT["sparse"],
        offload: str = _DEFAULT["offload"],
        segment_tokens: int | None = _DEFAULT["segment_tokens"],
        keep_attention: int | None = _DEFAULT["keep_attention"],
        keep_graphs: int | None = _DEFAULT["keep_graphs"],
        host_memory: int | str | None = _DEFAULT["host_memory"],
        gpu_memory: int | str | None = _DEFAULT["gpu_memory"],
        **kwargs: Any,
    ):
        # Checkpoints of long-context runs are large and slow to write: never leave a torn one behind. Set after
        # the base's __init__, since ModelParallelStrategy's takes no checkpoint_io. An explicit None (what the
        # Lightning CLI passes, having seen setdefault) stays None, so that a CheckpointIO among the Trainer's
        # plugins is not refused as set twice; the CLI makes the default atomic itself.
        kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        checkpoint_io = kwargs.pop("checkpoint_io")
        super().__init__(**kwargs)
        self.checkpoint_io = checkpoint_io
        self.chunk_config = ChunkConfig(
            chunk_size=chunk_size, page_size=page_size, attention=attention, checkpoint_layers=checkpoint_layers,
            cross_chunk_gradients=cross_chunk_gradients, grad_dtype=grad_dtype, sparse=sparse, offload=offload,
            segment_tokens=segment_tokens, keep_attention=keep_attention, keep_graphs=keep_graphs,
            host_memory=None if host_memory is None else _host_memory(host_memory), gpu_memory=gpu_memory,
        )
        self._pending: Serving | None = None

    # -- set-up -----------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        precision = self.precision_plugin.precision
        if precision not in SUPPORTED_PRECISION:
            raise SetupError(
                f"{type(self).__name__} supports precision {', '.join(SUPPORTED_PRECISION)}; got {precision!r}. "
                "float16 needs a gradient scaler that this strategy does not replay exactly: use bf16-mixed "
                "or bf16-true"
            )
        module_sparse = getattr(self.lightning_module, "sparse_config", None)
        if module_sparse is not None:  # the module's sparse options (SparseAttentionMixin) take precedence
            self.chunk_config = dataclasses.replace(self.chunk_config, sparse=module_sparse)
        trainer = self.lightning_module.trainer
        sparse = self.chunk_config.sparse
        if sparse is not None and not sparse.per_query_tile and getattr(trainer.datamodule, "document_masking", False):
            raise SetupError(PER_CHUNK_OVER_DOCUMENTS)
        if not any(isinstance(cb, PagedKVCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(PagedKVCallback())
        summary_in_place_of(trainer.callbacks)  # Lightning's model summary, without FLOPs it did not count
        if isinstance(self.checkpoint_io, AtomicCheckpointIO):
            self.checkpoint_io.host_room = self._checkpoint_host_room
        find_causal_lm(self.lightning_module)  # fail at set-up, not at the first step
        self._hold_to_gpu_budget()

    def _hold_to_gpu_budget(self) -> None:
        """With ``gpu_memory``, the caching allocator refuses to grow past it (the rest of a shared GPU stays
        free); a budget above the device's memory is refused."""
        budget, device = self.chunk_config.gpu_memory, self.root_device
        if budget is None or device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(device).total_memory
        if budget > total:
            raise SetupError(f"gpu_memory {budget / GIB:.1f} GiB is more than {device}'s {total / GIB:.1f} GiB; give "
                             "at most that, or leave gpu_memory out to use what the device has free")
        torch.cuda.set_per_process_memory_fraction(budget / total, device)

    def _checkpoint_host_room(self) -> int:
        """Host memory a copy of a checkpoint may take: the run's host memory budget less what the process
        holds now or was placed to hold at its step's peak, whichever is more, and the growth allowance."""
        placement = self.kv_callback.placement
        planned = placement.plan.peak_host_bytes if placement is not None and placement.plan is not None else 0
        held = max(process_host_bytes(), planned)
        return host_budget(self.chunk_config.host_memory) - held - HOST_GROWTH_BYTES

    @property
    def ranks(self) -> Ranks:
        """The data-parallel ranks a training step agrees with (``core.ranks``): here one process."""
        return Ranks()

    @property
    def before_chunk(self) -> ChunkHook | None:
        """The engine's hook before each chunk of both stages (``core.schedule.ChunkHook``): none here."""
        return None

    def _share_host_budget(self, local_ranks: int) -> None:
        """The ranks of a node share its host memory: each is placed against its share of the budget
        (``host_memory``, or what the machine has available less the headroom)."""
        if self.chunk_config.host_memory is not None:
            budget = self.chunk_config.host_memory // local_ranks
        else:
            available = available_host_memory()
            budget = process_host_bytes() + (available - host_headroom(available=available)) // local_ranks
        self.chunk_config = dataclasses.replace(self.chunk_config, host_memory=budget)

    @property
    def kv_callback(self) -> PagedKVCallback:
        return next(cb for cb in self.lightning_module.trainer.callbacks if isinstance(cb, PagedKVCallback))

    def _serve(self, max_calls: int | None):
        callback = self.kv_callback
        return serve(find_causal_lm(self.lightning_module), self.chunk_config, callback, max_calls, callback.observe,
                     self.optimizers, self.ranks, self.before_chunk)

    # -- steps ------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._release_pending()
        with self._serve(max_calls=1) as serving:
            output = super().training_step(*args, **kwargs)
        if not serving.sequences:
            raise RuntimeError(
                "training_step did not call the model with labels; under OOMBStrategy the loss must come from "
                "self.model(input_ids=..., labels=...).loss"
            )
        self._pending = serving
        return output

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Backpropagating the served loss runs stage 2 with the factor Lightning applied to it."""
        serving = self._pending
        if serving is None:
            raise RuntimeError("backward without a served training_step forward")
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if any(seq.table is not None for seq in serving.sequences):
            self._release_pending()
            raise RuntimeError(
                "the loss returned by training_step does not depend on the model's served loss, so stage 2 "
                "never ran; return (a function of) self.model(input_ids=..., labels=...).loss"
            )
        self._pending = None
        # The update that follows changes the weights and optimizer state a checkpoint may still be reading.
        if isinstance(self.checkpoint_io, AtomicCheckpointIO):
            self.checkpoint_io.wait_until_weights_free()
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._serve(max_calls=None):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._serve(max_calls=None):
            return super().test_step(*args, **kwargs)

    def _release_pending(self) -> None:
        if self._pending is not None:
            self._pending.release()
            self._pending = None

    @override
    def teardown(self) -> None:
        """Lightning's teardown moves the model and the optimizer state to the CPU: the checkpoint being written
        and the pinned page pool are given back first, or the host would hold both (a 1M-token run's pool and a
        7B model's AdamW state do not fit in 128 GB together: the kernel's OOM killer ended such a run here).
        The optimizer state and the last step's gradients are dropped rather than copied (43 GiB and most of
        a minute for a 7B model with AdamW): a later ``fit`` builds new optimizers, whose state comes from a
        checkpoint, and computes its own gradients. Weights the host has no room for stay on their device, and
        one line says so."""
        self._release_pending()
        wait = getattr(self.checkpoint_io, "wait", None)
        if wait is not None:
            wait()
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        for callback in trainer.callbacks if trainer is not None else ():
            if isinstance(callback, PagedKVCallback):
                callback.release_pool()
        for optimizer in self.optimizers:
            optimizer.state.clear()
        module = self.lightning_module
        if module is not None:
            module.zero_grad(set_to_none=True)
        # A set-up hook that refused the run did so before configure_model made the weights: the structure is on
        # the meta device, which Lightning's move to the CPU cannot copy, and its error would hide the refusal.
        # There is nothing to move, so the move is skipped for this call alone. Nor are weights moved that the
        # host has no room for (a step that failed still holding its pinned pages): the kernel's OOM killer
        # would end the process before the failure's message is printed.
        skeleton = module is not None and any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
        stays = skeleton
        if module is not None and not skeleton:
            moved = bytes_off_the_cpu(module)
            available = available_host_memory() if moved else 0
            if moved and not host_takes(moved, available):
                stays = True
                print(f"OOMBStrategy: the model's weights stay on {self.root_device} after the run: the host has "
                      f"{available / GIB:.2f} GiB available for their {moved / GIB:.2f} GiB")
        if stays:
            module.cpu = lambda: module
        try:
            super().teardown()
        finally:
            if stays:
                del module.cpu


def bytes_off_the_cpu(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers on a device other than the CPU (what ``.cpu()`` copies)."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers())
               if t.device.type not in ("cpu", "meta"))


def host_takes(nbytes: int, available: int) -> bool:
    """Whether ``nbytes`` more of host memory leave ``HOST_GROWTH_BYTES`` of the ``available`` bytes free."""
    return nbytes + HOST_GROWTH_BYTES <= available


# The Lightning CLI's help (`fit --help`) reads each argument's text from the class docstring: ChunkConfig's own.
OOMBStrategyMixin.__doc__ = OOMBStrategyMixin.__doc__.rstrip() + "\n\n" + textwrap.indent(option_docs(ChunkConfig), "    ")


class OOMBStrategy(OOMBStrategyMixin, SingleDeviceStrategy):
    """``OOMBStrategyMixin`` on one device.

    Args:
        device: the device to train on (default: the Trainer's accelerator's: the first CUDA device, or the CPU
            with ``accelerator="cpu"`` or without CUDA).
        The other arguments: ``OOMBStrategyMixin``'s (chunk_size, page_size, attention, ...) and
        ``SingleDeviceStrategy``'s.
    """

    strategy_name = "oomb"

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any):
        # Without a device the Trainer's accelerator decides at set-up (Trainer(accelerator="cpu") trains on the
        # CPU of a GPU machine, as with Lightning's own strategies); until then the first CUDA device, if any.
        self._device_from_accelerator = device is None
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=device, **kwargs)

    @override
    def setup_environment(self) -> None:
        if self._device_from_accelerator and isinstance(self.accelerator, CPUAccelerator):
            self._root_device = torch.device("cpu")
        super().setup_environment()
