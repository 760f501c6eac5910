"""The sparse-attention LightningModule mixin: a module that mixes it in trains with page-level sparse attention.

    class MyModule(SparseAttentionMixin, LightningModule):
        def __init__(self, ..., budget_pages=64, sink_pages=1, local_pages=4, sparse_score="mean",
                     per_kv_head=True, per_query_tile=True):
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

from ..core.config import SparseConfig
from .module import CausalLMModule

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

    Args (besides CausalLMModule's): budget_pages, sink_pages, local_pages, sparse_score, per_kv_head,
        per_query_tile: the
    fields of ``lightning_oomb.SparseConfig`` (``sparse_score`` is its ``score``); budget_pages=None is dense.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: dict | None = None,
        gguf_file: str | None = None,
        config_overrides: dict | None = None,
        dtype: str = "float32",
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | None = None,
        lora_dtype: str = "float32",
        quantization: str | dict | None = None,
        optimizer: str = "adamw",
        optimizer_args: dict | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        schedule_steps: int | None = None,
        answer_tokens: int = 0,
        seed: int = 0,
        new_token_ids: list[int] | None = None,
        budget_pages: int | None = 64,
        sink_pages: int = 1,
        local_pages: int = 4,
        sparse_score: str = "mean",
        per_kv_head: bool = True,
        per_query_tile: bool = True,
    ):
        if budget_pages is not None:  # refuse bad options before loading a model
            SparseConfig(budget_pages=budget_pages, sink_pages=sink_pages, local_pages=local_pages, score=sparse_score,
                         per_kv_head=per_kv_head, per_query_tile=per_query_tile)
        super().__init__(
            pretrained=pretrained, config=config, gguf_file=gguf_file, config_overrides=config_overrides,
            dtype=dtype, lora_rank=lora_rank, lora_alpha=lora_alpha,
            lora_target_modules=lora_target_modules, lora_dtype=lora_dtype, quantization=quantization,
            optimizer=optimizer, optimizer_args=optimizer_args,
            learning_rate=learning_rate, weight_decay=weight_decay,
            warmup_steps=warmup_steps, schedule_steps=schedule_steps, answer_tokens=answer_tokens, seed=seed,
            new_token_ids=new_token_ids,
        )
