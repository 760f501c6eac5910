"""Data parallel over torch.distributed, on the CPU with the gloo backend: each rank runs ``train_step`` on its
own sequences with the valid-label count of the whole batch (``num_items_in_batch``), the gradients summed
over the ranks (one all-reduce after stage 2) equal one process's gradient of the whole batch and
transformers' full-sequence gradient of it (fp32, reference attention, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightning_oomb
from tiny_models import VOCAB, as_torchrun_rank, assert_grads_close, full_sequence_grads, spawn_ranks, tiny_model

SEQ, CHUNK, PAGE = 40, 16, 8


def whole_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``world`` rows of SEQ tokens; the ranks' valid-label counts differ, and rank 1 has none."""
    ids = torch.randint(0, VOCAB, (world, SEQ), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :25] = -100
    labels[1, :] = -100
    return ids, labels


def valid_labels(labels: torch.Tensor) -> torch.Tensor:
    """The labels a causal LM's loss counts: every one after the first position (shifted) but -100."""
    return (labels[:, 1:] != -100).sum()


def _rank(rank: int, world: int, port: int, family: str, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    dist.init_process_group("gloo")
    try:
        model = tiny_model(family)
        ids, labels = whole_batch(world)
        mine = slice(rank, rank + 1)
        count = valid_labels(labels[mine])
        dist.all_reduce(count)  # the whole batch's count: every rank normalises by it
        lightning_oomb.train_step(model, ids[mine], labels[mine], chunk_size=CHUNK, page_size=PAGE,
                                  attention="reference", num_items_in_batch=count)
        for p in model.parameters():
            if p.grad is None:  # a rank whose tokens never reach a parameter still joins its all-reduce
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        if rank == 0:
            torch.save({n: p.grad for n, p in model.named_parameters()}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family, world", [("qwen2", 2), ("qwen2-tied", 3)])
def test_gradients_summed_over_ranks_equal_one_process(tmp_path, family, world):
    out = tmp_path / "grads.pt"
    spawn_ranks(_rank, world, family, str(out))
    summed = torch.load(out)

    model = tiny_model(family)
    ids, labels = whole_batch(world)
    _, want = full_sequence_grads(model, ids, labels)
    lightning_oomb.train_step(model, ids, labels, chunk_size=CHUNK, page_size=PAGE, attention="reference")
    one_process = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_grads_close({n: summed[n] for n in want}, want, 1e-5)
    assert_grads_close({n: summed[n] for n in one_process}, one_process, 1e-5)
