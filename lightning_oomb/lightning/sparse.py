"""The sparse-attention LightningModule mixin: a module that mixes it in trains with page-level sparse attention.

    class MyModule(SparseAttentionMixin, LightningModule):
        def __init__(self, ..., budget_pages=64, sink_pages=1, local_pages=4, sparse_score="mean",
                     per_kv_head=True, per_query_tile=None):
            super().__init__()
            self.save_hyperparameters()

The sparse options are ordinary hyperparameters: ``save_hyperparameters`` stores them in checkpoints and the
Lightning CLI's YAML sets them (``model.init_args.budget_pages: 64``). ``OOMBStrategy`` asks the module for
``sparse_config`` at set-up; the module's config takes precedence over the strategy's ``sparse`` argument
(a module without the mixin, or with ``budget_pages: null``, leaves the strategy's setting). On CUDA the
sparse Triton kernels run (``attention="auto"``); on CPU the PyTorch reference.

``SparseCausalLMModule`` is ``CausalLMModule`` with the mixin and these hyperparameters.
"""

from __future__ import annotations

from typing import Any

from ..core.config import SparseConfig, option_defaults
from .module import CausalLMModule

_SPARSE = option_defaults(SparseConfig)

SPARSE_HPARAMS = {
    "budget_pages": "budget_pages",
    "sink_pages": "sink_pages",
    "local_pages": "local_pages",
    "sparse_score": "score",
    "per_kv_head": "per_kv_head",
    "per_query_tile": "per_query_tile",
}


class SparseAttentionMixin:
    """Gives a LightningModule ``sparse_config``, read from its hyperparameters (see the module notes).

    Hyperparameters read: ``budget_pages`` (None: dense), ``sink_pages``, ``local_pages``, ``sparse_score``
    ("mean" | "minmax"), ``per_kv_head``, ``per_query_tile``; missing ones take ``SparseConfig``'s defaults.
    """

    @property
    def sparse_config(self) -> SparseConfig | None:
        hparams = getattr(self, "hparams", {})
        if hparams.get("budget_pages") is None:
            return None
        return SparseConfig(**{field: hparams[name] for name, field in SPARSE_HPARAMS.items() if name in hparams})


class SparseCausalLMModule(SparseAttentionMixin, CausalLMModule):
    """``CausalLMModule`` trained with page-level sparse attention.

    Args:
        budget_pages: past pages each query tile attends to; None: dense attention.
        sink_pages, local_pages, per_kv_head, per_query_tile: ``SparseConfig``'s fields, with its defaults.
        sparse_score: ``SparseConfig.score``, "mean" or "minmax".
        **kwargs: ``CausalLMModule``'s arguments.
    """

    def __init__(
        self,
        budget_pages: int | None = _SPARSE["budget_pages"],
        sink_pages: int = _SPARSE["sink_pages"],
        local_pages: int = _SPARSE["local_pages"],
        sparse_score: str = _SPARSE["score"],
        per_kv_head: bool = _SPARSE["per_kv_head"],
        per_query_tile: bool | None = _SPARSE["per_query_tile"],
        **kwargs: Any,
    ):
        if budget_pages is not None:  # refuse bad options before loading a model
            SparseConfig(budget_pages=budget_pages, sink_pages=sink_pages, local_pages=local_pages, score=sparse_score,
                         per_kv_head=per_kv_head, per_query_tile=per_query_tile)
        super().__init__(**kwargs)
