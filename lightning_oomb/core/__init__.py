"""The engine: no Lightning import; usable from a plain PyTorch loop."""

from ..kernels.page_table import PageTable, StoreSpec
from .config import ChunkConfig, SparseConfig
from .pages import PagePool
from .schedule import ChunkedSequence, eval_loss, train_step

__all__ = ["ChunkConfig", "ChunkedSequence", "PagePool", "PageTable", "SparseConfig", "StoreSpec", "eval_loss", "train_step"]
