"""What a ``lightning-oomb bench`` sweep runs: the model, the context lengths, the modes and their settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.config import ChunkConfig, SparseConfig, option_defaults
from ..core.plan.assumptions import DEFAULT_MATMUL_TFLOPS

STEP = option_defaults(ChunkConfig)
SPARSE = option_defaults(SparseConfig)


@dataclass(frozen=True)
class BenchConfig:
    """What the sweep runs. Lengths are tokens per sequence; times in seconds. The step options' defaults are
    ChunkConfig's and SparseConfig's."""

    model: str = "qwen2.5-7b"
    lengths: tuple[int, ...] = (16384, 32768, 65536, 131072)
    modes: tuple[str, ...] = ("baseline", "oomb")
    chunk_size: int = STEP["chunk_size"]
    page_size: int = STEP["page_size"]
    batch: int = 1
    lora_rank: int = 0
    repeats: int = 3
    warmup: int = 1
    attention: str = STEP["attention"]
    checkpoint_layers: bool = STEP["checkpoint_layers"]
    grad_dtype: str = STEP["grad_dtype"]
    budget_pages: int = SPARSE["budget_pages"]
    # sparse: one page selection per query tile (True), per chunk (False), or per chunk in the modes whose pages
    # live in host memory and per tile in the others (None), as SparseConfig.per_query_tile.
    per_query_tile: bool | None = SPARSE["per_query_tile"]
    # sparse with host gradient layers: how the staged gradients are added into them ("PROGRAMSxROWSxWARPS",
    # kernels.host_pages.AddLaunch); "" keeps host_pages.ADD_LAUNCH.
    add_launch: str = ""
    # sparse with host K/V layers: persistent programs of the gathers that run ahead on a side stream;
    # None keeps host_pages.GATHER_AHEAD_PROGRAMS.
    gather_programs: int | None = None
    matmul_tflops: float = DEFAULT_MATMUL_TFLOPS
    # Packed documents: each sequence made of documents of this many tokens; None: one per sequence.
    document_length: int | None = None
    out: Path = Path("bench-results")
    device: str = "auto"
    seed: int = 0
