"""Memory and time of a training step before it runs (docs/planner.md).

``plan(model, context, ...)`` returns a ``Plan``: the GPU and host memory of one chunk-recurrent training
step, line by line in bytes, whether it fits this (or a named) machine, the FLOP floor and a predicted
step time, and, when it does not fit, what would make it fit, each with its own numbers and the flags or
keywords that ask for it. ``plan(..., sparse=SparseConfig(...))`` counts
the FLOPs of page-level sparse attention and the memory of its page summaries and selections.

The model's shape comes from ``core.model_shape``; ``core.placement`` applies a plan to a real step (where
its pages live, on the device at hand); sizes as people write them are read by ``core.units``. See
docs/planner.md for the formulas and what is assumed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .config import OFFLOADS, SparseConfig
from .host_memory import host_budget
from .loss import piece_rows
from .optimizers import OPTIMIZERS as OPTIMIZER_CHOICES, PLAN_OPTIMIZERS, plan_state_bytes
from .model_shape import PRECISIONS, PROFILES, ModelShape, Precision, _itemsize, _kv_dtype
from .pages import HostGradStaging, movable_host_layers, spread_layers, stage_2_gather_order
from .ranks import GRADIENT_BUCKET_BYTES
from .units import GIB, human_count

# -- assumptions, named so that the bench can calibrate them --------------------------------------------
# CUDA context, cuBLAS/Triton workspaces and caching-allocator slack: memory the process holds on the GPU
# that torch.cuda.max_memory_allocated does not report. `lightning-oomb fit` on the H200 held 1.20 GiB outside
# torch's allocator when its step was placed, and place_step sets FIRST_STEP_RUNTIME_BYTES aside for the first
# step's workspaces: a plan that says FITS must leave both, or the fit refuses it.
CUDA_CONTEXT_BYTES = 7 * GIB // 4
# Host memory a training process takes from what the machine has available (MemAvailable) before any pinned
# pool: Python, torch, transformers and the CUDA runtime in its resident set, and the CUDA driver's share
# outside it. `lightning-oomb fit` of Qwen2.5-7B on the H200 held 1.14 GiB resident when its step was placed
# and had taken 2.60 GiB from MemAvailable (a plan made on the idle machine said 112.68 GiB of budget, the
# fit's own 111.22 plus its 1.14).
HOST_PROCESS_BYTES = 3 * GIB
# GPU memory outside torch's allocator that a process's first step adds (cuBLAS workspaces of its streams,
# kernel modules): 0.24 GiB in a 1M-token sparse step on an H200. place_step sets it aside for a step with
# no pool to reuse, so that the next step, which sees it gone, places no more host gradient layers.
FIRST_STEP_RUNTIME_BYTES = GIB // 2
# Fractions of the matmul peak that the linear layers and the attention reach in a whole step, each counted on
# the FLOPs the step executes (chunks whose stage-1 graph or attention output is kept skip that work in
# stage 2). Fitted by least squares to eight measured H200 steps (bench dense 32K/64K/128K, sparse 128K and
# 1M; the CLI's 128K, LoRA 32K and sparse 1M with checkpointing and AdamW; docs/planner.md, "Time"): each
# predicted within 6.1% (tests/test_planner_calibration.py).
LINEAR_EFFICIENCY = 0.70
ATTENTION_EFFICIENCY = 0.60
# Dense attention of the packed-document chunks that run in the portable Triton kernels on Hopper: chunks that
# hold a document border, and (measured, cause not found) the chunks of a document that starts mid-page,
# whose whole pages the warp-specialised kernels do run. Fitted to a step whose chunks all ran the portable
# kernels (1M tokens of 32K-token documents, LoRA, layer checkpointing: 206.3 s on the H200); the chunks of
# documents that start on a page run at ATTENTION_EFFICIENCY (162.5 s, planned 169.2 s), those of
# 30,000-token documents measured at this rate (188.9 s, planned 193.1 s; docs/benchmarks.md, "Packed
# documents"). Sparse attention over packed documents stayed within 2% of the plan at ATTENTION_EFFICIENCY.
PORTABLE_ATTENTION_EFFICIENCY = 0.38
DEFAULT_MATMUL_TFLOPS = 790.0  # bf16 dense matmul measured on the H200 (docs/benchmarks.md)
# What host gradient layers (sparse) add to a step: per host layer and chunk, the bus time of the chunk's
# additions (dK, dV of every distinct selected (page, KV head), read and written) at HOST_ADD_GBPS, less
# what hides behind the compute, HOST_ADD_HIDDEN_S. Fitted to whole steps on the H200 with every layer's
# pages on the host (+3.7 s at 256K, +15.6 s at 512K, measured on the H200).
HOST_ADD_GBPS = 61.5
HOST_ADD_HIDDEN_S = 5.4e-3
# What host K/V layers (sparse) add: per host layer and attention call, the gather of the pages the chunk
# selected (every KV head of each distinct page) over the bus at HOST_GATHER_GBPS; stage 1's on the compute
# stream, stage 2's on a side stream behind the compute (host_gather_seconds). Stage 1's gathers measured
# 46.4-49.5 GB/s on the H200 (256K and 768K, one selection per chunk and per tile; docs/benchmarks.md).
HOST_GATHER_GBPS = 48.0
# Several GPUs: the bus bandwidth per rank of NCCL's ring collectives (all-reduce, reduce-scatter, all-gather:
# by NCCL's definition of bus bandwidth one number serves all three), in GB/s. Assumed, not measured here (the
# several-GPU machines were not lent): about what NCCL reaches over NVLink on HGX H100/H200 nodes; calibrate
# with a measured step. Every collective is counted as not overlapping the compute: an upper bound, since
# FSDP2 runs its gathers and reduce-scatters on streams of their own.
COLLECTIVE_GBPS = 350.0
# Tensor parallel: the linear modules of a decoder layer that oomb_model_parallel's TENSOR_PARALLEL_PLAN makes
# RowwiseParallel (o_proj, down_proj: an all-reduce of the output in every forward) and ColwiseParallel (q, k, v,
# gate, up: each an all-reduce of its input's gradient in every backward).
TP_ROWWISE, TP_COLWISE = 2, 5
# zero3: decoder layers gathered at once: the one computing and the one FSDP2 prefetches (the next in forward,
# the previous in backward).
ZERO3_GATHERED_LAYERS = 2
# Offload: the past streams through the GPU in segments of up to this many tokens per sequence (two in
# flight, K, V, dK and dV of one layer each); longer segments mean fewer, larger copies and launches.
OFFLOAD_SEGMENT_TOKENS = 65536
# ... and the staging of both segments takes at most this fraction of the GPU memory the step leaves free.
OFFLOAD_STAGING_SHARE = 0.25
# A step is placed only where its plan leaves this fraction of the device's memory unused: measured peaks ran
# up to 3% above the plan (docs/planner.md), and a 1M-token sparse step planned with less ran out of memory.
PLACEMENT_HEADROOM_SHARE = 0.03
# Share of the GPU memory a step leaves free that it may fill with attention outputs kept from stage 1
# (the rest stays for what the user's code allocates between forward and backward).
KEPT_ATTENTION_SHARE = 0.5
# Share of what is left free after those that it may fill with autograd graphs of whole chunks kept from
# stage 1 (beyond the last chunk's, which costs nothing: stage 2 would hold it next).
KEPT_GRAPHS_SHARE = 0.75
# Host memory the process may add during a run beyond what it holds when a step is placed and the pinned
# blocks the placement decides: Triton's and CUDA's modules, Lightning's logging, a checkpoint's per-tensor
# staging (the largest weight). Checked against measured runs (docs/benchmarks.md, the CLI route).
HOST_GROWTH_BYTES = 2 * GIB
# Sparse with ``sparse=True`` (no SparseConfig): tokens of the past each query attends to (sink + local
# window + top-k pages). A SparseConfig gives its own: budget_pages * page_size.
SPARSE_ATTENDED_TOKENS = 16384

# Smallest chunk the planner suggests: below it matmuls get too thin to keep the GPU busy.
MIN_SUGGESTED_CHUNK = 256

# The optimizer a plan counts: a name of core.optimizers.OPTIMIZERS, or "none".
OPTIMIZERS = PLAN_OPTIMIZERS
# Where a served step keeps each chunk's dL/dh from stage 1 for stage 2; "recomputed": not kept, stage 2
# runs the output layer again (PlanConfig.loss_grads).
LOSS_GRADS = ("gpu", "host", "recomputed")
# Several GPUs: "none" is oomb_ddp (every rank whole); the others are oomb_model_parallel's sharding of the
# decoder layers (its class docstring says what each gathers and reduces per chunk).
Sharding = Literal["none", "zero1", "zero2", "zero3"]
SHARDINGS = ("none", "zero1", "zero2", "zero3")
SHARDING_SUMMARY = {
    "zero1": "layers' weights gathered once per step, gradients summed whole and reduce-scattered once",
    "zero2": "layers' weights gathered once per step, gradients reduce-scattered after every chunk",
    "zero3": "layers' weights gathered for every chunk's forward and backward, gradients reduce-scattered after "
             "every chunk",
}


class PlanError(RuntimeError):
    """A step would not fit in memory; the message is the formatted plan with its suggestions."""


# == activations ==========================================================================================


def layer_activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", lora_rank: int = 0, fused_ops: bool = True
) -> int:
    """Bytes one decoder layer saves for backward in stage 2 for ``tokens`` tokens (batch x chunk).

    Derived from transformers' Llama/Qwen2/Qwen3 decoder layer with lightning_oomb's attention (and checked
    against counted saved tensors in tests/test_planner.py). Full training:
    - each RMSNorm (2): its float32 input copy (pow), rsqrt (1 float per token), the normalised input in
      the residual dtype (saved by the weight multiply) and its output (saved by the projections after it);
    - attention (ChunkAttention): q, k after RoPE, v, the output (q's dtype), log-sum-exp (fp32 per head);
      o_proj saves its input (the output made contiguous, in the linear dtype);
    - MLP: gate output (SiLU), SiLU output and up output (the product), the product (down_proj): 4 x I;
    - Qwen3 QK-norm: float32 copies of q and k, rsqrt per head, normalised q, k in the linear dtype;
    - bf16-mixed: the projections save autocast's bf16 casts of the fp32 norm output instead, one cast per
      projection (q, k, v, gate, up); the bf16 weight copies are a separate line of the plan.
    RoPE multiplies by cos/sin that need no gradient, so it saves only cos/sin (counted once per model).

    LoRA (peft adapters on q, k, v, o; everything else frozen): a frozen linear layer saves only its
    weight, a frozen norm weight makes the norm skip its normalised input, so what remains is the norm
    statistics, the first norm's output (read by the q/k/v adapters), attention as above, o's input (its
    adapter), the MLP without down_proj's input (3 x I), and each adapter's rank-r intermediate.

    fused_ops (the Triton steps, lightning_oomb.kernels): each RMSNorm saves its input (in its own dtype)
    and one fp32 rstd per row instead of the fp32 copy and the normalised input; SwiGLU saves gate and up,
    not silu(gate) (one I less), and without autocast the trained down projection recomputes its input,
    the product (kernels.linear.swiglu_linear: another I less), except on tensor-parallel ranks, whose down
    projection is a DTensor shard that swiglu_linear does not take.

    A tensor-parallel rank's ``shape`` (``ModelShape.tensor_parallel_part``) has its own heads and MLP width:
    the attention and MLP terms are its part, the hidden-size terms whole.
    """
    p = PROFILES[precision]
    h, i, dq, dkv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    lora = lora_rank > 0
    attention = p.qk * (dq + dkv) + p.v * dkv + p.qk * dq + 4 * shape.n_heads + p.linear * dq
    if fused_ops:
        down_input = p.autocast_weight_copies or shape.tensor_parallel > 1  # saved, not recomputed
        mlp = 2 if lora or not down_input else 3  # gate, up (and down_proj's input)
        per_token = 2 * (p.residual * h + 4) + attention + mlp * p.linear * i
        if lora:
            per_token += 4 * lora_rank * p.linear + (3 * 2 * h if p.autocast_weight_copies else p.linear * h)
        elif p.autocast_weight_copies:
            per_token += 5 * 2 * h
        else:
            per_token += 2 * p.linear * h
        if shape.qk_norm:  # input (the projection's output) and rstd per head
            per_token += p.linear * (dq + dkv) + 4 * (shape.n_heads + shape.n_kv_heads)
        return tokens * per_token
    norm_stats = 2 * (4 * h + 4)
    if not lora:
        per_token = norm_stats + 2 * p.residual * h + attention + 4 * p.linear * i
        if p.autocast_weight_copies:
            per_token += 5 * 2 * h  # five bf16 casts of the fp32 norm outputs
        else:
            per_token += 2 * p.linear * h  # the two norm outputs, saved by the projections reading them
        qk_norm_outputs = p.linear * (dq + dkv)
    else:
        per_token = norm_stats + attention + 3 * p.linear * i + 4 * lora_rank * p.linear
        # The q, k, v adapters save the first norm's output, under autocast one bf16 cast each.
        per_token += 3 * 2 * h if p.autocast_weight_copies else p.linear * h
        qk_norm_outputs = 0
    if shape.qk_norm:
        per_token += 4 * (dq + dkv) + 4 * (shape.n_heads + shape.n_kv_heads) + qk_norm_outputs
    return tokens * per_token


def model_activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", lora_rank: int = 0, fused_ops: bool = True
) -> int:
    """Bytes saved outside the decoder layers: embedding indices (int64), RoPE cos and sin (shared by all
    layers, in the embedding's dtype) and the final RMSNorm. With LoRA the embedding is frozen (no indices
    saved, and the first layer's input needs no gradient, so its first norm saves nothing) and the final
    norm's weight is frozen (no normalised input saved). fused_ops: a norm saves its input and an fp32 rstd
    (see ``layer_activation_bytes``); with LoRA the final norm's then cancels the first layer's."""
    p = PROFILES[precision]
    h = shape.hidden
    rope = 2 * shape.head_dim * p.param
    if fused_ops:
        return tokens * (rope if lora_rank > 0 else 8 + rope + p.residual * h + 4)
    final_norm_stats = 4 * h + 4
    if lora_rank > 0:
        first_norm_stats_not_saved = 4 * h + 4
        return tokens * (rope + final_norm_stats - first_norm_stats_not_saved)
    return tokens * (8 + rope + final_norm_stats + p.residual * h)


def activation_bytes(
    shape: ModelShape, tokens: int, precision: str = "bf16-true", checkpoint_layers: bool = False, lora_rank: int = 0,
    fused_ops: bool = True,
) -> int:
    """Saved activations of one chunk's stage-2 forward (``tokens`` = batch x chunk tokens), in bytes.

    Without checkpointing: every layer's saved tensors. With it: each layer's input (T x hidden, residual
    dtype, kept by the checkpoint for the recompute) and attention output and log-sum-exp (q's dtype and
    float32 per head, which the recompute takes instead of attending again), plus one layer's full
    activations (the recompute).
    fused_ops: the Triton steps' fused RMSNorm/RoPE/SwiGLU (False: transformers' own ops).
    """
    one_layer = layer_activation_bytes(shape, tokens, precision, lora_rank, fused_ops)
    if checkpoint_layers:
        p = PROFILES[precision]
        per_layer = shape.hidden * p.residual + shape.q_width * p.qk + 4 * shape.n_heads
        layers = shape.n_layers * tokens * per_layer + one_layer
    else:
        layers = shape.n_layers * one_layer
    return layers + model_activation_bytes(shape, tokens, precision, lora_rank, fused_ops)


# == time =================================================================================================


@dataclass(frozen=True)
class StepTime:
    """FLOPs one step executes and its time at ``matmul_tflops`` (floor) and at LINEAR_EFFICIENCY and
    ATTENTION_EFFICIENCY of it (predicted). ``recompute_flops`` (layer checkpointing) are linear: the
    recompute takes the attention outputs of the stage-2 forward."""

    linear_flops: float
    attention_flops: float
    recompute_flops: float
    matmul_tflops: float
    portable_attention_flops: float = 0.0  # of the attention: packed chunks at PORTABLE_...
    stage_1_flops: float = 0.0  # of the total: stage 1's forward of every chunk
    host_add_s: float = 0.0  # host gradient layers' additions not hidden behind the compute (host_add_seconds)
    host_gather_s: float = 0.0  # host K/V layers: gathering the selected pages (host_gather_seconds)
    host_gather_bytes: float = 0.0  # ... and the bytes those gathers move (host_gather_bytes)
    all_reduce_s: float = 0.0  # data parallel: averaging the whole gradients after stage 2 (step_collectives)
    sharding_s: float = 0.0  # sharded data parallel: the decoder layers' gathers and reduce-scatters (step_collectives)
    tensor_parallel_s: float = 0.0  # tensor parallel: the decoder layers' activation all-reduces (step_collectives)

    @property
    def total_flops(self) -> float:
        return self.linear_flops + self.attention_flops + self.recompute_flops

    @property
    def floor_s(self) -> float:
        """Seconds if every FLOP ran at the matmul peak."""
        return self.total_flops / (self.matmul_tflops * 1e12)

    @property
    def compute_s(self) -> float:
        """The linear FLOPs at LINEAR_EFFICIENCY, the attention FLOPs at ATTENTION_EFFICIENCY of the peak, those
        of packed chunks in the portable kernels at PORTABLE_ATTENTION_EFFICIENCY."""
        linear = self.total_flops - self.attention_flops
        peak = self.matmul_tflops * 1e12
        return (linear / (peak * LINEAR_EFFICIENCY) + (self.attention_flops - self.portable_attention_flops)
                / (peak * ATTENTION_EFFICIENCY) + self.portable_attention_flops / (peak * PORTABLE_ATTENTION_EFFICIENCY))

    @property
    def predicted_s(self) -> float:
        """``compute_s`` plus the host gradient layers' additions, the host K/V gathers and the collectives that
        do not hide behind it: fitted to measured steps, to be calibrated with ``lightning-oomb bench`` on
        other machines."""
        return (self.compute_s + self.host_add_s + self.host_gather_s + self.all_reduce_s + self.sharding_s
                + self.tensor_parallel_s)


def expected_selected_pages(n_past: int, sparse: "SparseConfig", n_tiles: int) -> float:
    """Distinct past pages one KV head's selections of a chunk touch, in expectation, when each of its
    ``n_tiles`` query tiles picks its top-k pages at random (what random weights give; trained models pick
    more alike pages, so this bounds them from above)."""
    if n_past <= sparse.budget_pages:
        return float(n_past)
    free = n_past - sparse.sink_pages - sparse.local_pages
    picked = sparse.budget_pages - sparse.sink_pages - sparse.local_pages
    return sparse.sink_pages + sparse.local_pages + free * (1 - (1 - picked / free) ** n_tiles)


def host_layers_left(shape: "ModelShape", c: "PlanConfig") -> list[int]:
    """Host gradient layers still in host memory at each chunk's stage-2 backward (chunk order): stage 2 moves
    them into dead K/V and GPU gradient pages as those die (``PagePool.move_host_grads_to_gpu``: batch 1,
    gradient pages in the K/V dtype, after the chunks whose graphs stage 1 kept)."""
    n = c.n_chunks
    left = [c.host_grad_layers] * n
    if c.batch != 1 or c.grad_dtype != _kv_dtype(c.precision):
        return left
    seq_pages = -(-c.context // c.page_size)
    page_layers = 2 * shape.n_layers - c.host_grad_layers - c.host_kv_layers  # PagePool.page_layers
    on_host = c.host_grad_layers
    for index in reversed(range(n - c.graph_chunks)):
        live = -(-min((index + 1) * c.chunk_size, c.context) // c.page_size)
        on_host -= min(on_host, movable_host_layers(page_layers, seq_pages, live, c.host_grad_layers - on_host))
        left[index] = on_host
    return left


def host_add_seconds(shape: "ModelShape", c: "PlanConfig") -> float:
    """Seconds the host gradient layers' additions add to a step of ``c`` (HOST_ADD_GBPS, HOST_ADD_HIDDEN_S),
    for the layers still on the host at each chunk (``host_layers_left``)."""
    if not c.host_grad_layers:
        return 0.0
    sparse = c.sparse if isinstance(c.sparse, SparseConfig) else SparseConfig()
    n_tiles = -(-min(c.chunk_size, c.context) // c.page_size) if sparse.per_query_tile else 1
    page_bytes = c.page_size * shape.head_dim * _itemsize(c.grad_dtype)
    seconds = 0.0
    for start, layers in zip(range(0, c.context, c.chunk_size), host_layers_left(shape, c)):
        pairs = expected_selected_pages(-(-start // c.page_size), sparse, n_tiles) * shape.n_kv_heads * c.batch
        bus_bytes = pairs * page_bytes * 2 * 2  # dK and dV, read and written
        seconds += max(0.0, bus_bytes / (HOST_ADD_GBPS * 1e9) - HOST_ADD_HIDDEN_S) * layers
    return seconds


def expected_union_pages(n_past: int, sparse: "SparseConfig", n_tiles: int, heads: int) -> float:
    """Distinct past pages a chunk's selections touch over ``heads`` selecting KV heads (each page's K of every
    head travels together), in expectation, each of the ``n_tiles * heads`` (tile, head) pairs picking its
    top-k pages at random (``expected_selected_pages``)."""
    return expected_selected_pages(n_past, sparse, n_tiles * heads)


def attention_kept_chunks(n_chunks: int, checkpoint_layers: bool, graph_chunks: int, kept_chunks: int,
                          host_kept_chunks: int) -> set[int]:
    """Chunks whose attention forward stage 2 takes from stage 1 instead of computing it: the last
    ``graph_chunks`` (their whole graph; none with layer checkpointing), the ``kept_chunks`` before them and
    the first ``host_kept_chunks`` (their outputs), as ``ChunkedSequence`` places them."""
    graphs = 0 if checkpoint_layers else min(graph_chunks, n_chunks)
    kept = min(kept_chunks, n_chunks - graphs)
    host_kept = min(host_kept_chunks, n_chunks - graphs - kept)
    return set(range(n_chunks - graphs - kept, n_chunks)) | set(range(host_kept))


def _host_layer_requests(host: list[int], last: int, stage: int, kind: str, skip_last: bool) -> list[int]:
    """The host K/V layers whose attention a chunk asks for, in order, in ``stage`` 1 or 2 of a step (what
    ``ChunkedSequence`` runs). ``kind``: "graph" (stage 1 keeps its autograd graph: stage 2 runs only its
    backward), "kept" (stage 2 takes its attention outputs from stage 1) or
    "computed"; ``skip_last``: stage 1 ends the chunk at the last layer's K/V store (its hidden state unused)."""
    computed_in_1 = [layer for layer in host if not (skip_last and layer == last)]
    if stage == 1:
        return computed_in_1
    return stage_2_gather_order(host, set(computed_in_1) if kind == "kept" else set(), kind == "graph")


