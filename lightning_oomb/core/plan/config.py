"""``PlanConfig``: one training step as the planner sees it, checked when made, and the choices its fields take."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import SparseConfig
from ..model_shape import PRECISIONS, PROFILES
from ..optimizers import PLAN_OPTIMIZERS
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
class PlanConfig:
    """One training step as the planner sees it: token counts per sequence, memory in bytes. What each field
    does to the plan: docs/planner.md ("What it counts", "Host memory", "Time", "Several GPUs")."""

    context: int
    chunk_size: int = 4096
    batch: int = 1  # sequences per step (per rank)
    page_size: int = 128
    lora_rank: int = 0  # 0: full training
    optimizer: str = "adamw"  # OPTIMIZERS
    precision: str = "bf16-true"  # PRECISIONS
    checkpoint_layers: bool = False
    grad_dtype: torch.dtype = torch.float32  # of the KV-gradient pages
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS
    offload: bool = False  # dense: every page in pinned host memory, streamed through the GPU
    segment_tokens: int = OFFLOAD_SEGMENT_TOKENS  # offload: tokens per sequence of a streamed segment
    sparse: "bool | SparseConfig | None" = False  # None/False dense; True: SPARSE_ATTENDED_TOKENS past tokens
    host_grad_layers: int = 0  # sparse: layers whose KV-gradient pages are pinned on the host, added into
    kept_chunks: int = 0  # chunks whose attention outputs stage 1 keeps on the GPU for stage 2
    graph_chunks: int = 0  # last chunks whose autograd graphs stage 1 keeps (the last one's costs nothing)
    host_kept_chunks: int = 0  # first chunks whose attention outputs stage 1 keeps pinned on the host
    fused_ops: bool = True  # the Triton steps' RMSNorm/RoPE/SwiGLU; False: transformers' own ops
    stage_1_loss: bool = False  # the loss is computed in stage 1 (a served forward, as under OOMBStrategy)
    loss_grads: str = "gpu"  # LOSS_GRADS: where such a step keeps every chunk's dL/dh until stage 2
    host_process_bytes: int | None = None  # the process's own host memory; None: HOST_PROCESS_BYTES
    host_pending_bytes: int | None = None  # host memory the first update adds; None: the optimizer's compile
    devices: int = 1  # data-parallel ranks, each running this step on its own batch
    host_kv_layers: int = 0  # sparse: layers whose K/V pages are pinned on the host, selected pages gathered
    document_length: int | None = None  # packed documents of that many tokens; None: one per sequence
    sharding: Sharding = "none"  # SHARDINGS: oomb_ddp ("none") or oomb_model_parallel's zero1/2/3
    tensor_parallel: int = 1  # ranks splitting each decoder layer by KV heads (not with LoRA)

    def __post_init__(self):
        for name in ("context", "chunk_size", "batch", "page_size", "segment_tokens", "devices", "tensor_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.document_length is not None and (isinstance(self.document_length, bool)
                                                 or not isinstance(self.document_length, int)
                                                 or self.document_length < 1):
            raise ValueError(f"document_length must be None or an integer >= 1, got {self.document_length!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.tensor_parallel > 1 and self.lora_rank:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} with LoRA (lora_rank={self.lora_rank}) is not "
                             "built (oomb_model_parallel refuses it); plan full training (lora_rank=0), or "
                             "tensor_parallel=1 (--tensor-parallel 1)")
        if self.tensor_parallel > 1 and self.devices > 1 and self.sharding == "none":
            raise ValueError(f"tensor_parallel={self.tensor_parallel} with devices={self.devices} data-parallel ranks "
                             "runs in oomb_model_parallel, which shards the split layers over them: give sharding "
                             "'zero1', 'zero2' or 'zero3' (--sharding), or devices=1")
        if self.sharding != "none" and self.devices == 1:
            raise ValueError(f"sharding={self.sharding!r} shards the decoder layers over data-parallel ranks, and "
                             "there is one device: give devices >= 2 (--devices N), or sharding 'none'")
        if self.loss_grads not in LOSS_GRADS:
            raise ValueError(f"loss_grads must be one of {', '.join(LOSS_GRADS)}, got {self.loss_grads!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.precision not in PROFILES:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not self.matmul_tflops > 0:
            raise ValueError(f"matmul_tflops must be > 0, got {self.matmul_tflops}")
        if self.grad_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"grad_dtype must be torch.float32 or torch.bfloat16, got {self.grad_dtype}")
        if self.host_grad_layers < 0 or self.host_kv_layers < 0:
            raise ValueError(f"host_grad_layers and host_kv_layers must be >= 0, got {self.host_grad_layers}, "
                             f"{self.host_kv_layers}")
        if self.host_kv_layers and not self.sparse:
            raise ValueError("host_kv_layers (K/V pages in host memory, selected pages gathered) is for sparse "
                             "attention; dense steps stream every page with offload")
        if min(self.kept_chunks, self.graph_chunks, self.host_kept_chunks) < 0:
            raise ValueError(f"kept_chunks, graph_chunks and host_kept_chunks must be >= 0, got {self.kept_chunks}, "
                             f"{self.graph_chunks}, {self.host_kept_chunks}")
        if self.host_grad_layers and (not self.sparse or self.offload):
            raise ValueError(
                "host_grad_layers (gradient pages in host memory) is for sparse attention, "
                "without offload (which streams every page of a dense step)"
            )
        if self.sparse and self.offload:
            raise ValueError(
                "sparse attention does not stream its pages (offload): it keeps the KV-gradient and K/V pages of "
                "some layers in host memory instead (host_grad_layers, host_kv_layers)"
            )

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


def offload_segment_pages(c: PlanConfig) -> int:
    """Pages of the staging area per half (all sequences of the batch together): ``segment_tokens`` of
    each sequence, no more than the past needs, whole pages."""
    per_seq = min(c.segment_tokens, math.ceil(c.context / c.page_size) * c.page_size)
    return c.batch * math.ceil(per_seq / c.page_size)
