"""GPU and host memory of one step, by named line, in bytes (docs/planner.md, "What it counts", "Host memory"),
and the bytes of what a step may keep from stage 1 for stage 2."""

from __future__ import annotations

import math

import torch

from ..config import SparseConfig
from ..errors import SetupError
from ..loss import piece_rows
from ..model_shape import PROFILES, ModelShape, _itemsize, _kv_dtype
from ..optimizer_slices import SLICE_ELEMENTS
from ..optimizers import OPTIMIZERS as OPTIMIZER_CHOICES, plan_state_bytes
from ..pages import HostGradStaging, gradient_ring_pages, window_page_slots
from ..ranks import GRADIENT_BUCKET_BYTES
from ..units import human_count
from .activations import activation_bytes, activations_modelled, carried_mixing_bytes, layer_activation_bytes
from .assumptions import (
    CUDA_CONTEXT_BYTES, HOST_GROWTH_BYTES, HOST_PROCESS_BYTES, UNMODELLED_ACTIVATION_FACTOR, ZERO3_GATHERED_LAYERS,
)
from .collectives import trainable_split
from .config import PlanConfig, offload_segment_pages
from .formatting import bytes_name, dtype_name


def memory_lines(shape: ModelShape, c: PlanConfig) -> tuple[dict[str, int], dict[str, int]]:
    """GPU and host memory of one step, by named line, in bytes."""
    p = PROFILES[c.precision]
    param_dtype = bytes_name(p.param)
    lora = shape.lora_params(c.lora_rank, c.lora_experts) if c.lora_rank else 0
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
        trained_dtype = bytes_name(trained_bytes)
        adapters = f" + {human_count(lora)} LoRA in float32" if c.lora_rank else ""
        what, rate = _state_rate(c, trained_bytes)
        gpu: dict[str, int] = {}
        four_bit = quantized_params(shape, c)
        if four_bit:
            gpu[f"weights (4-bit {c.quantization.describe()}: decoder layers' linear layers, "
                f"{human_count(four_bit)} params)"] = c.quantization.weight_bytes(shape)
            kept = ("embeddings, lm_head, norms" + (", biases" if shape.layer_bias_params else "")
                    + (", experts, routers" if shape.n_experts else ""))
            gpu[f"weights ({param_dtype}, {human_count(shape.total_params - four_bit)} params: {kept}{adapters})"] = (
                (shape.total_params - four_bit) * p.param + lora * 4)
            # bitsandbytes dequantises a layer's weight for each matmul (forward, and the backward's dL/dx) and
            # frees it after: one matrix at a time, the largest 4-bit one (experts are not: they stay as loaded).
            gpu[f"dequantised weight (one layer's largest, {param_dtype}, transient)"] = (
                max(max(g.linear) for g in shape.layer_groups) * p.param)
        else:
            gpu[f"weights ({param_dtype}, {human_count(shape.total_params)} params{adapters})"] = (
                shape.total_params * p.param + lora * 4)
        if c.training:
            gpu[f"gradients ({trained_dtype}, {human_count(trainable)} trainable)"] = trainable * trained_bytes
            gpu[f"optimizer state ({what})"] = int(rate * trainable)
        scratch = OPTIMIZER_CHOICES[c.optimizer].step_scratch_bytes if c.optimizer in OPTIMIZER_CHOICES else 0
        if scratch and not c.lora_rank and c.training:
            # The update's float32 working set: the largest weight's (the embeddings', usually), a slice at a time.
            largest = max(shape.vocab * shape.hidden, max(max(g.linear) for g in shape.layer_groups))
            elements = min(largest, SLICE_ELEMENTS)
            gpu[f"optimizer step: float32 working set of {human_count(elements)} elements (transient)"] = (
                scratch * elements)
    else:
        gpu = _sharded_lines(shape, c, state)
    if p.autocast_weight_copies:
        # Autocast's cast of every weight to bf16 lives for the whole autocast region (its cache), and
        # linear layers save the bf16 copy for backward: a bf16 image of all matrices.
        matrices_and_biases = (shape.matmul_params - quantized_params(shape, c)
                               + shape.n_layers * shape.layer_bias_params)
        gpu["bf16 weight copies (autocast cache)"] = 2 * matrices_and_biases
    if c.devices > 1 and c.sharding == "none":
        gpu["gradient all-reduce bucket (float32, oomb_ddp)"] = min(GRADIENT_BUCKET_BYTES, 4 * trainable)
    t = c.chunk_tokens
    ckpt = " (layer checkpointing)" if c.checkpoint_layers else ""
    if not activations_modelled(shape):
        ckpt += (f"; {shape.model_type}'s layers not modelled: {UNMODELLED_ACTIVATION_FACTOR:g}x a Llama "
                 "layer's")
    if shape.carried_layers:
        measured = shape.carried_saved != ((0, 0), (0, 0))
        ckpt += ("; plus the state-carrying layers' token mixing, measured on the meta device" if measured else
                 "; the state-carrying layers' token mixing NOT counted (it could not run on the meta device)")
    tokens = f"{t:,} tokens" if c.batch == 1 else f"{t:,} tokens: batch {c.batch} x {t // c.batch:,}"
    one_layer = (layer_activation_bytes(shape, t, c.precision, c.lora_rank, c.fused_ops, c.lora_experts)
                 + carried_mixing_bytes(shape, t, c.precision))
    if not c.training:
        # Without autograd a layer's tensors are freed as the forward moves on: at most about what one layer
        # would save (an assumption, as the backward working set's).
        gpu[f"activations: a forward's working set, one chunk of {tokens} (one layer)"] = one_layer
    else:
        gpu[f"activations, one chunk of {tokens}{ckpt}"] = activation_bytes(
            shape, t, c.precision, c.checkpoint_layers, c.lora_rank, c.fused_ops, c.lora_experts
        )
        # Gradients in flight while autograd walks back through a layer: at most what that layer saved
        # (an assumption, see docs/planner.md).
        gpu["backward working set (one layer)"] = one_layer
        gpu["loss: dL/dh of the chunk"] = t * shape.hidden * p.linear
    if c.training and c.stage_1_loss and c.loss_grads != "recomputed":
        kept_grads = loss_grad_bytes(shape, t, c.n_chunks, c.precision)
        name = f"loss: dL/dh of every chunk, kept from stage 1 for stage 2 ({c.n_chunks} chunks)"
        on_host = c.loss_grads == "host"
        (host if on_host else gpu)[("pinned " if on_host else "") + name] = kept_grads
    rows = min(piece_rows(shape.vocab), t)
    # One piece holds logits (linear dtype), float32 log-probs and their scaled gradient, and its cast; the
    # fused kernel (kernels.cross_entropy) writes the gradient over the logits.
    piece = rows * shape.vocab * (p.linear if c.fused_ops else 8 + 2 * p.linear)
    head_w = shape.vocab * shape.hidden
    if head_trained and c.training:
        gpu["loss: dL/dW accumulator (fp32, vocab x hidden)"] = head_w * 4
        # Backward scales the accumulator in place and casts it to the weight dtype.
        gpu["loss: logits piece / dL/dW cast (transient)"] = max(piece, head_w * p.param)
    else:
        gpu[f"loss: logits piece of {rows} rows (transient)"] = piece
    kv_dtype = _kv_dtype(c.precision)
    kv_name = f"K/V pages ({dtype_name(kv_dtype)}, {c.stored_tokens:,} tokens)"
    grad_name = f"KV-gradient pages ({dtype_name(c.grad_dtype)})"
    kv_layer = grad_layer = 0
    windowed = shape.kv_layers - shape.full_kv_layers
    if shape.kv_layers:
        kv_layer = shape.kv_bytes_per_token(kv_dtype) // shape.kv_layers
        grad_layer = shape.kv_bytes_per_token(c.grad_dtype) // shape.kv_layers
    if windowed:
        # Sliding-window layers keep on the GPU, streamed pages or not, the K/V pages a later chunk's window
        # reaches and one chunk's scratch (core.pages.window_page_slots), and a ring of gradient pages
        # (core.pages.gradient_ring_pages); the other layers a page of each stored token.
        per_sequence = window_page_slots(c.context, c.chunk_size, c.page_size, shape.window)[1]
        line = f"K/V pages ({dtype_name(kv_dtype)}), {windowed} sliding-window layers: {per_sequence} pages a sequence"
        gpu[line] = kv_layer * windowed * c.batch * per_sequence * c.page_size
        if c.training:
            ring_pages = min(gradient_ring_pages(shape.window, c.chunk_size, c.page_size),
                             math.ceil(c.context / c.page_size))
            ring = f"{grad_name}, {windowed} sliding-window layers: a ring of {ring_pages} pages a sequence"
            gpu[ring] = grad_layer * windowed * c.batch * ring_pages * c.page_size

    def layers_line(name: str, n: int) -> str:
        return name if n == shape.kv_layers else f"{name}, {n} of {shape.kv_layers} layers"

    full = shape.full_kv_layers
    if not shape.kv_layers:
        pass  # no layer attends (pure state-space models): no pages, streamed or not
    elif c.streamed and not full:
        pass  # every layer has a window: nothing to stream
    elif c.streamed:
        grad_layer = grad_layer if c.training else 0
        segment = offload_segment_pages(c) * c.page_size
        staged = "K, V, dK, dV" if c.training else "K, V"
        gpu[f"offload staging: 2 segments x {segment:,} tokens of {staged} (one layer)"] = (
            2 * segment * (kv_layer + grad_layer)
        )
        # One chunk's K, V on their way out (two buffers) and its stored dK, dV on their way in.
        chunk_rows = c.batch * (math.ceil(min(c.chunk_size, c.context) / c.page_size) + 1) * c.page_size
        gpu["offload staging: a chunk's K, V out (x2) and dK, dV in"] = chunk_rows * (2 * kv_layer + grad_layer)
        # The streamed forward carries its output in fp32, the streamed backward its dQ: one layer each.
        gpu["offload: fp32 attention output / dQ of a chunk (one layer)"] = (
            c.chunk_tokens * max(shape.out_width, shape.q_width) * 4)
        host["pinned " + layers_line(kv_name, full)] = kv_layer * full * c.stored_tokens
        if c.training:
            host["pinned " + layers_line(grad_name, full)] = grad_layer * full * c.stored_tokens
    else:
        # Layers without a sliding window keep a page of each stored token, on the GPU or (sparse, host layers)
        # in pinned host memory.
        n_kv_host, n_host = c.host_kv_layers, c.host_grad_layers
        for n, what in ((n_kv_host, "host_kv_layers"), (n_host, "host_grad_layers")):
            if n > full:
                apart = f" without a sliding window (of {shape.kv_layers})" if windowed else ""
                raise SetupError(f"{what} ({n}) exceeds the model's {full} layers{apart}")
        # The last chunk's past and query tiles, for which the host layers' GPU staging is sized.
        past_pages = math.ceil(max(c.context - c.chunk_size, 0) / c.page_size)
        n_tiles = math.ceil(min(c.chunk_size, c.context) / c.page_size)
        if full:
            gpu[layers_line(kv_name, full - n_kv_host)] = kv_layer * (full - n_kv_host) * c.stored_tokens
        if n_kv_host:
            host[f"pinned {kv_name}, {n_kv_host} layers (selected pages gathered)"] = (
                kv_layer * n_kv_host * c.stored_tokens)
            # One attention call's gather: per sequence, every past page a selection can name (core.pages
            # HostKVStaging sizes it for the worst case, on the device).
            staged = past_pages
            if isinstance(c.sparse, SparseConfig):
                heads = shape.n_kv_heads if c.sparse.per_kv_head else 1
                lists = n_tiles if c.sparse.per_query_tile else 1
                staged = min(past_pages, heads * lists * min(past_pages, c.sparse.budget_pages))
            gpu["host K/V layers: staging of a chunk's selected pages (two layers: one in use, the next gathered "
                "ahead)"] = 2 * max(1, staged) * c.batch * c.page_size * kv_layer
        if c.training:
            if full:
                gpu[layers_line(grad_name, full - n_host)] = grad_layer * (full - n_host) * c.stored_tokens
            if n_host:
                host[f"pinned {grad_name}, {n_host} layers (added into from the GPU)"] = (
                    grad_layer * n_host * c.stored_tokens)
                # The last chunk's distinct selected pages per (sequence, KV head), bounded as in
                # kernels.sparse_attention.invert_selection.
                staged = past_pages
                if isinstance(c.sparse, SparseConfig):
                    staged = min(past_pages, n_tiles * c.sparse.budget_pages)
                buffers = HostGradStaging.N_BUFFERS
                gpu[f"host gradient layers: float32 staging of a chunk's selected pages ({buffers} buffers)"] = (
                    HostGradStaging.nbytes_for(c.batch, shape.n_kv_heads, staged, c.page_size, shape.head_dim,
                                               shape.value_dim)
                )
    if isinstance(c.sparse, SparseConfig) and shape.kv_layers:
        pages = c.stored_tokens // c.page_size
        # A float32 mean key, or a min and max key, per page, layer and KV head; the host K/V layers' live with
        # their pages in host memory.
        summary_bytes = 4 if c.sparse.score == "mean" else 2 * _itemsize(kv_dtype)
        per_layer = pages * shape.n_kv_heads * shape.head_dim * summary_bytes
        summaries = (shape.kv_layers - c.host_kv_layers) * per_layer
        if c.host_kv_layers:
            host[f"pinned page summaries ({c.sparse.score}), {c.host_kv_layers} layers"] = c.host_kv_layers * per_layer
        # int32 page lists kept from stage 1 to stage 2: per layer, sequence, KV head (or one), query tile (or
        # chunk, per_query_tile=False).
        heads = shape.n_kv_heads if c.sparse.per_kv_head else 1
        lists = pages if c.sparse.per_query_tile else c.batch * c.n_chunks
        selections = 4 * shape.kv_layers * heads * lists * min(c.sparse.budget_pages, pages)
        gpu[f"sparse: page summaries ({c.sparse.score}) and selections (int32)"] = summaries + selections
    if shape.carried_state_bytes and c.training:
        # Stage 1 keeps each state-carrying layer's state at every chunk border until stage 2 reruns the chunk.
        gpu[f"border states of {shape.carried_layers} state-carrying layers ({c.n_chunks} chunks)"] = (
            c.batch * c.n_chunks * shape.carried_state_bytes)
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
    dtype = bytes_name(p.param)
    n = c.devices
    layer_trainable, root_trainable = trainable_split(shape, c.lora_rank, c.lora_experts)
    layer_weights = shape.decoder_params + (layer_trainable if c.lora_rank else 0)
    # One layer at a time: the largest (a mixture's with experts, not its dense ones), with its adapters.
    adapters = layer_trainable // shape.n_layers if c.lora_rank else 0
    per_layer = shape.largest_layer_params + adapters
    per_layer_trainable = adapters if c.lora_rank else shape.largest_layer_params
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
        per_layer_trainable * (p.param + 4))
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
    dtype = bytes_name(p.param)
    layers, root = shape.decoder_params, shape.root_params
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


