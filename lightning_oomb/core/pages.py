"""The page pool: K, V and their gradients for every layer, in fixed-size pages, allocated once.

The layout and the per-layer views attention reads are in ``kernels.page_table``. Where a page lives (the GPU,
pinned host memory, host gradient layers moved into dead pages) is decided here, never in the kernels.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels.page_table import LayerStore, PageTable, StoreSpec
from .host_memory import HostLedger, pinned_empty
from .offload import BusyTime, Streamer

if TYPE_CHECKING:
    from .kept_attention import HostKeptAttention


def movable_host_layers(page_layers: int, seq_pages: int, live_pages: int, moved_layers: int) -> int:
    """How many more host gradient layers fit into a sequence's dead pages when its first ``live_pages`` of
    ``seq_pages`` pages are live in stage 2: the other pages of ``page_layers`` layers of pages are dead
    (every layer's K and V, and the GPU gradient layers' dK and dV when they share K's dtype:
    ``PagePool.page_layers``), each of the ``moved_layers`` already moved there holds its ``live_pages``
    pages' gradients in them (its gradient pages past the live ones died with their chunks and count as
    dead again), and a moved layer takes ``live_pages`` of them (dK in K's or dK's, dV in V's or dV's)."""
    if live_pages == 0:
        return 0
    return max(0, (page_layers * (seq_pages - live_pages) - moved_layers * live_pages) // live_pages)


def spread_layers(n_layers: int, n: int, apart: tuple[int, ...] | list[int] = ()) -> list[int]:
    """``n`` of layers 0..n_layers-1 not in ``apart``, evenly spaced over those (ascending)."""
    among = [layer for layer in range(n_layers) if layer not in apart]
    if n > len(among):
        raise ValueError(f"{n} layers asked for among the {len(among)} of {n_layers} not kept apart")
    return [among[(2 * i + 1) * len(among) // (2 * n)] for i in range(n)]


def full_attention_layers(n_layers: int, window_layers: int) -> tuple[int, ...]:
    """Where the planner puts the ``n_layers`` - ``window_layers`` layers without a sliding window, which it
    counts but does not place: evenly spaced with the last layer among them, as in the families that mix both
    (Gemma 2 and 3, GPT-OSS, Cohere 2: a global layer after each run of window layers)."""
    full = n_layers - window_layers
    return tuple((i + 1) * n_layers // full - 1 for i in range(full)) if full > 0 else ()


def gradient_ring_pages(window: int, chunk_size: int, page_size: int) -> int:
    """Pages per sequence of the gradient ring of layers with a sliding ``window`` (tokens): stage 2 adds into
    the pages from the one of its chunk's first visible key (``window`` - 1 tokens before the chunk) to its
    chunk's last, and each page is zeroed once its own chunk's backward has read it, so that many pages, plus
    the two a chunk and a window may straddle, are live at once."""
    return (chunk_size + window - 1) // page_size + 3


def window_page_slots(seq_len: int, chunk_size: int, page_size: int, window: int) -> tuple[np.ndarray, int]:
    """Where a sliding-window layer keeps each page of a sequence of ``seq_len`` tokens: (slots, per_sequence),
    slots (n_pages,) int64, each page's slot among the ``per_sequence`` slots the sequence takes.

    A chunk's queries take the chunk's own keys with them and read from the store only the past before the chunk,
    and a window layer's query only the ``window`` - 1 keys before it. A page is kept (a slot of its own) where
    a token of it lies within ``window`` - 1 tokens of the start of the chunk after its own, or where it straddles
    a chunk border. No later chunk reads a chunk's other pages, so they take scratch slots by their place in the
    chunk (counted from the page of its first token), the same for every chunk: each chunk overwrites the one
    before's. Valid while the tokens are written chunk by chunk, in
    order, each write within one chunk of ``chunk_size`` tokens counted from token 0 (``ChunkedSequence``'s
    ``fill`` and ``extend``). Where that keeps every page (a window longer than a chunk), each page has its own
    slot, in order."""
    n = -(-seq_len // page_size)
    first = np.arange(n, dtype=np.int64) * page_size
    last = np.minimum(first + page_size, seq_len) - 1
    chunk = last // chunk_size
    next_start = (chunk + 1) * chunk_size
    kept = ((next_start < seq_len) & (last >= next_start - (window - 1))) | (first // chunk_size != chunk)
    scratch = np.arange(n, dtype=np.int64) - chunk * chunk_size // page_size
    n_kept = int(kept.sum())
    per_sequence = n_kept + (int(scratch[~kept].max()) + 1 if n_kept < n else 0)
    if per_sequence >= n:
        return np.arange(n, dtype=np.int64), n
    return np.where(kept, np.cumsum(kept) - 1, n_kept + scratch), per_sequence


def _split_index(layer: int, host_layers: list[int], apart: list[int] = ()) -> tuple[bool, int]:
    """Whether ``layer`` is one of ``host_layers`` (ascending), and its index among the layers that live where
    it does: the host tensors hold the host layers in order, the GPU tensors the others but those kept
    ``apart`` (sliding-window layers with tensors of their own)."""
    if layer in host_layers:
        return True, host_layers.index(layer)
    return False, layer - sum(h < layer for h in host_layers) - sum(a < layer for a in apart)


class HostGradStaging:
    """Where the sparse backward of a host gradient layer leaves a chunk's share of its page gradients.

    The page dK/dV kernel writes the share of every distinct selected (page, KV head) into one of
    ``N_BUFFERS`` float32 GPU buffers; ``add_into`` then adds the buffer into the host pages on a side
    stream, so the bus traffic overlaps the layers computed meanwhile. Inside a step, ordering is by CUDA
    events only: a buffer is rewritten after the side stream has read it, and a layer's next backward waits
    for the additions into its pages; the pool waits for the side stream on the host when a step gives its
    pages back (``PagePool.free``). On a CPU device the additions run where they are issued.
    """

    N_BUFFERS = 2  # one being added into the host while the next layer's kernel fills the other
    ZERO_PAGES = 256  # pages per copy from a GPU buffer of zeros into host pages (zero_pages)

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.N_BUFFERS
        self._read: list[torch.cuda.Event | None] = [None] * self.N_BUFFERS
        self._next = 0
        self._layer_added: dict[int, torch.cuda.Event] = {}
        self.busy = BusyTime()  # the side stream's additions (not the zeroing)

    @staticmethod
    def nbytes_for(batch: int, n_kv_heads: int, n_pages: int, page_size: int, head_dim: int,
                   v_dim: int | None = None) -> int:
        """GPU bytes of the buffers for up to ``n_pages`` distinct selected pages per (sequence, KV head), dK
        ``head_dim`` and dV ``v_dim`` (None: ``head_dim``) wide."""
        width = head_dim + (head_dim if v_dim is None else v_dim)
        return HostGradStaging.N_BUFFERS * batch * n_kv_heads * n_pages * page_size * width * 4

    @property
    def nbytes(self) -> int:
        return sum((b[0].numel() + b[1].numel()) * 4 for b in self._buffers if b is not None)

    def buffers(self, batch: int, n_kv_heads: int, n_pages: int, page_size: int, head_dim: int, v_dim: int):
        """The next (dk, dv) buffers, (batch, n_kv_heads, >= n_pages, page_size, head_dim or v_dim) float32, once
        the side stream has finished reading them."""
        i = self._next
        held = self._buffers[i]
        if self._read[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._read[i])
        fits = held is not None and held[0].shape[2] >= n_pages and all(
            x.shape[:2] + x.shape[3:] == (batch, n_kv_heads, page_size, d) for x, d in zip(held, (head_dim, v_dim)))
        if not fits:
            # Sized by the first request: stage 2 starts at the last chunk, whose past is the longest.
            held = tuple(torch.empty((batch, n_kv_heads, n_pages, page_size, d), dtype=torch.float32,
                                     device=self.device) for d in (head_dim, v_dim))
            self._buffers[i] = held
        return held

    def add_into(self, store: LayerStore, pages: torch.Tensor, counts: torch.Tensor, start: int) -> None:
        """Add the buffers last handed out into ``store``'s gradient pages in host memory (see
        ``add_staged_pages``)."""
        from ..kernels.host_pages import add_staged_pages

        i = self._next
        self._next = (i + 1) % self.N_BUFFERS
        src_k, src_v = self._buffers[i]
        slots = store.grad_slots
        if not self.cuda:
            add_staged_pages(store.dk, store.dv, src_k, src_v, slots, pages, counts, start)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        begin, done = self.busy.timed()
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            add_staged_pages(store.dk, store.dv, src_k, src_v, slots, pages, counts, start)
            done.record(self.stream)
        for t in (slots, pages, counts):
            t.record_stream(self.stream)  # made on the compute stream, read here
        self._read[i] = self._layer_added[store.layer] = done

    def zero_pages(self, host: tuple[torch.Tensor, ...], layers: list[int], slots: list[int]) -> None:
        """Zero ``slots`` of the host gradient pages ``host`` (each (len(layers), num_pages, ...)) for a new step.

        On CUDA the copy engine does it from the side stream while stage 1 computes (no program holds an SM
        while it waits on the bus), and each of ``layers`` counts it as its additions so far: its first
        addition, read or move waits for it (``wait_for_layer``)."""
        runs: list[list[int]] = []  # [first, end) of consecutive slots: one copy per run (or piece of one)
        for slot in sorted(slots):
            if runs and runs[-1][1] == slot:
                runs[-1][1] += 1
            else:
                runs.append([slot, slot + 1])
        if not self.cuda:
            for pages in host:
                for a, b in runs:
                    pages[:, a:b] = 0
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the last step's reads of these pages
        with torch.cuda.stream(self.stream):
            for pages in host:
                zeros = torch.zeros((self.ZERO_PAGES, *pages.shape[2:]), dtype=pages.dtype, device=self.device)
                for layer_pages in pages:
                    for a, b in runs:
                        for lo in range(a, b, self.ZERO_PAGES):
                            hi = min(b, lo + self.ZERO_PAGES)
                            layer_pages[lo:hi].copy_(zeros[: hi - lo], non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        for layer in layers:
            self._layer_added[layer] = done

    def wait_for_layer(self, layer: int) -> None:
        """Make the compute stream wait for the additions into ``layer``'s host pages issued so far."""
        if self.cuda and layer in self._layer_added:
            torch.cuda.current_stream(self.device).wait_event(self._layer_added[layer])

    def synchronize(self) -> None:
        """Wait on the host until every addition issued so far is done."""
        if self.cuda:
            self.stream.synchronize()


