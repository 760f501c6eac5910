"""OOMBModelParallelStrategy: data parallel with the decoder layers' weights, gradients and optimizer state
sharded over the ranks by FSDP2, optionally split by KV heads (tensor parallel) first. Only the decoder layers
are sharded: the engine calls them, and reads the output layer's weight, outside FSDP's forward hooks
(docs/architecture.md, "Several GPUs", says why that keeps the embeddings, final norm and output layer whole).
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from typing_extensions import override

from ..core.errors import SetupError
from ..core.model_shape import ModelShape
from ..core.ranks import DataParallelRanks
from ..core.schedule import ChunkHook
from ..core.sparse import SparseConfig
from ..integrations.decoder import decoder_of
from ..integrations.transformers import find_causal_lm
from .checkpoint import partial_path, replace_folder
from .ddp import AveragedAfterBackward
from .strategy import OOMBStrategyMixin

SHARDING = ("zero1", "zero2", "zero3")


def shard_decoder_layers(lm: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """``fully_shard`` each decoder layer of the causal LM ``lm`` over ``mesh``, then the decoder as their root
    with its own weights (embeddings, final norm) left whole; the output layer is outside the decoder.

    Gradients are reduced in float32 whatever the weights' dtype, as oomb_ddp's buckets are."""
    decoder = decoder_of(lm)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    sharded = {id(p) for layer in decoder.layers for p in layer.parameters()}
    # The decoder as root: one FSDP group for all layers (one post-backward callback per backward, prefetching
    # from layer to layer) whose forward the engine does run, unlike the causal LM's.
    fully_shard(decoder, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                ignored_params={p for p in decoder.parameters() if id(p) not in sharded})


# Each decoder layer's tensor-parallel plan: the attention heads and the MLP's hidden units split over the ranks
# (q/k/v and gate/up by output features, o and down by input features, whose outputs are summed over the ranks).
TENSOR_PARALLEL_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def check_tensor_parallel(lm: nn.Module, size: int, lora: bool, sparse: SparseConfig | None = None) -> None:
    """Refuse, before any work, a model that ``size`` ranks cannot split by whole KV heads and hidden units, and
    a sparse selection that needs every KV head at once."""
    if size == 1:
        return
    if lora:
        raise SetupError(f"tensor_parallel_size={size} with a LoRA (peft) model is not built; use "
                         "tensor_parallel_size=1")
    if sparse is not None and not sparse.per_kv_head:
        raise SetupError(f"tensor_parallel_size={size} with sparse per_kv_head=False: one page selection for all KV "
                         "heads needs the scores of heads on other ranks; use per_kv_head=True (each KV head its "
                         "own pages) or tensor_parallel_size=1")
    try:
        ModelShape.resolve(lm).tensor_parallel_part(size, option="tensor_parallel_size")
    except ValueError as e:
        raise SetupError(str(e)) from None


def parallelize_decoder_layers(lm: nn.Module, mesh: DeviceMesh) -> None:
    """Split each decoder layer of the causal LM ``lm`` over the tensor-parallel ``mesh`` (TENSOR_PARALLEL_PLAN):
    each rank computes attention for its H_q/T query and H_kv/T KV heads, (B, H/T, t, D), and 1/T of the MLP's
    hidden units; the embeddings, norms and output layer stay whole on every rank."""
    for layer in decoder_of(lm).layers:
        parallelize_module(layer, mesh, TENSOR_PARALLEL_PLAN)


def _gathered_numel(param: DTensor) -> int:
    """Elements of an FSDP-sharded ``param`` that a rank holds while FSDP has gathered it: whole over the
    data-parallel ranks, but still split over the tensor-parallel ones where ``parallelize_decoder_layers`` split it."""
    names = param.device_mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and param.placements[names.index("tensor_parallel")].is_shard():
        return param.numel() // param.device_mesh.size(names.index("tensor_parallel"))
    return param.numel()


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient, to scale in place: a DTensor's shard, or the whole tensor."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) over gradients of which some are sharded DTensors and the others
    whole and equal on every rank, which torch's cannot mix; returns the total norm (float32 scalar)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # a shard's norm: summed over ranks
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        _local(grad).mul_(scale.to(grad.dtype))
    return total


def step_sharded_and_whole_apart(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` update tensor by tensor in each parameter group that holds both sharded (DTensor) and
    whole parameters: torch's foreach and fused kernels take one list of a kind, and mixed fail at the first step
    (foreach is torch's default on CUDA). The per-tensor loop computes the same update. A group that asked for
    foreach or fused is refused (``SetupError``) rather than changed."""
    for index, group in enumerate(optimizer.param_groups):
        if len({isinstance(p, DTensor) for p in group["params"]}) < 2 or "foreach" not in group:
            continue
        asked = [option for option in ("foreach", "fused") if group.get(option)]
        if asked:
            raise SetupError(f"{type(optimizer).__name__} with {asked[0]}=True: parameter group {index} holds the "
                             "sharded decoder layers and the whole embeddings, norm and output layer, which torch's "
                             f"{asked[0]} kernels cannot step together; leave {asked[0]} unset (the strategy steps "
                             "such a group tensor by tensor) or put the whole weights in a group of their own")
        group["foreach"] = False


