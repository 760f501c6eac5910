"""What one point of a sweep (one mode at one context length) measured, and its row of results.csv."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.units import GIB

# The columns of results.csv, in this order (PointResult.row gives each point's cells).
CSV_COLUMNS = (
    "mode", "context", "batch", "chunk_size", "lora_rank", "dtype", "status",
    "step_time_s", "step_times_s", "tokens_per_s", "peak_gpu_bytes", "peak_gpu_gib",
    "peak_host_bytes", "peak_host_gib", "floor_s", "floor_fraction",
    "planned_gpu_allocated_bytes", "planned_gpu_gib", "planned_host_gib", "planned_step_s", "loss",
    "segment_tokens", "h2d_bytes", "d2h_bytes", "h2d_s", "d2h_s", "grad_dtype", "host_grad_layers", "kept_chunks",
    "graph_chunks", "host_kept_chunks", "alloc_retries", "host_grads_moved_at", "document_length", "host_kv_layers",
    "kv_pages_gathered", "kv_gather_s", "kv_gather_ahead_s", "grad_add_s", "pin_s",
)



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
        """The point as one row of results.csv (keys: CSV_COLUMNS); absent values are blank cells."""
        gib = lambda n: "" if n is None else f"{n / GIB:.3f}"  # noqa: E731
        return {
            "mode": self.mode, "context": self.context, "batch": self.batch, "chunk_size": self.chunk_size,
            "lora_rank": self.lora_rank, "dtype": self.dtype, "status": self.status,
            "step_time_s": float_cell(self.step_time_s),
            "step_times_s": ";".join(f"{t:.6g}" for t in self.step_times_s),
            "tokens_per_s": float_cell(self.tokens_per_s),
            "peak_gpu_bytes": _blank_if_none(self.peak_gpu_bytes),
            "peak_gpu_gib": gib(self.peak_gpu_bytes),
            "peak_host_bytes": _blank_if_none(self.peak_host_bytes),
            "peak_host_gib": gib(self.peak_host_bytes),
            "floor_s": float_cell(self.floor_s), "floor_fraction": float_cell(self.floor_fraction),
            "planned_gpu_allocated_bytes": _blank_if_none(self.planned_gpu_allocated_bytes),
            "planned_gpu_gib": gib(self.planned_gpu_allocated_bytes),
            "planned_host_gib": gib(self.planned_host_bytes),
            "planned_step_s": "" if self.planned_step_s is None else float_cell(self.planned_step_s),
            "loss": float_cell(self.loss),
            "segment_tokens": _blank_if_none(self.segment_tokens),
            "h2d_bytes": _blank_if_none(self.h2d_bytes), "d2h_bytes": _blank_if_none(self.d2h_bytes),
            "h2d_s": "" if self.h2d_s is None else float_cell(self.h2d_s),
            "d2h_s": "" if self.d2h_s is None else float_cell(self.d2h_s),
            "grad_dtype": self.grad_dtype, "host_grad_layers": _blank_if_none(self.host_grad_layers),
            "host_kv_layers": _blank_if_none(self.host_kv_layers),
            "kv_pages_gathered": _blank_if_none(self.kv_pages_gathered),
            "kv_gather_s": "" if self.kv_gather_s is None else float_cell(self.kv_gather_s),
            "kv_gather_ahead_s": "" if self.kv_gather_ahead_s is None else float_cell(self.kv_gather_ahead_s),
            "grad_add_s": "" if self.grad_add_s is None else float_cell(self.grad_add_s),
            "pin_s": "" if self.pin_s is None else float_cell(self.pin_s),
            "kept_chunks": _blank_if_none(self.kept_chunks),
            "graph_chunks": _blank_if_none(self.graph_chunks),
            "host_kept_chunks": _blank_if_none(self.host_kept_chunks),
            "alloc_retries": _blank_if_none(self.alloc_retries),
            "host_grads_moved_at": ";".join(str(t) for t in self.host_grads_moved_at),
            "document_length": _blank_if_none(self.document_length),
        }


def _blank_if_none(x: int | None) -> int | str:
    return "" if x is None else x


def float_cell(x: float | None) -> str:
    """A float as a cell of the CSV or the table: 6 significant digits, blank for None or NaN (no measurement)."""
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"
