"""Access from the GPU to pages in pinned host memory, so that nothing inside a step waits for the host.

``add_staged_pages`` adds a sparse chunk's staged share of its selected pages' gradients into a host
gradient layer's pages, from persistent programs on a side stream (core.pages.HostGradStaging).
``read_rows`` and ``write_rows`` read and write rows through indices on the GPU (a torch gather or scatter
would need them on the host); ``copy_pages`` copies pages between slots (stage 2's moves into dead pages,
the gathers of a host K/V layer's selected pages). docs/architecture.md, "Host gradient pages for sparse
steps" and "Host K/V pages for sparse steps".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import on_device_of


@triton.jit
def _staged_rows(src_page, slot, hk, r0, rows, offs_r, sd_page, sd_off, sd_h, PAGE_SIZE: tl.constexpr,
                 WIDTH: tl.constexpr, W_PAD: tl.constexpr):
    """(mask, staging offsets, page offsets) of rows [r0, r0 + BLOCK_R) of a (PAGE_SIZE, WIDTH) staged page."""
    offs_d = tl.arange(0, W_PAD)
    mask = ((r0 + offs_r) < rows)[:, None] & (offs_d < WIDTH)[None, :]
    s_ptrs = src_page * PAGE_SIZE * WIDTH + (r0 + offs_r)[:, None] * WIDTH + offs_d[None, :]
    d_ptrs = slot * sd_page + (r0 + offs_r)[:, None] * sd_off + hk * sd_h + offs_d[None, :]
    return mask, s_ptrs, d_ptrs


@triton.jit
def _add_staged_kernel(DST_K, DST_V, SRC_K, SRC_V, SLOTS, PAGES, COUNTS, sd_page, sd_off, sd_h, sdv_page, sdv_off,
                       sdv_h, ss_b, ss_p, n_items, n_pages, staged_pages, start, H_KV: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, V_DIM: tl.constexpr,
                       V_PAD: tl.constexpr, V_SAME: tl.constexpr, BLOCK_R: tl.constexpr):
    # Persistent: item i = (sequence, KV head, i-th distinct page) of the chunk's selection. dK rows are HEAD_DIM
    # wide, dV rows V_DIM (V_SAME: dV's pages have dK's width and strides, and take its offsets).
    offs_r = tl.arange(0, BLOCK_R)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        bh = item // n_pages
        idx = item % n_pages
        hk = bh % H_KV
        count = tl.load(COUNTS + item)
        page = tl.load(PAGES + item)
        slot = tl.load(SLOTS + (bh // H_KV).to(tl.int64) * ss_b + page * ss_p).to(tl.int64)
        rows = tl.where(count > 0, tl.minimum(PAGE_SIZE, start - page * PAGE_SIZE), 0)
        src_page = bh.to(tl.int64) * staged_pages + idx
        for r0 in range(0, rows, BLOCK_R):
            mask, s_ptrs, d_ptrs = _staged_rows(src_page, slot, hk, r0, rows, offs_r, sd_page, sd_off, sd_h,
                                                PAGE_SIZE, HEAD_DIM, D_PAD)
            if V_SAME:
                mask_v, s_ptrs_v, d_ptrs_v = mask, s_ptrs, d_ptrs
            else:
                mask_v, s_ptrs_v, d_ptrs_v = _staged_rows(src_page, slot, hk, r0, rows, offs_r, sdv_page, sdv_off,
                                                          sdv_h, PAGE_SIZE, V_DIM, V_PAD)
            # stored + share in float32, rounded once: the page kernel's sum for GPU-resident pages.
            dk = tl.load(DST_K + d_ptrs, mask=mask).to(tl.float32) + tl.load(SRC_K + s_ptrs, mask=mask)
            dv = tl.load(DST_V + d_ptrs_v, mask=mask_v).to(tl.float32) + tl.load(SRC_V + s_ptrs_v, mask=mask_v)
            tl.store(DST_K + d_ptrs, dk.to(DST_K.dtype.element_ty), mask=mask)
            tl.store(DST_V + d_ptrs_v, dv.to(DST_V.dtype.element_ty), mask=mask_v)


@triton.jit
def _copy_pages_kernel(SRC, SRC_SLOTS, DST, DST_SLOTS, n, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        src_slot = tl.load(SRC_SLOTS + i).to(tl.int64)
        if src_slot >= 0:
            src = SRC + src_slot * PAGE_ELEMS
            dst = DST + tl.load(DST_SLOTS + i).to(tl.int64) * PAGE_ELEMS
            for j in range(0, PAGE_ELEMS, BLOCK):
                mask = j + offs < PAGE_ELEMS
                tl.store(dst + j + offs, tl.load(src + j + offs, mask=mask), mask=mask)


@triton.jit
def _write_rows_kernel(SRC, ROWS, DST, ROW_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    for j in range(0, ROW_ELEMS, BLOCK):
        mask = j + offs < ROW_ELEMS
        tl.store(DST + row * ROW_ELEMS + j + offs, tl.load(SRC + i * ROW_ELEMS + j + offs, mask=mask), mask=mask)


@triton.jit
def _read_rows_kernel(SRC, ROWS, DST, ROW_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    for j in range(0, ROW_ELEMS, BLOCK):
        mask = j + offs < ROW_ELEMS
        tl.store(DST + i * ROW_ELEMS + j + offs, tl.load(SRC + row * ROW_ELEMS + j + offs, mask=mask), mask=mask)


def copy_pages(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor,
               programs: int | None = None) -> None:
    """dst[dst_slots[i]] = src[src_slots[i]] on the slots' device: src, dst (n_pages, *page) with contiguous
    pages of one shape and dtype, either of them pinned host memory mapped for that CUDA device (or, in
    Triton's interpreter, CPU tensors); src_slots, dst_slots (n,) int; entries whose source slot is negative
    copy nothing (a fixed-length list made on the GPU: no host wait for how many pages travel).
    programs: persistent programs sharing the entries (a copy beside compute; ``GATHER_AHEAD_PROGRAMS``);
    None: one per entry (a copy the compute waits for)."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_pages needs contiguous pages of one shape and dtype on both sides")
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"copy_pages needs one destination per source page, got {src_slots.shape} and {dst_slots.shape}")
    if src_slots.numel() == 0:
        return
    page_elems, n = src[0].numel(), src_slots.numel()
    with on_device_of(src_slots):
        _copy_pages_kernel[(min(programs or n, n),)](
            src, src_slots.contiguous(), dst, dst_slots.contiguous(), n, PAGE_ELEMS=page_elems,
            BLOCK=min(4096, triton.next_power_of_2(page_elems)))


