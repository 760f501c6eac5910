"""``lightning-oomb bench``: step time and peak memory of training modes over context lengths.

    lightning-oomb bench --model qwen2.5-7b --lengths 16k,32k,64k,128k --modes baseline,oomb \\
        [--chunk 4096] [--lora 16] [--repeats 3] [--warmup 1] [--out DIR] [--attention auto] [--checkpoint-layers]
        [--document-length 32K]

One randomly initialised model of the given shape (bf16 on CUDA, float32 on CPU) is built once and every
mode runs on it at every length: warm-up steps, then ``--repeats`` timed steps (median reported). A step is
a forward and backward with gradients zeroed before it (set_to_none) and no optimizer step. Modes:
- baseline: transformers' full-sequence forward and backward, SDPA attention, gradient checkpointing
  (non-reentrant), ``model(input_ids, labels=input_ids).loss``;
- oomb: ``lightning_oomb.train_step`` (chunk-recurrent, exact gradient);
- sparse: ``train_step`` with page-level sparse attention, ``SparseConfig(budget_pages=--budget-pages)``
  (the other SparseConfig fields at their defaults). Its floor counts the sparse attention FLOPs.
Later modes join through ``register_mode``. ``--document-length D`` packs every sequence from documents of
D tokens (position ids restarting every D tokens, the last document shorter), given to the lightning_oomb
modes' ``train_step``: attention stays within each document; the floor and the plan count that attention
only. The baseline cannot take them (its SDPA attention would cross the borders): bench it at D tokens
instead. An out-of-memory point is recorded as "OOM" and the sweep goes
on. Written to --out: results.csv, results.md (machine, date, command line, table) and results.png (step
time and peak GPU memory against context length, log-log, with the FLOP floor of docs/planner.md, "Time").

The floor is the same for every dense mode (8 P_mm L + 9 n_layers d_q L^2 at --matmul-tflops, no extra layer
checkpointing recompute), so "fraction of floor" compares modes on the same useful work. For oomb rows
the planner's predicted peak (minus its CUDA context allowance, which max_memory_allocated does not see)
and predicted time are recorded next to the measurement: that is how the planner's assumptions are
calibrated (docs/planner.md).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import math
import platform
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..core.host_memory import peak_process_host_bytes, reset_peak_process_host_bytes
from ..core.model_shape import LORA_TARGETS, ModelShape, load_config_dict, transformers_config
from ..core.plan import CUDA_CONTEXT_BYTES, DEFAULT_MATMUL_TFLOPS, OFFLOAD_SEGMENT_TOKENS, plan, step_time
from ..core.units import GIB, argparse_type, human_count, parse_tokens
from ..kernels import host_pages

CSV_COLUMNS = (
    "mode", "context", "batch", "chunk_size", "lora_rank", "dtype", "status",
    "step_time_s", "step_times_s", "tokens_per_s", "peak_gpu_bytes", "peak_gpu_gib",
    "peak_host_bytes", "peak_host_gib", "floor_s", "floor_fraction",
    "planned_gpu_allocated_bytes", "planned_gpu_gib", "planned_host_gib", "planned_step_s", "loss",
    "segment_tokens", "h2d_bytes", "d2h_bytes", "h2d_s", "d2h_s", "grad_dtype", "host_grad_layers", "kept_chunks",
    "graph_chunks", "host_kept_chunks", "alloc_retries", "host_grads_moved_at", "document_length", "host_kv_layers",
    "kv_pages_gathered", "kv_gather_s", "kv_gather_ahead_s", "grad_add_s", "pin_s",
)


@dataclass(frozen=True)
class BenchConfig:
    """What the sweep runs. Lengths are tokens per sequence; times in seconds."""

    model: str = "qwen2.5-7b"
    lengths: tuple[int, ...] = (16384, 32768, 65536, 131072)
    modes: tuple[str, ...] = ("baseline", "oomb")
    chunk_size: int = 4096
    page_size: int = 128
    batch: int = 1
    lora_rank: int = 0
    repeats: int = 3
    warmup: int = 1
    attention: str = "auto"
    checkpoint_layers: bool = False
    grad_dtype: str = "float32"
    budget_pages: int = 64
    # sparse: one page selection per query tile (True) or per chunk (SparseConfig.per_query_tile).
    per_query_tile: bool = True
    # sparse with host gradient layers: how the staged gradients are added into them ("PROGRAMSxROWSxWARPS",
    # kernels.host_pages.AddLaunch); "" keeps host_pages.ADD_LAUNCH.
    add_launch: str = ""
    # sparse with host K/V layers: persistent programs of the gathers that run ahead on a side stream;
    # None keeps host_pages.GATHER_AHEAD_PROGRAMS.
    gather_programs: int | None = None
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS
    # Packed documents: each sequence made of documents of this many tokens; None: one per sequence.
    document_length: int | None = None
    out: Path = Path("bench-results")
    device: str = "auto"
    seed: int = 0


@dataclass
class PointResult:
    """One (mode, context length) measurement. Bytes are peaks over the timed steps."""

    mode: str
    context: int
    batch: int
    chunk_size: int
    lora_rank: int
    dtype: str
    status: str = "ok"
    step_time_s: float = math.nan
    step_times_s: tuple[float, ...] = ()
    tokens_per_s: float = math.nan
    peak_gpu_bytes: int | None = None
    peak_host_bytes: int | None = None
    floor_s: float = math.nan
    planned_gpu_allocated_bytes: int | None = None
    planned_host_bytes: int | None = None
    planned_step_s: float | None = None
    loss: float = math.nan
    # Offload modes: the streamed segment (tokens per sequence) and one timed step's host<->GPU traffic.
    segment_tokens: int | None = None
    h2d_bytes: int | None = None
    d2h_bytes: int | None = None
    h2d_s: float | None = None
    d2h_s: float | None = None
    # oomb modes: dtype of the KV-gradient pages; sparse: layers whose gradient pages the step put on the host.
    grad_dtype: str = ""
    host_grad_layers: int | None = None
    # sparse: layers whose K/V pages the step put on the host, and the pages it gathered from there (every
    # attention call of the point's steps, warm-up included).
    host_kv_layers: int | None = None
    kv_pages_gathered: int | None = None
    # ... and the seconds the timed steps' gathers took (median step): stage 1's on the compute stream, stage
    # 2's on the side stream, ahead of their calls (hidden behind the compute as far as the step time shows).
    kv_gather_s: float | None = None
    kv_gather_ahead_s: float | None = None
    # sparse with host gradient layers: seconds the side stream spent adding the chunks' page gradients into
    # the host pages (median step; hidden behind the compute as far as the step time shows).
    grad_add_s: float | None = None
    # Seconds the timed steps spent page-locking host memory (a pool or host buffer made in them: every timed
    # step with --warmup 0, which then carries this once-per-run cost).
    pin_s: float | None = None
    # oomb modes: chunks whose attention outputs stage 1 kept for stage 2 (place_step's choice).
    kept_chunks: int | None = None
    graph_chunks: int | None = None
    # oomb modes: first chunks whose attention outputs stage 1 kept in pinned host memory.
    host_kept_chunks: int | None = None
    # CUDA: times the caching allocator, out of memory, freed its cache and retried during the timed steps
    # (each such retry synchronises the device).
    alloc_retries: int | None = None
    # sparse with host gradient layers: live tokens of stage 2 when each of them moved into dead K/V pages.
    host_grads_moved_at: tuple[int, ...] = ()
    # Packed documents of this many tokens per sequence (--document-length); None: one document.
    document_length: int | None = None

    @property
    def floor_fraction(self) -> float:
        """FLOP-floor time over measured time: 1.0 would be every FLOP at the matmul peak."""
        return self.floor_s / self.step_time_s if self.status == "ok" else math.nan

    def row(self) -> dict[str, object]:
        gib = lambda n: "" if n is None else f"{n / GIB:.3f}"  # noqa: E731
        return {
            "mode": self.mode, "context": self.context, "batch": self.batch, "chunk_size": self.chunk_size,
            "lora_rank": self.lora_rank, "dtype": self.dtype, "status": self.status,
            "step_time_s": _num(self.step_time_s), "step_times_s": ";".join(f"{t:.6g}" for t in self.step_times_s),
            "tokens_per_s": _num(self.tokens_per_s),
            "peak_gpu_bytes": _blank_if_none(self.peak_gpu_bytes),
            "peak_gpu_gib": gib(self.peak_gpu_bytes),
            "peak_host_bytes": _blank_if_none(self.peak_host_bytes),
            "peak_host_gib": gib(self.peak_host_bytes),
            "floor_s": _num(self.floor_s), "floor_fraction": _num(self.floor_fraction),
            "planned_gpu_allocated_bytes": _blank_if_none(self.planned_gpu_allocated_bytes),
            "planned_gpu_gib": gib(self.planned_gpu_allocated_bytes),
            "planned_host_gib": gib(self.planned_host_bytes),
            "planned_step_s": "" if self.planned_step_s is None else _num(self.planned_step_s),
            "loss": _num(self.loss),
            "segment_tokens": _blank_if_none(self.segment_tokens),
            "h2d_bytes": _blank_if_none(self.h2d_bytes), "d2h_bytes": _blank_if_none(self.d2h_bytes),
            "h2d_s": "" if self.h2d_s is None else _num(self.h2d_s),
            "d2h_s": "" if self.d2h_s is None else _num(self.d2h_s),
            "grad_dtype": self.grad_dtype, "host_grad_layers": _blank_if_none(self.host_grad_layers),
            "host_kv_layers": _blank_if_none(self.host_kv_layers),
            "kv_pages_gathered": _blank_if_none(self.kv_pages_gathered),
            "kv_gather_s": "" if self.kv_gather_s is None else _num(self.kv_gather_s),
            "kv_gather_ahead_s": "" if self.kv_gather_ahead_s is None else _num(self.kv_gather_ahead_s),
            "grad_add_s": "" if self.grad_add_s is None else _num(self.grad_add_s),
            "pin_s": "" if self.pin_s is None else _num(self.pin_s),
            "kept_chunks": _blank_if_none(self.kept_chunks),
            "graph_chunks": _blank_if_none(self.graph_chunks),
            "host_kept_chunks": _blank_if_none(self.host_kept_chunks),
            "alloc_retries": _blank_if_none(self.alloc_retries),
            "host_grads_moved_at": ";".join(str(t) for t in self.host_grads_moved_at),
            "document_length": _blank_if_none(self.document_length),
        }


def _blank_if_none(x: int | None) -> int | str:
    return "" if x is None else x


def _num(x: float) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"


# == modes ================================================================================================


@dataclass(frozen=True)
class BenchMode:
    """A way to train one step. ``step`` adds gradients to the parameters and returns the loss.

    ``setup``/``teardown`` run once around the mode's sweep (they must leave the model as they found it);
    ``planned`` says whether ``lightning_oomb.core.planner`` models this mode's memory; ``documents`` whether
    its step packs documents when the config asks (``packed_position_ids``).
    """

    name: str
    description: str
    step: Callable[[nn.Module, torch.Tensor, BenchConfig], torch.Tensor]
    setup: Callable[[nn.Module, BenchConfig], None] = lambda model, config: None
    teardown: Callable[[nn.Module, BenchConfig], None] = lambda model, config: None
    planned: bool = False
    sparse: bool = False
    offload: bool = False
    documents: bool = False

    def sparse_config(self, config: "BenchConfig"):
        from ..core.config import SparseConfig

        if not self.sparse:
            return None
        return SparseConfig(budget_pages=config.budget_pages, per_query_tile=config.per_query_tile)


MODES: dict[str, BenchMode] = {}


def register_mode(mode: BenchMode) -> BenchMode:
    """Make ``mode`` available to ``--modes`` under ``mode.name``."""
    MODES[mode.name] = mode
    return mode


def _hf_model(model: nn.Module):
    from ..integrations.transformers import causal_lm

    return causal_lm(model)


def _baseline_setup(model: nn.Module, config: BenchConfig) -> None:
    lm = _hf_model(model)
    lm.set_attn_implementation("sdpa")
    # transformers >= 5.2x names it activation_checkpointing_*; earlier versions gradient_checkpointing_*.
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _baseline_teardown(model: nn.Module, config: BenchConfig) -> None:
    lm = _hf_model(model)
    if hasattr(lm, "activation_checkpointing_disable"):
        lm.activation_checkpointing_disable()
    else:
        lm.gradient_checkpointing_disable()
    # Enabling checkpointing also hooked the embedding to make its output require grad; the models the
    # bench builds have no such hook otherwise, and it would change what LoRA runs of other modes save.
    lm.disable_input_require_grads()


def _baseline_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def _step_options(config: BenchConfig, sparse=None, offload: str = "auto") -> dict:
    """The ``train_step`` keyword arguments (equally, ChunkConfig fields) of an oomb-family mode."""
    return dict(
        chunk_size=config.chunk_size, page_size=config.page_size, attention=config.attention,
        checkpoint_layers=config.checkpoint_layers, grad_dtype=config.grad_dtype, sparse=sparse, offload=offload,
    )


def packed_position_ids(input_ids: torch.Tensor, document_length: int | None) -> torch.Tensor | None:
    """position_ids (B, L) on input_ids' device restarting at 0 every ``document_length`` tokens (packed
    documents, transformers' convention); None for None (one document per sequence)."""
    if document_length is None:
        return None
    return (torch.arange(input_ids.shape[1], device=input_ids.device) % document_length).expand_as(input_ids)


