"""lightning_oomb: exact chunk-recurrent training of transformers causal LMs on very long contexts.

The core (``train_step``, ``eval_loss``, ``serve``) and the evaluation (``generate``; lightning_oomb.evaluation)
import no Lightning; the Lightning layer
(``OOMBStrategy``, ``OOMBDDPStrategy``, ``OOMBModelParallelStrategy``, ``PagedKVCallback``, ``LongContextEvalCallback``,
``NonFiniteGuard``,
``CausalLMModule``, ``PasskeyDataModule``, ``PasskeyTextDataModule``, ``TextCorpusDataModule``, ``ChatDataModule``, ``TorchThreads``)
loads on first use. So does the engine (it imports transformers): `lightning-oomb plan`
needs neither.
"""

from ._noise import quiet_imports
from .core.config import ChunkConfig, SparseConfig

quiet_imports()  # torchao's notices when transformers imports it (_noise.py)

_CORE = ("eval_loss", "train_step")  # lightning_oomb.core's own lazy names
_LIGHTNING = (
    "OOMBStrategy", "OOMBDDPStrategy", "OOMBModelParallelStrategy", "PagedKVCallback", "LongContextEvalCallback",
    "NonFiniteGuard",
    "CausalLMModule", "PasskeyDataModule", "PasskeyTextDataModule", "TextCorpusDataModule", "ChatDataModule", "SparseAttentionMixin", "SparseCausalLMModule",
    "TorchThreads",
)

__all__ = ["ChunkConfig", "SparseConfig", "eval_loss", "generate", "serve", "train_step", *_LIGHTNING]
__version__ = "0.1.0"


def __getattr__(name: str):
    import importlib

    if name in _CORE:
        return getattr(importlib.import_module(".core", __name__), name)
    if name == "generate":
        return importlib.import_module(".evaluation", __name__).generate
    if name == "serve":
        return importlib.import_module(".core.served", __name__).serve
    if name in _LIGHTNING:
        return getattr(importlib.import_module(".lightning", __name__), name)
    raise AttributeError(f"module 'lightning_oomb' has no attribute {name!r}")
