"""Where a transformers causal LM keeps its decoder: one answer for every part of the engine that needs it."""

from __future__ import annotations

from transformers import PreTrainedModel


def decoder_of(lm: PreTrainedModel) -> PreTrainedModel:
    """The decoder model inside the causal LM ``lm`` (embeddings, layers, final norm; not the output layer).
    transformers' ``get_decoder`` is the answer where it gives a model other than ``lm``; some classes give
    themselves (Mllama's text model) or a layer (ModernBERT's decoder head): then ``lm.model``."""
    found = lm.get_decoder()
    if not isinstance(found, PreTrainedModel) or found is lm:
        found = getattr(lm, "model", None)
    if not isinstance(found, PreTrainedModel) or found is lm:
        raise NotImplementedError(
            f"{type(lm).__name__} (model_type {lm.config.model_type!r}) has no decoder model lightning_oomb can "
            f"find (get_decoder() gives {type(lm.get_decoder()).__name__}, and no .model): not supported"
        )
    return found
