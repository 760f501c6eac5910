"""The command-line flags of the step options, one spelling and the declared default each (``ChunkConfig``,
``SparseConfig``): ``lightning-oomb plan``, ``lightning-oomb bench`` and the ``lightning_oomb.bench`` tools all
add them from here (tests/test_options.py holds them to it)."""

from __future__ import annotations

import argparse

from .core.config import OFFLOADS, ChunkConfig, SparseConfig, option_defaults
from .core.units import argparse_type, parse_tokens

STEP = option_defaults(ChunkConfig)
SPARSE = option_defaults(SparseConfig)
GRAD_DTYPES = ("float32", "bfloat16")


class OneLineParser(argparse.ArgumentParser):
    """The parser of ``lightning-oomb plan`` and ``bench``: an error is one line (the usage block is for
    --help), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def add_chunk(parser: argparse.ArgumentParser, help: str = "tokens per chunk") -> None:
    """``--chunk TOKENS`` (ChunkConfig.chunk_size; K = 1024, as in 4K)."""
    parser.add_argument("--chunk", type=argparse_type(parse_tokens), default=STEP["chunk_size"],
                        help=f"{help} (default {STEP['chunk_size']})")


def add_page_size(parser: argparse.ArgumentParser, help: str = "tokens per KV page",
                  default: int = STEP["page_size"]) -> None:
    """``--page-size TOKENS`` (ChunkConfig.page_size); ``default`` for a tool whose own experiment differs."""
    parser.add_argument("--page-size", type=int, default=default, help=f"{help} (default {default})")


def add_grad_dtype(parser: argparse.ArgumentParser, help: str = "dtype of the KV-gradient pages") -> None:
    """``--grad-dtype {float32,bfloat16}`` (ChunkConfig.grad_dtype)."""
    parser.add_argument("--grad-dtype", choices=GRAD_DTYPES, default=STEP["grad_dtype"],
                        help=f"{help} (default {STEP['grad_dtype']})")


def add_offload(parser: argparse.ArgumentParser, help: str = "where the K/V and KV-gradient pages live",
                default: str = STEP["offload"]) -> None:
    """``--offload {auto,gpu,host}`` (ChunkConfig.offload); ``default`` for a tool made to trace one of them."""
    parser.add_argument("--offload", choices=OFFLOADS, default=default, help=f"{help} (default {default})")


def add_budget_pages(parser: argparse.ArgumentParser, help: str = "sparse: past pages per query tile",
                     default: int = SPARSE["budget_pages"]) -> None:
    """``--budget-pages PAGES`` (SparseConfig.budget_pages); default 0 where 0 means dense attention."""
    parser.add_argument("--budget-pages", type=int, default=default, metavar="PAGES",
                        help=f"{help} (default {default})")


def add_selection(parser: argparse.ArgumentParser) -> None:
    """``--selection {auto,tile,chunk}`` (SparseConfig.per_query_tile None, True or False)."""
    default = SELECTIONS[SPARSE["per_query_tile"]]
    parser.add_argument("--selection", choices=tuple(SELECTIONS.values()), default=default,
                        help="sparse: one page selection per query tile or per chunk, which bounds the pages a host "
                        "K/V layer gathers (SparseConfig.per_query_tile); auto: per chunk with --offload host, per "
                        f"tile otherwise (default {default})")


# --selection's choices by the SparseConfig.per_query_tile each gives.
SELECTIONS = {None: "auto", True: "tile", False: "chunk"}


def per_query_tile(selection: str) -> bool | None:
    """SparseConfig.per_query_tile of a ``--selection`` choice."""
    return {name: value for value, name in SELECTIONS.items()}[selection]
