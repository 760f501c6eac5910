"""FLOPs and time of one step (docs/planner.md, "Time"): ``step_time`` counts the linear, attention and
recompute FLOPs a step executes; ``StepTime`` turns them into seconds at the assumed efficiencies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from ..config import SparseConfig
from ..model_shape import PROFILES, ModelShape
from .assumptions import (
    ATTENTION_EFFICIENCY, CARRIED_OP_LAUNCH_S, DECODE_GBPS, DEFAULT_MATMUL_TFLOPS, DEQUANT_GBPS,
    HEAD_DIM_64_ATTENTION_EFFICIENCY, KERNEL_LAUNCH_S, KERNELS_PER_LAYER_BACKWARD, KERNELS_PER_LAYER_FORWARD,
    LINEAR_EFFICIENCY, PORTABLE_ATTENTION_EFFICIENCY,
)
from .config import PlanConfig


@dataclass(frozen=True)
class StepTime:
    """FLOPs one step executes and its time at ``matmul_tflops`` (floor) and at LINEAR_EFFICIENCY and
    ``attention_efficiency`` of it (predicted), plus the host's kernel launches where a chunk's compute is
    shorter than them (``launch_s``). ``recompute_flops`` (layer checkpointing) are linear: the recompute
    takes the attention outputs of the stage-2 forward."""

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
    dequant_s: float = 0.0  # QLoRA: dequantising the 4-bit weights for every matmul (dequant_seconds)
    mixing_flops: float = 0.0  # hybrids: the state-carrying layers' token mixing (ModelShape.carried_mixing_flops)
    attention_efficiency: float = ATTENTION_EFFICIENCY  # of the peak: this model's heads (attention_efficiency)
    # The GPU waiting for the host: for each chunk, how far the host's time to launch its kernels
    # (chunk_kernels, KERNEL_LAUNCH_S each; the state-carrying layers' operations, CARRIED_OP_LAUNCH_S each)
    # outlasts the chunk's share of compute_s. Nothing for a 7B model's chunks; most of a small model's step in
    # small chunks, and of a hybrid's whose token mixing runs transformers' torch path (docs/planner.md).
    launch_s: float = 0.0
    carried_ops: float = 0.0  # hybrids: operations the state-carrying layers launch over the step (carried_ops)
    # Per chunk, seconds of its compute or, where longer, of its launches: what its streamed copies overlap.
    chunk_busy_s: tuple[float, ...] = dataclasses.field(default=(), compare=False, repr=False)
    stream_s: float = 0.0  # dense steps on host pages: the streamed copies outlasting each chunk (streamed_seconds)
    stream_bytes: float = 0.0  # ... and the bytes they move host to GPU (streamed_bytes_by_chunk)

    @property
    def total_flops(self) -> float:
        return self.linear_flops + self.attention_flops + self.recompute_flops + self.mixing_flops

    @property
    def floor_s(self) -> float:
        """Seconds if every FLOP ran at the matmul peak."""
        return self.total_flops / (self.matmul_tflops * 1e12)

    @cached_property  # frozen: computed once per StepTime (a plan search asks for it many times)
    def compute_s(self) -> float:
        """The linear FLOPs at LINEAR_EFFICIENCY, the attention FLOPs at ``attention_efficiency`` of the peak,
        those of packed chunks in the portable kernels at PORTABLE_ATTENTION_EFFICIENCY."""
        linear = self.total_flops - self.attention_flops - self.mixing_flops
        peak = self.matmul_tflops * 1e12
        fast = self.attention_flops + self.mixing_flops - self.portable_attention_flops
        return (linear / (peak * LINEAR_EFFICIENCY) + fast / (peak * self.attention_efficiency)
                + self.portable_attention_flops / (peak * PORTABLE_ATTENTION_EFFICIENCY))

    @property
    def predicted_s(self) -> float:
        """``compute_s`` plus the host gradient layers' additions, the host K/V gathers, the streamed pages and the
        collectives that do not hide behind it: fitted to measured steps, to be calibrated with ``lightning-oomb
        bench`` on other machines."""
        return (self.compute_s + self.launch_s + self.host_add_s + self.host_gather_s + self.stream_s
                + self.all_reduce_s + self.sharding_s + self.tensor_parallel_s + self.dequant_s)


def expected_selected_pages(n_past: int, sparse: "SparseConfig", n_tiles: int) -> float:
    """Distinct past pages one KV head's selections of a chunk touch, in expectation, when each of its
    ``n_tiles`` query tiles picks its top-k pages at random (what random weights give; trained models pick
    more alike pages, so this bounds them from above)."""
    if n_past <= sparse.budget_pages:
        return float(n_past)
    free = n_past - sparse.sink_pages - sparse.local_pages
    picked = sparse.budget_pages - sparse.sink_pages - sparse.local_pages
    return sparse.sink_pages + sparse.local_pages + free * (1 - (1 - picked / free) ** n_tiles)


@lru_cache(maxsize=512)
def selected_pages_by_chunk(context: int, chunk_size: int, page_size: int, sparse: "SparseConfig",
                            n_tiles: int) -> tuple[float, ...]:
    """``expected_selected_pages`` for each chunk of a sequence of ``context`` tokens, its past in pages of
    ``page_size`` tokens. Cached: a placement search asks for the same chunks under many placements."""
    return tuple(expected_selected_pages(-(-start // page_size), sparse, n_tiles)
                 for start in range(0, context, chunk_size))


def attention_kept_chunks(n_chunks: int, checkpoint_layers: bool, graph_chunks: int, kept_chunks: int,
                          host_kept_chunks: int) -> set[int]:
    """Chunks whose attention forward stage 2 takes from stage 1 instead of computing it: the last
    ``graph_chunks`` (their whole graph; none with layer checkpointing), the ``kept_chunks`` before them and
    the first ``host_kept_chunks`` (their outputs), as ``ChunkedSequence`` places them."""
    graphs = 0 if checkpoint_layers else min(graph_chunks, n_chunks)
    kept = min(kept_chunks, n_chunks - graphs)
    host_kept = min(host_kept_chunks, n_chunks - graphs - kept)
    return set(range(n_chunks - graphs - kept, n_chunks)) | set(range(host_kept))


def step_time(model: Any, config: PlanConfig | int, **options: Any) -> StepTime:
    """FLOPs one step of ``config`` (a PlanConfig, or the context in tokens per sequence, with ``options``
    replacing fields by name: ``PlanConfig.build``) executes (docs/planner.md, "Time", has the formulas):
    linear (8 x P_mm per token; LoRA 6 x P_mm + 8 x P_lora, and with ``lora_experts`` what
    ``expert_adapter_flops`` adds), attention (dense, sparse or within packed
    documents of ``document_length`` tokens), the layer-checkpoint recompute; less what stage 1 keeps
    (``graph_chunks``, ``kept_chunks``, ``host_kept_chunks``: ``attention_kept_chunks``).
    """
    c = PlanConfig.build(config, **options)
    shape = ModelShape.resolve(model)
    context, batch, chunk_size, page_size = c.context, c.batch, c.chunk_size, c.page_size
    checkpoint_layers, sparse, document_length = c.checkpoint_layers, c.sparse, c.document_length
    tokens = batch * context
    if c.lora_rank > 0:
        linear = 6.0 * shape.active_matmul_params * tokens + 8.0 * shape.lora_params(c.lora_rank) * tokens
    else:
        linear = 8.0 * shape.active_matmul_params * tokens
    # Forward attention FLOPs of one layer and one sequence: 2 * (d_q + d_out) per (query, key) pair (QK^T, PV).
    attended = context if sparse is None else sparse.attended_past_tokens(page_size)
    chunk_pairs = layer_chunk_pairs(shape, context, chunk_size, attended, document_length or context)
    per_pair = 2.0 * (shape.q_width + shape.out_width) * batch  # forward FLOPs of one (query, key) pair, one layer
    forward_attention = per_pair * float(chunk_pairs.sum())
    recompute = 2.0 * (shape.active_matmul_params - shape.head_params) * tokens if checkpoint_layers else 0.0
    n = len(chunk_pairs)
    lengths = chunk_lengths(context, chunk_size)
    graphs = 0 if checkpoint_layers else min(c.graph_chunks, n)
    graph_kept = np.arange(n) >= n - graphs  # chunks whose whole graph stage 1 kept
    kept = attention_kept_chunks(n, checkpoint_layers, c.graph_chunks, c.kept_chunks, c.host_kept_chunks)
    # Attention forwards a chunk executes: stage 1's, stage 2's and the backward's 2.5, less the stage-2
    # forward a kept output spares.
    attention_passes = np.full(n, 4.5)
    attention_passes[sorted(kept)] -= 1.0
    attention = per_pair * float(chunk_pairs @ attention_passes)
    linear -= 2.0 * shape.active_matmul_params * batch * float(lengths[graph_kept].sum())
    if c.lora_rank > 0 and c.lora_experts:
        linear += expert_adapter_flops(shape, c, n)
    stage_1 = 2.0 * shape.active_matmul_params * tokens + forward_attention
    portable = 0.0
    if document_length is not None and document_length < context and not sparse:
        portable = per_pair * sum(float(pairs * attention_passes[i]) for i, pairs in enumerate(chunk_pairs)
                                  if _runs_portable(i * chunk_size, min(chunk_size, context - i * chunk_size),
                                                    document_length, page_size))
    # The state-carrying layers' token mixing: stage 1's forward, stage 2's (unless its graph was kept), the
    # backward's two, a checkpoint's recompute.
    mixing = shape.carried_mixing_flops * batch * float(lengths @ (4.0 - graph_kept + checkpoint_layers))
    stage_1 += shape.carried_mixing_flops * tokens
    # Each pass of the decoder layers' matmuls (stage 1, stage 2's forward unless its graph was kept, the
    # backward, a checkpoint's recompute) dequantises their 4-bit weights once.
    passes = 3 * n - graphs + (n if checkpoint_layers else 0)
    efficiency = attention_efficiency(shape)
    # Each chunk's compute in seconds up to one factor (its linear and attention FLOPs at their rates), for
    # its share of compute_s.
    per_token = (linear + recompute) / tokens / LINEAR_EFFICIENCY + shape.carried_mixing_flops * batch / efficiency
    per_attended_pair = per_pair / efficiency
    weights = per_token * lengths + per_attended_pair * chunk_pairs * attention_passes
    time = StepTime(linear, attention, recompute, c.matmul_tflops, portable_attention_flops=portable,
                    stage_1_flops=stage_1, dequant_s=passes * dequant_seconds(shape, c), mixing_flops=mixing,
                    attention_efficiency=efficiency)
    seconds_per_weight = time.compute_s / float(weights.sum())
    launches = np.where(graph_kept, chunk_kernels(shape, True, checkpoint_layers),
                        chunk_kernels(shape, False, checkpoint_layers)) * KERNEL_LAUNCH_S
    mixing_ops = carried_ops(shape, lengths, 2.0 - graph_kept + checkpoint_layers)
    launches += mixing_ops * CARRIED_OP_LAUNCH_S
    compute = weights * seconds_per_weight
    waits = float(np.maximum(0.0, launches - compute).sum())
    return dataclasses.replace(time, launch_s=waits, carried_ops=float(mixing_ops.sum()),
                               chunk_busy_s=tuple(np.maximum(compute, launches).tolist()))


def carried_ops(shape: ModelShape, lengths: np.ndarray, forwards: np.ndarray | float,
                backwards: float = 1.0) -> np.ndarray:
    """Operations the state-carrying layers launch for each chunk of ``lengths`` tokens (one sequence: a batch
    runs the same operations on larger tensors): ``forwards`` forwards of each (stage 1's, stage 2's unless its
    graph was kept, a checkpoint's recompute) and ``backwards`` backwards, as counted on the meta device
    (``ModelShape.carried_ops``); zeros for a model without such layers or whose kernels were not counted."""
    (forward_per_token, forward_fixed), (backward_per_token, backward_fixed) = shape.carried_ops
    forward = forward_per_token * lengths + forward_fixed
    backward = backward_per_token * lengths + backward_fixed
    return shape.carried_layers * (forwards * forward + backwards * backward)


def chunk_lengths(context: int, chunk_size: int) -> np.ndarray:
    """Tokens of each chunk of a sequence of ``context`` tokens (the last one may be short), float64."""
    lengths = np.full(-(-context // chunk_size), float(chunk_size))
    lengths[-1] = context - (len(lengths) - 1) * chunk_size
    return lengths


@lru_cache(maxsize=512)
def layer_chunk_pairs(shape: ModelShape, context: int, chunk_size: int, attended: int | float,
                      document_length: int) -> np.ndarray:
    """(query, key) pairs of each chunk of one sequence, summed over the attending layers: full ones (each
    query seeing at most ``attended`` past keys, within documents of ``document_length`` tokens), then
    sliding-window ones; a read-only float64 array, one entry per chunk. Cached: a placement search asks for
    the same chunks under many placements."""
    full_layers = shape.kv_layers - shape.window_layers
    pairs_by_chunk = []
    for s in range(0, context, chunk_size):
        n = min(chunk_size, context - s)
        pairs = _chunk_pairs(s, n, attended, document_length)
        windowed = min(pairs, _window_pairs(s, n, shape.window)) if shape.window else 0
        pairs_by_chunk.append(full_layers * pairs + shape.window_layers * windowed)
    pairs = np.array(pairs_by_chunk, dtype=np.float64)
    pairs.flags.writeable = False
    return pairs


@dataclass(frozen=True)
class GenerationTime:
    """A generation's time in the plan (docs/planner.md, "Generation"): the prompt's prefill, chunk by chunk
    without gradients, and each new token's decoding over the pages."""

    prefill_flops: float
    prefill_s: float  # each chunk's compute, or its kernel launches where those take longer
    decode_bytes: float  # bytes one new token reads: the weights it goes through and the K/V it attends to
    decode_s: float  # seconds per new token: those bytes at DECODE_GBPS, or its kernel launches if longer


def generation_time(model: Any, context: int, chunk_size: int = 4096, page_size: int = 128,
                    sparse: SparseConfig | None = None, batch: int = 1, dtype_bytes: int = 2,
                    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS) -> GenerationTime:
    """The plan's time for prefilling a prompt of ``context`` tokens per sequence (``batch`` of them) in chunks
    of ``chunk_size`` and decoding one more token after it, dense or ``sparse``, weights and pages of
    ``dtype_bytes`` per element, at ``matmul_tflops`` (the training step's efficiencies, launch cost and
    kernels per layer forward, the state-carrying layers' operations; memory traffic at DECODE_GBPS scaled
    like DEQUANT_GBPS)."""
    shape = ModelShape.resolve(model)
    peak = matmul_tflops * 1e12
    efficiency = attention_efficiency(shape)
    attended = context if sparse is None else sparse.attended_past_tokens(page_size)
    per_pair = 2.0 * (shape.q_width + shape.out_width) * batch
    body = shape.active_matmul_params - shape.head_params  # logits of a chunk's last position only
    launches = shape.n_layers * KERNELS_PER_LAYER_FORWARD * KERNEL_LAUNCH_S
    lengths = chunk_lengths(context, chunk_size)
    chunk_launches = launches + carried_ops(shape, lengths, 1.0, backwards=0.0) * CARRIED_OP_LAUNCH_S
    flops, seconds = 2.0 * shape.head_params * batch, 0.0
    for i, pairs in enumerate(layer_chunk_pairs(shape, context, chunk_size, attended, context).tolist()):
        n = float(lengths[i]) * batch
        linear, attention = 2.0 * body * n, per_pair * pairs + shape.carried_mixing_flops * n
        flops += linear + attention
        seconds += max(linear / (peak * LINEAR_EFFICIENCY) + attention / (peak * efficiency),
                       float(chunk_launches[i]))
    seconds += 2.0 * shape.head_params * batch / (peak * LINEAR_EFFICIENCY)
    full_layers = shape.kv_layers - shape.window_layers
    keys = full_layers * min(context, attended) + shape.window_layers * min(context, shape.window or context)
    per_key = (shape.kv_width + shape.v_width) * dtype_bytes
    read = shape.active_matmul_params * dtype_bytes + batch * keys * per_key
    rate = DECODE_GBPS * 1e9 * matmul_tflops / DEFAULT_MATMUL_TFLOPS
    return GenerationTime(flops, seconds, read, max(read / rate, launches))


def attention_efficiency(shape: ModelShape) -> float:
    """Share of the matmul peak this model's attention reaches: HEAD_DIM_64_ATTENTION_EFFICIENCY for heads of
    64 (the kernels' tiles hold half the work per load there), ATTENTION_EFFICIENCY otherwise."""
    if shape.head_dim == 64 and shape.v_head_dim in (0, 64):
        return HEAD_DIM_64_ATTENTION_EFFICIENCY
    return ATTENTION_EFFICIENCY


def chunk_kernels(shape: ModelShape, kept_graph: bool, checkpoint_layers: bool) -> int:
    """Kernels the host launches for one chunk's decoder layers over a step: the forward of stage 1, of stage 2
    (unless the chunk's graph was kept) and of a checkpoint's recompute, and the backward, at
    KERNELS_PER_LAYER_FORWARD and KERNELS_PER_LAYER_BACKWARD each (counted on a Llama layer with the fused
    ops; other layers launch about as many)."""
    forwards = 1 + (not kept_graph) + checkpoint_layers
    return shape.n_layers * (forwards * KERNELS_PER_LAYER_FORWARD + KERNELS_PER_LAYER_BACKWARD)


def expert_adapter_flops(shape: ModelShape, c: PlanConfig, n_chunks: int) -> float:
    """Linear FLOPs that LoRA on the stacked expert weights adds to a step of ``n_chunks`` chunks: the routed
    experts' weight gradients (2 x the expert parameters a token goes through, per token: frozen experts
    skip them), and peft's W + scale x B @ A of each stack, 2 x rank x its elements per layer and chunk for
    each forward (stage 1's, stage 2's, a checkpoint's recompute) and twice that for its backward."""
    gradients = 2.0 * 3 * shape.hidden * shape.routed_intermediate * shape.n_layers * c.batch * c.context
    forwards = 2 + (1 if c.checkpoint_layers else 0)
    folds = 2.0 * c.lora_rank * shape.layer_expert_params * shape.n_layers * n_chunks * (forwards + 2)
    return gradients + folds


def dequant_seconds(shape: ModelShape, c: PlanConfig) -> float:
    """Seconds of one pass over every decoder layer's 4-bit weights (``c.quantization``; 0 without it): each
    matrix's packed codes and scales read, and written back in the compute dtype (the matmul then reads that
    as a bf16 weight's), at DEQUANT_GBPS, scaled with ``c.matmul_tflops``: GPUs have about the same memory
    bandwidth per matmul FLOP (an H200 4.8 TB/s for 790 TFLOP/s, an RTX 4090 1.0 TB/s for 165)."""
    if c.quantization is None:
        return 0.0
    written = shape.linear_params * PROFILES[c.precision].param
    rate = DEQUANT_GBPS * 1e9 * c.matmul_tflops / DEFAULT_MATMUL_TFLOPS
    return (c.quantization.weight_bytes(shape) + written) / rate


def _runs_portable(start: int, n: int, document_length: int, page_size: int) -> bool:
    """Whether the dense chunk [start, start + n) of a sequence packed from documents of ``document_length``
    tokens runs its attention in the portable kernels on Hopper (PORTABLE_ATTENTION_EFFICIENCY): it holds a
    document border, or its document starts mid-page."""
    first_doc = start - start % document_length
    return first_doc != (start + n - 1) - (start + n - 1) % document_length or first_doc % page_size != 0


def _window_pairs(start: int, n: int, window: int) -> float:
    """(query, key) pairs of the n queries of a chunk at ``start`` in a sliding window of ``window`` tokens
    (each query sees itself and the window - 1 keys before it; the diagonal counted as half a pair)."""
    growing = max(0, min(start + n, window) - start)  # queries whose window reaches the first token
    first = start + 1  # keys the chunk's first query sees while the window still grows
    return growing * first + growing * (growing - 1) / 2 + (n - growing) * window - n / 2


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
