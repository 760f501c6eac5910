"""One point of a sweep: one mode's step at one context length, timed, with its memory peaks.

Warm-up steps, then ``repeats`` timed steps (median reported); a step is a forward and backward with gradients
zeroed before it (set_to_none) and no optimizer step. Peaks are over the timed steps: GPU bytes from
``torch.cuda.max_memory_allocated``, host bytes of the process. Offload modes also record one step's host<->GPU
traffic and the seconds of their side streams. For the modes the planner models, its prediction for the
placement the step chose is recorded next to the measurement (docs/planner.md calibrates on these). The FLOP
floor (8 P_mm L + 9 n_layers d_q L^2 at --matmul-tflops) is the same for every dense mode.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback

import torch
from torch import nn

from ..core.config import ChunkConfig
from ..core.host_memory import peak_process_host_bytes, reset_peak_process_host_bytes
from ..core.model_shape import ModelShape
from ..core.plan.assumptions import CUDA_CONTEXT_BYTES, OFFLOAD_SEGMENT_TOKENS
from ..core.plan.config import Pages, PlanConfig
from ..core.plan.search import plan
from ..core.plan.timing import step_time
from .config import BenchConfig
from .modes import BenchMode, drop_cached_pool, step_options
from .results import PointResult


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock time covers it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(model: nn.Module, device: torch.device) -> None:
    """Drop the gradients and the allocator's cache, so that the next point's peak holds only its own memory."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    mode: BenchMode, model: nn.Module, context: int, config: BenchConfig, device: torch.device, shape: ModelShape
) -> PointResult:
    """Warm-up and timed steps of one mode at one length; OOM is a result, not an error."""
    from ..core.placement import place_step
    from ..core.schedule import cached_pool, pool_bytes

    dtype = next(model.parameters()).dtype
    result = PointResult(mode.name, context, config.batch, config.chunk_size, config.lora_rank,
                         str(dtype).removeprefix("torch."), document_length=config.document_length)
    if mode.planned:  # the lightning_oomb modes
        result.grad_dtype = config.grad_dtype
    sparse = mode.sparse_config(config)
    step_config = ChunkConfig(**step_options(config, sparse, "host" if mode.offload else "auto"))
    # The step as the planner sees it: no optimizer, memory without limit (the prediction, not a check).
    step = PlanConfig(context, ChunkConfig.build(step_config, host_memory=1 << 62), batch=config.batch,
                      lora_rank=config.lora_rank, optimizer="none",
                      precision="bf16-true" if dtype == torch.bfloat16 else "32-true",
                      matmul_tflops=config.matmul_tflops, document_length=config.document_length)
    result.floor_s = step_time(shape, step.checkpointed(False)).floor_s  # the same for every dense mode

    def planned(segment_tokens: int = OFFLOAD_SEGMENT_TOKENS, host_grad_layers: int = 0, host_kv_layers: int = 0,
                streamed: bool = mode.offload and not mode.sparse) -> None:
        predicted = plan(
            shape, step, gpu_memory=1 << 62, segment_tokens=segment_tokens,
            pages=Pages(streamed, host_grad_layers, host_kv_layers),
            kept_chunks=result.kept_chunks or 0, graph_chunks=result.graph_chunks or 0,
            host_kept_chunks=result.host_kept_chunks or 0,
        )
        result.planned_gpu_allocated_bytes = predicted.peak_gpu_bytes - CUDA_CONTEXT_BYTES
        result.planned_host_bytes = predicted.peak_host_bytes
        result.planned_step_s = predicted.time.predicted_s

    if mode.planned:
        planned()
    generator = torch.Generator().manual_seed(config.seed + context)
    input_ids = torch.randint(0, shape.vocab, (config.batch, context), generator=generator).to(device)
    out_of_memory = False
    try:
        drop_cached_pool(model)
        for _ in range(config.warmup):
            model.zero_grad(set_to_none=True)
            mode.step(model, input_ids, config)
        sync(device)
        pool = cached_pool(model)
        if mode.planned:  # the placement the timed steps get (the warm-up step's pool reused, no gradients yet)
            model.zero_grad(set_to_none=True)
            reusable = pool_bytes(pool) if pool is not None else (0, 0)
            placement = place_step(model, config.batch, context, step_config, device, *reusable)
            result.kept_chunks, result.graph_chunks = placement.kept_chunks, placement.graph_chunks
            result.host_kept_chunks = placement.host_kept_chunks
            planned()
        if pool is not None and pool.on_host:  # streamed (offload, or auto on a GPU too small for the pages)
            result.segment_tokens = pool.streamer.half_pages * config.page_size // config.batch
            if mode.planned:  # plan as the step was placed, with the segment it chose
                planned(result.segment_tokens, streamed=not mode.sparse)
            pool.streamer.take_stats()  # the timed steps' traffic only
        if pool is not None:  # the timed steps' gathers and additions only
            _bus_seconds(pool)
        staging = pool.kv_staging if pool is not None else None  # small: its gathers end with each step
        gathered_before = staging.pages_staged if staging is not None else 0

        ledger = pool.host if pool is not None else None  # small: holds no tensor
        pinned_before = ledger.pin_seconds if ledger is not None else 0.0
        pool = None  # a step that replaces the pool must be able to free it
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        reset_peak_process_host_bytes()
        times, loss, bus = [], None, []
        for _ in range(config.repeats):
            model.zero_grad(set_to_none=True)
            sync(device)
            start = time.perf_counter()
            loss = mode.step(model, input_ids, config)
            sync(device)
            times.append(time.perf_counter() - start)
            _take_stream_stats(model, result)
            step_pool = cached_pool(model)
            if step_pool is not None:
                bus.append(_bus_seconds(step_pool))
            step_pool = None
        if bus and mode.sparse:
            result.kv_gather_s, result.kv_gather_ahead_s, result.grad_add_s = (
                statistics.median(seconds[i] for seconds in bus) for i in range(3))
        result.step_times_s = tuple(times)
        result.step_time_s = statistics.median(times)
        result.tokens_per_s = config.batch * context / result.step_time_s
        result.loss = float(loss)
        result.peak_host_bytes = peak_process_host_bytes()
        if device.type == "cuda":
            result.peak_gpu_bytes = int(torch.cuda.max_memory_allocated(device))
            result.alloc_retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    except torch.OutOfMemoryError:
        # Leave the except block first: its traceback holds the frames (and tensors) of the failed step.
        out_of_memory = True
    except Exception as error:  # one broken point must not cost the rest of a long sweep
        traceback.print_exc()
        result.status = f"error: {type(error).__name__}"
    if out_of_memory:
        result.status = "OOM"
        if device.type == "cuda":
            result.peak_gpu_bytes = int(torch.cuda.max_memory_allocated(device))
    pool = cached_pool(model)
    if pool is not None and result.status == "ok":
        result.pin_s = pool.host.pin_seconds - (pinned_before if pool.host is ledger else 0.0)
    if mode.sparse and pool is not None:  # the placement the step chose (also when it ran out of memory)
        result.host_grad_layers = pool.host_grad_layers
        result.host_grads_moved_at = tuple(live for _, live in pool.host_grads_moved)
        result.host_kv_layers = pool.host_kv_layers
        if pool.kv_staging is not None and result.status == "ok":  # per timed step, as the plan counts
            before = gathered_before if pool.kv_staging is staging else 0
            result.kv_pages_gathered = (pool.kv_staging.pages_staged - before) // config.repeats
        planned(host_grad_layers=pool.host_grad_layers, host_kv_layers=pool.host_kv_layers)
    del input_ids, pool
    drop_cached_pool(model)
    free_memory(model, device)
    return result


def _bus_seconds(pool) -> tuple[float, float, float]:
    """Seconds the host K/V gathers took on the compute stream and ahead on the side stream, and the host
    gradient additions on theirs, since the last call (zero where the pool has none, or on a CPU)."""
    gathers = pool.kv_staging
    kv = (gathers.busy.take(), gathers.busy_ahead.take()) if gathers is not None else (0.0, 0.0)
    return (*kv, pool.grad_staging.busy.take() if pool.grad_staging is not None else 0.0)


def _take_stream_stats(model: nn.Module, result: PointResult) -> None:
    """The last step's traffic of a host-placed pool, if any (holding no reference to the pool after)."""
    from ..core.schedule import cached_pool

    pool = cached_pool(model)
    if pool is not None and pool.on_host:
        stats = pool.streamer.take_stats()
        result.h2d_bytes, result.d2h_bytes = stats.h2d_bytes, stats.d2h_bytes
        result.h2d_s, result.d2h_s = stats.h2d_s, stats.d2h_s