def clip_grad_value(params: Iterable[nn.Parameter], clip_value: float) -> None:
    """``torch.nn.utils.clip_grad_value_`` over sharded and whole gradients alike."""
    for p in params:
        if p.grad is not None:
            _local(p.grad).clamp_(-clip_value, clip_value)


class OOMBModelParallelStrategy(AveragedAfterBackward, OOMBStrategyMixin, ModelParallelStrategy):
    """``OOMBStrategyMixin`` data parallel over ``data_parallel_size`` ranks ("oomb_model_parallel") with the decoder
    layers sharded by FSDP2 (``fully_shard``, on Lightning's ``ModelParallelStrategy`` and its device mesh) and
    optionally split by KV heads over ``tensor_parallel_size`` ranks: a step's update is one process's update of
    all ranks' batches together. The embeddings, final norm and output layer stay whole on every rank; a
    ``configure_model`` is optional and must leave them unsharded. Launch with ``torchrun`` or Lightning's own
    launcher (no spawn variant). docs/architecture.md, "Several GPUs", says how.

    data_parallel_size: "auto" (default): the run's processes divided by tensor_parallel_size; an int must be
        that number.
    sharding:
        "zero2" (default): the layers' weights are gathered in stage 1's first chunk and kept until stage 2's
            last (``reshard_after_forward=False``, and no reshard after backward until then); each chunk's
            gradients are reduce-scattered into the sharded gradients. Per rank: whole weights during the step,
            sharded gradients and optimizer state.
        "zero3": weights gathered for each chunk's forward and again for its backward, resharded after each
            (``reshard_after_forward=True``): 1/N of the weights at rest, for models whose weights do not fit.
        "zero1": gathered as zero2, but the gradients are summed unsharded over the chunks (and micro-batches)
            and reduce-scattered once, after the last: whole gradients during the step (float32 for bfloat16
            weights), one reduce-scatter per optimizer step instead of one per chunk.
    tensor_parallel_size: T (default 1) ranks split each decoder layer by KV heads (``parallelize_decoder_layers``:
        q/k/v and gate/up column-wise, o and down row-wise): each rank computes attention for H_kv/T KV heads
        and holds their K/V pages and 1/T of the layers' weights, gradients and optimizer state; the T ranks of a
        group run the same batch. With data_parallel_size D > 1 as well (D*T processes, Lightning's 2-D mesh)
        FSDP2 shards each rank's part over the D ranks as ``sharding`` says; with D = 1 ``sharding`` does not
        apply. T must divide num_key_value_heads, num_attention_heads and intermediate_size; with T > 1 LoRA
        (peft) models and a ``configure_model`` that applied ``fully_shard`` are refused.
    save_distributed_checkpoint: False (default): checkpoints are gathered on rank 0 and written as one file by
        ``AtomicCheckpointIO`` (atomic, in the background). True: every rank writes its own shards into one folder
        with torch.distributed.checkpoint (nothing whole on any rank), as ``.<name>.partial``, renamed over the
        target once every rank has finished (``checkpoint.replace_folder``), before the step goes on.

    Args: ``OOMBStrategyMixin``'s (chunk_size, page_size, attention, ...), the above, and
    ``ModelParallelStrategy``'s process_group_backend and timeout.
    """

    strategy_name = "oomb_model_parallel"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        sharding: str = "zero2",
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ):
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {tensor_parallel_size!r}")
        if sharding not in SHARDING:
            raise ValueError(f"sharding must be one of {', '.join(SHARDING)}, got {sharding!r}")
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend,
                         timeout=timeout, **kwargs)
        self.sharding = sharding
        self._fsdp_modules: list[FSDPModule] = []
        self._step_gpu_bytes = 0
        self._replicated: list[nn.Parameter] = []

    @property
    @override
    def ranks(self) -> DataParallelRanks:
        return DataParallelRanks(self.root_device, self._step_gpu_bytes, kv_head_split=self._tensor_parallel_size)

    def _gathered_bytes(self) -> int:
        """GPU bytes a step adds to the shards at rest, which the placement must leave free: the other data-
        parallel ranks' shards of the layers gathered (zero1, zero2: every layer for the whole step; zero3: the
        layer computing and the one prefetched) and, under zero1, the unsharded float32 gradients summed until
        the last chunk. Under tensor parallelism FSDP gathers and reduces this rank's tensor-parallel part only."""
        # The innermost FSDP modules (the layers): the decoder above them holds no sharded weight of its own.
        layers = [[p for p in m.parameters() if isinstance(p, DTensor)] for m in self._fsdp_modules
                  if not any(isinstance(c, FSDPModule) for c in m.modules() if c is not m)]
        per_layer = [sum((_gathered_numel(p) - p.to_local().numel()) * p.element_size() for p in params)
                     for params in layers]
        gathered = sum(per_layer) if self.sharding != "zero3" else sum(sorted(per_layer)[-2:])
        if self.sharding == "zero1":
            gathered += sum(4 * _gathered_numel(p) for params in layers for p in params if p.requires_grad)
        return gathered

    @override
    def setup_environment(self) -> None:
        tensor = self._tensor_parallel_size
        if self._data_parallel_size == "auto":  # Lightning's "auto" is one rank per node (with TP inside a node)
            self._data_parallel_size = self.num_nodes * self.num_processes // tensor
        super().setup_environment()
        self._share_host_budget(self.num_processes)

    @override
    def setup(self, trainer: Any) -> None:
        """ModelParallelStrategy.setup, except that a module without ``configure_model`` (or whose
        ``configure_model`` applied no ``fully_shard``) is sharded here rather than refused."""
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        lm = find_causal_lm(self.lightning_module)
        tensor = self._tensor_parallel_size
        check_tensor_parallel(lm, tensor, lora=any(hasattr(m, "peft_config") for m in self.model.modules()),
                              sparse=self.chunk_config.sparse)
        user_sharded = any(isinstance(m, FSDPModule) for m in self.model.modules())
        if tensor > 1 and user_sharded:
            raise SetupError(f"tensor_parallel_size={tensor} with a configure_model that applied fully_shard: the "
                             "layers must be split over the tensor-parallel ranks before FSDP shards them; leave "
                             "the model unsharded and the sharding to OOMBModelParallelStrategy")
        if tensor > 1:  # torch's 2-D recipe: split over the tensor-parallel ranks, then FSDP shards each part
            parallelize_decoder_layers(lm, self.device_mesh["tensor_parallel"])
        # Tensor parallel over one data-parallel rank: FSDP would shard nothing, so none.
        if not user_sharded and (tensor == 1 or self.device_mesh["data_parallel"].size() > 1):
            shard_decoder_layers(lm, self.device_mesh["data_parallel"], reshard_after_forward=self.sharding == "zero3")
        self._check_root_unsharded(lm)
        self._fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        self._step_gpu_bytes = self._gathered_bytes()
        self._replicated = [p for p in self.model.parameters() if not isinstance(p, DTensor)]
        with torch.no_grad():  # the whole weights must agree on every rank; the shards are each rank's own
            for tensor in [*self._replicated, *self.model.buffers()]:
                dist.broadcast(tensor, src=0)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                step_sharded_and_whole_apart(optimizer)
        self.setup_precision_plugin()
        # Lightning clips through the precision plugin (chosen by the Trainer's precision flag), whose torch
        # clipping cannot mix sharded and whole gradients: this plugin instance clips with the functions above.
        plugin = self.precision_plugin
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm(plugin.main_params(optimizer), clip_val)
        plugin.clip_grad_by_value = lambda optimizer, clip_val: clip_grad_value(plugin.main_params(optimizer), clip_val)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @staticmethod
    def _check_root_unsharded(lm: nn.Module) -> None:
        in_layers = {id(p) for layer in decoder_of(lm).layers for p in layer.parameters()}
        outside = [n for n, p in lm.named_parameters() if isinstance(p, DTensor) and id(p) not in in_layers]
        if outside:
            raise SetupError(f"{outside[0]} is sharded, but the embeddings, final norm and output layer must stay "
                             "whole (the engine never runs their FSDP hooks): fully_shard only the decoder layers "
                             "in configure_model, or leave the sharding to OOMBModelParallelStrategy")

    # -- collectives around the step ----------------------------------------------------------------------
    @property
    @override
    def before_chunk(self) -> ChunkHook | None:
        return None if self.sharding == "zero3" else self._keep_gathered

    def _keep_gathered(self, stage: int, index: int) -> None:
        """zero2 and zero1: the layers gathered in stage 1 stay so until stage 2's last chunk (index 0), whose
        backward reshards them. zero2 reduce-scatters every chunk's gradients; zero1 sums them unsharded and
        reduce-scatters once, after the last chunk of the accumulation's last micro-batch."""
        if stage != 2:
            return
        last = index == 0
        for module in self._fsdp_modules:
            module.set_reshard_after_backward(last, recurse=False)
            if self.sharding == "zero1":
                module.set_requires_gradient_sync(last and self._average_after_backward, recurse=False)

    @override
    def averaged_params(self) -> list[nn.Parameter]:
        """The whole weights' (after an accumulation's last micro-batch, as the layers' under zero1; zero2 and
        zero3 reduce-scatter the layers' after every chunk)."""
        return [p for p in self._replicated if p.requires_grad]

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        # zero1/zero2 keep the layers gathered from a step's first forward to its end, and so does PagedKVCallback's
        # probe at fit start; Lightning loads into the shards (and finds the model by them), so reshard first.
        for module in self._fsdp_modules:
            module.reshard()
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        partial = partial_path(path)
        if self.global_rank == 0 and partial.exists():  # a killed save's
            shutil.rmtree(partial)
        self.barrier("oomb_checkpoint_partial_clear")
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier("oomb_checkpoint_shards_written")
        if self.global_rank == 0:
            replace_folder(partial, path)
        self.barrier("oomb_checkpoint_in_place")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=f"{cls.__name__}: FSDP2-sharded decoder "
                                   "layers, data parallel, tensor parallel over KV heads, or both", override=True)


OOMBModelParallelStrategy.register_strategies(StrategyRegistry)
