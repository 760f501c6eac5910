"""How much of a parameter one optimizer update takes at a time (torchao_optim.SlicedStep), for the update and
for the plan, which counts that slice's float32 working set."""

from __future__ import annotations

import math

from torch import Tensor

# Elements of one parameter that one update of the torchao choices takes at a time: its float32 working set is
# at most 12 bytes x this (768 MiB), whatever the parameter's size.
SLICE_ELEMENTS = 1 << 26


def row_slices(p: Tensor, block_size: int) -> list[slice | None]:
    """Ranges of ``p``'s rows (dim 0) of at most SLICE_ELEMENTS elements each (``[None]``: the whole of a
    smaller or 0-d ``p``), each a whole number of ``block_size``-element blocks, as torchao slices 8-bit state."""
    if p.dim() == 0 or p.numel() <= SLICE_ELEMENTS:
        return [None]
    row = p[0].numel()
    block = block_size if isinstance(block_size, int) else 1  # torchao's plain states: no blocks
    align = block // math.gcd(row, block)  # rows whose elements fill whole blocks
    rows = max(align, SLICE_ELEMENTS // row // align * align)
    return [slice(start, min(start + rows, p.shape[0])) for start in range(0, p.shape[0], rows)]
