"""Access from the GPU to pages that live in pinned host memory.

The KV-gradient pages of a pool's host layers (``PagePool(host_grad_layers=N)``) are mapped into the GPU's
address space: the sparse kernels add into the pages a chunk selected in place. Two more accesses need
the GPU, not the CPU, so that nothing waits for the host inside a step: zeroing the pages a batch takes
(a torch op would zero them on the CPU, synchronously), and reading a chunk's own stored gradient rows
(a torch gather would need the row indices on the host).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_attention import _device_ctx


@triton.jit
def _zero_pages_kernel(X, SLOTS, layer_stride, page_stride, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.load(SLOTS + tl.program_id(0)).to(tl.int64)
    page = X + tl.program_id(1).to(tl.int64) * layer_stride + slot * page_stride
    offs = tl.arange(0, BLOCK)
    for i in range(0, PAGE_ELEMS, BLOCK):
        tl.store(page + i + offs, tl.zeros([BLOCK], X.dtype.element_ty), mask=i + offs < PAGE_ELEMS)


@triton.jit
def _read_rows_kernel(SRC, ROWS, DST, ROW_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    for j in range(0, ROW_ELEMS, BLOCK):
        mask = j + offs < ROW_ELEMS
        tl.store(DST + i * ROW_ELEMS + j + offs, tl.load(SRC + row * ROW_ELEMS + j + offs, mask=mask), mask=mask)


def zero_pages(pages: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero ``pages[:, slots]`` of a (n_layers, num_pages, ...) tensor whose pages are contiguous.

    pages: pinned host memory mapped for the CUDA device ``slots`` (int, any shape) is on (or, in Triton's
    interpreter, any CPU tensor).
    """
    if pages.numel() == 0 or slots.numel() == 0:
        return
    page_elems = pages[0, 0].numel()
    if pages.stride(1) != page_elems or not pages[0, 0].is_contiguous():
        raise ValueError("zero_pages needs pages stored contiguously, one after another")
    flat = slots.reshape(-1).to(torch.int32)
    with _device_ctx(slots):
        _zero_pages_kernel[(flat.numel(), pages.shape[0])](
            pages, flat, pages.stride(0), pages.stride(1), PAGE_ELEMS=page_elems, BLOCK=1024
        )


def read_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``src[rows]`` on ``rows``' device: src (n_rows, *row) with contiguous rows, in pinned host memory
    mapped for that CUDA device (or, in Triton's interpreter, a CPU tensor); rows int (any shape).
    Returns (*rows.shape, *row) in src's dtype."""
    row_elems = src[0].numel()
    if not src.is_contiguous():
        raise ValueError("read_rows needs contiguous rows")
    out = torch.empty((*rows.shape, *src.shape[1:]), dtype=src.dtype, device=rows.device)
    flat = rows.reshape(-1)
    if flat.numel():
        with _device_ctx(rows):
            block = triton.next_power_of_2(min(row_elems, 1024))
            _read_rows_kernel[(flat.numel(),)](src, flat, out, ROW_ELEMS=row_elems, BLOCK=block)
    return out
