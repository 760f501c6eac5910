"""Sizes and counts as people write them, read and printed the same way everywhere: token counts (``32K``,
``1M``: K = 1024, M = 1024 * 1024), memory sizes with their unit (``141GB`` = 141e9 bytes, ``80GiB`` =
80 * 2**30), parameter counts for people (``7.62B``)."""

from __future__ import annotations

import argparse
import re

GIB = 1 << 30

_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_BYTE_UNITS = {
    "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def _split(text: str, what: str) -> tuple[float, str]:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match:
        raise ValueError(f"cannot read {what} {text!r}")
    return float(match.group(1)), match.group(2).lower()


def parse_tokens(text: str | int) -> int:
    """A token count: ``4096``, ``32K``/``32k`` (x 1024), ``1M`` (x 1024**2), ``1.5M``."""
    if isinstance(text, int):
        return text
    value, unit = _split(text, "a token count")
    if unit not in _TOKEN_UNITS:
        raise ValueError(f"cannot read the token count {text!r}: use a number with K (x1024) or M (x1024^2)")
    tokens = value * _TOKEN_UNITS[unit]
    if tokens != int(tokens) or tokens < 1:
        raise ValueError(f"the token count {text!r} is not a whole number >= 1")
    return int(tokens)


def parse_bytes(text: str | int) -> int:
    """A memory size with its unit: ``141GB`` = 141e9 (decimal K/M/G/T[B]), ``80GiB`` = 80 * 2**30 (binary
    KiB..TiB), ``1024B``. A number alone is refused (141 bytes is never what was meant); an int is bytes."""
    if isinstance(text, int):
        return text
    try:
        value, unit = _split(text, "a memory size")
    except ValueError as e:
        raise ValueError(f"{e}: give a number and its unit, e.g. 140GiB, 141GB, 512MiB") from None
    if unit not in _BYTE_UNITS:
        raise ValueError(f"cannot read the memory size {text!r}: give its unit, e.g. 140GiB, 141GB, 512MiB")
    return int(value * _BYTE_UNITS[unit])


def argparse_type(parse, many: bool = False):
    """An argparse ``type`` from a parser of this module (``parse_tokens``, ``parse_bytes``): its ValueError
    becomes argparse's usage error; ``many``: a comma-separated list of such values, as a tuple."""
    def convert(text: str):
        try:
            return tuple(parse(x) for x in text.split(",") if x.strip()) if many else parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert


def human_tokens(n: int) -> str:
    """A token count as ``parse_tokens`` reads it: 65536 -> 64K, 1048576 -> 1M, 1536 -> 1.5K, 1000 -> 1000."""
    for unit in ("M", "K"):
        size = _TOKEN_UNITS[unit.lower()]
        if n >= size and (n * 2) % size == 0:
            return f"{n / size:g}{unit}"
    return str(n)


def human_count(n: float) -> str:
    """7.62B, 10.1M, 22.1K: a parameter count for people."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"