def _train_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig, **options) -> torch.Tensor:
    from .. import train_step

    return train_step(model, input_ids, position_ids=packed_position_ids(input_ids, config.document_length),
                      **_step_options(config, **options))


def _oomb_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config)


def _sparse_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config, sparse=MODES["sparse"].sparse_config(config))


def _sparse_offload_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config, sparse=MODES["sparse-offload"].sparse_config(config), offload="host")


def _offload_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config, offload="host")


def _drop_cached_pool(model: nn.Module, config: BenchConfig | None = None) -> None:
    """Forget the page pool train_step keeps per model, so each point's peak holds only its own pool."""
    from ..core.schedule import release_cached_pool

    release_cached_pool(model)


register_mode(BenchMode(
    "baseline", "transformers full-sequence forward+backward, SDPA, gradient checkpointing (non-reentrant)",
    _baseline_step, _baseline_setup, _baseline_teardown,
))
register_mode(BenchMode(
    "oomb", "lightning_oomb.train_step (chunk-recurrent, exact gradient)",
    _oomb_step, _drop_cached_pool, _drop_cached_pool, planned=True, documents=True,
))
register_mode(BenchMode(
    "sparse", "lightning_oomb.train_step with page-level sparse attention (--budget-pages pages per query tile)",
    _sparse_step, _drop_cached_pool, _drop_cached_pool, planned=True, sparse=True, documents=True,
))
register_mode(BenchMode(
    "sparse-offload", "sparse, with every layer's KV-gradient and K/V pages in pinned host memory (the "
    "selected pages gathered for each attention call): what a host layer costs",
    _sparse_offload_step, _drop_cached_pool, _drop_cached_pool, planned=True, sparse=True, offload=True,
    documents=True,
))
register_mode(BenchMode(
    "offload", "lightning_oomb.train_step with every K/V and KV-gradient page in pinned host memory, streamed",
    _offload_step, _drop_cached_pool, _drop_cached_pool, planned=True, offload=True, documents=True,
))


