"""lightning_oomb: exact chunk-recurrent training of transformers causal LMs on very long contexts.

The core (``train_step``, ``eval_loss``, ``serve``) imports no Lightning; the Lightning layer
(``OOMBStrategy``, ``OOMBDDPStrategy``, ``OOMBModelParallelStrategy``, ``PagedKVCallback``, ``CausalLMModule``, ``PasskeyDataModule``,
``TextCorpusDataModule``) loads on first use.
"""

from .core import ChunkConfig, SparseConfig, eval_loss, train_step
from .core.served import serve

_LIGHTNING = (
    "OOMBStrategy", "OOMBDDPStrategy", "OOMBModelParallelStrategy", "PagedKVCallback", "CausalLMModule", "PasskeyDataModule",
    "TextCorpusDataModule", "SparseAttentionMixin", "SparseCausalLMModule",
)

__all__ = ["ChunkConfig", "SparseConfig", "eval_loss", "serve", "train_step", *_LIGHTNING]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LIGHTNING:
        from . import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module 'lightning_oomb' has no attribute {name!r}")
