"""Serving ``model(input_ids=..., labels=...)`` with the chunk-recurrent schedule.

Inside ``serve(model, config)`` a call of the causal LM's forward runs stage 1 and returns an output whose
``loss`` is a tensor like any other: backpropagating through it (``loss.backward()``, Lightning's
automatic optimisation, a loss scaled by gradient accumulation) runs stage 2 with exactly the incoming
gradient as scale, inside the autocast state the forward ran under. This is how OOMBStrategy trains an
unchanged LightningModule. Logits are not materialised (only ``logits_to_keep`` last positions on request).
Beside transformers' inputs the forward takes ``loss_weights`` (a weight per label; ``train_step``'s).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import nn

from ..integrations.transformers import causal_lm
from .config import ChunkConfig
from .ranks import Ranks
from .schedule import ChunkedSequence, ChunkHook, ChunkObserver, PoolProvider

# Keyword arguments of a causal LM's forward that we accept when they ask for nothing we do not compute.
_IGNORED_WHEN_FALSY = ("use_cache", "output_attentions", "output_hidden_states", "inputs_embeds", "cache", "past_key_values")


class ServedOutput:
    """What a served forward returns: ``loss``, and ``logits`` only for the ``logits_to_keep`` last positions."""

    def __init__(self, loss: torch.Tensor, logits: torch.Tensor | None):
        self.loss = loss
        self._logits = logits

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            raise AttributeError(
                "lightning_oomb serves the loss of this forward without materialising logits (for a long "
                "sequence they would not fit); pass logits_to_keep=N for the logits of the last N positions, "
                "or compute what you need from the loss"
            )
        return self._logits

    def __getitem__(self, key):
        if key == "loss":
            return self.loss
        if key == "logits":
            return self.logits
        raise KeyError(key)


class _StageTwo(torch.autograd.Function):
    """Identity on the loss value whose backward runs stage 2 with the incoming gradient as scale."""

    @staticmethod
    def forward(ctx, anchor, loss, seq: ChunkedSequence):
        device_type = loss.device.type
        ctx.seq = seq
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        device_type, dtype, enabled = ctx.autocast
        # The loss's graph node outlives the backward wherever the loss is still referenced (Lightning's
        # closure result, an exception's frames): without the sequence it no longer holds the page pool.
        seq, ctx.seq = ctx.seq, None
        if seq is None:
            raise RuntimeError("stage 2 of this step has already run: a served loss backpropagates once")
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            seq.backward(grad)
        return None, None, None


@dataclass
class Serving:
    """State of one ``serve`` block: the sequences it ran, in order."""

    model: nn.Module
    config: ChunkConfig
    pools: PoolProvider | None = None
    max_calls: int | None = None
    observer: ChunkObserver | None = None
    optimizers: Sequence[torch.optim.Optimizer] = ()
    ranks: Ranks = field(default_factory=Ranks)
    before_chunk: ChunkHook | None = None
    sequences: list[ChunkedSequence] = field(default_factory=list)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ServedOutput:
        if self.max_calls is not None and len(self.sequences) >= self.max_calls:
            raise RuntimeError(
                "the model was called more than once in this step; OOMBStrategy serves one forward with labels "
                "per training_step (concatenate the batches, or compute other losses outside the model call)"
            )
        for name, value in kwargs.items():
            if name not in _IGNORED_WHEN_FALSY or (value is not None and value is not False):
                raise TypeError(f"a forward served by lightning_oomb does not take `{name}={value!r}`")
        if input_ids is None:
            raise ValueError("a forward served by lightning_oomb needs input_ids")
        if labels is None:
            raise ValueError(
                "a forward served by lightning_oomb needs labels: it computes the loss chunk by chunk instead "
                "of logits; call model(input_ids=..., labels=...)"
            )
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padding masks are not supported; mark padded positions with label -100 instead")
        if isinstance(position_ids, torch.Tensor) and position_ids.shape == (1, *input_ids.shape[1:]):
            position_ids = position_ids.expand_as(input_ids)  # one row for the batch, as transformers takes it
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        train = torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters())
        # Evaluation agrees nothing with other ranks: each reports the loss of its own batch.
        seq = ChunkedSequence(
            self.model, input_ids, labels, self.config, self.pools, num_items_in_batch, self.observer,
            stage_1_loss=True, optimizers=self.optimizers, position_ids=position_ids,
            ranks=self.ranks if train else Ranks(), before_chunk=self.before_chunk, loss_weights=loss_weights,
        )
        self.sequences.append(seq)
        loss, logits = seq.fill(with_grads=train, keep_last=logits_to_keep)
        if train:
            anchor = next(p for p in self.model.parameters() if p.requires_grad)
            loss = _StageTwo.apply(anchor, loss, seq)
        else:
            seq.release()
        return ServedOutput(loss, logits)

    def release(self) -> None:
        for seq in self.sequences:
            seq.release()


@contextlib.contextmanager
def serve(
    model: nn.Module,
    config: ChunkConfig = ChunkConfig(),
    pools: PoolProvider | None = None,
    max_calls: int | None = None,
    observer: ChunkObserver | None = None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    ranks: Ranks = Ranks(),
    before_chunk: ChunkHook | None = None,
) -> Iterator[Serving]:
    """Within the block, the causal LM's forward is served by the chunk-recurrent schedule; stage 2 runs
    when the returned loss is backpropagated, inside or after the block. The instance's ``forward`` attribute is
    set for the block and removed after it (the class is untouched).

    ``optimizers``: those that update the model after the step (the state their first update creates is
    counted when the step is placed: ``optimizers.pending_state``). ``ranks``: the data-parallel ranks a
    training forward agrees with (``core.ranks``; evaluation forwards agree nothing). ``before_chunk``: the
    engine's hook before each chunk of both stages (``schedule.ChunkHook``), for training and evaluation.
    """
    lm = causal_lm(model)
    if "forward" in lm.__dict__:
        raise RuntimeError(f"{type(lm).__name__}.forward is already overridden on this instance (nested serve?)")
    serving = Serving(model, config, pools, max_calls, observer, optimizers, ranks, before_chunk)
    lm.forward = serving.forward
    try:
        yield serving
    finally:
        del lm.forward