# == measuring ============================================================================================


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(model: nn.Module, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} (CPU)"


def build_model(config: BenchConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The randomly initialised model of ``config.model``'s shape, built on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    hf_config = transformers_config(load_config_dict(config.model))
    hf_config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=dtype)
    if config.lora_rank > 0:
        import peft

        lora = peft.LoraConfig(r=config.lora_rank, lora_alpha=16, target_modules=list(LORA_TARGETS))
        # Adapters in the model's dtype, as Lightning's bf16-true would hold them.
        model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    return model.train()


def measure(
    mode: BenchMode, model: nn.Module, context: int, config: BenchConfig, device: torch.device, shape: ModelShape
) -> PointResult:
    """Warm-up and timed steps of one mode at one length; OOM is a result, not an error."""
    from ..core.config import ChunkConfig
    from ..core.placement import place_step
    from ..core.schedule import cached_pool, pool_bytes

    dtype = next(model.parameters()).dtype
    result = PointResult(mode.name, context, config.batch, config.chunk_size, config.lora_rank,
                         str(dtype).removeprefix("torch."), document_length=config.document_length)
    if mode.planned:  # the lightning_oomb modes
        result.grad_dtype = config.grad_dtype
    sparse = mode.sparse_config(config)
    floor = step_time(shape, context, batch=config.batch, chunk_size=config.chunk_size,
                      lora_rank=config.lora_rank, matmul_tflops=config.matmul_tflops, sparse=sparse,
                      page_size=config.page_size, document_length=config.document_length)
    result.floor_s = floor.floor_s

    def planned(segment_tokens: int = OFFLOAD_SEGMENT_TOKENS, host_grad_layers: int = 0, host_kv_layers: int = 0) -> None:
        predicted = plan(
            shape, context, chunk_size=config.chunk_size, batch=config.batch, page_size=config.page_size,
            lora_rank=config.lora_rank, optimizer="none",
            precision="bf16-true" if dtype == torch.bfloat16 else "32-true",
            checkpoint_layers=config.checkpoint_layers, gpu_memory=1 << 62, host_memory=1 << 62,
            matmul_tflops=config.matmul_tflops, sparse=sparse, offload=mode.offload and not mode.sparse,
            segment_tokens=segment_tokens,
            grad_dtype=getattr(torch, config.grad_dtype), host_grad_layers=host_grad_layers, kept_chunks=result.kept_chunks or 0,
            graph_chunks=result.graph_chunks or 0, host_kept_chunks=result.host_kept_chunks or 0,
            host_kv_layers=host_kv_layers, document_length=config.document_length,
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
        _drop_cached_pool(model)
        for _ in range(config.warmup):
            model.zero_grad(set_to_none=True)
            mode.step(model, input_ids, config)
        _sync(device)
        pool = cached_pool(model)
        if mode.planned:  # the placement the timed steps get (the warm-up step's pool reused, no gradients yet)
            model.zero_grad(set_to_none=True)
            step_config = ChunkConfig(**_step_options(config, sparse, "host" if mode.offload else "auto"))
            reusable = pool_bytes(pool) if pool is not None else (0, 0)
            placement = place_step(model, config.batch, context, step_config, device, *reusable)
            result.kept_chunks, result.graph_chunks = placement.kept_chunks, placement.graph_chunks
            result.host_kept_chunks = placement.host_kept_chunks
            planned()
        if mode.offload and pool is not None and pool.on_host:  # plan with the segment the step chose
            result.segment_tokens = pool.streamer.half_pages * config.page_size // config.batch
            planned(result.segment_tokens)
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
            _sync(device)
            start = time.perf_counter()
            loss = mode.step(model, input_ids, config)
            _sync(device)
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
    _drop_cached_pool(model)
    _free_memory(model, device)
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


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{seconds:.1f}s"


def progress_line(index: int, total: int, r: PointResult, elapsed: float) -> str:
    head = f"[{index}/{total}] {r.mode:<9} L={r.context:>9,}"
    if r.host_grad_layers:
        head += f"  (KV-gradient pages of {r.host_grad_layers} layers on the host"
        if r.host_kv_layers:
            head += f", K/V pages of {r.host_kv_layers} ({r.kv_pages_gathered:,} pages gathered)"
        if r.host_grads_moved_at:
            moved = r.host_grads_moved_at
            head += f", {len(moved)} moved to the GPU in stage 2 at {moved[0]:,}-{moved[-1]:,} live tokens"
        head += ")"
    kept = [f"graphs of the last {r.graph_chunks}" if r.graph_chunks else "",
            f"attention outputs of {r.kept_chunks} on the GPU" if r.kept_chunks else "",
            f"attention outputs of the first {r.host_kept_chunks} on the host" if r.host_kept_chunks else ""]
    if any(kept):
        head += f"  (kept from stage 1, in chunks: {', '.join(k for k in kept if k)})"
    if r.status != "ok":
        return f"{head}  {r.status}  (elapsed {_elapsed(elapsed)})"
    gpu = f"  peak GPU {r.peak_gpu_bytes / GIB:.2f} GiB" if r.peak_gpu_bytes is not None else ""
    if r.alloc_retries:
        gpu += f" ({r.alloc_retries} allocator retries)"
    step = f"{r.step_time_s:.4g} s/step"
    if r.pin_s and r.pin_s >= 0.05 * r.step_time_s:  # a pool made in the timed step (--warmup 0)
        step += f" ({r.pin_s:.3g} s of it pinning host memory)"
    if r.kv_gather_ahead_s or r.kv_gather_s:
        step += f" (gathers {r.kv_gather_s:.3g} s on the compute stream, {r.kv_gather_ahead_s:.3g} s ahead)"
    if r.grad_add_s:
        step += f" (host gradient additions {r.grad_add_s:.3g} s on their stream)"
    return (
        f"{head}  {step}  {r.tokens_per_s:,.0f} tok/s{gpu}  "
        f"host {r.peak_host_bytes / GIB:.2f} GiB  {r.floor_fraction:.1%} of floor  loss {r.loss:.3f}  "
        f"(elapsed {_elapsed(elapsed)})"
    )


def _device(config: BenchConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def _print_now(line: str) -> None:
    print(line, flush=True)  # progress must show while a long sweep runs, also when piped to a file


def check_modes(config: BenchConfig) -> None:
    """Refuse modes that do not exist, or that cannot pack documents when ``config`` asks for them."""
    unknown = [m for m in config.modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; available: {', '.join(MODES)}")
    if config.document_length is not None:
        if config.document_length < 1:
            raise ValueError(f"--document-length must be >= 1 token, got {config.document_length}")
        unpacked = [m for m in config.modes if not MODES[m].documents]
        if unpacked:
            packing = ", ".join(m for m in MODES if MODES[m].documents)
            raise ValueError(
                f"--document-length packs documents in the modes {packing} only: {', '.join(unpacked)} would attend "
                "across their borders (bench it at the document length instead)"
            )


def run(config: BenchConfig, log: Callable[[str], None] = _print_now) -> list[PointResult]:
    """The sweep: every mode of ``config.modes`` at every length, on one model."""
    check_modes(config)
    device = _device(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = ModelShape.resolve(config.model)
    started = time.perf_counter()
    model = build_model(config, device, dtype)
    log(f"built {shape.name} ({human_count(shape.total_params)} params, {str(dtype).removeprefix('torch.')}) on "
        f"{machine_name(device)} in {_elapsed(time.perf_counter() - started)}")
    results: list[PointResult] = []
    total = len(config.modes) * len(config.lengths)
    launch = host_pages.AddLaunch.parse(config.add_launch) if config.add_launch else host_pages.ADD_LAUNCH
    gather = host_pages.GATHER_AHEAD_PROGRAMS if config.gather_programs is None else config.gather_programs
    with host_pages.side_launches(launch, gather):
        for name in config.modes:
            mode = MODES[name]
            mode.setup(model, config)
            try:
                for context in config.lengths:
                    result = measure(mode, model, context, config, device, shape)
                    results.append(result)
                    log(progress_line(len(results), total, result, time.perf_counter() - started))
            finally:
                mode.teardown(model, config)
                _free_memory(model, device)
    return results


# == reporting ============================================================================================


def markdown_table(results: list[PointResult]) -> str:
    head = ("| mode | context | status | step time (s) | tokens/s | peak GPU (GiB) | planned GPU (GiB) "
            "| peak host (GiB) | FLOP floor (s) | fraction of floor |")
    rows = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        row = r.row()
        cells = [
            r.mode, f"{r.context:,}", r.status,
            _num(r.step_time_s) and f"{r.step_time_s:.4g}", _num(r.tokens_per_s) and f"{r.tokens_per_s:,.0f}",
            row["peak_gpu_gib"] and f"{float(row['peak_gpu_gib']):.2f}",
            row["planned_gpu_gib"] and f"{float(row['planned_gpu_gib']):.2f}",
            row["peak_host_gib"] and f"{float(row['peak_host_gib']):.2f}",
            f"{r.floor_s:.4g}", _num(r.floor_fraction) and f"{r.floor_fraction:.1%}",
        ]
        rows.append("| " + " | ".join(c or "–" for c in cells) + " |")
    return "\n".join(rows)


def write_outputs(results: list[PointResult], config: BenchConfig, command: str, machine: str) -> dict[str, Path]:
    """results.csv, results.md and results.png under ``config.out``; returns their paths."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "results.csv", "md": out / "results.md", "png": out / "results.png"}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(r.row() for r in results)
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    settings = (
        f"model `{config.model}`, batch {config.batch}, chunk {config.chunk_size}, page {config.page_size}, "
        f"{'LoRA rank ' + str(config.lora_rank) if config.lora_rank else 'all parameters trainable'}, "
        f"attention `{config.attention}`, layer checkpointing (oomb) {'on' if config.checkpoint_layers else 'off'}, "
        f"{config.warmup} warm-up + {config.repeats} timed steps (median), "
        f"FLOP floor at {config.matmul_tflops:g} TFLOP/s"
    )
    if any(MODES[m].sparse for m in config.modes):
        settings += (f", sparse: {config.budget_pages} pages per "
                     + ("query tile" if config.per_query_tile else "chunk (one selection for all its query tiles)"))
    if config.document_length is not None:
        settings += (f", sequences packed from documents of {config.document_length:,} tokens (position ids "
                     "restarting at 0 for each)")
    modes = "\n".join(f"- `{m}`: {MODES[m].description}" for m in config.modes)
    paths["md"].write_text(
        f"# lightning-oomb bench\n\n- machine: {machine}\n- date: {date}\n- command: `{command}`\n"
        f"- settings: {settings}\n{modes}\n\n{markdown_table(results)}\n\n![step time and peak memory](results.png)\n"
    )
    plot(results, config, machine, paths["png"])
    return paths


def _tokens_label(n: float) -> str:
    n = int(round(n))
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def plot(results: list[PointResult], config: BenchConfig, machine: str, path: Path) -> None:
    """Two log-log panels against context length: step time (with the FLOP floor) and peak GPU memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    lengths = sorted({r.context for r in results})
    for name in config.modes:
        points = [r for r in results if r.mode == name]
        ok = [r for r in points if r.status == "ok"]
        line = ax_time.plot([r.context for r in ok], [r.step_time_s for r in ok], "o-", label=name)[0]
        color = line.get_color()
        with_memory = [r for r in ok if r.peak_gpu_bytes is not None]
        memory_of = {r.context: r.peak_gpu_bytes for r in with_memory}
        if not with_memory:  # CPU: the host peak is what there is
            memory_of = {r.context: r.peak_host_bytes for r in ok}
        ax_mem.plot(list(memory_of), [v / GIB for v in memory_of.values()], "o-", color=color, label=name)
        planned = [r for r in points if r.planned_gpu_allocated_bytes is not None]
        if planned and with_memory:
            ax_mem.plot([r.context for r in planned], [r.planned_gpu_allocated_bytes / GIB for r in planned], ":",
                        color=color, label=f"{name} (planned)")
        failed = [r for r in points if r.status != "ok"]
        for ax in (ax_time, ax_mem):
            for r in failed:
                ax.plot(r.context, 0.95, "x", color=color, markersize=10, transform=ax.get_xaxis_transform())
                ax.annotate(r.status, (r.context, 0.95), xycoords=ax.get_xaxis_transform(), color=color,
                            textcoords="offset points", xytext=(4, -12), fontsize=8)
    floors = {r.context: r.floor_s for r in results}
    ax_time.plot(lengths, [floors[n] for n in lengths], "k--", label=f"FLOP floor ({config.matmul_tflops:g} TFLOP/s)")
    on_gpu = any(r.peak_gpu_bytes is not None for r in results)
    ax_time.set_ylabel("step time (s)")
    ax_mem.set_ylabel("peak GPU memory allocated (GiB)" if on_gpu else "peak host RSS (GiB)")
    tokens = FuncFormatter(lambda x, _: _tokens_label(x))
    measured = any(r.status == "ok" for r in results)
    for ax in (ax_time, ax_mem):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(tokens)
        if ax is ax_time or measured:  # a sweep whose every point failed has no memory to draw
            ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{ModelShape.resolve(config.model).name} on {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# == command line =========================================================================================


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-oomb bench",
        description="Step time and peak memory of training modes over context lengths (K = 1024 tokens, M = 1024^2).",
    )
    parser.add_argument("--model", default="qwen2.5-7b",
                        help="built-in shape, a config.json or a model directory (default qwen2.5-7b)")
    parser.add_argument("--lengths", type=argparse_type(parse_tokens, many=True), default=BenchConfig.lengths,
                        help="context lengths, e.g. 16k,32k,64k,128k")
    parser.add_argument("--modes", type=argparse_type(str.strip, many=True), default=BenchConfig.modes,
                        help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--chunk", type=argparse_type(parse_tokens), default=4096, help="tokens per chunk (default 4096)")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank on q,k,v,o")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per point before timing")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--attention", choices=("auto", "reference", "triton"), default="auto", help="oomb attention")
    parser.add_argument("--checkpoint-layers", action="store_true", help="oomb: checkpoint decoder layers in stage 2")
    parser.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="oomb modes: dtype of the KV-gradient pages (default float32)")
    parser.add_argument("--budget-pages", type=int, default=64, help="sparse: past pages per query tile (default 64)")
    parser.add_argument("--selection", choices=("tile", "chunk"), default="tile",
                        help="sparse: one page selection per query tile (default) or per chunk, which bounds the "
                        "pages a host K/V layer gathers (SparseConfig.per_query_tile=False)")
    parser.add_argument("--add-launch", default="", metavar="PROGRAMSxROWSxWARPS",
                        help="sparse with host gradient layers: launch of the kernel adding their staged gradients "
                             "(default: kernels.host_pages.ADD_LAUNCH)")
    parser.add_argument("--gather-programs", type=int, default=None, metavar="N",
                        help="sparse with host K/V layers: persistent programs of the gathers that run ahead of "
                             "their calls (default: kernels.host_pages.GATHER_AHEAD_PROGRAMS)")
    parser.add_argument("--matmul-tflops", type=float, default=DEFAULT_MATMUL_TFLOPS,
                        help="matmul peak in TFLOP/s for the FLOP floor")
    parser.add_argument("--document-length", type=argparse_type(parse_tokens), default=None, metavar="TOKENS",
                        help="pack each sequence from documents of this many tokens, e.g. 32K (position ids "
                             "restarting every TOKENS; lightning_oomb modes only); default one document per sequence")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda, cuda:1, cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    config = BenchConfig(
        model=args.model, lengths=args.lengths, modes=args.modes, chunk_size=args.chunk, page_size=args.page_size,
        batch=args.batch, lora_rank=args.lora, repeats=args.repeats, warmup=args.warmup, attention=args.attention,
        checkpoint_layers=args.checkpoint_layers, grad_dtype=args.grad_dtype, budget_pages=args.budget_pages,
        per_query_tile=args.selection == "tile", add_launch=args.add_launch, gather_programs=args.gather_programs,
        matmul_tflops=args.matmul_tflops,
        document_length=args.document_length,
        out=args.out, device=args.device, seed=args.seed,
    )
    if config.add_launch:
        try:
            host_pages.AddLaunch.parse(config.add_launch)
        except ValueError as error:
            parser.error(str(error))
    for name, value in (("--repeats", config.repeats), ("--batch", config.batch),
                        ("--gather-programs", 1 if config.gather_programs is None else config.gather_programs)):
        if value < 1:
            parser.error(f"{name} must be >= 1")
    if config.warmup < 0:
        parser.error("--warmup must be >= 0")
    try:
        check_modes(config)
    except ValueError as error:
        parser.error(str(error))
    try:
        load_config_dict(config.model)
    except FileNotFoundError as error:
        parser.error(str(error))
    results = run(config)
    paths = write_outputs(results, config, "lightning-oomb bench " + shlex.join(argv), machine_name(_device(config)))
    print()
    print(markdown_table(results))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