def _gathers(requests: list[int], held: int | None) -> tuple[int, int | None]:
    """Gathers ``requests`` cost when a request for the layer gathered last (``held``, same chunk) reuses it
    (``HostKVStaging`` keeps one); and the layer then held."""
    count = 0
    for layer in requests:
        count += layer != held
        held = layer
    return count, held


def host_gather_stage_bytes(shape: "ModelShape", c: "PlanConfig") -> tuple[float, float]:
    """Bytes the host K/V layers' gathers move over the bus in stage 1 and in stage 2 of a step of ``c``, in
    expectation: each gather moves the union of the chunk's selected pages (``expected_union_pages``); a chunk
    gathers once per attention call of a host layer (``_host_layer_requests``: stage 1's forward; stage 2's
    forward and the backward, less the forwards ``attention_kept_chunks``
    spares), except where a call follows one of the same layer and chunk, which reuses its gather
    (``_gathers``)."""
    if not c.host_kv_layers:
        return 0.0, 0.0
    sparse = c.sparse if isinstance(c.sparse, SparseConfig) else SparseConfig()
    n_tiles = -(-min(c.chunk_size, c.context) // c.page_size) if sparse.per_query_tile else 1
    heads = shape.n_kv_heads if sparse.per_kv_head else 1
    page_bytes = c.page_size * shape.kv_bytes_per_token(_kv_dtype(c.precision)) // shape.n_layers  # K and V
    n = c.n_chunks
    graphs = 0 if c.checkpoint_layers else min(c.graph_chunks, n)
    kept = attention_kept_chunks(n, c.checkpoint_layers, c.graph_chunks, c.kept_chunks, c.host_kept_chunks)
    host, last = spread_layers(shape.n_layers, c.host_kv_layers), shape.n_layers - 1
    per_kind: dict[tuple[str, bool, bool], tuple[int, int]] = {}
    gathers = [0.0, 0.0]
    for index, start in enumerate(range(0, c.context, c.chunk_size)):
        kind = "graph" if index >= n - graphs else "kept" if index in kept else "computed"
        skip_last = kind != "graph" and not c.stage_1_loss
        key = (kind, skip_last, index == n - 1)
        if key not in per_kind:
            requests = [_host_layer_requests(host, last, stage, kind, skip_last) for stage in (1, 2)]
            first, held = _gathers(requests[0], None)
            # stage 2 starts with the chunk stage 1 ended with: its last gather may serve stage 2's first call
            per_kind[key] = (first, _gathers(requests[1], held if index == n - 1 else None)[0])
        union = expected_union_pages(-(-start // c.page_size), sparse, n_tiles, heads)
        for stage, calls in enumerate(per_kind[key]):
            gathers[stage] += union * calls
    return gathers[0] * c.batch * page_bytes, gathers[1] * c.batch * page_bytes


def host_gather_bytes(shape: "ModelShape", c: "PlanConfig") -> float:
    """Bytes the host K/V layers' gathers move over the bus in a step of ``c`` (``host_gather_stage_bytes``)."""
    return sum(host_gather_stage_bytes(shape, c))


def host_gather_seconds(shape: "ModelShape", c: "PlanConfig", stage_2_compute_s: float = 0.0) -> float:
    """Seconds the host K/V layers' gathers add to a step of ``c`` at HOST_GATHER_GBPS: stage 1's, each made
    just after its selection, on the compute stream; stage 2's run on a side stream ahead of their calls
    (``core.pages.HostKVStaging``), so only what outlasts stage 2's compute (``stage_2_compute_s``) shows."""
    stage_1, stage_2 = (b / (HOST_GATHER_GBPS * 1e9) for b in host_gather_stage_bytes(shape, c))
    return stage_1 + max(0.0, stage_2 - stage_2_compute_s)


@dataclass(frozen=True)
class Collective:
    """One collective a step issues on every rank, ``calls`` times per step, each moving ``bus_bytes`` over a
    rank's link (the mean of the calls where a shorter last chunk moves less): a ring reduce-scatter or
    all-gather of a B-byte buffer (N - 1) / N x B, an all-reduce twice that. ``kind``: "all-reduce",
    "all-gather" or "reduce-scatter"; ``activations``: it sums a tensor-parallel layer's activations or their
    gradients (else weights or their gradients); ``seconds``: all calls at ``COLLECTIVE_GBPS``."""

    kind: str
    what: str
    calls: int
    bus_bytes: float
    activations: bool = False

    @property
    def seconds(self) -> float:
        return self.calls * self.bus_bytes / (COLLECTIVE_GBPS * 1e9)


def trainable_split(shape: "ModelShape", lora_rank: int) -> tuple[int, int]:
    """(trainable parameters inside the decoder layers, trainable parameters of the root: embeddings, final norm,
    output layer). LoRA trains only adapters, which sit in the layers."""
    if lora_rank:
        return shape.lora_params(lora_rank), 0
    return shape.n_layers * shape.layer_params, shape.root_params


def step_collectives(shape: "ModelShape", c: "PlanConfig") -> list[Collective]:
    """The collectives one step of ``c`` issues per rank. oomb_ddp (sharding "none"): the float32 all-reduce of
    every gradient after stage 2. Sharding (oomb_model_parallel, as its class docstring says): the decoder
    layers' weights all-gathered (zero1 and zero2: once per step, in stage 1's first chunk; zero3: for every
    chunk's forward in both stages, less the stage-2 forwards that kept graphs skip, and again for its
    backward), their gradients reduce-scattered in float32 (zero2 and zero3: after every chunk's backward;
    zero1: once, after the last), and the root's gradients all-reduced in float32 after stage 2. Tensor
    parallel: ``tensor_parallel_collectives``, and the whole weights' gradients all-reduced in float32 over the
    T ranks (alone) or, with sharding over data-parallel ranks too (``shape``: one rank's part), the root's over
    all D x T ranks. None on one device."""
    found = tensor_parallel_collectives(shape, c) if c.tensor_parallel > 1 else []
    n = c.devices
    world = n * c.tensor_parallel
    if n == 1:
        if c.tensor_parallel > 1:
            replicated = shape.n_layers * shape.layer_replicated_params + shape.root_params
            found.append(Collective("all-reduce", "the whole weights' gradients (float32)", 1,
                                    2 * (world - 1) / world * 4 * replicated))
        return found
    layer_trainable, root_trainable = trainable_split(shape, c.lora_rank)
    if c.sharding == "none":
        return [Collective("all-reduce", "every gradient (float32)", 1, 2 * (n - 1) / n * 4 * (layer_trainable +
                                                                                           root_trainable))]
    share = (n - 1) / n
    weights = shape.n_layers * shape.layer_params + (layer_trainable if c.lora_rank else 0)
    param = PROFILES[c.precision].param
    graphs = 0 if c.checkpoint_layers else min(c.graph_chunks, c.n_chunks)
    gathers = 3 * c.n_chunks - graphs if c.sharding == "zero3" else 1
    found += [
        Collective("all-gather", f"the decoder layers' weights ({_bytes_name(param)})", gathers,
                   share * weights * param),
        Collective("reduce-scatter", "the decoder layers' gradients (float32)",
                   1 if c.sharding == "zero1" else c.n_chunks, share * layer_trainable * 4),
    ]
    if root_trainable:
        found.append(Collective("all-reduce", "the root's gradients (float32)", 1,
                                2 * (world - 1) / world * 4 * root_trainable))
    return found


def tensor_parallel_collectives(shape: "ModelShape", c: "PlanConfig") -> list[Collective]:
    """The all-reduces one step of ``c`` issues on each of its ``c.tensor_parallel`` ranks (``shape``: one rank's
    part), as torch's tensor parallelism runs the decoder layers: in every forward of a layer, o_proj's and
    down_proj's outputs (RowwiseParallel: each rank's partial sums), (batch x chunk tokens x hidden) in the
    linear dtype; in every backward, the gradients of q/k/v_proj's and gate/up_proj's inputs (ColwiseParallel:
    each module sums its own), the same size in the dtype of their input, the normed residual stream. A layer
    runs forward in stage 1 (not the last layer where stage 1 ends at its K/V store), in stage 2 (not for a
    chunk whose graph stage 1 kept; kept attention outputs spare only the attention) and again in a layer
    checkpoint's recompute, which ends when down_proj has saved its input (torch's non-reentrant checkpoint
    stops there), before down_proj's all-reduce."""
    ring = 2 * (c.tensor_parallel - 1) / c.tensor_parallel  # of the buffer, per all-reduce
    p = PROFILES[c.precision]
    layers = shape.n_layers
    graphs = 0 if c.checkpoint_layers else min(c.graph_chunks, c.n_chunks)
    forwards = forward_tokens = 0  # all-reduces of o_proj's and down_proj's outputs, and their tokens summed
    for index, start in enumerate(range(0, c.context, c.chunk_size)):
        graph = index >= c.n_chunks - graphs
        passes = layers - (not graph and not c.stage_1_loss) + (0 if graph else layers)  # stage 1, stage 2
        calls = TP_ROWWISE * passes + (TP_ROWWISE - 1) * layers * c.checkpoint_layers  # and the recompute
        forwards += calls
        forward_tokens += calls * c.batch * min(c.chunk_size, c.context - start)
    backwards, backward_tokens = TP_COLWISE * layers * c.n_chunks, TP_COLWISE * layers * c.batch * c.context
    return [
        Collective("all-reduce", f"o_proj's and down_proj's outputs ({_bytes_name(p.linear)}), every layer forward",
                   forwards, ring * forward_tokens * shape.hidden * p.linear / forwards, activations=True),
        Collective("all-reduce", f"the input gradients of q/k/v_proj and gate/up_proj ({_bytes_name(p.residual)}), "
                   "every layer backward", backwards, ring * backward_tokens * shape.hidden * p.residual / backwards,
                   activations=True),
    ]


def step_time(
    model: Any,
    context: int,
    *,
    batch: int = 1,
    chunk_size: int = 4096,
    lora_rank: int = 0,
    checkpoint_layers: bool = False,
    sparse: "bool | SparseConfig | None" = False,
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS,
    page_size: int = 128,
    graph_chunks: int = 0,
    kept_chunks: int = 0,
    host_kept_chunks: int = 0,
    document_length: int | None = None,
) -> StepTime:
    """FLOP model (docs/planner.md, "Time") for one step of ``batch`` sequences of ``context`` tokens.

    linear: 8 * P_mm * tokens (stage-1 forward 2, stage-2 forward 2, backward 4). With LoRA the frozen
    weights still need the backward with respect to their inputs but not their own gradient:
    6 * P_mm * tokens, plus 8 * P_lora * tokens for the adapters.
    attention (dense, causal): 9 * n_layers * d_q * L^2 per sequence (forward 2 d_q L^2 per layer, counted
    4.5 times: two forwards and a backward of 2.5 forwards).
    layer checkpointing recomputes each layer's forward once more but its attention (the recompute takes the
    stage-2 forward's attention outputs): 2 * (P_mm - lm_head) * tokens.
    sparse: each query attends to at most A past tokens (A = budget_pages * page_size for a SparseConfig,
    SPARSE_ATTENDED_TOKENS for True) plus its chunk causally: per chunk of n tokens after s past tokens,
    n * (min(s, A) + n / 2) pairs instead of n * (s + n / 2).
    document_length D (packed documents, ``position_ids`` restarting every D tokens): a query sees its own
    document's keys only, so a query t attends to t mod D + 1/2 keys on average (the unpacked step's t + 1/2)
    and the past of a chunk's first document is at most s - D * (s // D) tokens; None: one document per
    sequence.
    What stage 1 keeps is not computed again: the last ``graph_chunks`` chunks' stage-2 forward (linear and
    attention; none with layer checkpointing), the attention forward of the ``kept_chunks`` chunks before
    them and of the first ``host_kept_chunks`` chunks (``attention_kept_chunks``).
    """
    shape = ModelShape.resolve(model)
    tokens = batch * context
    if lora_rank > 0:
        linear = 6.0 * shape.matmul_params * tokens + 8.0 * shape.lora_params(lora_rank) * tokens
    else:
        linear = 8.0 * shape.matmul_params * tokens
    # Forward attention FLOPs of one layer and one sequence: 4 * d_q per (query, key) pair.
    attended = context
    if sparse:
        attended = sparse.attended_past_tokens(page_size) if isinstance(sparse, SparseConfig) else SPARSE_ATTENDED_TOKENS
    chunk_pairs = [_chunk_pairs(s, min(chunk_size, context - s), attended, document_length or context)
                   for s in range(0, context, chunk_size)]
    per_pair = 4.0 * shape.q_width * shape.n_layers * batch  # forward attention FLOPs of one (query, key) pair
    forward_attention = per_pair * sum(chunk_pairs)
    recompute = 2.0 * (shape.matmul_params - shape.head_params) * tokens if checkpoint_layers else 0.0
    n = len(chunk_pairs)
    graphs = 0 if checkpoint_layers else min(graph_chunks, n)
    kept = attention_kept_chunks(n, checkpoint_layers, graph_chunks, kept_chunks, host_kept_chunks)
    # Attention forwards a chunk executes: stage 1's, stage 2's and the backward's 2.5, less the stage-2
    # forward a kept output spares.
    passes = [4.5 - (i in kept) for i in range(n)]
    attention = per_pair * sum(pairs * passes[i] for i, pairs in enumerate(chunk_pairs))
    linear -= 2.0 * shape.matmul_params * batch * sum(min(chunk_size, context - i * chunk_size)
                                                      for i in range(n - graphs, n))
    stage_1 = 2.0 * shape.matmul_params * tokens + forward_attention
    portable = 0.0
    if document_length is not None and document_length < context and not sparse:
        portable = per_pair * sum(pairs * passes[i] for i, pairs in enumerate(chunk_pairs)
                                  if _runs_portable(i * chunk_size, min(chunk_size, context - i * chunk_size),
                                                    document_length, page_size))
    return StepTime(linear, attention, recompute, matmul_tflops, portable_attention_flops=portable,
                    stage_1_flops=stage_1)


def _runs_portable(start: int, n: int, document_length: int, page_size: int) -> bool:
    """Whether the dense chunk [start, start + n) of a sequence packed from documents of ``document_length``
    tokens runs its attention in the portable kernels on Hopper (PORTABLE_ATTENTION_EFFICIENCY): it holds a
    document border, or its document starts mid-page."""
    first_doc = start - start % document_length
    return first_doc != (start + n - 1) - (start + n - 1) % document_length or first_doc % page_size != 0


def _chunk_pairs(start: int, n: int, attended: int | float, document_length: int) -> float:
    """(query, key) pairs of the n queries of a chunk at ``start`` (counting the diagonal as half a pair, as
    n * n / 2 does), each seeing at most ``attended`` keys before the chunk, within documents of
    ``document_length`` tokens. The queries of the document the chunk starts in see its past and the chunk
    causally; those of documents starting in the chunk only their document's first tokens."""
    first_doc = start - start % document_length
    head = min(first_doc + document_length, start + n) - start  # queries of the document the chunk starts in

    def before(x: int) -> int:  # sum of t mod D over t < x: keys each query sees before itself
        whole, rest = divmod(x, document_length)
        return whole * document_length * (document_length - 1) // 2 + rest * (rest - 1) // 2

    rest = n - head  # queries of documents starting in the chunk: t mod D + 1/2 keys each
    later = before(start + n) - before(start + head) + rest / 2
    return head * (min(start - first_doc, attended) + head / 2) + later


# == the plan =============================================================================================


@dataclass(frozen=True)
class PlanConfig:
    """One training step as the planner sees it. Token counts are per sequence; memory is in bytes.

    offload: K/V and KV-gradient pages in pinned host memory, streamed through the GPU in segments of
    ``segment_tokens`` tokens per sequence (dense attention). sparse: None/False (dense), a SparseConfig, or
    True (a projection with SPARSE_ATTENDED_TOKENS). host_grad_layers (sparse only): the KV-gradient pages
    of that many layers in pinned host memory, added into from the GPU after each sparse backward.
    host_kv_layers (sparse only): the K/V pages of that many layers in pinned host memory too, of which each
    attention call gathers the pages its chunk selected. kept_chunks: attention outputs of that many chunks kept on the GPU from stage 1 for
    stage 2 (which then skips their attention forward). graph_chunks: autograd graphs of the last that many
    chunks kept from stage 1 (stage 2 then skips their forward; the graph of the last costs nothing extra,
    and those chunks need no kept attention outputs). host_kept_chunks: attention outputs of the first that
    many chunks kept from stage 1 in pinned host memory. fused_ops: the fused Triton
    RMSNorm/RoPE/SwiGLU of Triton steps (False: transformers' own ops, attention="reference").
    stage_1_loss: the step computes its loss in stage 1 (a served forward, as under OOMBStrategy).
    loss_grads: where such a step keeps each chunk's dL/dh for stage 2 (``LOSS_GRADS``): "gpu", "host" (one
    pinned block), or "recomputed": none kept, stage 2 runs the output layer again (its forward then runs in
    both stages, as ``step_time`` counts it for every step).
    host_process_bytes: the process's own host memory (measured when a step is placed); None: HOST_PROCESS_BYTES.
    host_pending_bytes: host memory the run adds before its next step beyond HOST_GROWTH_BYTES (the first
    compilation of a torchao optimizer's step); None: the optimizer's ``compile_host_bytes``.
    devices: data-parallel ranks, each running this step on its own ``batch`` sequences: memory is per GPU,
    the time includes the collectives (``step_collectives``). sharding: "none": every rank whole (oomb_ddp,
    plus the gradients' all-reduce bucket); "zero1", "zero2", "zero3": oomb_model_parallel's sharding of the
    decoder layers' weights, gradients and optimizer state over the ``devices`` ranks (docs/planner.md,
    "Several GPUs").
    document_length: packed documents of that many tokens (position ids restarting every document_length
    tokens): attention FLOPs within documents only (``step_time``); None: one document per sequence. Memory
    is the same either way.
    tensor_parallel: ranks that split each decoder layer by KV heads (oomb_model_parallel's
    tensor_parallel_size), all running this step's ``batch``: memory and FLOPs are one rank's (the shape the
    plan gets is one rank's part, ``ModelShape.tensor_parallel_part``), the time includes their all-reduces
    (``tensor_parallel_collectives``). With ``devices`` D > 1 too, D x T ranks (oomb_model_parallel's 2-D mesh):
    each rank's part sharded over the D data-parallel ranks (``sharding`` zero1/2/3). Not with LoRA (refused,
    as the strategy refuses it).
    """

    context: int
    chunk_size: int = 4096
    batch: int = 1
    page_size: int = 128
    lora_rank: int = 0
    optimizer: str = "adamw"
    precision: str = "bf16-true"
    checkpoint_layers: bool = False
    grad_dtype: torch.dtype = torch.float32
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS
    offload: bool = False
    segment_tokens: int = OFFLOAD_SEGMENT_TOKENS
    sparse: "bool | SparseConfig | None" = False
    host_grad_layers: int = 0
    kept_chunks: int = 0
    graph_chunks: int = 0
    host_kept_chunks: int = 0
    fused_ops: bool = True
    stage_1_loss: bool = False
    loss_grads: str = "gpu"
    host_process_bytes: int | None = None
    host_pending_bytes: int | None = None
    devices: int = 1
    host_kv_layers: int = 0
    document_length: int | None = None
    sharding: Sharding = "none"
    tensor_parallel: int = 1

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


@dataclass
class Suggestion:
    """A change that would make a step fit (goal "memory") or run faster (goal "time"), with its plan: in
    words, as flags of ``lightning-oomb plan`` (``cli``) and as keyword arguments of ``plan()`` and the
    training API (``python``)."""

    change: str
    plan: "Plan"
    cli: str
    python: str
    goal: str = "memory"

    def render(self, style: str = "python") -> str:
        p = self.plan
        verdict = "fits" if p.fits else "still does not fit"
        host = f", host {_gib(p.peak_host_bytes)} GiB" if p.config.offload or p.config.host_grad_layers else ""
        how = self.cli if style == "cli" else self.python
        return (f"- {self.change} ({how}): GPU {_gib(p.peak_gpu_bytes)} GiB{host}, {verdict}; "
                f"step ≈ {_duration(p.time.predicted_s)}")

    def __str__(self) -> str:
        return self.render()


@dataclass
class Plan:
    """Memory (bytes, per named line) and time of one step of ``config`` for ``shape`` (the model, or with
    ``config.tensor_parallel`` > 1 one rank's part of it) on a machine."""

    shape: ModelShape
    config: PlanConfig
    gpu_lines: dict[str, int]
    host_lines: dict[str, int]
    time: StepTime
    gpu_memory: int
    host_memory: int
    machine: str = ""
    checkpoint_auto: bool = False
    other_activation_bytes: int | None = None
    # "cpu": a step on a CPU device, whose "GPU" lines are host memory too; printed without GPU-only lines.
    device: str = "cuda"
    # How suggestions name their changes: "python" (keyword arguments) or "cli" (lightning-oomb plan's flags).
    suggestion_style: str = "python"
    notes: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def peak_gpu_bytes(self) -> int:
        return sum(self.gpu_lines.values())

    @property
    def peak_host_bytes(self) -> int:
        return sum(self.host_lines.values())

    @property
    def usable_gpu_bytes(self) -> int:
        """GPU memory a step may plan for: all of it less the reserve ``place_step`` keeps."""
        return int(self.gpu_memory * (1 - PLACEMENT_HEADROOM_SHARE))

    @property
    def fits(self) -> bool:
        """What ``place_step`` would decide: the GPU lines within the memory less its reserve, the host lines
        within the host memory budget."""
        return self.peak_gpu_bytes <= self.usable_gpu_bytes and self.peak_host_bytes <= self.host_memory

    def check(self) -> "Plan":
        """Raise PlanError (with this plan as the message) when the step does not fit; else return self."""
        if not self.fits:
            raise PlanError(str(self))
        return self

    def __str__(self) -> str:
        c, s = self.config, self.shape
        training = f"LoRA rank {c.lora_rank}" if c.lora_rank else "full training"
        ckpt = "on" if c.checkpoint_layers else "off"
        if self.checkpoint_auto:
            ckpt += " (auto)"
        head = (
            f"Plan: {s.name}, context {c.context:,} tokens x batch {c.batch}, chunk {c.chunk_size:,}, "
            f"page {c.page_size}; {training}, optimizer {c.optimizer}, {c.precision}, layer checkpointing "
            f"{ckpt}, KV-gradients {_dtype_name(c.grad_dtype)}"
        )
        if c.devices > 1 and c.sharding == "none":
            head += f"; {c.devices} data-parallel ranks (oomb_ddp), memory per GPU"
        elif c.devices > 1:
            head += (f"; {c.devices} data-parallel ranks (oomb_model_parallel, sharding {c.sharding}: "
                     f"{SHARDING_SUMMARY[c.sharding]})" + ("" if c.tensor_parallel > 1 else ", memory per GPU"))
        if c.tensor_parallel > 1:
            head += (f"; {c.tensor_parallel} tensor-parallel ranks" + (" each" if c.devices > 1 else "")
                     + " (oomb_model_parallel, split by KV heads), memory per GPU")
        if c.document_length is not None and c.document_length < c.context:
            head += f"; packed from documents of {c.document_length:,} tokens"
        if c.offload:
            head += f"; pages offloaded to pinned host memory, streamed in segments of {c.segment_tokens:,} tokens"
        if c.host_grad_layers:
            head += f"; KV-gradient pages of {c.host_grad_layers} of {s.n_layers} layers in pinned host memory"
        if c.host_kv_layers:
            head += f"; K/V pages of {c.host_kv_layers} of {s.n_layers} layers in pinned host memory"
        if c.stage_1_loss and c.loss_grads == "recomputed":
            head += "; each chunk's dL/dh computed again in stage 2 (no room to keep it)"
        if not c.fused_ops:
            head += "; transformers' own RMSNorm/RoPE/SwiGLU"
        if isinstance(c.sparse, SparseConfig):
            sp = c.sparse
            head += (
                f"; sparse attention: {sp.budget_pages} pages per query tile ({sp.sink_pages} sink, "
                f"{sp.local_pages} local), score {sp.score}, {'per KV head' if sp.per_kv_head else 'shared'}"
                + ("" if sp.per_query_tile else ", one selection per chunk")
            )
        cpu = self.device == "cpu"
        gpu_lines, host_lines = self.gpu_lines, self.host_lines
        unit, amount = "GiB", _gib
        if cpu:
            # A CPU run is small: MiB when the step is under a GiB, and lines that round to nothing left out.
            if self.peak_gpu_bytes < GIB:
                unit, amount = "MiB", lambda n: f"{n / 2**20:.2f}"
            gpu_lines = {k: v for k, v in gpu_lines.items() if float(amount(v))}
            host_lines = {k: v for k, v in host_lines.items() if float(amount(v))}
        width = max(len(k) for k in [*gpu_lines, *host_lines]) + 2
        rows = [head, "", f"{'Step memory (this CPU run: host RAM)' if cpu else 'GPU memory':<{width}}{unit:>10}"]
        rows += [f"  {k:<{width - 2}}{amount(v):>10}" for k, v in gpu_lines.items()]
        rows.append(f"  {'total':<{width - 2}}{amount(self.peak_gpu_bytes):>10}")
        rows += ["", f"{'Host memory':<{width}}{unit:>10}"]
        rows += [f"  {k:<{width - 2}}{amount(v):>10}" for k, v in host_lines.items()]
        rows.append(f"  {'total':<{width - 2}}{amount(self.peak_host_bytes):>10}")
        t = self.time
        rows += [] if cpu else [
            "",
            f"Step FLOPs {t.total_flops:.3g} (linear {t.linear_flops:.3g}, attention {t.attention_flops:.3g}, "
            f"checkpoint recompute {t.recompute_flops:.3g})",
            f"Step time: floor {_duration(t.floor_s)} at {t.matmul_tflops:g} TFLOP/s; predicted "
            f"{_duration(t.predicted_s)} (linear at {LINEAR_EFFICIENCY:.0%}, attention at {ATTENTION_EFFICIENCY:.0%} "
            "of the peak" + (f", {_portable_share(t):.0%} of it at {PORTABLE_ATTENTION_EFFICIENCY:.0%}: packed "
                             "chunks that hold a document border or whose document starts mid-page run the "
                             "portable Triton kernels, docs/planner.md" if t.portable_attention_flops else "")
            + (f", plus {_duration(t.host_add_s)} for the host gradient layers" if t.host_add_s else "")
            + (f", plus {_duration(t.host_gather_s)} of gathering the host K/V layers' selected pages "
               f"({_gb(t.host_gather_bytes)} at {HOST_GATHER_GBPS:g} GB/s; stage 2's behind the compute)"
               if t.host_gather_bytes else "")
            + _collectives_time(t, c)
            + ", calibrate with lightning-oomb bench)",
        ]
        collectives = step_collectives(s, c) if c.sharding != "none" or c.tensor_parallel > 1 else []
        if collectives:
            rows.append(f"Collectives per step and rank (ring, {COLLECTIVE_GBPS:g} GB/s bus bandwidth assumed, none "
                        "hidden behind the compute):")
            rows += [f"  {x.kind} of {x.what}: {x.calls} x {_gib(x.bus_bytes)} GiB, {_duration(x.seconds)}"
                     for x in collectives]
        if self.other_activation_bytes is not None:
            other = "on" if not c.checkpoint_layers else "off"
            rows.append(f"Activations with layer checkpointing {other}: {amount(self.other_activation_bytes)} {unit}")
        rows += [f"Note: {n}" for n in self.notes]
        if cpu:
            return "\n".join(rows)
        machine = (
            f"GPU {_gb(self.gpu_memory)} ({_gib(self.gpu_memory)} GiB){' ' + self.machine if self.machine else ''}, "
            f"host {_gb(self.host_memory)} ({_gib(self.host_memory)} GiB)"
        )
        rows.append("")
        reserve = f"beyond the {PLACEMENT_HEADROOM_SHARE:.0%} reserve a step keeps"
        if self.fits:
            rows.append(
                f"FITS on {machine}: {_gib(self.usable_gpu_bytes - self.peak_gpu_bytes)} GiB of GPU memory to spare "
                f"{reserve}"
            )
        else:
            short = []
            if self.peak_gpu_bytes > self.usable_gpu_bytes:
                short.append(f"GPU short by {_gib(self.peak_gpu_bytes - self.usable_gpu_bytes)} GiB {reserve}")
            if self.peak_host_bytes > self.host_memory:
                short.append(f"host short by {_gib(self.peak_host_bytes - self.host_memory)} GiB")
            rows.append(f"DOES NOT FIT on {machine}: {', '.join(short)}")
        memory = [x for x in self.suggestions if x.goal == "memory"]
        faster = [x for x in self.suggestions if x.goal == "time"]
        if memory:
            rows += ["What would make it fit:", *(x.render(self.suggestion_style) for x in memory)]
        if faster:
            rows += ["What would make it faster:", *(x.render(self.suggestion_style) for x in faster)]
        return "\n".join(rows)


def _collectives_time(t: StepTime, c: PlanConfig) -> str:
    """What the collectives add to the predicted step time, in the words of the plan's time line."""
    if c.tensor_parallel > 1 and c.sharding == "none":
        return (f", plus {_duration(t.tensor_parallel_s)} for the decoder layers' tensor-parallel all-reduces and "
                f"{_duration(t.all_reduce_s)} for the whole weights' gradient all-reduce at {COLLECTIVE_GBPS:g} GB/s")
    if c.sharding == "none":
        return (f", plus {_duration(t.all_reduce_s)} for the gradients' all-reduce at {COLLECTIVE_GBPS:g} GB/s"
                if t.all_reduce_s else "")
    text = f", plus {_duration(t.sharding_s)} for the decoder layers' all-gathers and reduce-scatters"
    if t.tensor_parallel_s:
        text += f", {_duration(t.tensor_parallel_s)} for their tensor-parallel all-reduces"
    if t.all_reduce_s:
        text += f" and {_duration(t.all_reduce_s)} for the root's all-reduce"
    return text + f" at {COLLECTIVE_GBPS:g} GB/s"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _bytes_name(itemsize: int) -> str:
    """The plan's name of a float of ``itemsize`` bytes (a DtypeProfile's entries)."""
    return "bf16" if itemsize == 2 else "fp32"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _portable_share(t: StepTime) -> float:
    return t.portable_attention_flops / t.attention_flops


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _memory_lines(shape: ModelShape, c: PlanConfig) -> tuple[dict[str, int], dict[str, int]]:
    """GPU and host memory of one step, by named line, in bytes."""
    p = PROFILES[c.precision]
    param_dtype = _bytes_name(p.param)
    lora = shape.lora_params(c.lora_rank) if c.lora_rank else 0
    trainable = lora if c.lora_rank else shape.total_params
    head_trained = c.lora_rank == 0
    if c.host_process_bytes is None:
        host = {"process (Python, torch, CUDA runtime and driver; assumed)": HOST_PROCESS_BYTES}
    else:
        host = {"process when the step was placed (measured resident set)": c.host_process_bytes}
    host["process growth during the run (allowance)"] = HOST_GROWTH_BYTES
    pending = c.host_pending_bytes
    if pending is None:
        pending = OPTIMIZER_CHOICES[c.optimizer].compile_host_bytes if c.optimizer in OPTIMIZER_CHOICES else 0
    if pending:
        host["optimizer: torch.compile of its step at the first update (allowance)"] = pending
    state = _state_rate(c, p.param)
    if c.tensor_parallel > 1 and c.sharding == "none":
        gpu = _tensor_parallel_lines(shape, c, state)
    elif c.sharding == "none":
        # LoRA adapters train in float32 whatever the precision (CausalLMModule's lora_dtype default).
        trained_bytes = 4 if c.lora_rank else p.param
        trained_dtype = _bytes_name(trained_bytes)
        adapters = f" + {human_count(lora)} LoRA in float32" if c.lora_rank else ""
        what, rate = _state_rate(c, trained_bytes)
        gpu: dict[str, int] = {
            f"weights ({param_dtype}, {human_count(shape.total_params)} params{adapters})":
                shape.total_params * p.param + lora * 4,
            f"gradients ({trained_dtype}, {human_count(trainable)} trainable)": trainable * trained_bytes,
            f"optimizer state ({what})": int(rate * trainable),
        }
    else:
        gpu = _sharded_lines(shape, c, state)
    if p.autocast_weight_copies:
        # Autocast's cast of every weight to bf16 lives for the whole autocast region (its cache), and
        # linear layers save the bf16 copy for backward: a bf16 image of all matrices.
        matrices_and_biases = shape.matmul_params + shape.n_layers * shape.layer_bias_params
        gpu["bf16 weight copies (autocast cache)"] = 2 * matrices_and_biases
    if c.devices > 1 and c.sharding == "none":
        gpu["gradient all-reduce bucket (float32, oomb_ddp)"] = min(GRADIENT_BUCKET_BYTES, 4 * trainable)
    t = c.chunk_tokens
    ckpt = " (layer checkpointing)" if c.checkpoint_layers else ""
    gpu[f"activations, one chunk of {t:,} tokens{ckpt}"] = activation_bytes(
        shape, t, c.precision, c.checkpoint_layers, c.lora_rank, c.fused_ops
    )
    # Gradients in flight while autograd walks back through a layer: at most what that layer saved
    # (an assumption, see docs/planner.md).
    gpu["backward working set (one layer)"] = layer_activation_bytes(shape, t, c.precision, c.lora_rank, c.fused_ops)
    gpu["loss: dL/dh of the chunk"] = t * shape.hidden * p.linear
    if c.stage_1_loss and c.loss_grads != "recomputed":
        kept_grads = loss_grad_bytes(shape, t, c.n_chunks, c.precision)
        name = f"loss: dL/dh of every chunk, kept from stage 1 for stage 2 ({c.n_chunks} chunks)"
        on_host = c.loss_grads == "host"
        (host if on_host else gpu)[("pinned " if on_host else "") + name] = kept_grads
    rows = min(piece_rows(shape.vocab), t)
    # One piece holds logits (linear dtype), float32 log-probs and their scaled gradient, and its cast; the
    # fused kernel (kernels.cross_entropy) writes the gradient over the logits.
    piece = rows * shape.vocab * (p.linear if c.fused_ops else 8 + 2 * p.linear)
    head_w = shape.vocab * shape.hidden
    if head_trained:
        gpu["loss: dL/dW accumulator (fp32, vocab x hidden)"] = head_w * 4
        # Backward scales the accumulator in place and casts it to the weight dtype.
        gpu["loss: logits piece / dL/dW cast (transient)"] = max(piece, head_w * p.param)
    else:
        gpu[f"loss: logits piece of {rows} rows (transient)"] = piece
    kv_dtype = _kv_dtype(c.precision)
    kv_bytes = c.stored_tokens * shape.kv_bytes_per_token(kv_dtype)
    grad_bytes = c.stored_tokens * shape.kv_bytes_per_token(c.grad_dtype)
    kv_name = f"K/V pages ({_dtype_name(kv_dtype)}, {c.stored_tokens:,} tokens)"
    grad_name = f"KV-gradient pages ({_dtype_name(c.grad_dtype)})"
    if c.offload:
        kv_layer = shape.kv_bytes_per_token(kv_dtype) // shape.n_layers
        grad_layer = shape.kv_bytes_per_token(c.grad_dtype) // shape.n_layers
        segment = offload_segment_pages(c) * c.page_size
        gpu[f"offload staging: 2 segments x {segment:,} tokens of K, V, dK, dV (one layer)"] = (
            2 * segment * (kv_layer + grad_layer)
        )
        # One chunk's K, V on their way out (two buffers) and its stored dK, dV on their way in.
        chunk_rows = c.batch * (math.ceil(min(c.chunk_size, c.context) / c.page_size) + 1) * c.page_size
        gpu["offload staging: a chunk's K, V out (x2) and dK, dV in"] = chunk_rows * (2 * kv_layer + grad_layer)
        # The streamed forward carries its output in fp32, the streamed backward its dQ: one layer each.
        gpu["offload: fp32 attention output / dQ of a chunk (one layer)"] = c.chunk_tokens * shape.q_width * 4
        host[f"pinned {kv_name}"] = kv_bytes
        host[f"pinned {grad_name}"] = grad_bytes
    else:
        n_kv_host = c.host_kv_layers
        if n_kv_host > shape.n_layers:
            raise ValueError(f"host_kv_layers ({n_kv_host}) exceeds the model's {shape.n_layers} layers")
        if n_kv_host:
            kv_layer = kv_bytes // shape.n_layers
            gpu[f"{kv_name}, {shape.n_layers - n_kv_host} of {shape.n_layers} layers"] = kv_layer * (
                shape.n_layers - n_kv_host)
            host[f"pinned {kv_name}, {n_kv_host} layers (selected pages gathered)"] = kv_layer * n_kv_host
            # One attention call's gather: per sequence, every past page a selection can name (core.pages
            # HostKVStaging sizes it for the worst case, on the device).
            past_pages = math.ceil(max(c.context - c.chunk_size, 0) / c.page_size)
            n_tiles = math.ceil(min(c.chunk_size, c.context) / c.page_size)
            staged = past_pages
            if isinstance(c.sparse, SparseConfig):
                heads = shape.n_kv_heads if c.sparse.per_kv_head else 1
                lists = n_tiles if c.sparse.per_query_tile else 1
                staged = min(past_pages, heads * lists * min(past_pages, c.sparse.budget_pages))
            per_token = shape.kv_bytes_per_token(kv_dtype) // shape.n_layers
            gpu["host K/V layers: staging of a chunk's selected pages (two layers: one in use, the next gathered "
                "ahead)"] = 2 * max(1, staged) * c.batch * c.page_size * per_token
        else:
            gpu[kv_name] = kv_bytes
        n_host = c.host_grad_layers
        if n_host > shape.n_layers:
            raise ValueError(f"host_grad_layers ({n_host}) exceeds the model's {shape.n_layers} layers")
        if n_host:
            n_gpu = shape.n_layers - n_host
            gpu[f"{grad_name}, {n_gpu} of {shape.n_layers} layers"] = grad_bytes // shape.n_layers * n_gpu
            host[f"pinned {grad_name}, {n_host} layers (added into from the GPU)"] = (
                grad_bytes // shape.n_layers * n_host
            )
            # The last chunk's distinct selected pages per (sequence, KV head), bounded as in
            # kernels.sparse_attention.invert_selection.
            past_pages = math.ceil(max(c.context - c.chunk_size, 0) / c.page_size)
            n_tiles = math.ceil(min(c.chunk_size, c.context) / c.page_size)
            staged = past_pages
            if isinstance(c.sparse, SparseConfig):
                staged = min(past_pages, n_tiles * c.sparse.budget_pages)
            buffers = HostGradStaging.N_BUFFERS
            gpu[f"host gradient layers: float32 staging of a chunk's selected pages ({buffers} buffers)"] = (
                HostGradStaging.nbytes_for(c.batch, shape.n_kv_heads, staged, c.page_size, shape.head_dim)
            )
        else:
            gpu[grad_name] = grad_bytes
    if isinstance(c.sparse, SparseConfig):
        pages = c.stored_tokens // c.page_size
        # A float32 mean key, or a min and max key, per page, layer and KV head; the host K/V layers' live with
        # their pages in host memory.
        summary_bytes = 4 if c.sparse.score == "mean" else 2 * _itemsize(kv_dtype)
        per_layer = pages * shape.n_kv_heads * shape.head_dim * summary_bytes
        summaries = (shape.n_layers - c.host_kv_layers) * per_layer
        if c.host_kv_layers:
            host[f"pinned page summaries ({c.sparse.score}), {c.host_kv_layers} layers"] = c.host_kv_layers * per_layer
        # int32 page lists kept from stage 1 to stage 2: per layer, sequence, KV head (or one), query tile (or
        # chunk, per_query_tile=False).
        heads = shape.n_kv_heads if c.sparse.per_kv_head else 1
        lists = pages if c.sparse.per_query_tile else c.batch * c.n_chunks
        selections = 4 * shape.n_layers * heads * lists * min(c.sparse.budget_pages, pages)
        gpu[f"sparse: page summaries ({c.sparse.score}) and selections (int32)"] = summaries + selections
    graphs = min(c.graph_chunks, c.n_chunks)
    kept = min(c.kept_chunks, c.n_chunks - graphs)
    if kept:
        gpu[f"attention outputs kept from stage 1 ({kept} of {c.n_chunks} chunks)"] = kept * kept_chunk_bytes(
            shape, c.chunk_tokens, kv_dtype
        )
    host_kept = min(c.host_kept_chunks, c.n_chunks - graphs - kept)
    if host_kept:
        host[f"pinned attention outputs kept from stage 1 ({host_kept} of {c.n_chunks} chunks)"] = (
            host_kept * kept_chunk_bytes(shape, c.chunk_tokens, kv_dtype)
        )
    if graphs > 1:
        gpu[f"autograd graphs kept from stage 1 ({graphs} of {c.n_chunks} chunks, one counted above)"] = (
            (graphs - 1) * graph_chunk_bytes(shape, c)
        )
    gpu["CUDA context and workspaces (assumed)"] = CUDA_CONTEXT_BYTES
    return gpu, host


def _state_rate(c: PlanConfig, weight_bytes: int) -> tuple[str, float]:
    """(what the optimizer-state lines say, bytes of state per trained parameter of ``weight_bytes`` bytes)
    for ``c.optimizer``."""
    rate = plan_state_bytes(c.optimizer, weight_bytes)
    summary = OPTIMIZER_CHOICES[c.optimizer].summary if c.optimizer in OPTIMIZER_CHOICES else "no optimizer"
    return f"{c.optimizer}: {summary}, {rate:.3g} bytes per trainable", rate


def _sharded_lines(shape: ModelShape, c: PlanConfig, state: tuple[str, float]) -> dict[str, int]:
    """Weights, gradients and optimizer state on one GPU of oomb_model_parallel, by named line, in bytes.

    The decoder layers are FSDP2-sharded: each rank keeps 1/N of their weights, and of their gradients and
    optimizer state (in the weights' dtype) once reduced, each parameter's rows split evenly (FSDP2 pads
    uneven rows; not counted). zero1 and zero2 gather the layers' weights whole in stage 1's first chunk and
    keep them until stage 2's last (a buffer of their own, next to the shards); zero3 gathers
    ZERO3_GATHERED_LAYERS layers at a time. zero1 sums each chunk's gradients whole in float32 (FSDP2's reduce
    dtype) until one reduce-scatter after the last chunk. Each reduce-scatter holds, beyond the shards, one
    layer's gradient as autograd made it and its float32 copy. The root (embeddings, final norm, output
    layer) stays whole on every rank, its gradients averaged through oomb_ddp's float32 bucket. Line names
    that start with "weights", "gradients" or "optimizer state" are what stays allocated between steps (what
    ``place_step`` measures rather than plans)."""
    p = PROFILES[c.precision]
    dtype = _bytes_name(p.param)
    n = c.devices
    layer_trainable, root_trainable = trainable_split(shape, c.lora_rank)
    layer_weights = shape.n_layers * shape.layer_params + (layer_trainable if c.lora_rank else 0)
    per_layer = layer_weights // shape.n_layers
    shard = f"1/{n} shard" + (f" of this rank's 1/{c.tensor_parallel} by KV heads" if c.tensor_parallel > 1 else "")
    gpu = {
        f"weights: root (embeddings, final norm, output layer; {dtype}, whole, "
        f"{human_count(shape.root_params)} params)": shape.root_params * p.param,
        f"weights: decoder layers, {shard} ({dtype}, {human_count(layer_weights // n)} params)":
            -(-layer_weights // n) * p.param,
    }
    if c.sharding == "zero3":
        layers = min(ZERO3_GATHERED_LAYERS, shape.n_layers)
        gpu[f"gathered weights: {layers} of {shape.n_layers} decoder layers at a time ({dtype})"] = (
            layers * per_layer * p.param)
    else:
        gpu[f"gathered weights: decoder layers, whole for the step ({dtype})"] = layer_weights * p.param
    if root_trainable:
        gpu[f"gradients: root ({dtype}, whole)"] = root_trainable * p.param
    if c.sharding == "zero1":
        gpu["gradients: decoder layers (float32, whole, summed over the chunks)"] = layer_trainable * 4
    else:
        gpu[f"gradients: decoder layers, {shard} ({dtype})"] = -(-layer_trainable // n) * p.param
    gpu[f"reduce-scatter in flight: one layer's gradients ({dtype}) and their float32 copy"] = (
        layer_trainable // shape.n_layers * (p.param + 4))
    what, rate = state
    if root_trainable:
        gpu[f"optimizer state: root ({what}, whole)"] = int(rate * root_trainable)
    gpu[f"optimizer state: decoder layers, {shard} ({what})"] = int(rate * -(-layer_trainable // n))
    if root_trainable:
        gpu["gradient all-reduce bucket (float32, the root's)"] = min(GRADIENT_BUCKET_BYTES, 4 * root_trainable)
    return gpu


def _tensor_parallel_lines(shape: ModelShape, c: PlanConfig, state: tuple[str, float]) -> dict[str, int]:
    """Weights, gradients and optimizer state on one GPU of a tensor-parallel group, by named line, in bytes
    (``shape``: one rank's part, ``ModelShape.tensor_parallel_part``): the decoder layers' 1/T split by KV heads
    (their norms and o's and down's biases whole), the root (embeddings, final norm, output layer) whole. The
    whole weights' gradients are averaged after stage 2 through oomb_ddp's float32 bucket."""
    p = PROFILES[c.precision]
    dtype = _bytes_name(p.param)
    layers, root = shape.n_layers * shape.layer_params, shape.root_params
    part = f"1/{c.tensor_parallel} by KV heads"
    what, rate = state
    replicated = shape.n_layers * shape.layer_replicated_params + root
    return {
        f"weights: root (embeddings, final norm, output layer; {dtype}, whole, {human_count(root)} params)":
            root * p.param,
        f"weights: decoder layers, {part} ({dtype}, {human_count(layers)} params)": layers * p.param,
        f"gradients: root ({dtype}, whole)": root * p.param,
        f"gradients: decoder layers, {part} ({dtype})": layers * p.param,
        f"optimizer state: root ({what}, whole)": int(rate * root),
        f"optimizer state: decoder layers, {part} ({what})": int(rate * layers),
        "gradient all-reduce bucket (float32, the whole weights')": min(GRADIENT_BUCKET_BYTES, 4 * replicated),
    }


def kept_chunk_bytes(shape: ModelShape, chunk_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one chunk's attention outputs (every layer's out in ``dtype`` and fp32 lse) kept from stage 1."""
    return shape.n_layers * chunk_tokens * (shape.q_width * _itemsize(dtype) + 4 * shape.n_heads)


def graph_chunk_bytes(shape: ModelShape, c: PlanConfig) -> int:
    """Bytes one chunk's autograd graph holds from its forward to its backward: its activations and the
    loss's dL/dh (the output layer's gradient goes into the step's float32 sum, counted once)."""
    p = PROFILES[c.precision]
    t = c.chunk_tokens
    return activation_bytes(shape, t, c.precision, False, c.lora_rank, c.fused_ops) + t * shape.hidden * p.linear


def loss_grad_bytes(shape: ModelShape, chunk_tokens: int, n_chunks: int, precision: str) -> int:
    """Bytes of every chunk's dL/dh that a step computing its loss in stage 1 (a served forward) keeps for
    stage 2 (on the host: one pinned block of the pool, ``PagePool.loss_grad_buffer``)."""
    return n_chunks * chunk_tokens * shape.hidden * PROFILES[precision].residual


def keepable_chunks(spare_bytes: float, chunk_bytes: int, n_chunks: int, share: float = KEPT_ATTENTION_SHARE) -> int:
    """Chunks of ``chunk_bytes`` each (attention outputs, or with KEPT_GRAPHS_SHARE autograd graphs) a step keeps
    by default when ``spare_bytes`` of GPU memory are left beyond it: those that fit in ``share`` of them, at
    most ``n_chunks``."""
    return min(n_chunks, int(share * max(0.0, spare_bytes)) // chunk_bytes)


def asked_graphs(n_chunks: int, checkpoint_layers: bool, keep_graphs: int | None) -> int:
    """Autograd graphs stage 1 keeps before any share of spare memory: none with layer checkpointing, else
    ``keep_graphs`` or (None) the last chunk's, which costs nothing (stage 2 would hold it next)."""
    return 0 if checkpoint_layers else min(n_chunks, 1 if keep_graphs is None else keep_graphs)


def kept_for_stage_2(
    step: Plan, spare_bytes: float, keep_attention: int | None = None, keep_graphs: int | None = None
) -> tuple[int, int]:
    """(attention outputs, autograd graphs) of chunks stage 1 keeps for stage 2 in ``step`` with every page on
    the GPU, when ``spare_bytes`` are free beyond its plan (which keeps neither): those asked for (PlanError
    when they do not fit), else the last chunk's graph (it costs nothing), attention outputs in
    KEPT_ATTENTION_SHARE of the spare memory and more graphs in KEPT_GRAPHS_SHARE of what is left. No graphs
    with layer checkpointing; the chunks with graphs need no kept outputs."""
    c = step.config
    n = c.n_chunks
    per_output = kept_chunk_bytes(step.shape, c.chunk_tokens, _kv_dtype(c.precision))
    per_graph = graph_chunk_bytes(step.shape, c)
    graphs = asked_graphs(n, c.checkpoint_layers, keep_graphs)
    graph_bytes = max(0, graphs - 1) * per_graph
    if keep_attention is None:
        kept = keepable_chunks(spare_bytes - graph_bytes, per_output, n)
    else:
        kept = min(keep_attention, n)
    left = spare_bytes - graph_bytes - kept * per_output
    if left < 0:
        raise PlanError(
            f"keep_attention={keep_attention} and keep_graphs={keep_graphs} need {graph_bytes / GIB:.2f} GiB for "
            f"kept graphs and {kept * per_output / GIB:.2f} GiB for the attention outputs of {kept} chunks, but "
            f"{spare_bytes / GIB:.2f} GiB are free beyond the step and a {PLACEMENT_HEADROOM_SHARE:.0%} reserve; "
            "nothing was allocated for it. None keeps as many as fit"
        )
    if keep_graphs is None and graphs:
        graphs += keepable_chunks(left, per_graph, n - graphs, KEPT_GRAPHS_SHARE)
    return min(kept, n - graphs), graphs


def host_kept_for_stage_2(step: Plan, host_spare_bytes: float, kept: int, graphs: int,
                          keep_attention: int | None = None) -> int:
    """First chunks whose attention outputs stage 1 keeps in pinned host memory for ``step`` when it keeps
    ``kept`` chunks' outputs and ``graphs`` graphs on the GPU and the host memory budget has
    ``host_spare_bytes`` left beyond everything else the run holds: as many whole chunks as fit there and
    stage 2 would recompute (keep_attention=None), else none."""
    c = step.config
    if keep_attention is not None:
        return 0
    whole = c.context // c.chunk_size  # a shorter last chunk has other shapes
    per_output = kept_chunk_bytes(step.shape, c.chunk_tokens, _kv_dtype(c.precision))
    return keepable_chunks(host_spare_bytes, per_output, min(whole, c.n_chunks - kept - graphs), 1.0)


def _estimate(
    shape: ModelShape, config: PlanConfig, gpu_memory: int, host_memory: int, machine: str
) -> Plan:
    gpu, host = _memory_lines(shape, config)
    time = step_time(
        shape,
        config.context,
        batch=config.batch,
        chunk_size=config.chunk_size,
        lora_rank=config.lora_rank,
        checkpoint_layers=config.checkpoint_layers,
        sparse=config.sparse,
        matmul_tflops=config.matmul_tflops,
        page_size=config.page_size,
        graph_chunks=config.graph_chunks,
        kept_chunks=config.kept_chunks,
        host_kept_chunks=config.host_kept_chunks,
        document_length=config.document_length,
    )
    collectives = step_collectives(shape, config)
    time = dataclasses.replace(time, host_add_s=host_add_seconds(shape, config),
                               host_gather_s=host_gather_seconds(
                                   shape, config, time.compute_s * (1 - time.stage_1_flops / time.total_flops)),
                               host_gather_bytes=host_gather_bytes(shape, config),
                               all_reduce_s=sum(x.seconds for x in collectives
                                                if x.kind == "all-reduce" and not x.activations),
                               sharding_s=sum(x.seconds for x in collectives if x.kind != "all-reduce"),
                               tensor_parallel_s=sum(x.seconds for x in collectives if x.activations))
    return Plan(shape, config, gpu, host, time, gpu_memory, host_memory, machine)


def this_gpu_memory() -> tuple[int, str]:
    """(total bytes, name) of this machine's current CUDA device; ValueError when there is none."""
    if not torch.cuda.is_available():
        raise ValueError(
            "there is no CUDA device on this machine to plan for: give the GPU's memory "
            "(gpu_memory=140 * 2**30, or --gpu-memory 140GiB for an H200, 79GiB for an H100/A100 80GB: what torch "
            "sees of them)"
        )
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(props.total_memory), props.name


def plan(
    model: Any,
    context: int,
    *,
    stage_1_loss: bool = False,
    loss_grads: str | None = None,
    host_process_bytes: int | None = None,
    host_pending_bytes: int | None = None,
    chunk_size: int = 4096,
    batch: int = 1,
    page_size: int = 128,
    lora_rank: int = 0,
    optimizer: str = "adamw",
    precision: Precision = "bf16-true",
    checkpoint_layers: bool | None = None,
    grad_dtype: torch.dtype = torch.float32,
    gpu_memory: int | float | None = None,
    host_memory: int | float | None = None,
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS,
    sparse: SparseConfig | dict | None = None,
    offload: bool = False,
    segment_tokens: int = OFFLOAD_SEGMENT_TOKENS,
    host_grad_layers: int | None = 0,
    kept_chunks: int = 0,
    graph_chunks: int = 0,
    host_kept_chunks: int = 0,
    fused_ops: bool = True,
    devices: int = 1,
    host_kv_layers: int = 0,
    document_length: int | None = None,
    sharding: Sharding = "none",
    tensor_parallel: int = 1,
) -> Plan:
    """Plan one training step of ``batch`` sequences of ``context`` tokens.

    model: a ModelShape, a built-in name (``builtin_names()``), a config.json / model directory path, a
    transformers config (or config dict) or model. checkpoint_layers: None decides (off if it fits, else on).
    gpu_memory: bytes; None takes this machine's CUDA device (no CUDA device: error). host_memory: the run's host
    memory budget in bytes; None: what a run started now would get, ``host_memory.host_budget()`` (the
    memory this machine has available, MemAvailable, less ``host_memory.host_headroom()``).
    matmul_tflops: the GPU's dense bf16 matmul peak, for the time floor.
    sparse: a SparseConfig (or dict) for page-level sparse attention: its FLOPs and the memory of its page
    summaries and selections.
    offload: K/V and KV-gradient pages in pinned host memory, streamed through the GPU in segments of
    ``segment_tokens`` tokens per sequence (dense attention).
    host_grad_layers (sparse): KV-gradient pages of that many layers in pinned host memory, added into from the GPU
    after each sparse backward; None: the fewest that make the step fit on the GPU (0 if it fits as it is, and
    for dense attention), then, with every layer's there, the fewest layers' K/V pages too.
    host_kv_layers (sparse): K/V pages of that many layers in pinned host memory, the selected pages gathered
    for each attention call.
    kept_chunks: attention outputs of that many chunks kept from stage 1 for stage 2.
    graph_chunks: autograd graphs of the last that many chunks kept from stage 1 for stage 2.
    host_kept_chunks: attention outputs of the first that many chunks kept in pinned host memory.
    stage_1_loss, loss_grads, host_process_bytes, host_pending_bytes: see ``PlanConfig``; loss_grads None: where
    ``place_step`` would keep a served step's dL/dh (``_loss_grads_placed``).
    devices: data-parallel ranks on one machine, each with ``batch`` sequences: the plan is one rank's, whose
    host memory budget is ``host_memory`` divided among the ranks, as the strategies divide it.
    sharding: with devices > 1, "none" plans an oomb_ddp rank (every weight whole); "zero1", "zero2", "zero3"
    an oomb_model_parallel rank with that sharding of the decoder layers (docs/planner.md, "Several GPUs").
    fused_ops: activations of the fused Triton RMSNorm/RoPE/SwiGLU (what steps on CUDA run); False:
    transformers' own ops (attention="reference").
    document_length: each sequence packed from documents of that many tokens (attention within them only).
    tensor_parallel: T ranks of one machine splitting each decoder layer by KV heads (oomb_model_parallel's
    tensor_parallel_size), all on the same ``batch``: the plan is one rank's, whose host memory budget is
    ``host_memory`` divided among the T, and whose Plan.shape is its part of the model; T must divide the KV
    heads, attention heads and MLP width; not with LoRA (refused: not built). With devices D > 1 and a sharding,
    D x T ranks: each rank's part sharded over the D data-parallel ranks, the host budget divided among all.
    """
    shape = ModelShape.resolve(model)
    machine = ""
    if gpu_memory is None:
        gpu_memory, machine = this_gpu_memory()
    if host_memory is None:
        host_memory = host_budget()
    gpu_memory, host_memory = int(gpu_memory), int(host_memory)
    base = PlanConfig(
        context=context,
        chunk_size=chunk_size,
        batch=batch,
        page_size=page_size,
        lora_rank=lora_rank,
        optimizer=optimizer,
        precision=precision,
        checkpoint_layers=bool(checkpoint_layers),
        grad_dtype=grad_dtype,
        matmul_tflops=matmul_tflops,
        sparse=SparseConfig.coerce(sparse),
        offload=offload,
        segment_tokens=segment_tokens,
        host_grad_layers=host_grad_layers or 0,
        kept_chunks=kept_chunks,
        graph_chunks=graph_chunks,
        host_kept_chunks=host_kept_chunks,
        fused_ops=fused_ops,
        stage_1_loss=stage_1_loss,
        loss_grads=loss_grads or "gpu",
        host_process_bytes=host_process_bytes,
        host_pending_bytes=host_pending_bytes,
        devices=devices,
        host_kv_layers=host_kv_layers,
        document_length=document_length,
        sharding=sharding,
        tensor_parallel=tensor_parallel,
    )
    shape = shape.tensor_parallel_part(base.tensor_parallel)
    # each process's share: the strategies divide the budget among a machine's processes alike
    host_memory //= base.devices * base.tensor_parallel

    def estimate(config: PlanConfig) -> Plan:
        if loss_grads is None and config.stage_1_loss and config.loss_grads != "recomputed":
            return _kept_loss_grads_placed(config, lambda c: _estimate(shape, c, gpu_memory, host_memory, machine))
        return _estimate(shape, config, gpu_memory, host_memory, machine)

    def pages_placed(config: PlanConfig) -> Plan:
        # Host layers are chosen for each layer-checkpointing setting: checkpointing may need fewer.
        if host_grad_layers is None and config.sparse:
            return fewest_host_grad_layers(config, shape, estimate)
        return estimate(config)

    def placed(config: PlanConfig) -> Plan:
        # As place_step: a served step recomputes dL/dh only when keeping it fits nowhere.
        result = pages_placed(config)
        if loss_grads is None and config.stage_1_loss and not result.fits:
            recomputed = pages_placed(dataclasses.replace(config, loss_grads="recomputed"))
            if recomputed.fits:
                return recomputed
        return result

    result = placed(base)
    other = placed(dataclasses.replace(base, checkpoint_layers=not base.checkpoint_layers))
    if checkpoint_layers is None and not result.fits:
        result, other = other, result
        result.checkpoint_auto = True
    elif checkpoint_layers is None:
        result.checkpoint_auto = True
    result.other_activation_bytes = next(v for k, v in other.gpu_lines.items() if k.startswith("activations"))
    result.suggestions = _suggestions(result, estimate)
    return result


def plan_placed(model: Any, context: int, *, offload: str = "auto", sparse: SparseConfig | dict | None = None,
                **kwargs: Any) -> Plan:
    """``plan`` with the pages placed as a training step with ``offload`` ("auto", "gpu", "host") would place
    them: dense steps stream every page from the host ("host", or "auto" when it fits only there); sparse
    steps put the KV-gradient and K/V pages of every layer ("host") in host memory, or the fewest layers'
    pages that fit ("auto": gradient pages first, then K/V pages). Other keyword arguments go to ``plan``."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {offload!r}")
    sparse = SparseConfig.coerce(sparse)
    if sparse is not None:
        n_layers = ModelShape.resolve(model).n_layers
        layers = {"gpu": 0, "auto": None, "host": n_layers}[offload]
        result = plan(model, context, sparse=sparse, host_grad_layers=layers,
                      host_kv_layers=n_layers if offload == "host" else 0, **kwargs)
        c = result.config
        if c.host_grad_layers and offload == "auto":
            result.notes.append("the KV-gradient pages do not all fit on the GPU: offload='auto' keeps those of "
                                f"{c.host_grad_layers} layers in pinned host memory"
                                + (f", and the K/V pages of {c.host_kv_layers}" if c.host_kv_layers else ""))
        return _kept_for_stage_2(result)
    result = plan(model, context, offload=offload == "host", **kwargs)
    if offload == "auto" and not result.fits:
        on_host = plan(model, context, offload=True, **kwargs)
        if on_host.fits:
            on_host.notes.append("the pages do not fit on the GPU: offload='auto' puts them in pinned host memory")
            return on_host
    return _kept_for_stage_2(result)


@dataclass
class ContextLimit:
    """The longest context a step fits, next to what the machine could hold.

    ``context``: the most tokens per sequence (a multiple of the chunk) whose step fits as a training step
    with the asked ``offload`` would place it (0: not even one chunk); ``plan``: that step's plan (or the
    one-chunk plan that does not fit). ``physical_tokens``: the machine's limit for any placement: the GPU
    memory the one-chunk step leaves free plus the host memory budget's room for pinned pages, over the
    bytes a token stores (K, V and their gradients over all layers; the dL/dh a served step keeps is left
    out). ``bytes_per_token``: that
    divisor, the bytes one token of the batch stores."""

    context: int
    plan: Plan
    physical_tokens: int
    bytes_per_token: int

    def __str__(self) -> str:
        p = self.plan
        if not self.context:
            return f"not even one chunk of {p.config.chunk_size:,} tokens fits:\n\n{p}"
        return (f"{self.context:,} tokens fit ({p.config.n_chunks} chunks of {p.config.chunk_size:,}): GPU "
                f"{_gib(p.peak_gpu_bytes)} GiB, host {_gib(p.peak_host_bytes)} GiB, step ≈ "
                f"{_duration(p.time.predicted_s)}; the machine holds {self.physical_tokens:,} tokens of K/V "
                "and their gradients")


def max_context(model: Any, *, offload: str = "auto", chunk_size: int = 4096, limit: int = 1 << 30,
                **kwargs: Any) -> ContextLimit:
    """The longest context (tokens per sequence, a multiple of ``chunk_size``, at most ``limit``) whose step
    fits, as ``plan_placed`` with ``offload`` would place it, and the machine's physical limit
    (``ContextLimit``). Other keyword arguments go to ``plan_placed`` (batch, lora_rank, sparse, optimizer,
    gpu_memory, host_memory, ...). Assumes that a step that fits at some length fits at every shorter one."""
    def placed(chunks: int) -> Plan:
        return plan_placed(model, chunks * chunk_size, offload=offload, chunk_size=chunk_size, **kwargs)

    one = placed(1)
    # The machine's limit starts from the smallest fixed cost: with layer checkpointing unless it is refused.
    least = one if kwargs.get("checkpoint_layers") is False else plan_placed(
        model, chunk_size, offload=offload, chunk_size=chunk_size, **{**kwargs, "checkpoint_layers": True})
    c = least.config
    per_token = c.batch * (least.shape.kv_bytes_per_token(_kv_dtype(c.precision))
                           + least.shape.kv_bytes_per_token(c.grad_dtype))
    host_room = least.host_memory - sum(v for k, v in least.host_lines.items() if k.startswith("process"))
    # The one-chunk step's own pages on the GPU are room for tokens too (its pinned ones are in host_room).
    own_pages = sum(v for k, v in least.gpu_lines.items() if k.startswith(("K/V pages", "KV-gradient pages")))
    gpu_room = least.usable_gpu_bytes - least.peak_gpu_bytes + own_pages
    physical = max(0, gpu_room + host_room) // per_token
    if not one.fits:
        return ContextLimit(0, one, physical, per_token)
    low, high, best = 1, 2, one  # placed(low) fits; find a high that does not
    most = max(1, limit // chunk_size)
    while high <= most:
        result = placed(high)
        if not result.fits:
            break
        low, best, high = high, result, 2 * high
    high = min(high, most + 1)
    while high - low > 1:
        mid = (low + high) // 2
        result = placed(mid)
        if result.fits:
            low, best = mid, result
        else:
            high = mid
    return ContextLimit(low * chunk_size, best, physical, per_token)


def _kept_for_stage_2(result: Plan) -> Plan:
    """The plan with the chunks' autograd graphs and attention outputs a step would keep (keep_graphs=None,
    keep_attention=None) in what this plan leaves free, as place_step decides it: their memory and the
    stage-2 work they save, said in a note."""
    c = result.config
    if c.offload or c.host_grad_layers or c.host_kv_layers or not result.fits:
        return result
    kept, graphs = kept_for_stage_2(result, result.usable_gpu_bytes - result.peak_gpu_bytes)
    if not (kept or graphs):
        return result
    placed = _estimate(result.shape, dataclasses.replace(c, kept_chunks=kept, graph_chunks=graphs),
                       result.gpu_memory, result.host_memory, result.machine)
    placed.checkpoint_auto, placed.other_activation_bytes = result.checkpoint_auto, result.other_activation_bytes
    placed.suggestions = result.suggestions
    placed.notes = result.notes + [
        f"a step keeps stage 1's autograd graphs of the last {graphs} and the attention outputs of {kept} more "
        f"of {c.n_chunks} chunks in the memory to spare (keep_graphs=None, keep_attention=None), so stage 2 "
        "skips their forward or their attention forward"
    ]
    return placed


def host_layer_counts(n_layers: int) -> list[tuple[int, int]]:
    """(host gradient layers, host K/V layers) in the order a sparse step moves pages to the host: the
    KV-gradient pages first, layer by layer, then, with all of those there, the K/V pages."""
    return [(n, 0) for n in range(n_layers + 1)] + [(n_layers, m) for m in range(1, n_layers + 1)]


def _kept_loss_grads_placed(config: PlanConfig, estimate) -> Plan:
    """The plan with a served step's kept dL/dh where ``place_step`` puts them: in pinned host memory when any
    page of the step is there or they do not fit on the GPU next to everything else, else on the GPU."""
    if not (config.offload or config.host_grad_layers or config.host_kv_layers):
        on_gpu = estimate(dataclasses.replace(config, loss_grads="gpu"))
        if on_gpu.peak_gpu_bytes <= on_gpu.usable_gpu_bytes:
            return on_gpu
    return estimate(dataclasses.replace(config, loss_grads="host"))


def fewest_host_grad_layers(config: PlanConfig, shape: ModelShape, estimate) -> Plan:
    """The plan of ``config`` with the fewest pages in host memory (sparse: KV-gradient pages of layers, then
    their K/V pages, ``host_layer_counts``) that fits on the GPU with ``place_step``'s reserve, or with all of
    them when none does."""
    for n, m in host_layer_counts(shape.n_layers):
        result = estimate(dataclasses.replace(config, host_grad_layers=n, host_kv_layers=m))
        if result.peak_gpu_bytes <= result.usable_gpu_bytes:
            return result
    return result


def _suggestions(result: Plan, estimate) -> list[Suggestion]:
    """Single changes that make the step fit (each with its numbers); all of them together when no single one
    does; sparse attention when attention dominates the step's FLOPs."""
    c = result.config
    found: list[Suggestion] = []
    if not result.fits:
        if not c.checkpoint_layers:
            found.append(Suggestion("layer checkpointing", estimate(dataclasses.replace(c, checkpoint_layers=True)),
                                    "--checkpoint-layers on", "checkpoint_layers=True"))
        halvings = []
        chunk = min(c.chunk_size, c.context) // 2
        while chunk >= MIN_SUGGESTED_CHUNK:
            halvings.append(chunk)
            chunk //= 2
        if halvings:
            # Memory falls with the chunk: the first halving that fits is the largest; if none does, the half.
            plans = (estimate(dataclasses.replace(c, chunk_size=k)) for k in halvings)
            smaller = next((p for p in plans if p.fits), None)
            smaller = smaller or estimate(dataclasses.replace(c, chunk_size=halvings[0]))
            k = smaller.config.chunk_size
            found.append(Suggestion("smaller chunks", smaller, f"--chunk {k}", f"chunk_size={k}"))
        if c.precision != "bf16-true":
            found.append(Suggestion("bf16 parameters and optimizer state",
                                    estimate(dataclasses.replace(c, precision="bf16-true")),
                                    "--precision bf16-true", "precision='bf16-true'"))
        if c.lora_rank == 0 and c.tensor_parallel == 1:  # LoRA under tensor parallel is not built
            found.append(Suggestion("LoRA rank 16 on q, k, v, o", estimate(dataclasses.replace(c, lora_rank=16)),
                                    "--lora 16", "lora_rank=16"))
        if c.grad_dtype != torch.bfloat16:
            found.append(Suggestion("bf16 KV-gradients", estimate(dataclasses.replace(c, grad_dtype=torch.bfloat16)),
                                    "--grad-dtype bfloat16", "grad_dtype=torch.bfloat16"))
        if c.sparse:
            hosted = fewest_host_grad_layers(c, result.shape, estimate)
            h = hosted.config
            if (h.host_grad_layers, h.host_kv_layers) != (c.host_grad_layers, c.host_kv_layers):
                found.append(Suggestion(
                    f"KV-gradient pages of {h.host_grad_layers} layers in pinned host memory"
                    + (f", K/V pages of {h.host_kv_layers}" if h.host_kv_layers else ""), hosted,
                    "--offload auto", "offload='auto'"))
        elif not c.offload:
            found.append(Suggestion("K/V and KV-gradient pages in pinned host memory, streamed",
                                    estimate(dataclasses.replace(c, offload=True)), "--offload host", "offload='host'"))
        stronger = SHARDINGS[SHARDINGS.index(c.sharding) + 1:] if c.devices > 1 else ()
        stronger = [mode for mode in stronger if mode != "zero1"]  # zero1 holds every gradient whole, in float32
        if stronger:
            # The least sharding that fits (the more it shards, the more it gathers); else the most.
            plans = (estimate(dataclasses.replace(c, sharding=mode)) for mode in stronger)
            sharded = next((p for p in plans if p.fits), None) or estimate(dataclasses.replace(c, sharding="zero3"))
            mode = sharded.config.sharding
            found.append(Suggestion(f"oomb_model_parallel: the decoder layers sharded over the {c.devices} ranks, "
                                    f"{mode}", sharded, f"--sharding {mode}", f"sharding={mode!r}"))
        if found and not any(x.plan.fits for x in found):
            combined = c
            for x in found:  # every change at once; of the chunk sizes the smallest
                changed = {f.name: getattr(x.plan.config, f.name) for f in dataclasses.fields(c)
                           if getattr(x.plan.config, f.name) != getattr(c, f.name)}
                if "chunk_size" in changed:
                    changed["chunk_size"] = min(changed["chunk_size"], combined.chunk_size)
                combined = dataclasses.replace(combined, **changed)
            if len(found) > 1:
                found.append(Suggestion("all of the above together", estimate(combined),
                                        " ".join(x.cli for x in found), ", ".join(x.python for x in found)))
    t = result.time
    if t.attention_flops > t.linear_flops and not c.sparse:
        config = SparseConfig()
        sparse = estimate(dataclasses.replace(c, sparse=config, offload=False))
        if c.offload:  # sparse moves the fewest layers' pages to host memory, gradient pages first
            sparse = fewest_host_grad_layers(sparse.config, result.shape, estimate)
        if sparse.fits:  # a faster step that does not fit here is no suggestion
            found.append(Suggestion(
                f"page-level sparse attention: at most {config.attended_past_tokens(c.page_size):,} past tokens per "
                "query", sparse, f"--sparse-budget {config.budget_pages}",
                f"sparse=SparseConfig(budget_pages={config.budget_pages})", goal="time"))
    return found