def write_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] = src`` on ``rows``' device: dst (n_rows, *row) with contiguous rows, in pinned host memory
    mapped for that CUDA device (or, in Triton's interpreter, a CPU tensor); rows int (any shape); src
    (*rows.shape, *row) in dst's dtype."""
    if not dst.is_contiguous() or src.dtype != dst.dtype or src.shape != (*rows.shape, *dst.shape[1:]):
        raise ValueError("write_rows needs contiguous rows of dst's dtype and one source row per row index")
    flat = rows.reshape(-1)
    if flat.numel():
        row_elems = dst[0].numel()
        with on_device_of(rows):
            block = triton.next_power_of_2(min(row_elems, 1024))
            _write_rows_kernel[(flat.numel(),)](src.contiguous(), flat, dst, ROW_ELEMS=row_elems, BLOCK=block)


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
        with on_device_of(rows):
            block = triton.next_power_of_2(min(row_elems, 1024))
            _read_rows_kernel[(flat.numel(),)](src, flat, out, ROW_ELEMS=row_elems, BLOCK=block)
    return out


@dataclass(frozen=True)
class AddLaunch:
    """How ``add_staged_pages`` runs: persistent programs, rows of a page per loop step, warps per program.
    The programs hold their SMs while they wait on the bus, so fewer programs with more bytes in flight each
    leave more of the GPU to the layers computed meanwhile (bench.sparse_kernels --add-launch)."""

    programs: int = 64
    block_rows: int = 32
    num_warps: int = 4

    def __post_init__(self):
        pow2 = lambda n: n >= 1 and n & (n - 1) == 0  # noqa: E731
        if self.programs < 1 or not pow2(self.block_rows) or not pow2(self.num_warps):
            raise ValueError(f"AddLaunch needs programs >= 1 and powers of two for block_rows and num_warps, got {self}")

    @classmethod
    def parse(cls, text: str) -> "AddLaunch":
        """From "PROGRAMSxROWSxWARPS", e.g. "64x32x4"."""
        try:
            programs, rows, warps = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"an add launch is PROGRAMSxROWSxWARPS, e.g. 64x32x4; got {text!r}") from None
        return cls(programs, rows, warps)


