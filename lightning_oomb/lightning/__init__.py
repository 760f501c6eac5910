"""The Lightning layer: strategy, callback, ready module and data, built on the core engine."""

from ..core.errors import SetupError
from .callback import PagedKVCallback
from .checkpoint import AtomicCheckpointIO
from .corpus import CorpusError, TextCorpusDataModule
from .data import PasskeyDataModule
from .module import CausalLMModule
from .sparse import SparseAttentionMixin, SparseCausalLMModule
from .strategy import OOMBStrategy

__all__ = [
    "AtomicCheckpointIO",
    "CausalLMModule",
    "CorpusError",
    "OOMBStrategy",
    "PagedKVCallback",
    "PasskeyDataModule",
    "SetupError",
    "SparseAttentionMixin",
    "SparseCausalLMModule",
    "TextCorpusDataModule",
]
