"""The paged KV store: K, V and their gradients for every layer, in fixed-size pages.

Layout of one pool tensor: (n_layers, num_pages, page_size, n_kv_heads, head_dim). A sequence's logical
page p lives in physical slot ``page_table[b, p]``; token t of sequence b is row
``page_table[b, t // page_size] * page_size + t % page_size`` of a layer's pool viewed as
(num_pages * page_size, n_kv_heads, head_dim). Where a page lives is decided here, never in the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StoreSpec:
    """What one token costs in the store, per layer: K and V in ``dtype``, dK and dV in ``grad_dtype``."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    grad_dtype: torch.dtype = torch.float32

    def bytes_per_token(self, with_grads: bool = True) -> int:
        """Bytes of K+V (and dK+dV when ``with_grads``) for one token over all layers."""
        elems = 2 * self.n_layers * self.n_kv_heads * self.head_dim
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

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Pool rows of tokens [start, end) of every sequence: (batch, end - start) int64."""
        t = torch.arange(start, end, device=self.slots.device)
        return self.slots[:, t // self.page_size].long() * self.page_size + t % self.page_size


class LayerStore:
    """One layer's view of the pool: what the attention op reads and accumulates into."""

    def __init__(self, pool: "PagePool", layer: int, table: PageTable):
        self.k = pool.k[layer]
        self.v = pool.v[layer]
        self.dk = pool.dk[layer] if pool.dk is not None else None
        self.dv = pool.dv[layer] if pool.dv is not None else None
        self.table = table
        self.page_size = pool.page_size

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store a chunk's K, V (batch, n_kv_heads, T, head_dim) at tokens [start, start + T)."""
        rows = self.table.rows(start, start + k.shape[2])
        self._flat(self.k)[rows] = k.transpose(1, 2).to(self.k.dtype)
        self._flat(self.v)[rows] = v.transpose(1, 2).to(self.v.dtype)

    def read(self, start: int, end: int, grads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (or dK, dV) of tokens [start, end): two (batch, n_kv_heads, end - start, head_dim) tensors."""
        rows = self.table.rows(start, end)
        a, b = (self.dk, self.dv) if grads else (self.k, self.v)
        return self._flat(a)[rows].transpose(1, 2), self._flat(b)[rows].transpose(1, 2)

    def accumulate_grads(self, dk: torch.Tensor, dv: torch.Tensor, start: int) -> None:
        """Add dK, dV (batch, n_kv_heads, n, head_dim) of tokens [start, start + n) into the gradient pages."""
        rows = self.table.rows(start, start + dk.shape[2]).reshape(-1)
        fdk, fdv = self._flat(self.dk), self._flat(self.dv)
        fdk.index_add_(0, rows, dk.transpose(1, 2).reshape(-1, *fdk.shape[1:]).to(fdk.dtype))
        fdv.index_add_(0, rows, dv.transpose(1, 2).reshape(-1, *fdv.shape[1:]).to(fdv.dtype))


class PagePool:
    """Pages of K, V (and dK, dV when ``with_grads``) for all layers, allocated once.

    ``num_pages`` slots are shared by all sequences of a step; tables are handed out by ``allocate``
    and returned by ``free``. Nothing here grows after construction.
    """

    def __init__(
        self,
        spec: StoreSpec,
        num_pages: int,
        page_size: int,
        device: torch.device | str,
        with_grads: bool = True,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        shape = (spec.n_layers, num_pages, page_size, spec.n_kv_heads, spec.head_dim)
        self.k = torch.empty(shape, dtype=spec.dtype, device=self.device)
        self.v = torch.empty(shape, dtype=spec.dtype, device=self.device)
        self.dk = torch.zeros(shape, dtype=spec.grad_dtype, device=self.device) if with_grads else None
        self.dv = torch.zeros(shape, dtype=spec.grad_dtype, device=self.device) if with_grads else None
        self._free = list(range(num_pages))
        self.peak_pages_in_use = 0
        self._summaries: dict[str, tuple[torch.Tensor, ...]] = {}

    def summaries(self, score: str) -> tuple[torch.Tensor, ...]:
        """Per-page key summaries for sparse attention, each (n_layers, num_pages, n_kv_heads, head_dim):
        (mean,) in float32 for score "mean", (min, max) in the K dtype for "minmax". Allocated on first use
        (only sparse steps use them), sized with the pool (1/page_size of K's memory each)."""
        if score not in self._summaries:
            shape = (self.spec.n_layers, self.num_pages, self.spec.n_kv_heads, self.spec.head_dim)
            if score == "mean":
                made = (torch.zeros(shape, dtype=torch.float32, device=self.device),)
            elif score == "minmax":
                made = tuple(torch.zeros(shape, dtype=self.spec.dtype, device=self.device) for _ in range(2))
            else:
                raise ValueError(f"unknown sparse score {score!r}")
            self._summaries[score] = made
        return self._summaries[score]

    @property
    def with_grads(self) -> bool:
        return self.dk is not None

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def nbytes(self) -> int:
        tensors = [self.k, self.v, self.dk, self.dv, *(t for ts in self._summaries.values() for t in ts)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def allocate(self, batch: int, seq_len: int) -> PageTable:
        """Take pages for ``batch`` sequences of ``seq_len`` tokens; their gradient pages start at zero."""
        n = -(-seq_len // self.page_size)
        if batch * n > len(self._free):
            raise RuntimeError(
                f"the page pool holds {self.num_pages} pages of {self.page_size} tokens "
                f"({len(self._free)} free) but a batch of {batch} x {seq_len} tokens needs {batch * n}; "
                "build the pool for the longest batch you will train on (PagedKVCallback(max_tokens=...))"
            )
        taken, self._free = self._free[: batch * n], self._free[batch * n :]
        self.peak_pages_in_use = max(self.peak_pages_in_use, self.pages_in_use)
        slots = torch.tensor(taken, dtype=torch.int32, device=self.device).view(batch, n)
        if self.with_grads:
            idx = slots.view(-1).long()
            self.dk[:, idx] = 0
            self.dv[:, idx] = 0
        return PageTable(slots=slots, seq_len=seq_len, page_size=self.page_size)

    def free(self, table: PageTable) -> None:
        """Give a table's pages back to the pool."""
        self._free.extend(table.slots.view(-1).tolist())

    def zero_grads(self, table: PageTable, start: int, end: int) -> None:
        """Zero the gradient pages of tokens [start, end) of every layer."""
        rows = table.rows(start, end).reshape(-1)
        for grads in (self.dk, self.dv):
            grads.view(grads.shape[0], -1, *grads.shape[3:])[:, rows] = 0

    def layer(self, layer: int, table: PageTable) -> LayerStore:
        return LayerStore(self, layer, table)