ADD_LAUNCH = AddLaunch()
# Persistent programs of a host K/V gather that runs ahead on a side stream (core.pages.HostKVStaging): for
# the reason AddLaunch gives, a few leave more of the GPU to the compute beside them than one per page.
GATHER_AHEAD_PROGRAMS = 16


@contextmanager
def side_launches(add: AddLaunch, gather_ahead_programs: int) -> Iterator[None]:
    """``ADD_LAUNCH`` and ``GATHER_AHEAD_PROGRAMS`` are these inside the block (benchmarks compare launches),
    as before after it."""
    global ADD_LAUNCH, GATHER_AHEAD_PROGRAMS
    before = ADD_LAUNCH, GATHER_AHEAD_PROGRAMS
    ADD_LAUNCH, GATHER_AHEAD_PROGRAMS = add, gather_ahead_programs
    try:
        yield
    finally:
        ADD_LAUNCH, GATHER_AHEAD_PROGRAMS = before


def add_staged_pages(
    dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor, slots: torch.Tensor,
    pages: torch.Tensor, counts: torch.Tensor, start: int, launch: AddLaunch | None = None,
) -> None:
    """dst[slot of page, :rows, h] += src[b, h, i, :rows] for each distinct selected page i of (sequence b, KV head h).

    dst_k, dst_v: one layer's gradient pages (num_pages, page_size, H_kv, D or D_v), pinned host memory mapped for
    the CUDA device the rest is on (in Triton's interpreter, CPU tensors); src_k, src_v: (B, H_kv, NP', page_size, D
    or D_v) float32 staging, contiguous; slots (B, n_pages) int32 page table; pages, counts (B, H_kv, NP) int32 with
    NP <= NP' (``sparse_attention.invert_selection``: pages with count 0 are skipped); start: first token of the
    chunk (rows of a past page end there); launch: None for ``ADD_LAUNCH``.
    """
    launch = launch or ADD_LAUNCH
    b, h, n_pages = pages.shape
    d, dv = dst_k.shape[-1], dst_v.shape[-1]
    if (dst_k.stride(-1) != 1 or dst_v.stride(-1) != 1 or src_k.shape[-1] != d or src_v.shape[-1] != dv
            or src_k.shape[2] != src_v.shape[2] or not (src_k.is_contiguous() and src_v.is_contiguous())):
        raise ValueError("add_staged_pages needs contiguous rows of D (D_v) in dst_k and src_k (dst_v and src_v), "
                         "contiguous staging of one page count")
    if b * h * n_pages == 0:
        return
    pages, counts = pages.contiguous(), counts.contiguous()
    with on_device_of(pages):
        _add_staged_kernel[(min(launch.programs, b * h * n_pages),)](
            dst_k, dst_v, src_k, src_v, slots, pages, counts, dst_k.stride(0), dst_k.stride(1), dst_k.stride(2),
            dst_v.stride(0), dst_v.stride(1), dst_v.stride(2),
            slots.stride(0), slots.stride(1), b * h * n_pages, n_pages, src_k.shape[2], start,
            H_KV=h, PAGE_SIZE=dst_k.shape[1], HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), V_DIM=dv,
            V_PAD=triton.next_power_of_2(dv), V_SAME=dv == d and dst_v.stride() == dst_k.stride(),
            BLOCK_R=min(launch.block_rows, triton.next_power_of_2(dst_k.shape[1])), num_warps=launch.num_warps,
        )
