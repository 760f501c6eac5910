"""The modes ``lightning-oomb bench`` measures, each a way to train one step, and the registry ``--modes`` picks from.

baseline is transformers' own step; oomb, sparse, sparse-offload and offload run ``lightning_oomb.train_step``.
Later modes join through ``register_mode``. The lightning_oomb modes can pack documents
(``packed_position_ids``); the baseline cannot (its SDPA attention would cross the borders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .config import BenchConfig


@dataclass(frozen=True)
class BenchMode:
    """A way to train one step. ``step`` adds gradients to the parameters and returns the loss.

    ``setup``/``teardown`` run once around the mode's sweep (they must leave the model as they found it);
    ``planned`` says whether ``lightning_oomb.core.plan`` models this mode's memory; ``documents`` whether
    its step packs documents when the config asks (``packed_position_ids``).
    """

    name: str
    description: str
    step: Callable[[nn.Module, torch.Tensor, BenchConfig], torch.Tensor]
    setup: Callable[[nn.Module, BenchConfig], None] = lambda model, config: None
    teardown: Callable[[nn.Module, BenchConfig], None] = lambda model, config: None
    planned: bool = False
    sparse: bool = False
    offload: bool = False
    documents: bool = False

    def sparse_config(self, config: "BenchConfig"):
        """The SparseConfig of this mode's steps under ``config``; None for a dense mode."""
        from ..core.config import SparseConfig

        if not self.sparse:
            return None
        return SparseConfig(budget_pages=config.budget_pages, per_query_tile=config.per_query_tile)


MODES: dict[str, BenchMode] = {}


def register_mode(mode: BenchMode) -> BenchMode:
    """Make ``mode`` available to ``--modes`` under ``mode.name``."""
    MODES[mode.name] = mode
    return mode


def check_modes(config: BenchConfig) -> None:
    """Refuse modes that do not exist, or that cannot pack documents when ``config`` asks for them."""
    unknown = [m for m in config.modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; available: {', '.join(MODES)}")
    if config.document_length is not None:
        if config.document_length < 1:
            raise ValueError(f"--document-length must be >= 1 token, got {config.document_length}")
        unpacked = [m for m in config.modes if not MODES[m].documents]
        if unpacked:
            packing = ", ".join(m for m in MODES if MODES[m].documents)
            raise ValueError(
                f"--document-length packs documents in the modes {packing} only: {', '.join(unpacked)} would attend "
                "across their borders (bench it at the document length instead)"
            )


def _hf_model(model: nn.Module):
    from ..integrations.transformers import causal_lm

    return causal_lm(model)


def _baseline_setup(model: nn.Module, config: BenchConfig) -> None:
    lm = _hf_model(model)
    lm.set_attn_implementation("sdpa")
    # transformers >= 5.2x names it activation_checkpointing_*; earlier versions gradient_checkpointing_*.
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _baseline_teardown(model: nn.Module, config: BenchConfig) -> None:
    lm = _hf_model(model)
    if hasattr(lm, "activation_checkpointing_disable"):
        lm.activation_checkpointing_disable()
    else:
        lm.gradient_checkpointing_disable()
    # Enabling checkpointing also hooked the embedding to make its output require grad; the models the
    # bench builds have no such hook otherwise, and it would change what LoRA runs of other modes save.
    lm.disable_input_require_grads()


def _baseline_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def step_options(config: BenchConfig, sparse=None, offload: str = "auto") -> dict:
    """The ``train_step`` keyword arguments (equally, ChunkConfig fields) of an oomb-family mode."""
    return dict(
        chunk_size=config.chunk_size, page_size=config.page_size, attention=config.attention,
        checkpoint_layers=config.checkpoint_layers, grad_dtype=config.grad_dtype, sparse=sparse, offload=offload,
    )


def packed_position_ids(input_ids: torch.Tensor, document_length: int | None) -> torch.Tensor | None:
    """position_ids (B, L) on input_ids' device restarting at 0 every ``document_length`` tokens (packed
    documents, transformers' convention); None for None (one document per sequence)."""
    if document_length is None:
        return None
    return (torch.arange(input_ids.shape[1], device=input_ids.device) % document_length).expand_as(input_ids)


def _train_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig, **options) -> torch.Tensor:
    from .. import train_step

    return train_step(model, input_ids, position_ids=packed_position_ids(input_ids, config.document_length),
                      **step_options(config, **options))


def _oomb_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config)


def _sparse_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config, sparse=MODES["sparse"].sparse_config(config))


def _sparse_offload_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config, sparse=MODES["sparse-offload"].sparse_config(config), offload="host")


def _offload_step(model: nn.Module, input_ids: torch.Tensor, config: BenchConfig) -> torch.Tensor:
    return _train_step(model, input_ids, config, offload="host")


def drop_cached_pool(model: nn.Module, config: BenchConfig | None = None) -> None:
    """Forget the page pool train_step keeps per model, so each point's peak holds only its own pool."""
    from ..core.schedule import release_cached_pool

    release_cached_pool(model)


register_mode(BenchMode(
    "baseline", "transformers full-sequence forward+backward, SDPA, gradient checkpointing (non-reentrant)",
    _baseline_step, _baseline_setup, _baseline_teardown,
))
register_mode(BenchMode(
    "oomb", "lightning_oomb.train_step (chunk-recurrent, exact gradient)",
    _oomb_step, drop_cached_pool, drop_cached_pool, planned=True, documents=True,
))
register_mode(BenchMode(
    "sparse", "lightning_oomb.train_step with page-level sparse attention (--budget-pages pages per query tile)",
    _sparse_step, drop_cached_pool, drop_cached_pool, planned=True, sparse=True, documents=True,
))
register_mode(BenchMode(
    "sparse-offload", "sparse, with every layer's KV-gradient and K/V pages in pinned host memory (the "
    "selected pages gathered for each attention call): what a host layer costs",
    _sparse_offload_step, drop_cached_pool, drop_cached_pool, planned=True, sparse=True, offload=True,
    documents=True,
))
register_mode(BenchMode(
    "offload", "lightning_oomb.train_step with every K/V and KV-gradient page in pinned host memory, streamed",
    _offload_step, drop_cached_pool, drop_cached_pool, planned=True, offload=True, documents=True,
))
