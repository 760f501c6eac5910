"""Seconds that host-memory pages add over the bus: sparse steps' host gradient layers' additions and host K/V
layers' gathers of the selected pages, dense steps' streamed segments (docs/planner.md, "Time")."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..config import SparseConfig
from ..model_shape import ModelShape, _itemsize, _kv_dtype
from ..pages import full_attention_layers, movable_host_layers, spread_layers, stage_2_gather_order
from .assumptions import HOST_ADD_GBPS, HOST_ADD_HIDDEN_S, HOST_GATHER_GBPS, STREAM_GBPS
from .config import PlanConfig, offload_segment_pages
from .timing import attention_kept_chunks, selected_pages_by_chunk


def host_layers_left(shape: "ModelShape", c: "PlanConfig") -> list[int]:
    """Host gradient layers still in host memory at each chunk's stage-2 backward (chunk order): stage 2 moves
    them into dead K/V and GPU gradient pages as those die (``PagePool.move_host_grads_to_gpu``: batch 1,
    gradient pages in the K/V dtype, after the chunks whose graphs stage 1 kept)."""
    n = c.n_chunks
    left = [c.host_grad_layers] * n
    if c.batch != 1 or c.grad_dtype != _kv_dtype(c.precision):
        return left
    seq_pages = -(-c.context // c.page_size)
    # PagePool.page_layers: the K pages of the layers in the pool's K tensor and the GPU gradient layers' (not
    # those of host layers, nor of sliding-window layers, which keep both apart).
    page_layers = 2 * shape.full_kv_layers - c.host_grad_layers - c.host_kv_layers
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
    page_bytes = c.page_size * (shape.head_dim + shape.value_dim) * _itemsize(c.grad_dtype)  # dK and dV
    seconds = 0.0
    selected = selected_pages_by_chunk(c.context, c.chunk_size, c.page_size, sparse, n_tiles)
    for pages, layers in zip(selected, host_layers_left(shape, c)):
        pairs = pages * shape.n_kv_heads * c.batch
        bus_bytes = pairs * page_bytes * 2  # read and written
        seconds += max(0.0, bus_bytes / (HOST_ADD_GBPS * 1e9) - HOST_ADD_HIDDEN_S) * layers
    return seconds


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


def chunk_kinds(c: "PlanConfig") -> tuple[str, ...]:
    """What stage 2 runs of each chunk: "graph" (stage 1 kept its autograd graph: the backward only), "kept"
    (stage 1 kept its attention outputs: no attention forward) or "computed" (``attention_kept_chunks``)."""
    n = c.n_chunks
    graphs = 0 if c.checkpoint_layers else min(c.graph_chunks, n)
    kept = attention_kept_chunks(n, c.checkpoint_layers, c.graph_chunks, c.kept_chunks, c.host_kept_chunks)
    return tuple("graph" if i >= n - graphs else "kept" if i in kept else "computed" for i in range(n))


def host_gather_stage_bytes(shape: "ModelShape", c: "PlanConfig") -> tuple[float, float]:
    """Bytes the host K/V layers' gathers move over the bus in stage 1 and in stage 2 of a step of ``c``, in
    expectation: each gather moves the union of the chunk's selected pages over its query tiles and selecting
    KV heads (each page's K of every head travels together; ``selected_pages_by_chunk`` with a picker per (tile,
    head) pair); a chunk gathers once per attention call of a host layer (``_host_layer_requests``: stage 1's
    forward; stage 2's forward and the backward, less the forwards ``attention_kept_chunks`` spares), except
    where a call follows one of the same layer and chunk, which reuses its gather (``_gathers``)."""
    if not c.host_kv_layers:
        return 0.0, 0.0
    sparse = c.sparse if isinstance(c.sparse, SparseConfig) else SparseConfig()
    n_tiles = -(-min(c.chunk_size, c.context) // c.page_size) if sparse.per_query_tile else 1
    heads = shape.n_kv_heads if sparse.per_kv_head else 1
    page_bytes = c.page_size * shape.kv_bytes_per_token(_kv_dtype(c.precision)) // shape.kv_layers  # K and V
    n = c.n_chunks
    kinds = chunk_kinds(c)
    windowed = set(range(shape.kv_layers)) - set(full_attention_layers(shape.kv_layers, shape.window_layers))
    host, last = spread_layers(shape.kv_layers, c.host_kv_layers, windowed), shape.kv_layers - 1
    per_kind: dict[tuple[str, bool, bool], tuple[int, int]] = {}
    gathers = [0.0, 0.0]
    # a chunk's union over the (tile, head) pairs, each picking its top-k pages at random
    unions = selected_pages_by_chunk(c.context, c.chunk_size, c.page_size, sparse, n_tiles * heads)
    for index, (union, kind) in enumerate(zip(unions, kinds)):
        skip_last = kind != "graph" and not c.stage_1_loss
        key = (kind, skip_last, index == n - 1)
        if key not in per_kind:
            requests = [_host_layer_requests(host, last, stage, kind, skip_last) for stage in (1, 2)]
            first, held = _gathers(requests[0], None)
            # stage 2 starts with the chunk stage 1 ended with: its last gather may serve stage 2's first call
            per_kind[key] = (first, _gathers(requests[1], held if index == n - 1 else None)[0])
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


def streamed_bytes_by_chunk(shape: "ModelShape", c: "PlanConfig") -> tuple[np.ndarray, np.ndarray]:
    """Dense steps with every page in pinned host memory (``c.streamed``): the bytes each chunk's attention
    calls move host to GPU and GPU to host, stage 1 and stage 2 together, as ``core.offload.Streamer`` moves
    them (``_streamed_rows``). Zeros for any other step."""
    n = c.n_chunks
    if not c.streamed or c.sparse or not shape.full_kv_layers:
        return np.zeros(n), np.zeros(n)
    per_seq = offload_segment_pages(c) // c.batch * c.page_size
    # Sliding-window layers keep their pages on the GPU (core.pages): only the others stream, the last layer
    # taken to be one of them (as in the families that mix both).
    kv_in, grads_in, kv_out, grads_out = _streamed_rows(
        shape.full_kv_layers, c.context, c.chunk_size, c.page_size, per_seq, c.document_length or 0,
        chunk_kinds(c), c.stage_1_loss)
    # one token's K and V (or dK and dV) of one layer, over the batch
    kv_row = shape.kv_bytes_per_token(_kv_dtype(c.precision)) // shape.kv_layers * c.batch
    grad_row = shape.kv_bytes_per_token(c.grad_dtype) // shape.kv_layers * c.batch
    return kv_in * kv_row + grads_in * grad_row, kv_out * kv_row + grads_out * grad_row


def streamed_seconds(h2d: np.ndarray, d2h: np.ndarray, chunk_busy_s: np.ndarray) -> float:
    """Seconds the streamed segments of a dense host-paged step add: for each chunk, how far its copies
    (``streamed_bytes_by_chunk``) at STREAM_GBPS, each direction on its own copy stream, outlast its compute and
    launches (``chunk_busy_s``)."""
    bus = np.maximum(h2d, d2h) / (STREAM_GBPS * 1e9)
    return float(np.maximum(0.0, bus - chunk_busy_s).sum())


@lru_cache(maxsize=64)
def _streamed_rows(layers: int, context: int, chunk: int, page: int, segment: int, document_length: int,
                   kinds: tuple[str, ...], stage_1_loss: bool) -> tuple[np.ndarray, ...]:
    """Token rows of one sequence and one layer's K and V (or dK and dV) that each chunk's calls move over the
    ``layers`` streamed layers: (K/V in, dK/dV in, K/V out, dK/dV out), as ``Streamer`` moves them. A call
    streams its past from the page of its first visible key (documents of ``document_length`` tokens) in
    segments of ``segment`` tokens. Stage 1 calls every layer's forward (but the last one's when it ends the
    chunk at that layer's K/V store, whose first two segments the layer before sent ahead anyway), stage 2 the
    forwards it does not take from stage 1 and every backward, which also stages the past's dK, dV (zeros below
    what this step's passes wrote: they go in reverse order) and the chunk's stored ones, and writes the past's
    back in whole pages. ``kinds``: per chunk, "graph", "kept" or "computed" as in
    ``host_gather_stage_bytes``."""
    n = len(kinds)
    starts = np.arange(n, dtype=np.int64) * chunk
    lengths = np.minimum(chunk, context - starts)
    first_key = starts // document_length * document_length if document_length else np.zeros(n, np.int64)
    skip_last = np.array([kind != "graph" and not stage_1_loss for kind in kinds])
    forwards_all = np.array([kind == "computed" for kind in kinds])
    kept_last = np.array([kind == "kept" for kind in kinds]) & skip_last
    lo = np.where(first_key < starts, first_key // page * page, starts)  # lo == start: no past
    past = starts - lo
    # The first token of this step's dK, dV sums when the chunk's backward runs: the least lo of the chunks
    # after it (each pass writes back from its lo), the context's end for the last chunk.
    written = np.append(np.minimum.accumulate(lo[::-1])[::-1][1:], context)
    calls = 2 + forwards_all  # stage 1's forward, stage 2's forward where computed, the backward
    kv_in = layers * past * calls
    grads_in = layers * (np.maximum(0, starts - np.maximum(lo, written))
                         + np.maximum(0, starts + lengths - np.maximum(starts, written)))
    grads_out = layers * np.where(past > 0, -(-starts // page) * page - lo, 0)
    first_two = np.where(past > 0, np.minimum((lo // segment + 2) * segment, starts) - lo, 0)
    kv_in = kv_in - skip_last * past  # stage 1 skips the last layer's forward ...
    kv_in = kv_in + kept_last * past  # ... which stage 2 then runs where it keeps the others' outputs
    wasted = skip_last & (layers > 1)  # ... but the layer before sent its first copies ahead
    wasted[-1] &= not kept_last[-1]  # the last chunk's stage 2 starts with that very call: they serve it
    kv_in = kv_in + wasted * first_two
    kv_out = layers * lengths.astype(float)
    return kv_in.astype(float), grads_in.astype(float), kv_out, grads_out.astype(float)
