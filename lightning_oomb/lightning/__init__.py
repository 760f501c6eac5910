"""The Lightning layer: strategies, callback, ready module and data, built on the core engine. Importing it
registers the strategy names "oomb_ddp" and "oomb_ddp_spawn" with Lightning (``Trainer(strategy="oomb_ddp")``)."""

from ..core.errors import SetupError
from .callback import PagedKVCallback
from .checkpoint import AtomicCheckpointIO
from .corpus import CorpusError, TextCorpusDataModule
from .data import PasskeyDataModule
from .ddp import OOMBDDPStrategy
from .module import CausalLMModule
from .sparse import SparseAttentionMixin, SparseCausalLMModule
from .strategy import OOMBStrategy

__all__ = [
    "AtomicCheckpointIO",
    "CausalLMModule",
    "CorpusError",
    "OOMBDDPStrategy",
    "OOMBStrategy",
    "PagedKVCallback",
    "PasskeyDataModule",
    "SetupError",
    "SparseAttentionMixin",
    "SparseCausalLMModule",
    "TextCorpusDataModule",
]
