"""Packed documents: sequences made of several documents, each attending only within itself.

The convention is transformers' (``DataCollatorWithFlattening``): ``position_ids`` restart at 0 at the first
token of every document of a row. Token t of a row then belongs to the document that starts at
``doc_start[t] = t - position_ids[t]``; a query at t sees the keys [doc_start[t], t] (causal within its
document), which is all the attention backends need (``core/attention.py``). The token before a document
start does not predict it: its shifted label is ignored (docs/architecture.md, "Packed documents").
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def document_starts(position_ids: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """doc_start (B, L) int32 on input_ids' device: for every token, the position of its document's first
    token; None when there are no position ids or they are 0..L-1 in every row (one document per row, the
    unpacked step). Raises ValueError for position ids of another form."""
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int64, torch.int32):
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise TypeError(f"position_ids must be an int64 or int32 tensor, got {got}")
    if position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(position_ids.shape)}"
        )
    pos = position_ids.long()
    step = pos[:, 1:] - pos[:, :-1]
    if bool((pos[:, 0] != 0).any()) or bool(((step != 1) & (pos[:, 1:] != 0)).any()):
        raise ValueError(
            "position_ids must start every row at 0 and count up by 1 within a document, restarting at 0 where "
            "a document starts (as transformers' DataCollatorWithFlattening makes them)"
        )
    token = torch.arange(pos.shape[1], device=pos.device)
    if bool((pos == token).all()):
        return None
    return (token - pos).to(device=input_ids.device, dtype=torch.int32)


def chunk_documents(position_ids: torch.Tensor, chunks: list[tuple[int, int]]) -> tuple[dict[int, int], dict[int, int]]:
    """Host facts of each chunk [s, e) of ``chunks``, over all rows (one read of position ids per step, none
    when they are on the CPU, as a data loader gives them): (first_keys, one_document).

    first_keys[s]: the earliest document start among the chunk's queries, before which none of them attends
    to a key. one_document[s], only for a chunk whose queries all belong to one document, the same in every
    row: that document's start (the chunk is then an unpacked chunk over the keys from there on).
    position_ids: as ``document_starts`` accepted."""
    firsts = torch.tensor([s for s, _ in chunks], dtype=torch.long, device=position_ids.device)
    lasts = torch.tensor([e - 1 for _, e in chunks], dtype=torch.long, device=position_ids.device)
    # Document starts only grow along a row: a chunk's first token has its earliest, its last token its latest.
    first_doc = firsts - position_ids[:, firsts].long()  # (B, n_chunks)
    last_doc = lasts - position_ids[:, lasts].long()
    one = ((first_doc == last_doc) & (first_doc == first_doc[:1])).all(0)
    starts = firsts.tolist()
    first_keys = dict(zip(starts, first_doc.amin(0).tolist()))
    one_document = {s: key for s, key, single in zip(starts, first_doc[0].tolist(), one.tolist()) if single}
    return first_keys, one_document


def ignore_across_borders(targets: torch.Tensor, doc_start: torch.Tensor | None) -> torch.Tensor:
    """Shifted targets (B, L) with the label of the last token of every document but the row's last set to
    -100: a document's first token is not predicted from the previous document."""
    if doc_start is None:
        return targets
    starts = torch.zeros_like(targets, dtype=torch.bool)
    starts[:, :-1] = doc_start[:, 1:] == torch.arange(1, targets.shape[1], device=targets.device)
    return targets.masked_fill(starts, IGNORE_INDEX)


def document_loss_weights(labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Loss weights (B, L) float32 aligned with ``labels`` (B, L) that make the engine's weighted mean loss
    (``train_step(loss_weights=...)``) the mean over documents of each document's mean token loss: 1 / n for
    each of a document's n labels that is predicted, 0 elsewhere. A document is a run of ``position_ids``
    from 0 (as ``document_starts`` takes them), or each row where there are none. A label at a document's
    first token is not predicted (nothing before it in the document), nor is -100; a document with none
    predicted (padding) weighs nothing. Raises ValueError for position ids ``document_starts`` refuses."""
    token = torch.arange(labels.shape[1], device=labels.device)
    doc_start = document_starts(position_ids, labels)
    # each token's document start, (B, L)
    start = torch.zeros_like(labels, dtype=torch.long) if doc_start is None else doc_start.long()
    predicted = (labels != IGNORE_INDEX) & (token != start)
    # Documents are numbered by their start in the flattened batch: starts grow along a row.
    key = (start + torch.arange(labels.shape[0], device=labels.device)[:, None] * labels.shape[1]).reshape(-1)
    counts = torch.zeros(labels.numel(), dtype=torch.float32, device=labels.device)
    counts.index_add_(0, key, predicted.reshape(-1).float())
    per_token = counts[key].view_as(labels)
    return torch.where(predicted, 1.0 / per_token.clamp(min=1.0), torch.zeros((), device=labels.device))
