"""The Lightning layer: strategies, callback, ready module and data, built on the core engine. Importing it
registers the strategy names "oomb_ddp", "oomb_ddp_spawn" and "oomb_model_parallel" with Lightning
(``Trainer(strategy="oomb_ddp")``)."""

from ..core.errors import SetupError
from .callback import PagedKVCallback
from .chat import ChatDataModule
from .checkpoint import AtomicCheckpointIO
from .corpus import CorpusError, TextCorpusDataModule
from .data import PasskeyDataModule
from .guard import NonFiniteError, NonFiniteGuard
from .ddp import OOMBDDPStrategy
from .eval_callback import LongContextEvalCallback
from .model_parallel import OOMBModelParallelStrategy
from .module import CausalLMModule
from .passkey_text import PasskeyTextDataModule
from .sparse import SparseAttentionMixin, SparseCausalLMModule
from .strategy import OOMBStrategy
from .threads import TorchThreads

__all__ = [
    "AtomicCheckpointIO",
    "CausalLMModule",
    "ChatDataModule",
    "CorpusError",
    "LongContextEvalCallback",
    "NonFiniteError",
    "NonFiniteGuard",
    "OOMBDDPStrategy",
    "OOMBModelParallelStrategy",
    "OOMBStrategy",
    "PagedKVCallback",
    "PasskeyDataModule",
    "PasskeyTextDataModule",
    "SetupError",
    "SparseAttentionMixin",
    "SparseCausalLMModule",
    "TextCorpusDataModule",
    "TorchThreads",
]
