"""The paged layout of the KV store, as attention reads it.

Layout of one pool tensor: (n_layers, num_pages, page_size, n_kv_heads, width), the width ``head_dim`` for K
and dK and ``v_dim`` for V and dV (the two differ in some models: DeepSeek's MLA). A sequence's logical page p
lives in physical slot ``page_table[b, p]``; token t of sequence b is row
``page_table[b, t // page_size] * page_size + t % page_size`` of a layer's pool viewed as
(num_pages * page_size, n_kv_heads, width). ``PageTable`` holds the slots of a batch, ``LayerStore`` is
one layer's view of a pool (what the attention op reads and adds into), ``StoreSpec`` what a token costs.
The pool that owns the tensors and decides where they live is ``core.pages.PagePool``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch


def gather_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``src[rows]`` on ``rows``' device: src (n_rows, *row) there, or in pinned host memory mapped for it
    (a ``PagePool``'s host pages), which the GPU reads without a host wait (``host_pages.read_rows``)."""
    if src.device == rows.device:
        return src[rows]
    from .host_pages import read_rows

    return read_rows(src, rows)


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[rows] = values`` wherever ``dst`` lives (``gather_rows``; ``host_pages.write_rows``)."""
    if dst.device == rows.device:
        dst[rows] = values
        return
    from .host_pages import write_rows

    write_rows(dst, rows, values)


@dataclass(frozen=True)
class StoreSpec:
    """What one token costs in the store, per layer: K and V in ``dtype``, dK and dV in ``grad_dtype``; K and dK
    ``head_dim`` wide per KV head, V and dV ``v_head_dim`` wide (None: ``head_dim``).

    window_layers: the layers with a sliding window of at most ``window`` tokens, whose gradient pages a pool
    may keep in a ring of ``grad_ring_pages`` pages per sequence (``core.pages.gradient_ring_pages``: a page's
    gradient is only added into by the chunks in its window, and is read by its own chunk's backward), whose K/V
    pages it may keep only where a later chunk of ``chunk_size`` tokens reaches them
    (``core.pages.window_page_slots``), and whose host pages a streamed step visits from the window's first page
    on (``core.offload``)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    grad_dtype: torch.dtype = torch.float32
    window_layers: tuple[int, ...] = ()
    window: int = 0
    grad_ring_pages: int = 0
    v_head_dim: int | None = None
    chunk_size: int = 0  # tokens per chunk of the steps the store serves (0: not known; set with window_layers)

    @property
    def v_dim(self) -> int:
        """Channels of one value head (and of its gradient)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def bytes_per_token(self, with_grads: bool = True) -> int:
        """Bytes of K+V (and dK+dV when ``with_grads``) for one token over all layers."""
        elems = self.n_layers * self.n_kv_heads * (self.head_dim + self.v_dim)
        kv = elems * _itemsize(self.dtype)
        return kv + (elems * _itemsize(self.grad_dtype) if with_grads else 0)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class PageTable:
    """Which pool slots hold the pages of a batch of sequences: ``slots`` is (batch, n_pages) int32."""

    slots: torch.Tensor
    seq_len: int
    page_size: int
    # The last rows asked for, with the slots' version they came from: every layer of a chunk asks for the same
    # rows, and each computation is seven small kernels (a small model's step is bound by launching them).
    _last_rows: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Pool rows of tokens [start, end) of every sequence: (batch, end - start) int64. Callers must not
        modify it (the next call for the same tokens returns the same tensor)."""
        # Inference tensors (a table made under torch.inference_mode) keep no version counter: never cached.
        version = None if self.slots.is_inference() else self.slots._version
        last = self._last_rows
        if version is not None and last is not None and last[0] is self.slots and last[1:4] == (version, start, end):
            return last[4]
        t = torch.arange(start, end, device=self.slots.device)
        rows = self.slots[:, t // self.page_size].long() * self.page_size + t % self.page_size
        self._last_rows = None if version is None else (self.slots, version, start, end, rows)
        return rows


@dataclass
class LayerStore:
    """One layer's view of a pool: what the attention op reads and accumulates into.

    k, dk: (num_pages, page_size, n_kv_heads, D) tensors, v, dv (num_pages, page_size, n_kv_heads, D_v) (dk, dv
    None without gradient pages).
    streamer: set when they live in host memory (streamed through the GPU by core.offload; ``layer`` names this
    layer there). grad_staging: where a host gradient layer's share goes (core.pages.HostGradStaging).
    grad_table: the gradient pages' own slots (a host gradient layer moved into dead K/V pages); dk, dv are then
    indexed by it, k, v by ``table``. kv_stager: set for host K/V pages under sparse attention.
    """

    k: torch.Tensor
    v: torch.Tensor
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    table: PageTable
    page_size: int
    layer: int = 0
    streamer: HostPageStreamer | None = None
    grad_staging: HostGradAdder | None = None
    grad_table: PageTable | None = None
    kv_stager: HostKVStager | None = None

    @property
    def grad_slots(self) -> torch.Tensor:
        """(batch, n_pages) int32: where each page's gradient lives in dk, dv (the kernels index it with the
        strides of ``table.slots``)."""
        slots = (self.grad_table or self.table).slots
        if slots.stride() != self.table.slots.stride():
            raise ValueError("the gradient page table must have the layout of the K/V page table")
        return slots

    def from_page(self, page: int) -> LayerStore:
        """This store less every sequence's first ``page`` pages: its token t is token t + page * page_size
        here (the keys of a document that starts on that page, for kernels that know no documents)."""
        if page == 0:
            return self

        def shifted(table: PageTable | None) -> PageTable | None:
            if table is None:
                return None
            return PageTable(table.slots[:, page:], table.seq_len - page * self.page_size, self.page_size)

        return replace(self, table=shifted(self.table), grad_table=shifted(self.grad_table))

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store a chunk's K (batch, n_kv_heads, T, D), V (batch, n_kv_heads, T, D_v) at tokens [start, start + T)."""
        if self.streamer is not None:
            self.streamer.write(self, k, v, start)
            return
        rows = self.table.rows(start, start + k.shape[2])
        k, v = k.transpose(1, 2).to(self.k.dtype), v.transpose(1, 2).to(self.v.dtype)
        scatter_rows(self._flat(self.k), rows, k)  # host K/V pages too (PagePool(host_kv_layers=...))
        scatter_rows(self._flat(self.v), rows, v)

    def read(self, start: int, end: int, grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (or dK, dV) of tokens [start, end): (batch, n_kv_heads, end - start, D), and D_v for V (dV)."""
        rows = (self.grad_table or self.table).rows(start, end) if grads else self.table.rows(start, end)
        a, b = (self.dk, self.dv) if grads else (self.k, self.v)
        # Host pages too (PagePool(host_grad_layers=/host_kv_layers=)).
        return gather_rows(self._flat(a), rows).transpose(1, 2), gather_rows(self._flat(b), rows).transpose(1, 2)

    def accumulate_grads(self, dk: torch.Tensor, dv: torch.Tensor, start: int) -> None:
        """Add dK (batch, n_kv_heads, n, D), dV (batch, n_kv_heads, n, D_v) of tokens [start, start + n) into the
        gradient pages."""
        rows = (self.grad_table or self.table).rows(start, start + dk.shape[2]).reshape(-1)
        fdk, fdv = self._flat(self.dk), self._flat(self.dv)
        fdk.index_add_(0, rows, dk.transpose(1, 2).reshape(-1, *fdk.shape[1:]).to(fdk.dtype))
        fdv.index_add_(0, rows, dv.transpose(1, 2).reshape(-1, *fdv.shape[1:]).to(fdv.dtype))


class HostPageStreamer(Protocol):
    """Streams the pages of a host-placed pool through the GPU (``core.offload.Streamer``)."""

    def write(self, store: LayerStore, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store a chunk's K (batch, n_kv_heads, T, D), V (..., D_v) at tokens [start, start + T)."""

    def forward(self, backend, q, k, v, store: LayerStore, start: int, scale: float, doc_start=None):
        """The attention backend's forward over ``store``'s pages, streamed segment by segment (doc_start:
        each query's document start, or None)."""

    def backward(self, backend, dout, q, k, v, out, lse, store: LayerStore, start: int, scale: float,
                 doc_start=None):
        """The backend's backward over the streamed pages, their gradients added back into host memory."""


class HostGradAdder(Protocol):
    """Adds the sparse backward's page gradients of a host gradient layer into its pinned host pages
    (``core.pages.HostGradStaging``)."""

    def wait_for_layer(self, layer: int) -> None:
        """Make the compute stream wait for the additions into ``layer``'s host pages issued so far."""

    def buffers(self, batch: int, n_kv_heads: int, n_pages: int, page_size: int, head_dim: int, v_dim: int):
        """The next (dk, dv) float32 GPU buffers, (batch, n_kv_heads, >= n_pages, page_size, head_dim or v_dim)."""

    def add_into(self, store: LayerStore, pages: torch.Tensor, counts: torch.Tensor, start: int) -> None:
        """Add the buffers last handed out into ``store``'s gradient pages in host memory."""


class HostKVStager(Protocol):
    """Brings the K/V pages a sparse chunk selected of a host K/V layer to the GPU (``core.pages.HostKVStaging``)."""

    def stage(self, store: LayerStore, selection: torch.Tensor, start: int) -> LayerStore:
        """A view of ``store`` whose k, v hold the pages ``selection`` (B, H_sel, n_tiles, K) names, on the GPU,
        under a remapped page table; its gradient pages are ``store``'s, under their own table."""
