"""The engine: no Lightning import; usable from a plain PyTorch loop."""

from ..kernels.page_table import PageTable, StoreSpec
from .pages import PagePool
from .schedule import ChunkConfig, ChunkedSequence, eval_loss, train_step
from .sparse import SparseConfig

__all__ = ["ChunkConfig", "ChunkedSequence", "PagePool", "PageTable", "SparseConfig", "StoreSpec", "eval_loss", "train_step"]