def quantized_params(shape: ModelShape, c: PlanConfig) -> int:
    """Weights ``c.quantization`` holds in 4 bits: every decoder layer's nn.Linear layers (transformers keeps
    the output layer, the embeddings, the norms, and a mixture's experts and routers in the compute dtype;
    core.quantization); 0 without it."""
    return shape.linear_params if c.quantization is not None else 0


def kept_chunk_bytes(shape: ModelShape, chunk_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one chunk's attention outputs (every layer's out in ``dtype`` and fp32 lse) kept from stage 1."""
    return shape.kv_layers * chunk_tokens * (shape.out_width * _itemsize(dtype) + 4 * shape.n_heads)


def graph_chunk_bytes(shape: ModelShape, c: PlanConfig) -> int:
    """Bytes one chunk's autograd graph holds from its forward to its backward: its activations and the
    loss's dL/dh (the output layer's gradient goes into the step's float32 sum, counted once)."""
    p = PROFILES[c.precision]
    t = c.chunk_tokens
    return (activation_bytes(shape, t, c.precision, False, c.lora_rank, c.fused_ops, c.lora_experts)
            + t * shape.hidden * p.linear)


def loss_grad_bytes(shape: ModelShape, chunk_tokens: int, n_chunks: int, precision: str) -> int:
    """Bytes of every chunk's dL/dh that a step computing its loss in stage 1 (a served forward) keeps for
    stage 2 (on the host: one pinned block of the pool, ``PagePool.loss_grad_buffer``)."""
    return n_chunks * chunk_tokens * shape.hidden * PROFILES[precision].residual