def stage_2_gather_order(host_layers: list[int], stored: set[int], graph: bool) -> list[int]:
    """The host K/V layers whose attention a chunk's stage 2 calls, in order: the forward over the layers whose
    attention stage 1 did not keep (``stored``), then the backward from the last layer down (a layer
    checkpoint's recompute takes the forward's attention outputs: it calls nothing); a chunk whose graph stage 1
    kept (``graph``) runs only the backward."""
    if graph:
        return host_layers[::-1]
    return [layer for layer in host_layers if layer not in stored] + host_layers[::-1]


class HostKVStaging:
    """Brings the pages a sparse chunk selected of a host K/V layer to the GPU, for its attention calls.

    Per sequence, the union of the pages its tiles and KV heads selected is gathered from the host-mapped pages
    into GPU staging (the union found on the device, so the host never waits) and the layer's view remapped onto
    it. Stage 2's gathers run ahead of their calls on a side stream (``expect``); the last gather serves a call of
    the same layer, chunk and selection (docs/architecture.md, "Host K/V pages for sparse steps").
    ``pages_staged`` counts the pages gathered (on the device: reading it waits for the GPU), ``calls`` the
    gathers, ``prefetched`` those run ahead; ``busy``, ``busy_ahead``: the copies' time on the compute, side stream.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._staged = torch.zeros((), dtype=torch.int64, device=device)
        self.calls = 0
        self.prefetched = 0
        # A gather: (layer, start, selection, k, v, remapped page table, event of its copies or None); the
        # selection is held, so that the identity test cannot meet a new tensor at a freed one's address.
        self._last: tuple | None = None
        self._ahead: tuple | None = None
        self._expected: list[tuple[LayerStore, torch.Tensor]] = []
        self._expected_start = -1
        # CUDA: the gathers' copies on the compute stream (stage 1) and ahead, on the side stream (stage 2).
        self.busy, self.busy_ahead = BusyTime(), BusyTime()

    def forget(self) -> None:
        """Drop the kept and announced gathers (a step's end: its pages and selections are gone). A gather
        still copying keeps its memory until it ends: its tensors are marked as used on the side stream."""
        self._last = self._ahead = None
        self._expected = []

    @property
    def pages_staged(self) -> int:
        return int(self._staged)

    def expect(self, calls: list[tuple[LayerStore, torch.Tensor]], start: int) -> None:
        """Announce a stage-2 chunk's calls at ``start``: (store, selection) of each host layer in the order
        ``stage_2_gather_order`` gives, and start the first gather it needs (the last one made may serve the
        first call: the end of stage 1 and the start of stage 2 are the same chunk)."""
        self._ahead = None
        expected = [call for i, call in enumerate(calls) if i == 0 or call[0].layer != calls[i - 1][0].layer]
        if expected and self._serves(self._last, expected[0][0].layer, start, expected[0][1]):
            expected.pop(0)
        else:
            self._last = None
        self._expected, self._expected_start = expected, start
        self._prefetch_next()

    def _prefetch_next(self) -> None:
        if self._expected and self._ahead is None:
            store, selection = self._expected.pop(0)
            self._ahead = self._gather(store, selection, self._expected_start, ahead=True)
            self.prefetched += 1

    @staticmethod
    def _serves(gather: tuple | None, layer: int, start: int, selection: torch.Tensor) -> bool:
        return gather is not None and gather[0] == layer and gather[1] == start and gather[2] is selection

    def stage(self, store: LayerStore, selection: torch.Tensor, start: int) -> LayerStore:
        """``store`` (a host K/V layer) with k, v (B * cap, page_size, H_kv, D or D_v) on the GPU holding the pages
        ``selection`` (B, H_sel, n_tiles, K) names (-1: none), under a remapped page table; its gradient pages
        stay ``store``'s, under their own table."""
        if not self._serves(self._last, store.layer, start, selection):
            self._last = None  # the old staging goes before the new one is made
            if self._serves(self._ahead, store.layer, start, selection):
                self._last, self._ahead = self._ahead, None
                if self._last[-1] is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._last[-1])
                self._prefetch_next()
            else:  # not announced (stage 1), or the announcement went wrong: gather here, announce no more
                self._ahead, self._expected = None, []
                self._last = self._gather(store, selection, start, ahead=False)
        return dataclasses.replace(store, k=self._last[3], v=self._last[4], table=self._last[5],
                                   grad_table=store.grad_table or store.table, kv_stager=None)

    def _gather(self, store: LayerStore, selection: torch.Tensor, start: int, ahead: bool) -> tuple:
        # The union and the remapped table are found on the compute stream (small); on CUDA the copies run
        # on the side stream when ``ahead`` (its tensors marked as used there), else where the call is made.
        from ..kernels import host_pages

        asked = selection
        slots = store.table.slots
        batch = slots.shape[0]
        n_past = -(-start // store.page_size)
        if selection.stride(2) == 0:  # one list for every tile (SparseConfig.per_query_tile=False)
            selection = selection[:, :, :1]
        picks = selection.reshape(batch, -1).long()
        cap = max(1, min(n_past, picks.shape[1]))
        hit = torch.zeros(batch, n_past + 1, dtype=torch.bool, device=slots.device)
        hit.scatter_(1, picks + 1, True)  # column 0 collects the -1 entries
        hit = hit[:, 1:]
        staged = torch.arange(batch, device=slots.device)[:, None] * cap + hit.cumsum(1) - 1
        remapped = torch.zeros_like(slots)
        remapped[:, :n_past] = torch.where(hit, staged, 0).to(slots.dtype)
        k = torch.empty((batch * cap, *store.k.shape[1:]), dtype=store.k.dtype, device=slots.device)
        v = torch.empty((batch * cap, *store.v.shape[1:]), dtype=store.v.dtype, device=slots.device)
        self._staged += hit.sum()
        self.calls += 1
        table = PageTable(remapped, store.table.seq_len, store.page_size)
        if not self.cuda:
            src, dst = slots[:, :n_past][hit].long(), staged[hit]
            k[dst], v[dst] = store.k[src], store.v[src]
            return store.layer, start, asked, k, v, table, None
        # The GPU reads the host pages: one launch each, no host wait.
        src, dst = torch.where(hit, slots[:, :n_past].long(), -1).view(-1), staged.view(-1)
        compute = torch.cuda.current_stream(self.device)
        stream = self.stream if ahead else compute
        if ahead:
            stream.wait_stream(compute)
        begin, end = (self.busy_ahead if ahead else self.busy).timed()
        with torch.cuda.stream(stream):
            begin.record(stream)
            for host, pages in ((store.k, k), (store.v, v)):
                host_pages.copy_pages(host, src, pages, dst, host_pages.GATHER_AHEAD_PROGRAMS if ahead else None)
            end.record(stream)
        if not ahead:
            return store.layer, start, asked, k, v, table, None
        for t in (src, dst, k, v):
            t.record_stream(stream)
        return store.layer, start, asked, k, v, table, end


class PagePool:
    """Pages of K, V (and dK, dV when ``with_grads``) for all layers, allocated once: ``num_pages`` slots of
    ``page_size`` tokens shared by the sequences of a step, handed out by ``allocate``, returned by ``free``.

    placement: "gpu" keeps them on ``device``; "host" in host memory (pinned when ``device`` is CUDA), streamed
        through the GPU in segments of ``segment_tokens`` tokens (core.offload; on a CPU with synchronous copies).
    host_grad_layers, host_kv_layers (placement "gpu", sparse attention): that many layers, spread over those
        without a sliding window, keep their KV-gradient pages, or their K/V pages and summaries, in pinned host
        memory; window layers keep theirs on the GPU, a few of their window's pages each.
    host_limit: the pinned bytes its placement left for the pool (``host``, a ``HostLedger``). docs/architecture.md,
    "Memory" and the host-page sections after it, says how each is used.
    """

    def __init__(
        self,
        spec: StoreSpec,
        num_pages: int,
        page_size: int,
        device: torch.device | str,
        with_grads: bool = True,
        placement: str = "gpu",
        segment_tokens: int | None = None,
        host_grad_layers: int = 0,
        host_limit: int | None = None,
        host_kv_layers: int = 0,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if placement not in ("gpu", "host"):
            raise ValueError(f"placement must be 'gpu' or 'host', got {placement!r}")
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.placement = placement
        # Every host block of the pool, counted; ``host_limit`` is what its placement left for them.
        self.host = HostLedger(host_limit)
        self._loss_grads: torch.Tensor | None = None
        # Sliding-window layers keep their gradient pages in a ring (``gradient_ring_pages``), made by
        # ``allocate`` for its batch, on the device, wherever the other layers' pages are.
        ring = with_grads and bool(spec.grad_ring_pages)
        self.ring_layers: list[int] = sorted(spec.window_layers) if ring else []
        self.ring_dk = self.ring_dv = None
        self._ring_slots: torch.Tensor | None = None  # (batch, n_pages) int32: each page's slot in the ring
        # Sliding-window layers keep their K/V pages in tensors of their own on the device, which ``allocate``
        # sizes for its batch: only the pages a later chunk's window reaches, and one chunk's scratch
        # (``window_page_slots``); a streamed pool only beside their gradient ring (its host tensors then
        # hold the other layers' K, V, dK and dV alike).
        own = spec.chunk_size > 0 and (placement == "gpu" or not with_grads or bool(ring))
        self.window_layers: list[int] = sorted(spec.window_layers) if own else []
        self.window_k = self.window_v = None
        self._window_table: PageTable | None = None
        split_ok = host_grad_layers == 0 or (placement == "gpu" and with_grads)
        most = spec.n_layers - len(self.ring_layers)
        if not 0 <= host_grad_layers <= most or not split_ok:
            raise ValueError(
                f"host_grad_layers must be in [0, {most}] (the layers without a sliding window's gradient ring) and "
                f"needs placement 'gpu' with gradient pages, got {host_grad_layers} with placement {placement!r}, "
                f"with_grads={with_grads}"
            )
        most = spec.n_layers - len(self.window_layers)
        if not 0 <= host_kv_layers <= most or (host_kv_layers and placement != "gpu"):
            raise ValueError(
                f"host_kv_layers must be in [0, {most}] (the layers without a sliding window's own K/V pages) and "
                f"needs placement 'gpu' (sparse attention), got {host_kv_layers} with placement {placement!r}"
            )
        # Host layers are taken from the others: a window layer's pages are a few of its window's, not the
        # context's, and stay on the GPU.
        self.host_grad_layers = host_grad_layers
        self.host_layers = spread_layers(spec.n_layers, host_grad_layers, self.ring_layers)
        self.host_dk = self.host_dv = None
        self.grad_staging = None
        self.host_kv_layers = host_kv_layers
        self.host_kv_layer_ids = spread_layers(spec.n_layers, host_kv_layers, self.window_layers)
        self.host_k = self.host_v = None
        self.kv_staging = None
        shape = (spec.n_layers, num_pages, page_size, spec.n_kv_heads, spec.head_dim)
        v_shape = (*shape[:-1], spec.v_dim)
        if placement == "gpu":
            n = spec.n_layers - host_kv_layers - len(self.window_layers)
            on_gpu = spec.n_layers - host_grad_layers - len(self.ring_layers) if with_grads else 0
            if with_grads and spec.grad_dtype == spec.dtype:
                # The GPU layers' dK, dV pages follow every layer's K, V pages in one tensor each, so that
                # stage 2 can move host gradient layers into the dead pages of both (move_host_grads_to_gpu).
                self._k_pages, self._v_pages = (
                    torch.empty((n + on_gpu, *pages[1:]), dtype=spec.dtype, device=self.device)
                    for pages in (shape, v_shape)
                )
                self.k, self.dk = self._k_pages[:n], self._k_pages[n:].zero_()
                self.v, self.dv = self._v_pages[:n], self._v_pages[n:].zero_()
            else:
                self.k = self._k_pages = torch.empty((n, *shape[1:]), dtype=spec.dtype, device=self.device)
                self.v = self._v_pages = torch.empty((n, *v_shape[1:]), dtype=spec.dtype, device=self.device)
                grads = (on_gpu, *shape[1:]), (on_gpu, *v_shape[1:])
                self.dk = torch.zeros(grads[0], dtype=spec.grad_dtype, device=self.device) if with_grads else None
                self.dv = torch.zeros(grads[1], dtype=spec.grad_dtype, device=self.device) if with_grads else None
            pin = self.device.type == "cuda"
            if host_grad_layers:
                # Zeroed page by page as batches take them (allocate), not here.
                grads = (spec.grad_dtype, pin, self.host, "KV-gradient pages")
                self.host_dk = pinned_empty((host_grad_layers, *shape[1:]), *grads)
                self.host_dv = pinned_empty((host_grad_layers, *v_shape[1:]), *grads)
                self.grad_staging = HostGradStaging(self.device)
            if host_kv_layers:
                kv = (spec.dtype, pin, self.host, "K/V pages")
                self.host_k = pinned_empty((host_kv_layers, *shape[1:]), *kv)
                self.host_v = pinned_empty((host_kv_layers, *v_shape[1:]), *kv)
                self.kv_staging = HostKVStaging(self.device)
            self.streamer = None
        else:
            # Every layer's pages but the window layers' (above) on the host, streamed.
            streamed = [layer for layer in range(spec.n_layers) if layer not in self.window_layers]
            host_shape = (len(streamed), *shape[1:])
            pin = self.device.type == "cuda"
            self.k = pinned_empty(host_shape, spec.dtype, pin, self.host, "K/V pages")
            self.v = pinned_empty((*host_shape[:-1], spec.v_dim), spec.dtype, pin, self.host, "K/V pages")
            self._k_pages = self._v_pages = None  # nothing moves: every page is on the host
            # Gradient pages are never zeroed on the host: a step's first backward pass over a layer
            # starts its staged gradients from zero instead (offload.Streamer).
            grads = (spec.grad_dtype, pin, self.host, "KV-gradient pages")
            self.dk = pinned_empty(host_shape, *grads) if with_grads else None
            self.dv = pinned_empty((*host_shape[:-1], spec.v_dim), *grads) if with_grads else None
            if segment_tokens is None:
                raise ValueError("a host-placed pool needs segment_tokens (tokens per staged segment, all sequences)")
            host = {"k": self.k, "v": self.v, "dk": self.dk, "dv": self.dv}
            self.streamer = Streamer(spec, page_size, host, self.device, segment_tokens, streamed)
        self._free = list(range(num_pages))
        self.peak_pages_in_use = 0
        # Host gradient layers moved into dead pages: layer -> gradient slots (batch, n_pages) int32 into the
        # K (and dK) pages, V (and dV) pages viewed as (page_layers * num_pages, ...); the dead slots not yet
        # taken; (layer, live tokens) moves.
        self._moved: dict[int, torch.Tensor] = {}
        self._dead_slots: list[torch.Tensor] = []
        self._dead_from = 0
        self.host_grads_moved: list[tuple[int, int]] = []
        # score -> (summaries of the GPU layers, of the host K/V layers), each a tuple of (layers, num_pages, H, D).
        self._summaries: dict[str, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        self._host_kept: "HostKeptAttention | None" = None

    @property
    def on_host(self) -> bool:
        return self.placement == "host"

    @property
    def page_layers(self) -> int:
        """Layers of pages whose dead pages stage 2 moves host gradient layers into: every layer's K, V and,
        when they share K's dtype, the GPU gradient layers' dK, dV."""
        return 0 if self.on_host else self._k_pages.shape[0]

    def summaries(self, score: str, layer: int) -> tuple[torch.Tensor, ...]:
        """``layer``'s per-page key summaries for sparse attention, each (num_pages, n_kv_heads, head_dim):
        (mean,) in float32 for score "mean", (min, max) in the K dtype for "minmax". Those of the host K/V
        layers live with their pages, in pinned host memory (read and written from the GPU: core.sparse), so
        that the GPU holds no per-token memory of them. Allocated on first use (only sparse steps use them),
        sized with the pool (1/page_size of K's memory each)."""
        if self.on_host:
            raise ValueError("sparse attention over host-resident pages is not available: use offload='gpu'")
        if score not in ("mean", "minmax"):
            raise ValueError(f"unknown sparse score {score!r}")
        if score not in self._summaries:
            dtype, count = (torch.float32, 1) if score == "mean" else (self.spec.dtype, 2)
            shape = (self.num_pages, self.spec.n_kv_heads, self.spec.head_dim)
            on_gpu = tuple(torch.zeros((self.spec.n_layers - self.host_kv_layers, *shape), dtype=dtype,
                                       device=self.device) for _ in range(count))
            on_host = tuple(
                pinned_empty((self.host_kv_layers, *shape), dtype, self.device.type == "cuda", self.host,
                             "page summaries").zero_() for _ in range(count)
            ) if self.host_kv_layers else ()
            self._summaries[score] = (on_gpu, on_host)
        on_gpu, on_host = self._summaries[score]
        host, i = _split_index(layer, self.host_kv_layer_ids)
        return tuple(s[i] for s in (on_host if host else on_gpu))

    def host_kept_attention(self, n_chunks: int, out: torch.Tensor, lse: torch.Tensor) -> "HostKeptAttention":
        """Pinned host buffers for stage 1's attention outputs of ``n_chunks`` chunks, every layer, each like
        ``out`` (B, H_q, T, D) and ``lse`` (B, H_q, T); made on first use (only steps that keep outputs on the
        host use them), kept with the pool for the next steps, emptied for this one."""
        from .kept_attention import HostKeptAttention

        if self._host_kept is None or not self._host_kept.holds(n_chunks, out, lse):
            self._host_kept = None  # give the old buffers back before pinning new ones
            self._host_kept = HostKeptAttention(n_chunks, self.spec.n_layers, out, lse, self.host)
        self._host_kept.begin()
        return self._host_kept

    def loss_grad_buffer(self, n_chunks: int, chunk_elems: int, dtype: torch.dtype) -> torch.Tensor:
        """(n_chunks, chunk_elems) pinned host memory for each chunk's dL/dh, kept from stage 1 to stage 2 by a
        step that computes its loss in stage 1; made on first use, kept with the pool for the next steps."""
        held = self._loss_grads
        if held is None or held.shape[0] < n_chunks or held.shape[1] < chunk_elems or held.dtype != dtype:
            self._loss_grads = None  # give the old block back before pinning a new one
            pin = self.device.type == "cuda"
            self._loss_grads = pinned_empty((n_chunks, chunk_elems), dtype, pin, self.host, "dL/dh of every chunk")
        return self._loss_grads

    @property
    def with_grads(self) -> bool:
        return self.dk is not None

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of all pages (wherever they live) and, if any, sparse summaries."""
        summaries = (t for where in self._summaries.values() for ts in where for t in ts)
        tensors = [self.k, self.v, self.dk, self.dv, self.ring_dk, self.ring_dv, self.window_k, self.window_v,
                   self.host_dk, self.host_dv, self.host_k, self.host_v, *summaries]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def host_nbytes(self) -> int:
        """Bytes in host memory: all pages with placement "host", else the host gradient layers', the
        attention outputs stage 1 keeps there (``host_kept_attention``) and the kept dL/dh
        (``loss_grad_buffer``): what the pool's ledger counts."""
        return self.host.total

    @property
    def _host_page_nbytes(self) -> int:
        summaries = (t for _, on_host in self._summaries.values() for t in on_host)
        pages = (self.host_dk, self.host_dv, self.host_k, self.host_v, *summaries)
        return sum(t.numel() * t.element_size() for t in pages if t is not None)

    @property
    def gpu_nbytes(self) -> int:
        """Bytes this pool holds on the GPU: the pages, or the streaming buffers of a host pool."""
        if self.on_host:
            apart = (self.ring_dk, self.ring_dv, self.window_k, self.window_v)
            return self.streamer.nbytes + sum(t.numel() * t.element_size() for t in apart if t is not None)
        return self.nbytes - self._host_page_nbytes + (self.grad_staging.nbytes if self.grad_staging else 0)

    def allocate(self, batch: int, seq_len: int, first_keys: dict[int, int] | None = None) -> PageTable:
        """Take pages for ``batch`` sequences of ``seq_len`` tokens; their gradient pages start at zero.
        first_keys (packed documents): per chunk start, the first key the chunk's queries see
        (``core.documents.chunk_documents``); a host pool's streams skip the segments before it."""
        n = -(-seq_len // self.page_size)
        if batch * n > len(self._free):
            raise RuntimeError(
                f"the page pool holds {self.num_pages} pages of {self.page_size} tokens "
                f"({len(self._free)} free) but a batch of {batch} x {seq_len} tokens needs {batch * n}; "
                "build the pool for the longest batch you will train on (PagedKVCallback(max_seq_len=..., max_batch_size=...))"
            )
        if self._moved or self._dead_slots:
            raise RuntimeError("another batch holds dead pages of this pool with moved gradient pages: free it first")
        taken, self._free = self._free[: batch * n], self._free[batch * n :]
        self.peak_pages_in_use = max(self.peak_pages_in_use, self.pages_in_use)
        slots = torch.tensor(taken, dtype=torch.int32, device=self.k.device).view(batch, n)
        table = PageTable(slots=slots, seq_len=seq_len, page_size=self.page_size)
        self._dead_from = n
        self.host_grads_moved = []
        if self.window_layers:
            self._take_window_pages(batch, seq_len)
        if self.on_host:
            self.streamer.begin(table, first_keys)
        elif self.with_grads:
            idx = slots.view(-1).long()
            self.dk[:, idx] = 0
            self.dv[:, idx] = 0
            if self.host_dk is not None:
                self.grad_staging.zero_pages((self.host_dk, self.host_dv), self.host_layers, taken)
        if self.ring_layers:
            self._take_ring(batch, n)
        return table

    def _take_window_pages(self, batch: int, seq_len: int) -> None:
        """The sliding-window layers' K/V pages for ``batch`` sequences of ``seq_len`` tokens: page p of sequence
        b in slot b * S + slots[p] (``window_page_slots``: S slots a sequence)."""
        slots, per_sequence = window_page_slots(seq_len, self.spec.chunk_size, self.page_size, self.spec.window)
        if self.window_k is None or self.window_k.shape[1] < batch * per_sequence:
            self.window_k = self.window_v = None  # give the old pages back before taking more
            shape = (len(self.window_layers), batch * per_sequence, self.page_size, self.spec.n_kv_heads)
            self.window_k = torch.empty((*shape, self.spec.head_dim), dtype=self.spec.dtype, device=self.device)
            self.window_v = torch.empty((*shape, self.spec.v_dim), dtype=self.spec.dtype, device=self.device)
        offsets = torch.arange(batch, dtype=torch.int32)[:, None] * per_sequence
        table = (torch.from_numpy(slots).to(torch.int32)[None, :] + offsets).to(self.device)
        self._window_table = PageTable(slots=table, seq_len=seq_len, page_size=self.page_size)

    def _take_ring(self, batch: int, n_pages: int) -> None:
        """The sliding-window layers' gradient ring for ``batch`` sequences of ``n_pages`` pages, zeroed: page p
        of sequence b in ring slot b * R + p % R (R = ``spec.grad_ring_pages``, at most ``n_pages``)."""
        ring = min(self.spec.grad_ring_pages, n_pages)
        if self.ring_dk is None or self.ring_dk.shape[1] < batch * ring:
            self.ring_dk = self.ring_dv = None  # give the old ring back before making a bigger one
            shape = (len(self.ring_layers), batch * ring, self.page_size, self.spec.n_kv_heads)
            self.ring_dk = torch.zeros((*shape, self.spec.head_dim), dtype=self.spec.grad_dtype, device=self.device)
            self.ring_dv = torch.zeros((*shape, self.spec.v_dim), dtype=self.spec.grad_dtype, device=self.device)
        else:
            self.ring_dk[:, : batch * ring] = 0
            self.ring_dv[:, : batch * ring] = 0
        pages = torch.arange(n_pages, dtype=torch.int32, device=self.device) % ring
        offsets = torch.arange(batch, dtype=torch.int32, device=self.device)[:, None] * ring
        self._ring_slots = (pages[None, :] + offsets).contiguous()

    def chunk_grads_read(self, table: PageTable, start: int, end: int) -> None:
        """Stage 2, after the backward of the chunk of tokens [start, end): its pages that start at or after
        ``start`` are read and never added into again; their ring slots are zeroed for the earlier pages
        that take them next (the page straddling ``start``, if any, waits for the chunk before)."""
        if not self.ring_layers:
            return
        first, last = -(-start // self.page_size), -(-end // self.page_size)
        if last > first:
            slots = self._ring_slots[:, first:last].reshape(-1).long()
            self.ring_dk[:, slots] = 0
            self.ring_dv[:, slots] = 0

    def free(self, table: PageTable) -> None:
        """Give a table's pages back to the pool."""
        if self.on_host:
            self.streamer.end(table)
        if self.grad_staging is not None:
            self.grad_staging.synchronize()  # no addition may outlive the step: the pool may be dropped next
        self._moved.clear()
        self._dead_slots = []
        self._ring_slots = None
        self._window_table = None
        # Sorted, so that a sequence's pages form long runs of consecutive slots (one copy per run).
        self._free = sorted(self._free + table.slots.view(-1).tolist())

    def zero_grads(self, table: PageTable, start: int, end: int) -> None:
        """Zero the gradient pages of tokens [start, end) of every layer."""
        if self.on_host:
            self.streamer.synchronize()  # no copy may still be writing these pages
        elif self.host_dk is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no kernel or side stream may still be adding into the host pages
        rows = table.rows(start, end).reshape(-1)
        for grads in (self.dk, self.dv, self.host_dk, self.host_dv):
            if grads is not None and grads.numel():
                grads.view(grads.shape[0], -1, *grads.shape[3:])[:, rows.to(grads.device)] = 0
        if self.ring_layers:
            rows = PageTable(self._ring_slots, table.seq_len, table.page_size).rows(start, end).reshape(-1)
            for grads in (self.ring_dk, self.ring_dv):
                grads.view(grads.shape[0], -1, *grads.shape[3:])[:, rows] = 0
        for grad_slots in self._moved.values():
            moved = PageTable(grad_slots, table.seq_len, table.page_size).rows(start, end).reshape(-1)
            for pages in (self._k_pages, self._v_pages):
                pages.view(-1, *pages.shape[3:])[moved] = 0

    def move_host_grads_to_gpu(self, table: PageTable, live_tokens: int) -> None:
        """Stage 2, before computing the chunk that ends at ``live_tokens``: move the gradient pages of as many
        host layers as now fit into the dead K/V pages (those of tokens >= live_tokens, every layer, and the
        moved layers' gradient pages of those tokens), one layer after another. Only pages [0, live) move: the
        others' gradients were consumed with their chunks.

        A moved layer's additions then run like a GPU layer's, in the page dK/dV kernel, through its own
        gradient page table. Moves need batch 1 and gradient pages in the K/V dtype; otherwise nothing moves.
        """
        host = [layer for layer in self.host_layers if layer not in self._moved]
        if not host or table.slots.shape[0] != 1 or self.spec.grad_dtype != self.spec.dtype:
            return
        live = -(-live_tokens // self.page_size)
        if live < self._dead_from:
            # Slot ids into the K and V pages viewed as (page_layers * num_pages, ...); made on the GPU: no
            # host wait. The GPU layers' gradient pages of those tokens died with their chunks too.
            dead = table.slots[0, live : self._dead_from]
            layers = torch.arange(self.page_layers, dtype=torch.int32, device=dead.device)
            self._dead_slots.append((dead[:, None] + layers * self.num_pages).view(-1))
            # So are the moved layers' gradient pages of those tokens: their chunks have consumed them.
            self._dead_slots += [grad_slots[0, live : self._dead_from] for grad_slots in self._moved.values()]
            self._dead_from = live
        n = movable_host_layers(self.page_layers, table.slots.shape[1], live, len(self._moved))
        for layer in host[:n]:
            self._move(layer, table, live)
            self.host_grads_moved.append((layer, live_tokens))

    def _move(self, layer: int, table: PageTable, live: int) -> None:
        from ..kernels.host_pages import copy_pages

        dead = torch.cat(self._dead_slots)
        self._dead_slots = [dead[live:]]
        grad_slots = torch.full_like(table.slots, -1)  # pages >= live are never touched again
        grad_slots[0, :live] = dead[:live]
        i = self.host_layers.index(layer)
        if self.grad_staging is not None:
            self.grad_staging.wait_for_layer(layer)  # the side stream's additions into its host pages come first
        src, dst = table.slots[0, :live], grad_slots[0, :live]
        for host, pages in ((self.host_dk[i], self._k_pages), (self.host_dv[i], self._v_pages)):
            if self.device.type == "cuda":  # the GPU reads the host pages: no host wait, no temporary copy
                copy_pages(host, src, pages.view(-1, *pages.shape[2:]), dst)
            else:
                pages.view(-1, *pages.shape[2:])[dst.long()] = host[src.long()]
        self._moved[layer] = grad_slots

    def layer(self, layer: int, table: PageTable) -> LayerStore:
        kv_table = table
        if layer in self.window_layers:
            i = self.window_layers.index(layer)
            k, v, stager, kv_table = self.window_k[i], self.window_v[i], None, self._window_table
        else:
            host, i = _split_index(layer, self.host_kv_layer_ids, self.window_layers)
            k, v, stager = (self.host_k[i], self.host_v[i], self.kv_staging) if host else (self.k[i], self.v[i], None)
        dk = dv = staging = grad_table = None
        if self.dk is not None:
            if layer in self._moved:
                dk, dv = (pages.view(-1, *pages.shape[2:]) for pages in (self._k_pages, self._v_pages))
                grad_table = PageTable(self._moved[layer], table.seq_len, table.page_size)
            elif layer in self.ring_layers:
                i = self.ring_layers.index(layer)
                dk, dv = self.ring_dk[i], self.ring_dv[i]
                grad_table = PageTable(self._ring_slots, table.seq_len, table.page_size)
            else:
                host, i = _split_index(layer, self.host_layers, self.ring_layers)
                dk, dv = (self.host_dk[i], self.host_dv[i]) if host else (self.dk[i], self.dv[i])
                staging = self.grad_staging if host else None
        if dk is not None and grad_table is None and kv_table is not table:
            grad_table = table
        streamer = None if layer in self.window_layers else self.streamer
        return LayerStore(k, v, dk, dv, kv_table, self.page_size, layer, streamer, staging, grad_table, stager)
