"""The engine: no Lightning import; usable from a plain PyTorch loop."""

from .pages import PagePool, PageTable, StoreSpec
from .schedule import ChunkConfig, ChunkedSequence, eval_loss, train_step
from .sparse import SparseConfig

__all__ = ["ChunkConfig", "ChunkedSequence", "PagePool", "PageTable", "SparseConfig", "StoreSpec", "eval_loss", "train_step"]
