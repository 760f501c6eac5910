"""``PlanConfig``: one training step as the planner sees it, checked when made: the step options asked for (a
``ChunkConfig``), the run around them, and the planner's decisions (``Pages``, what stage 1 keeps); and the
choices its fields take."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..config import ChunkConfig, SparseConfig
from ..errors import SetupError
from ..model_shape import PRECISIONS, PROFILES
from ..optimizers import PLAN_OPTIMIZERS
from ..quantization import Quantization
from .assumptions import DEFAULT_MATMUL_TFLOPS, OFFLOAD_SEGMENT_TOKENS

# The optimizer a plan counts: a name of core.optimizers.OPTIMIZERS, or "none".
OPTIMIZERS = PLAN_OPTIMIZERS
# Where a served step keeps each chunk's dL/dh from stage 1 for stage 2; "recomputed": not kept, stage 2
# runs the output layer again (PlanConfig.loss_grads).
LOSS_GRADS = ("gpu", "host", "recomputed")
# Several GPUs: "none" is oomb_ddp (every rank whole); the others are oomb_model_parallel's sharding of the
# decoder layers (its class docstring says what each gathers and reduces per chunk).
Sharding = Literal["none", "zero1", "zero2", "zero3"]
SHARDINGS = ("none", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Pages:
    """Where a step's K/V and KV-gradient pages live, as decided from ``ChunkConfig.offload``: all streamed
    from pinned host memory (``streamed``, dense), or on the GPU but for the KV-gradient pages of
    ``host_grad_layers`` and the K/V pages of ``host_kv_layers`` layers in pinned host memory (sparse)."""

    streamed: bool = False
    host_grad_layers: int = 0
    host_kv_layers: int = 0

    @property
    def on_host(self) -> bool:
        """Whether any page lives in host memory."""
        return bool(self.streamed or self.host_grad_layers or self.host_kv_layers)


@dataclass(frozen=True)
class PlanConfig:
    """One training step as the planner sees it: token counts per sequence, memory in bytes. What each field
    does to the plan: docs/planner.md ("What it counts", "Host memory", "Time", "Several GPUs").

    ``chunk``: the step options as asked (ChunkConfig, which declares, defaults and checks them); the planner
    reads its chunk_size, page_size, checkpoint_layers, grad_dtype, sparse, segment_tokens (None: the longest
    a streamed step takes, OFFLOAD_SEGMENT_TOKENS) and host_memory, its offload only where it places the
    pages (``plan_placed``). They read as this config's own (``c.chunk_size``). Then the run around the step,
    and the decisions a training step makes (``core.placement.place_step``) that a plan either is given or
    makes itself: ``pages``, the kept chunks and ``loss_grads`` (None: ``plan`` decides it).
    ``build``/``replace`` take all of them by name, ChunkConfig's and Pages' fields included.
    """

    context: int
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    # -- the run around the step
    batch: int = 1  # sequences per step (per rank)
    lora_rank: int = 0  # 0: full training
    # with lora_rank: LoRA on the stacked expert weights too (CausalLMModule's lora_target_parameters)
    lora_experts: bool = False
    # QLoRA: the frozen base weights in 4 bits, as CausalLMModule's option of that name takes it ("nf4", "fp4" or
    # {"quant_type": ..., "double_quant": ...}); read as a Quantization
    quantization: "Quantization | str | dict | None" = None
    optimizer: str = "adamw"  # OPTIMIZERS
    precision: str = "bf16-true"  # PRECISIONS
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS
    fused_ops: bool = True  # the Triton steps' RMSNorm/RoPE/SwiGLU; False: transformers' own ops
    stage_1_loss: bool = False  # the loss is computed in stage 1 (a served forward, as under OOMBStrategy)
    host_process_bytes: int | None = None  # the process's own host memory; None: HOST_PROCESS_BYTES
    host_pending_bytes: int | None = None  # host memory the first update adds; None: the optimizer's compile
    devices: int = 1  # data-parallel ranks, each running this step on its own batch
    document_length: int | None = None  # packed documents of that many tokens; None: one per sequence
    sharding: Sharding = "none"  # SHARDINGS: oomb_ddp ("none") or oomb_model_parallel's zero1/2/3
    tensor_parallel: int = 1  # ranks splitting each decoder layer by KV heads (not with LoRA)
    # -- the decisions
    pages: Pages = Pages()
    kept_chunks: int = 0  # chunks whose attention outputs stage 1 keeps on the GPU for stage 2
    graph_chunks: int = 0  # last chunks whose autograd graphs stage 1 keeps (the last one's costs nothing)
    host_kept_chunks: int = 0  # first chunks whose attention outputs stage 1 keeps pinned on the host
    loss_grads: str | None = None  # LOSS_GRADS: where a stage_1_loss step keeps every chunk's dL/dh until stage 2
    # False: a forward over the chunks and their K/V pages alone (eval_loss, generate, scoring): no gradients,
    # optimizer state, KV-gradient pages, border states or anything stage 1 keeps for a stage 2
    training: bool = True

    def __post_init__(self):
        if not isinstance(self.chunk, ChunkConfig):
            raise TypeError(f"chunk must be a ChunkConfig, got {type(self.chunk).__name__}")
        for name in ("context", "batch", "devices", "tensor_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SetupError(f"{name} must be an integer >= 1, got {value!r}")
        if self.document_length is not None and (isinstance(self.document_length, bool)
                                                 or not isinstance(self.document_length, int)
                                                 or self.document_length < 1):
            raise SetupError(f"document_length must be None or an integer >= 1, got {self.document_length!r}")
        if self.lora_rank < 0:
            raise SetupError(f"lora_rank must be >= 0, got {self.lora_rank}")
        object.__setattr__(self, "quantization", Quantization.parse(self.quantization))
        if self.quantization is not None and not self.lora_rank:
            raise SetupError(f"quantization={self.quantization.quant_type!r} freezes the base weights in 4 bits for "
                             "LoRA adapters to train: give lora_rank > 0 (--lora-rank 16)")
        if self.quantization is not None and self.sharding != "none":
            raise SetupError(f"quantization with sharding={self.sharding!r}: oomb_model_parallel does not shard "
                             "4-bit weights; plan sharding 'none' (oomb_ddp), or no quantization")
        if self.sharding not in SHARDINGS:
            raise SetupError(f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.tensor_parallel > 1 and self.lora_rank:
            raise SetupError(f"tensor_parallel={self.tensor_parallel} with LoRA (lora_rank={self.lora_rank}) is not "
                             "built (oomb_model_parallel refuses it); plan full training (lora_rank=0), or "
                             "tensor_parallel=1 (--tensor-parallel 1)")
        if self.tensor_parallel > 1 and self.devices > 1 and self.sharding == "none":
            raise SetupError(f"tensor_parallel={self.tensor_parallel} with devices={self.devices} data-parallel ranks "
                             "runs in oomb_model_parallel, which shards the split layers over them: give sharding "
                             "'zero1', 'zero2' or 'zero3' (--sharding), or devices=1")
        if self.sharding != "none" and self.devices == 1:
            raise SetupError(f"sharding={self.sharding!r} shards the decoder layers over data-parallel ranks, and "
                             "there is one device: give devices >= 2 (--devices N), or sharding 'none'")
        if self.loss_grads is not None and self.loss_grads not in LOSS_GRADS:
            raise SetupError(f"loss_grads must be None or one of {', '.join(LOSS_GRADS)}, got {self.loss_grads!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SetupError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.precision not in PROFILES:
            raise SetupError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not self.matmul_tflops > 0:
            raise SetupError(f"matmul_tflops must be > 0, got {self.matmul_tflops}")
        if self.host_grad_layers < 0 or self.host_kv_layers < 0:
            raise SetupError(f"host_grad_layers and host_kv_layers must be >= 0, got {self.host_grad_layers}, "
                             f"{self.host_kv_layers}")
        if self.host_kv_layers and not self.sparse:
            raise SetupError("host_kv_layers (K/V pages in host memory, selected pages gathered) is for sparse "
                             "attention; dense steps stream every page")
        if min(self.kept_chunks, self.graph_chunks, self.host_kept_chunks) < 0:
            raise SetupError(f"kept_chunks, graph_chunks and host_kept_chunks must be >= 0, got {self.kept_chunks}, "
                             f"{self.graph_chunks}, {self.host_kept_chunks}")
        if self.host_grad_layers and (not self.sparse or self.streamed):
            raise SetupError(
                "host_grad_layers (gradient pages in host memory) is for sparse attention, "
                "without streamed pages (which a dense step streams, every one)"
            )
        if self.sparse and self.streamed:
            raise SetupError(
                "sparse attention does not stream its pages: it keeps the KV-gradient and K/V pages of "
                "some layers in host memory instead (host_grad_layers, host_kv_layers)"
            )

    @classmethod
    def build(cls, config: "PlanConfig | int", **options: Any) -> "PlanConfig":
        """``config`` (a PlanConfig, or the context in tokens per sequence with every other field at its
        default) with the fields named in ``options`` replaced (``replace``)."""
        return (config if isinstance(config, PlanConfig) else cls(context=config)).replace(**options)

    def replace(self, **options: Any) -> "PlanConfig":
        """This config with the fields named in ``options`` replaced: ChunkConfig's fields in ``chunk`` (through
        ``ChunkConfig.build``, which checks them), Pages' in ``pages``, the others here. An unknown name is
        refused with the known ones."""
        if not options:
            return self
        step = {k: options.pop(k) for k in list(options) if k in _CHUNK_FIELDS}
        placed = {k: options.pop(k) for k in list(options) if k in _PAGES_FIELDS}
        unknown = set(options) - set(_OWN_FIELDS)
        if unknown:
            raise SetupError(f"unknown plan option(s) {', '.join(sorted(unknown))}; the options are ChunkConfig's "
                             f"fields, Pages' and PlanConfig's: {', '.join([*_CHUNK_FIELDS, *_PAGES_FIELDS, *_OWN_FIELDS])}")
        if step:
            options["chunk"] = ChunkConfig.build(options.get("chunk", self.chunk), **step)
        if placed:
            options["pages"] = dataclasses.replace(options.get("pages", self.pages), **placed)
        return dataclasses.replace(self, **options)

    def checkpointed(self, on: bool = True) -> "PlanConfig":
        """This step with layer checkpointing ``on`` or off; checkpointed layers keep no chunk's graph, so a
        ``keep_graphs`` asked for goes with it."""
        return self.replace(checkpoint_layers=on, **({"keep_graphs": None} if on else {}))

    # -- the step options, read from ``chunk``
    @property
    def chunk_size(self) -> int:
        return self.chunk.chunk_size

    @property
    def page_size(self) -> int:
        return self.chunk.page_size

    @property
    def checkpoint_layers(self) -> bool:
        return self.chunk.checkpoint_layers

    @property
    def grad_dtype(self) -> torch.dtype:
        """The KV-gradient pages' dtype."""
        return self.chunk.grad_dtype

    @property
    def sparse(self) -> SparseConfig | None:
        return self.chunk.sparse

    @property
    def segment_tokens(self) -> int:
        """Streamed pages: tokens per sequence of a segment (``chunk.segment_tokens``, else the longest a step
        streams, OFFLOAD_SEGMENT_TOKENS)."""
        return self.chunk.segment_tokens or OFFLOAD_SEGMENT_TOKENS

    # -- the pages, read from ``pages``
    @property
    def streamed(self) -> bool:
        return self.pages.streamed

    @property
    def host_grad_layers(self) -> int:
        return self.pages.host_grad_layers

    @property
    def host_kv_layers(self) -> int:
        return self.pages.host_kv_layers

    @property
    def chunk_tokens(self) -> int:
        """Tokens of one chunk over the batch (what one chunk's activations scale with)."""
        return self.batch * min(self.chunk_size, self.context)

    @property
    def n_chunks(self) -> int:
        return math.ceil(self.context / self.chunk_size)

    @property
    def stored_tokens(self) -> int:
        """Tokens the page pool holds: whole pages per sequence."""
        return self.batch * math.ceil(self.context / self.page_size) * self.page_size


_CHUNK_FIELDS = tuple(f.name for f in dataclasses.fields(ChunkConfig))
_PAGES_FIELDS = tuple(f.name for f in dataclasses.fields(Pages))
_OWN_FIELDS = tuple(f.name for f in dataclasses.fields(PlanConfig))


def offload_segment_pages(c: PlanConfig) -> int:
    """Pages of the staging area per half (all sequences of the batch together): ``segment_tokens`` of
    each sequence, no more than the past needs, whole pages."""
    per_seq = min(c.segment_tokens, math.ceil(c.context / c.page_size) * c.page_size)
    return c.batch * math.ceil(per_seq / c.page_size)
