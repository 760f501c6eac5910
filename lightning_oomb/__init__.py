"""lightning_oomb: exact chunk-recurrent training of transformers causal LMs on very long contexts.

The core (``train_step``, ``eval_loss``) imports no Lightning; the Lightning layer is loaded on first use.
"""

from .core import ChunkConfig, eval_loss, train_step

__all__ = ["ChunkConfig", "eval_loss", "train_step"]
__version__ = "0.1.0"
