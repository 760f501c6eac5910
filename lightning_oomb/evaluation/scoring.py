"""lm-eval's scoring requests through the engine's chunked forward, without gradients: the log-likelihood of a
continuation given its whole context (``loglikelihood``) and of a whole text (``loglikelihood_rolling``), every
token conditioned on every token before it, however long the context. No whole-sequence logits are held: the
continuation's rows only, or none (the rolling sum is the engine's loss, in pieces of rows)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..core.config import ChunkConfig
from ..core.schedule import ChunkedSequence
from ..integrations.transformers import causal_lm

TokenIds = Sequence[int] | torch.Tensor


def _ids(tokens: TokenIds, what: str, device: torch.device) -> torch.Tensor:
    """(1, n) int64 on ``device`` from a list or a 1-D tensor of token ids; empty is refused."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}")
    return ids.to(device)[None]


def _check_positions(lm: nn.Module, positions: int) -> None:
    limit = getattr(lm.config, "max_position_embeddings", None)
    if limit is not None and positions > limit:
        raise ValueError(f"{positions} positions to score, beyond the model's max_position_embeddings {limit}")


def loglikelihood(
    model: nn.Module,
    requests: Sequence[tuple[TokenIds, TokenIds]],
    *,
    config: ChunkConfig | None = None,
    **options: Any,
) -> list[tuple[float, bool]]:
    """lm-eval's ``loglikelihood`` on token ids: for each (context, continuation) pair, (the sum over the
    continuation's tokens of log p(token | everything before it), in nats; whether every continuation token is
    the argmax of its distribution, i.e. greedy decoding from the context would produce the continuation).

    context, continuation: non-empty lists (or 1-D tensors) of token ids; lm-eval puts the end-of-text token
    as the context of an empty one, which the caller does here. The whole context is used, never truncated.
    One request at a time, in chunks of ``chunk_size`` (config, options: the ``ChunkConfig`` as ``eval_loss``
    takes it); only the continuation's (n, V) logits are made, the context's last position and the
    continuation but its last token.
    """
    lm = causal_lm(model)
    device = lm.get_output_embeddings().weight.device
    config = ChunkConfig.build(config, **options)
    results = []
    for context, continuation in requests:
        ctx = _ids(context, "a context", device)
        cont = _ids(continuation, "a continuation", device)
        ids = torch.cat([ctx, cont], dim=1)
        n = cont.shape[1]
        _check_positions(lm, ids.shape[1] - 1)  # the last token is predicted, never run
        seq = ChunkedSequence(model, ids, config=config, training=False)
        try:
            logits = seq.extend(ids.shape[1] - 1, keep_last=n)[0]  # (n, V): positions predicting the continuation
        finally:
            seq.release()
        scores = torch.log_softmax(logits.float(), dim=-1)
        logprob = scores.gather(1, cont[0, :, None]).sum()
        greedy = bool((logits.argmax(dim=-1) == cont[0]).all())
        results.append((logprob.item(), greedy))
    return results


def loglikelihood_rolling(
    model: nn.Module,
    requests: Sequence[TokenIds],
    *,
    prefix_token_id: int | None = None,
    config: ChunkConfig | None = None,
    **options: Any,
) -> list[float]:
    """lm-eval's ``loglikelihood_rolling`` on token ids: for each text, the sum over its tokens of
    log p(token | every token before it), in nats, with the whole text as context (lm-eval's windows of
    max_length tokens cut the context; this is the full-context value they approximate).

    prefix_token_id: a token put before the text, so that every token of it is scored (lm-eval prepends the
    end-of-text token); None: nothing is prepended and the text's first token, which has no context, is not
    scored (a text needs 2 tokens then). One text at a time, through the engine's loss in chunks of
    ``chunk_size`` (config, options: the ``ChunkConfig``): the log-probabilities are summed chunk by chunk in
    float32, in pieces of rows, without logits of the whole text.
    """
    lm = causal_lm(model)
    device = lm.get_output_embeddings().weight.device
    config = ChunkConfig.build(config, **options)
    results = []
    for text in requests:
        ids = _ids(text, "a text", device)
        if prefix_token_id is not None:
            ids = torch.cat([ids.new_full((1, 1), prefix_token_id), ids], dim=1)
        if ids.shape[1] < 2:
            raise ValueError("a text of one token has nothing to score without a prefix_token_id")
        _check_positions(lm, ids.shape[1] - 1)
        # The loss over one valid label per token: its sum, not its mean.
        seq = ChunkedSequence(model, ids, config=config, stage_1_loss=True, num_items_in_batch=1, training=False)
        seq.balance = None  # the experts' load-balancing loss is no log-likelihood
        try:
            total = seq.fill(with_grads=False)[0]
        finally:
            seq.release()
        results.append(-total.item())
    return results
