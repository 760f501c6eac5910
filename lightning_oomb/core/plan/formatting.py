"""How a plan writes bytes, dtypes and seconds."""

from __future__ import annotations

import torch

from ..units import GIB


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def bytes_name(itemsize: int) -> str:
    """The plan's name of a float of ``itemsize`` bytes (a DtypeProfile's entries)."""
    return "bf16" if itemsize == 2 else "fp32"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"
