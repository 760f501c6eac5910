"""Pages in host memory, streamed through the GPU (docs/architecture.md, "Host pages").

A host-placed PagePool keeps K, V, dK and dV of every layer in pinned host memory. Attention over that past
runs segment by segment (``segment_tokens`` tokens), each copied into one half of a double-buffered staging
area while the other half is computed on: the forward carries the online-softmax state across segments
(``backend.forward_state``), the backward adds each segment's dK, dV (``backend.backward_part``) and sends
them back on a second copy stream. CUDA events order it all: no host synchronisation inside a step, no
Python threads. On a CPU device the same code runs with synchronous copies, which is how it is tested.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.page_table import LayerStore, PageTable, StoreSpec



@dataclass
class CopyStats:
    """Host<->GPU traffic of one step: bytes each way and seconds the copy streams were busy."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_s: float = 0.0
    d2h_s: float = 0.0


class BusyTime:
    """Seconds a CUDA stream spent on work bracketed by ``timed`` events; finished brackets are folded into a
    sum as new ones come (``take`` waits for the rest), so that a long run holds few events."""

    def __init__(self):
        self._open: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0

    def timed(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """(begin, end) events to record on the stream around the work (``end`` doubles as its done event)."""
        while self._open and self._open[0][1].query():
            begin, end = self._open.pop(0)
            self._seconds += begin.elapsed_time(end) / 1e3
        pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._open.append(pair)
        return pair

    def take(self) -> float:
        """The seconds since the last ``take``; waits for the work still open."""
        for begin, end in self._open:
            end.synchronize()
            self._seconds += begin.elapsed_time(end) / 1e3
        self._open, seconds, self._seconds = [], self._seconds, 0.0
        return seconds


class _Streams:
    """The two copy streams and their events; on a CPU device every operation is a no-op (copies run
    synchronously where they are issued)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
        self._busy = {"h2d": BusyTime(), "d2h": BusyTime()}

    def event(self):
        return torch.cuda.Event() if self.cuda else None

    @contextlib.contextmanager
    def on(self, name: str, waits=()):
        """Run the enclosed copies on copy stream ``name`` ("h2d" or "d2h") after ``waits`` (events)."""
        if not self.cuda:
            yield
            return
        stream = getattr(self, name)
        for event in waits:
            if event is not None:
                stream.wait_event(event)
        begin, end = self._busy[name].timed()
        with torch.cuda.stream(stream):
            begin.record(stream)
            yield
            end.record(stream)

    def record(self, event, name: str | None = None) -> None:
        """Record ``event`` on copy stream ``name``, or on the compute (current) stream."""
        if self.cuda:
            event.record(getattr(self, name) if name else torch.cuda.current_stream(self.device))

    def compute_waits(self, event) -> None:
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def finish(self, stats: CopyStats) -> None:
        """Wait for every copy, and add the busy time of each stream to ``stats``."""
        if not self.cuda:
            return
        self.h2d.synchronize()
        self.d2h.synchronize()
        stats.h2d_s += self._busy["h2d"].take()
        stats.d2h_s += self._busy["d2h"].take()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(pages, page_size, H, D) -> (pages * page_size, H, D): one row per token slot."""
    return t.view(-1, *t.shape[2:])


class Streamer:
    """The GPU side of a host-placed PagePool: staging buffers, copy streams, and the streamed attention.

    Staging holds two halves of ``segment_tokens`` tokens per step (shared by the sequences of a batch) of
    K, V and, with gradient pages, dK and dV of ONE layer, plus one chunk's K, V on their way out and one
    chunk's stored dK, dV on their way in: fixed memory, whatever the context length.
    """

    def __init__(self, spec: StoreSpec, page_size: int, host: dict[str, torch.Tensor | None], device: torch.device,
                 segment_tokens: int, layers: list[int] | None = None):
        """host: the pool's pages, "k", "v", "dk", "dv" -> (len(layers), num_pages, page_size, n_kv_heads,
        head_dim or v_dim) host tensors (dk, dv None without gradient pages) of the streamed ``layers``
        (ascending; None: every layer); device: the GPU they stream through.
        The pages, not the pool: a reference back would make a cycle that keeps the staging buffers (and
        the pool's pinned pages) alive after the pool is dropped, until Python's cycle GC runs."""
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
        self.page_size, self.spec, self.with_grads = page_size, spec, host["dk"] is not None
        self._host = host
        self.layers = list(range(spec.n_layers)) if layers is None else layers
        self._index = {layer: i for i, layer in enumerate(self.layers)}  # a layer's place in the host tensors
        self.device = device
        ps = page_size
        self.half_pages = -(-segment_tokens // ps)
        self._page = (ps, spec.n_kv_heads, spec.head_dim)
        self._v_page = (ps, spec.n_kv_heads, spec.v_dim)
        two = 2 * self.half_pages
        self.k = torch.empty((two, *self._page), dtype=spec.dtype, device=self.device)
        self.v = torch.empty((two, *self._v_page), dtype=spec.dtype, device=self.device)
        self.dk = self.dv = None
        if self.with_grads:
            self.dk = torch.empty((two, *self._page), dtype=spec.grad_dtype, device=self.device)
            self.dv = torch.empty((two, *self._v_page), dtype=spec.grad_dtype, device=self.device)
        # One chunk's K, V going out (two, alternating) and stored dK, dV coming in: sized at first use.
        self._out_k = self._out_v = self._in_dk = self._in_dv = None
        self.streams = _Streams(self.device)
        ev = self.streams.event
        self._loaded, self._consumed, self._written = [ev(), ev()], [ev(), ev()], [ev(), ev()]
        self._out_ready, self._out_done, self._out_turn = [ev(), ev()], [ev(), ev()], 0
        self._in_loaded, self._in_consumed, self._in_turn = [ev(), ev()], [ev(), ev()], 0
        # Per layer, the event of its last copy to the host (a chunk's K, V or a segment's dK, dV): a load reads
        # host pages of its own layer only, so it waits for that layer's writes, not for every layer's.
        self._layer_d2h: dict[int, torch.cuda.Event | None] = {}
        self.stats = CopyStats()
        self._step: dict | None = None

    @property
    def nbytes(self) -> int:
        """GPU bytes of the staging buffers."""
        bufs = (self.k, self.v, self.dk, self.dv, self._out_k, self._out_v, self._in_dk, self._in_dv)
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)

    # -- a step's lifetime (called by PagePool.allocate / free) -------------------------------------------
    def begin(self, table: PageTable, first_keys: dict[int, int] | None = None) -> None:
        """first_keys (packed documents): per chunk start, the first key its queries see; None: token 0."""
        batch, n_pages = table.slots.shape
        per_seq = self.half_pages // batch
        if per_seq < 1:
            raise ValueError(
                f"the offload staging holds {self.half_pages} pages per segment, fewer than the batch of "
                f"{batch} sequences: raise segment_tokens to at least {batch * self.page_size}"
            )
        p = torch.arange(n_pages, device=self.device)
        b = torch.arange(batch, device=self.device)[:, None]
        # Segment i holds pages [i * per_seq, (i + 1) * per_seq) of every sequence, in half i % 2.
        seg_slots = ((p // per_seq) % 2) * self.half_pages + b * per_seq + p % per_seq
        self._step = dict(
            table=table,
            slots=table.slots.tolist(),
            seg_tokens=per_seq * self.page_size,
            seg_view=LayerStore(self.k, self.v, self.dk, self.dv,
                                PageTable(seg_slots.int(), table.seq_len, table.page_size), self.page_size),
            first_keys=first_keys or {},
            # Per layer: the token from which its host gradient pages of the past hold this step's sums (written
            # by the backward passes so far, every one from its first segment to its chunk); below, an earlier
            # step's. Absent: no pass yet. Later passes read only below their chunk's end, where this holds.
            grads_from={},
            runs={},
            chunk_views={},
            # (direction, layer, start, chunk-grad turn) whose first segments are already on their way in.
            ahead=None,
        )

    def end(self, table: PageTable) -> None:
        """Wait for the step's copies (the host pages are then final) and close its statistics."""
        self.synchronize()
        self._step = None

    def synchronize(self) -> None:
        self.streams.finish(self.stats)

    def take_stats(self) -> CopyStats:
        """The traffic since the last call."""
        self.synchronize()
        stats, self.stats = self.stats, CopyStats()
        return stats

    # -- where tokens are ---------------------------------------------------------------------------------
    def _runs(self, b: int, t0: int, t1: int) -> list[tuple[int, int, int]]:
        """Tokens [t0, t1) of sequence b as runs of consecutive host slots: (host row, rows, offset from t0)."""
        key = (b, t0, t1)
        runs = self._step["runs"].get(key)
        if runs is None:
            ps, slots = self.page_size, self._step["slots"][b]
            runs, t = [], t0
            while t < t1:
                first = last = t // ps
                while (last + 1) * ps < t1 and slots[last + 1] == slots[last] + 1:
                    last += 1
                end = min((last + 1) * ps, t1)
                runs.append((slots[first] * ps + t % ps, end - t, t - t0))
                t = end
            self._step["runs"][key] = runs
        return runs

    def _segments(self, start: int, layer: int) -> list[tuple[int, int, int]]:
        """The past of the chunk at ``start`` that ``layer``'s queries see, as segments (index, lo, hi): segment i
        holds tokens [i * n, (i + 1) * n) of every sequence, in staging half i % 2. Those wholly before the
        chunk's first key (packed documents; a sliding-window layer's window) are left out, and the first one
        kept starts at the page of that key: a window of 1,024 tokens moves its 1,024, not its segment's 64K.
        Page starts, because staging and the sm_90 kernels address whole pages."""
        n = self._step["seg_tokens"]
        first_key = self._step["first_keys"].get(start, 0)
        if layer in self.spec.window_layers:
            first_key = max(first_key, start - self.spec.window + 1)
        if first_key >= start:
            return []
        first_page_key = first_key // self.page_size * self.page_size
        return [(i, max(i * n, first_page_key), min((i + 1) * n, start))
                for i in range(first_page_key // n, -(-start // n))]

    def _grads_from(self, layer: int) -> int:
        return self._step["grads_from"].get(layer, self._step["table"].seq_len)

    def _chunk_rows(self, t: int) -> int:
        """Staging rows per sequence for one chunk of t tokens starting anywhere in a page."""
        ps = self.page_size
        return (-(-t // ps) + 1) * ps

    def _chunk_view(self, start: int, t: int, turn: int) -> LayerStore:
        """A store whose dK, dV rows of tokens [start, start + t) are the incoming gradients staged in ``turn``."""
        view = self._step["chunk_views"].get((start, t, turn))
        if view is None:
            ps = self.page_size
            per_seq = self._chunk_rows(t) // ps
            table = self._step["table"]
            batch, n_pages = table.slots.shape
            p = torch.arange(n_pages, device=self.device)
            b = torch.arange(batch, device=self.device)[:, None]
            slots = (b * per_seq + (p - start // ps).clamp(0, per_seq - 1)).int()
            view = LayerStore(self.k, self.v, self._in_dk[turn], self._in_dv[turn], PageTable(slots, table.seq_len, ps), ps)
            self._step["chunk_views"][(start, t, turn)] = view
        return view

    def _ensure_chunk_buffers(self, batch: int, t: int) -> None:
        rows = batch * self._chunk_rows(t)
        if self._out_k is None or self._out_k.shape[1] < rows:
            spec = self.spec
            self._out_k = torch.empty((2, rows, *self._page[1:]), dtype=spec.dtype, device=self.device)
            self._out_v = torch.empty((2, rows, *self._v_page[1:]), dtype=spec.dtype, device=self.device)
            if self.with_grads:
                pages = (2, rows // self.page_size)  # two: one layer's in use, the next one's coming
                self._in_dk = torch.empty((*pages, *self._page), dtype=spec.grad_dtype, device=self.device)
                self._in_dv = torch.empty((*pages, *self._v_page), dtype=spec.grad_dtype, device=self.device)
            self._step["chunk_views"].clear()

    # -- copies -------------------------------------------------------------------------------------------
    def write(self, store: LayerStore, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Send a chunk's K (B, H_kv, T, D), V (B, H_kv, T, D_v) to the host pages of tokens [start, start + T)."""
        batch, _, t, _ = k.shape
        self._ensure_chunk_buffers(batch, t)
        turn = self._out_turn
        self._out_turn ^= 1
        rows = self._chunk_rows(t)
        self.streams.compute_waits(self._out_done[turn])  # this buffer's previous copy has left
        out_k = self._out_k[turn, : batch * rows].view(batch, rows, *self._page[1:])
        out_v = self._out_v[turn, : batch * rows].view(batch, rows, *self._v_page[1:])
        out_k[:, :t].copy_(k.transpose(1, 2))
        out_v[:, :t].copy_(v.transpose(1, 2))
        self.streams.record(self._out_ready[turn])
        host_k, host_v = _flat(store.k), _flat(store.v)
        with self.streams.on("d2h", [self._out_ready[turn]]):
            for b in range(batch):
                for row, n, off in self._runs(b, start, start + t):
                    host_k[row : row + n].copy_(out_k[b, off : off + n], non_blocking=True)
                    host_v[row : row + n].copy_(out_v[b, off : off + n], non_blocking=True)
        self.stats.d2h_bytes += (out_k[:, :t].numel() + out_v[:, :t].numel()) * out_k.element_size()
        self.streams.record(self._out_done[turn], "d2h")
        self._layer_d2h[store.layer] = self._out_done[turn]

    def _copy(self, host: torch.Tensor, staged: torch.Tensor, base: Callable[[int], int], lo: int, hi: int,
              to_host: bool) -> int:
        """Copy tokens [lo, hi) of every sequence between host pages and staging rows ``base(b)`` onwards, one
        copy per run of consecutive host slots; both tensors (pages, page_size, H, D). Returns the bytes."""
        host, staged = _flat(host), _flat(staged)
        nbytes = 0
        for b in range(len(self._step["slots"])):
            for row, n, off in self._runs(b, lo, hi):
                src, dst = host[row : row + n], staged[base(b) + off : base(b) + off + n]
                (src if to_host else dst).copy_(dst if to_host else src, non_blocking=True)
                nbytes += n * staged[0].numel() * staged.element_size()
        return nbytes

    def _segment_base(self, index: int, lo: int) -> Callable[[int], int]:
        """Staging row of token ``lo`` of sequence b in segment ``index`` (staging half index % 2)."""
        n = self._step["seg_tokens"]
        return lambda b: (index % 2) * self.half_pages * self.page_size + b * n + lo - index * n

    def _load(self, layer: int, index: int, lo: int, hi: int, grads: bool) -> None:
        """Bring segment ``index`` (tokens [lo, hi) of every sequence) of ``layer`` into half index % 2; with
        ``grads`` its dK, dV too, those of tokens no backward pass of this step has written yet as zeros."""
        half = index % 2
        written = max(lo, self._grads_from(layer)) if grads else hi  # dK, dV copied from here on
        nbytes = 0
        # The half's K, V and dK, dV are free once the compute has read them and, where this load overwrites its
        # dK, dV, once their write-back has read them; the host rows it reads once their layer's writes are done.
        waits = [self._consumed[half], self._layer_d2h.get(layer)] + ([self._written[half]] if grads else [])
        with self.streams.on("h2d", waits):
            if grads and written > lo:
                rows = slice(half * self.half_pages, (half + 1) * self.half_pages)
                self.dk[rows].zero_()
                self.dv[rows].zero_()
            for name, (t0, t1) in (("k", (lo, hi)), ("v", (lo, hi)), ("dk", (written, hi)), ("dv", (written, hi))):
                if t0 < t1:
                    nbytes += self._copy(self._host[name][self._index[layer]], getattr(self, name),
                                         self._segment_base(index, t0), t0, t1, to_host=False)
        self.stats.h2d_bytes += nbytes
        self.streams.record(self._loaded[half], "h2d")

    def _write_back(self, store: LayerStore, index: int, lo: int, hi: int) -> None:
        """Send this layer's dK, dV of segment ``index`` (half index % 2) back to the host."""
        half = index % 2
        per_seq = self._step["seg_tokens"]
        nbytes = 0
        with self.streams.on("d2h", [self._consumed[half]]):
            # Whole pages go back: rows past ``hi`` in the last page carry what was loaded.
            end = _page_end(hi, self.page_size, index * per_seq, per_seq)
            for host, staged in ((store.dk, self.dk), (store.dv, self.dv)):
                nbytes += self._copy(host, staged, self._segment_base(index, lo), lo, end, to_host=True)
        self.stats.d2h_bytes += nbytes
        self.streams.record(self._written[half], "d2h")
        self._layer_d2h[store.layer] = self._written[half]

    def _load_chunk_grads(self, layer: int, start: int, t: int) -> int:
        """Stage the gradient later chunks stored for tokens [start, start + t) of ``layer`` (zero where no
        backward pass has written one yet) into the next of the two incoming buffers; returns that buffer's turn."""
        batch = len(self._step["slots"])
        self._ensure_chunk_buffers(batch, t)
        turn = self._in_turn
        self._in_turn ^= 1
        rows = self._chunk_rows(t)
        first = (start // self.page_size) * self.page_size
        written = max(start, self._grads_from(layer))
        nbytes = 0
        with self.streams.on("h2d", [self._in_consumed[turn], self._layer_d2h.get(layer)]):
            if written > start:
                self._in_dk[turn].zero_()
                self._in_dv[turn].zero_()
            if written < start + t:
                for name in ("dk", "dv"):
                    nbytes += self._copy(self._host[name][self._index[layer]], getattr(self, "_in_" + name)[turn],
                                         lambda b: b * rows + (written - first), written, start + t, to_host=False)
        self.stats.h2d_bytes += nbytes
        self.streams.record(self._in_loaded[turn], "h2d")
        return turn

    def _first_loads(self, direction: str, layer: int, start: int, t: int) -> int | None:
        """Issue the loads a call over ``layer`` starts with (its first two segments, and backward the chunk's
        stored gradients), unless the previous call already sent them ahead; returns the chunk-grad turn."""
        ahead, self._step["ahead"] = self._step["ahead"], None
        if ahead is not None and ahead[:3] == (direction, layer, start):
            return ahead[3]
        grads = direction == "backward"
        for index, lo, hi in self._segments(start, layer)[:2]:
            self._load(layer, index, lo, hi, grads)
        return self._load_chunk_grads(layer, start, t) if grads else None

    def _send_ahead(self, direction: str, layer: int, start: int, t: int) -> None:
        """Start the next streamed layer's first loads now, so that they run behind the rest of this layer's
        work (its projections and MLP, and the layers between whose pages stay on the GPU): forward goes up the
        layers, backward down. A guess that turns out wrong (stage 1 ends a chunk at the last layer's K/V
        store, before its attention) only costs the copies."""
        i = self._index[layer] + (1 if direction == "forward" else -1)
        if not 0 <= i < len(self.layers):
            return
        nxt = self.layers[i]
        turn = self._first_loads(direction, nxt, start, t)
        self._step["ahead"] = (direction, nxt, start, turn)

    # -- streamed attention (called by lightning_oomb.core.attention for host stores) ---------------------
    def forward(self, backend, q, k, v, store: LayerStore, start: int, scale: float, doc_start=None, softcap=None):
        """``backend.attention_forward`` over a host-resident past: (out like q, lse (B, H_q, T) fp32)."""
        segments = self._segments(start, store.layer)
        view = self._step["seg_view"]
        self._first_loads("forward", store.layer, start, q.shape[2])
        state = backend.forward_state(q, k, v, view, 0, 0, scale, chunk=True, doc_start=doc_start, chunk_start=start,
                                      softcap=softcap)
        for i, (index, lo, hi) in enumerate(segments):
            half = index % 2
            self.streams.compute_waits(self._loaded[half])
            backend.forward_state(q, k, v, view, lo, hi, scale, chunk=False, state=state, doc_start=doc_start,
                                  softcap=softcap)
            self.streams.record(self._consumed[half])
            if i + 2 < len(segments):
                self._load(store.layer, *segments[i + 2], grads=False)
        self._send_ahead("forward", store.layer, start, q.shape[2])
        out, lse = state
        return out.to(q.dtype), lse

    def backward(self, backend, dout, q, k, v, out, lse, store: LayerStore, start: int, scale: float,
                 doc_start=None, softcap=None):
        """``backend.attention_backward`` over a host-resident past: (dq, dk, dv) of the chunk; the past's
        dK, dV are added into the host gradient pages."""
        segments = self._segments(start, store.layer)
        view = self._step["seg_view"]
        t = q.shape[2]
        turn = self._first_loads("backward", store.layer, start, t)
        delta = backend.backward_delta(out, dout)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        self.streams.compute_waits(self._in_loaded[turn])
        chunk_view = self._chunk_view(start, t, turn)
        dk, dv = backend.backward_part(dout, q, k, v, lse, delta, chunk_view, 0, 0, start, scale, True, dq, doc_start,
                                       softcap=softcap)
        self.streams.record(self._in_consumed[turn])
        for i, (index, lo, hi) in enumerate(segments):
            half = index % 2
            self.streams.compute_waits(self._loaded[half])
            backend.backward_part(dout, q, k, v, lse, delta, view, lo, hi, start, scale, False, dq, doc_start,
                                  softcap=softcap)
            self.streams.record(self._consumed[half])
            self._write_back(store, index, lo, hi)
            if i + 2 < len(segments):
                self._load(store.layer, *segments[i + 2], grads=True)
        # This pass wrote back its segments, [first lo, start): later passes read below that, their chunks' end.
        first_lo = segments[0][1] if segments else start
        self._step["grads_from"][store.layer] = min(self._grads_from(store.layer), first_lo)
        self._send_ahead("backward", store.layer, start, t)
        return dq.to(q.dtype), dk, dv


def _page_end(hi: int, page_size: int, segment_start: int, per_seq: int) -> int:
    """The end of the page holding token hi - 1, within the segment that starts at ``segment_start``."""
    return min(-(-hi // page_size) * page_size, segment_start + per_seq)
