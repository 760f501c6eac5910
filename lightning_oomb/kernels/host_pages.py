"""Zeroing pages that live in pinned host memory, from the GPU.

The KV-gradient pages of a pool's host layers (``PagePool(host_grad_layers=N)``) are read and added into
in place by the sparse kernels through their host-mapped address. The pages a batch takes must start at
zero; a torch op would zero them on the CPU, synchronously and at one thread's memset speed, so this kernel
writes the zeros from the GPU across the bus instead, in stream order with the step that follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _zero_pages_kernel(X, SLOTS, layer_stride, page_stride, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.load(SLOTS + tl.program_id(0)).to(tl.int64)
    page = X + tl.program_id(1).to(tl.int64) * layer_stride + slot * page_stride
    offs = tl.arange(0, BLOCK)
    for i in range(0, PAGE_ELEMS, BLOCK):
        tl.store(page + i + offs, tl.zeros([BLOCK], X.dtype.element_ty), mask=i + offs < PAGE_ELEMS)


def zero_pages(pages: torch.Tensor, slots: torch.Tensor) -> None:
    """Zero ``pages[:, slots]`` of a (n_layers, num_pages, ...) tensor whose pages are contiguous.

    pages: pinned host memory, mapped into the address space of the CUDA device ``slots`` (int, any shape)
    is on; or any CPU tensor with CPU ``slots`` (then a torch op does it).
    """
    if not slots.is_cuda:
        pages[:, slots.view(-1).long()] = 0
        return
    page_elems = pages[0, 0].numel()
    if not pages[0, 0].is_contiguous() or pages.stride(1) != page_elems:
        raise ValueError("zero_pages needs pages stored contiguously, one after another")
    flat = slots.reshape(-1).to(torch.int32)
    if flat.numel() == 0 or pages.shape[0] == 0:
        return
    with torch.cuda.device(slots.device):
        _zero_pages_kernel[(flat.numel(), pages.shape[0])](
            pages, flat, pages.stride(0), pages.stride(1), PAGE_ELEMS=page_elems, BLOCK=1024
        )
