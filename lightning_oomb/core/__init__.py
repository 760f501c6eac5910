"""The engine: no Lightning import; usable from a plain PyTorch loop. The step and the page pool load on first
use (they import transformers); the configs and the planner do not need them."""

from .config import ChunkConfig, SparseConfig

_LAZY = {
    "PageTable": "..kernels.page_table", "StoreSpec": "..kernels.page_table", "PagePool": ".pages",
    "ChunkedSequence": ".schedule", "eval_loss": ".schedule", "train_step": ".schedule",
}

__all__ = ["ChunkConfig", "ChunkedSequence", "PagePool", "PageTable", "SparseConfig", "StoreSpec", "eval_loss", "train_step"]


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'lightning_oomb.core' has no attribute {name!r}")
