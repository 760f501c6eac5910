"""Attention outputs of a step's first chunks, kept by stage 1 in pinned host memory for stage 2.

Where the GPU has no room for them (a 1M-token step), stage 1 copies each layer's (out, lse) of the first
``n_chunks`` chunks out on a side stream, and stage 2, which reaches those chunks last, copies each back one
layer ahead of its use. One side stream carries both directions, so a step's copies back follow its copies
out; the compute stream waits only for the layer it is about to use. On a CPU the copies run where issued.
"""

from __future__ import annotations

import torch

from .host_memory import HostLedger, pinned_empty

Key = tuple[int, int]  # (chunk index, layer)


class HostKeptAttention:
    """Pinned (out, lse) of ``n_chunks`` chunks x ``n_layers`` layers, each shaped like ``out`` (B, H_q, T, D)
    and ``lse`` (B, H_q, T) float32 of one attention call; reused by the steps of a run (``PagePool``), counted
    in its ``ledger``."""

    def __init__(self, n_chunks: int, n_layers: int, out: torch.Tensor, lse: torch.Tensor,
                 ledger: HostLedger | None = None):
        self.device = out.device
        cuda = self.device.type == "cuda"
        what = "attention outputs kept from stage 1"
        self.out = pinned_empty((n_chunks, n_layers, *out.shape), out.dtype, cuda, ledger, what)
        self.lse = pinned_empty((n_chunks, n_layers, *lse.shape), lse.dtype, cuda, ledger, what)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.saved: set[Key] = set()
        self._ahead: dict[Key, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = {}

    def holds(self, n_chunks: int, out: torch.Tensor, lse: torch.Tensor) -> bool:
        """Whether this buffer serves a step keeping ``n_chunks`` chunks of outputs like ``out``, ``lse``."""
        return (self.out.shape[0] >= n_chunks and self.out.shape[2:] == out.shape and self.out.dtype == out.dtype
                and self.lse.shape[2:] == lse.shape and self.device == out.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.out, self.lse))

    def begin(self) -> None:
        """A new step: nothing saved, nothing on its way back."""
        self.saved.clear()
        self._ahead.clear()

    def save(self, chunk: int, layer: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Stage 1: copy one attention call's ``out``, ``lse`` to the host, behind the work that made them."""
        self.saved.add((chunk, layer))
        self._copy(((self.out[chunk, layer], out), (self.lse[chunk, layer], lse)))
        if self.stream is not None:
            for t in (out, lse):
                t.record_stream(self.stream)  # not reused by the compute stream before the copy has read it

    def fetch(self, chunk: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 2: (out, lse) of a saved call on the device, ready for the compute stream; starts bringing
        in the next saved call stage 2 will ask for."""
        out, lse, done = self._ahead.pop((chunk, layer), None) or self._bring(chunk, layer)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        following = (chunk, layer + 1) if (chunk, layer + 1) in self.saved else (chunk - 1, 0)
        if following in self.saved and following not in self._ahead:
            self._ahead[following] = self._bring(*following)
        return out, lse

    def _bring(self, chunk: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        # Allocated on the compute stream, which uses and frees them.
        out = torch.empty(self.out.shape[2:], dtype=self.out.dtype, device=self.device)
        lse = torch.empty(self.lse.shape[2:], dtype=self.lse.dtype, device=self.device)
        return out, lse, self._copy(((out, self.out[chunk, layer]), (lse, self.lse[chunk, layer])))

    def _copy(self, pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> torch.cuda.Event | None:
        """dst.copy_(src) for each (dst, src) on the side stream, after the work already queued on the compute
        stream (which made the sources, or may still use the destinations' memory); the copies' event."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done
