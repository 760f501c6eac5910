"""OOMBDDPStrategy in real Lightning Trainers over 2 and 3 gloo processes on the CPU: the gradient averaged over
the ranks is transformers' full-sequence gradient of all ranks' sequences together, and the weights after the
steps are those of one process training on those batches (fp32, reference attention)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.utils.data import DataLoader

import lightning_oomb
from lightning_oomb import OOMBDDPStrategy, OOMBStrategy
from lightning_oomb.core.config import ChunkConfig
from lightning_oomb.core.documents import document_loss_weights
from lightning_oomb.core.ranks import DataParallelRanks
from lightning_oomb.core.schedule import ChunkedSequence
from lightning_oomb.lightning.corpus import ResumableBatchSampler, data_parallel_rank
from test_strategy import UserModule, weights
from tiny_models import (VOCAB, as_torchrun_rank, assert_adamw_updates_close, assert_grads_close,
                         full_sequence_grads, rel_err, spawn_ranks, tiny_model)

SEQ, CHUNK, PAGE = 40, 16, 8
TRAINER = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0)


def sequences(n: int, seq_len: int = SEQ) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences with uneven valid-label counts; the second has none (its rank's batch in step 1)."""
    g = torch.Generator().manual_seed(1)
    items = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (seq_len,), generator=g)
        labels = ids.clone()
        labels[: 5 * (i % 4) + 3] = -100
        if i == 1:
            labels[:] = -100
        items.append({"input_ids": ids, "labels": labels})
    return items


def stacked(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([i["input_ids"] for i in items]), torch.stack([i["labels"] for i in items])


class RankRows(LightningDataModule):
    """Step k's global batch is items k*world .. k*world + world - 1, data-parallel rank r its r-th (the rank-aware
    sampler TextCorpusDataModule uses, unshuffled; the ranks of a tensor-parallel group take the same item)."""

    def __init__(self, items):
        super().__init__()
        self.items = items

    def train_dataloader(self):
        rank, world = data_parallel_rank(self.trainer)
        sampler = ResumableBatchSampler(len(self.items), 1, seed=0, shuffle=False, rank=rank, world_size=world)
        return DataLoader(self.items, batch_sampler=sampler)


class Record(Callback):
    """Each rank saves its gradients as the first optimizer step sees them, and its weights at the end."""

    def __init__(self, out):
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            torch.save(grads, self.out / f"grads{trainer.global_rank}.pt")

    def on_train_end(self, trainer, pl_module):
        torch.save(weights(pl_module), self.out / f"weights{trainer.global_rank}.pt")


def _ddp_trainer(world, steps, out, strategy_kwargs, trainer_kwargs) -> Trainer:
    strategy = OOMBDDPStrategy(**{"chunk_size": CHUNK, "page_size": PAGE, "attention": "reference", **strategy_kwargs})
    return Trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[Record(out)],
                   use_distributed_sampler=False, **TRAINER, **trainer_kwargs)


def _fit_rank(rank, world, port, out, family, module_kwargs, items, steps, strategy_kwargs, trainer_kwargs) -> None:
    as_torchrun_rank(rank, world, port)
    module = UserModule(tiny_model(family), **module_kwargs)  # built here: a module passed in would share its memory
    _ddp_trainer(world, steps, out, strategy_kwargs, trainer_kwargs).fit(module, datamodule=RankRows(items))


def fit_ddp(tmp_path, family, items, world, steps, strategy_kwargs=None, module_kwargs=None, spawn=False,
            **trainer_kwargs):
    """Fit ``UserModule(tiny_model(family), **module_kwargs)`` over ``world`` gloo processes, each its own rows of
    ``items`` (``RankRows``): started as torchrun starts them, or with ``spawn`` by Lightning's own launcher (Trainer
    and module pickled to each); returns rank 0's (first gradients, final weights)."""
    strategy_kwargs, module_kwargs = strategy_kwargs or {}, module_kwargs or {}
    if spawn:
        trainer = _ddp_trainer(world, steps, tmp_path, {"start_method": "spawn", **strategy_kwargs}, trainer_kwargs)
        trainer.fit(UserModule(tiny_model(family), **module_kwargs), datamodule=RankRows(items))
    else:
        spawn_ranks(_fit_rank, world, tmp_path, family, module_kwargs, items, steps, strategy_kwargs, trainer_kwargs)
    grads = [torch.load(tmp_path / f"grads{r}.pt") for r in range(world)]
    final = [torch.load(tmp_path / f"weights{r}.pt") for r in range(world)]
    for r in range(1, world):  # every rank takes the same steps
        assert all(torch.equal(grads[r][n], grads[0][n]) for n in grads[0])
        assert all(torch.equal(final[r][n], final[0][n]) for n in final[0])
    return grads[0], final[0]


def module_grads(model, items):
    """transformers' full-sequence gradients of the batch ``items``, named as in UserModule."""
    _, grads = full_sequence_grads(model, *stacked(items))
    return {f"model.{n}": g for n, g in grads.items()}


def test_adamw_steps_equal_one_process(tmp_path):
    """Two AdamW steps on 2 ranks that Lightning spawns (rank 1's first batch has no valid label): the averaged
    gradient is transformers' of both rows, the weights those of OOMBStrategy on one process with both rows per
    batch."""
    items = sequences(4)
    grads, got = fit_ddp(tmp_path, "qwen2", items, 2, 2, module_kwargs={"lr": 1e-2, "optimizer": "adamw"},
                         spawn=True)
    assert_grads_close(grads, module_grads(tiny_model("qwen2"), items[:2]), 1e-5)

    one = UserModule(tiny_model("qwen2"), lr=1e-2, optimizer="adamw")
    start = weights(one)
    Trainer(devices=1, max_steps=2, strategy=OOMBStrategy(chunk_size=CHUNK, page_size=PAGE, attention="reference"),
            **TRAINER).fit(one, DataLoader(items, batch_size=2))
    assert_adamw_updates_close(got, weights(one), start)


def test_three_ranks_layer_checkpointing_accumulation(tmp_path):
    """3 ranks, layer checkpointing, 2 micro-batches per step: the gradient the optimizer sees is the mean of
    transformers' gradients of the two micro-batches of 3 rows each."""
    items = sequences(6)
    grads, _ = fit_ddp(tmp_path, "qwen2-tied", items, 3, 1,
                       {"checkpoint_layers": True}, accumulate_grad_batches=2)
    first, second = module_grads(tiny_model("qwen2-tied"), items[:3]), module_grads(tiny_model("qwen2-tied"), items[3:])
    assert_grads_close(grads, {n: (first[n] + second[n]) / 2 for n in first}, 1e-5)


@pytest.mark.parametrize("options", [{"offload": "host"}, {"keep_graphs": 2}], ids=["host-pages", "kept-graphs"])
def test_qwen3_host_pages_or_kept_graphs(tmp_path, options):
    """Qwen3 (q/k norms) on 2 ranks with every page in host memory, or with the last 2 chunks' graphs kept
    from stage 1: the averaged gradient is transformers'."""
    items = sequences(2)
    grads, _ = fit_ddp(tmp_path, "qwen3", items, 2, 1, options)
    assert_grads_close(grads, module_grads(tiny_model("qwen3"), items), 1e-5)


def test_clipping_after_the_average(tmp_path):
    """Clipped SGD steps on 2 ranks give plain one-process training's weights: the norm is taken over the
    averaged gradient (clipping each rank's own would scale the updates differently)."""
    items = sequences(4)
    _, got = fit_ddp(tmp_path, "llama", items, 2, 2, gradient_clip_val=0.05)
    plain = UserModule(tiny_model("llama"))
    start = weights(plain)
    Trainer(devices=1, max_steps=2, gradient_clip_val=0.05, **TRAINER).fit(plain, DataLoader(items, batch_size=2))
    want = weights(plain)
    # As in test_strategy's clipping test: float32 rounding anywhere reaches every entry through the norm.
    worst = max((rel_err(got[n] - start[n], want[n] - start[n]), n) for n in want)
    assert worst[0] <= 1e-4, f"update of {worst[1]} differs by {worst[0]:.2e}"


def _mismatched_rank(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    dist.init_process_group("gloo")
    try:
        ranks = DataParallelRanks(torch.device("cpu"))
        assert ranks.least([10 + rank, 20 - rank]) == [10, 20 - world + 1]
        ids, labels = stacked(sequences(1, SEQ - 8 * rank))
        config = ChunkConfig(chunk_size=CHUNK, page_size=PAGE, attention="reference")
        try:
            ChunkedSequence(tiny_model("qwen2"), ids, labels, config, ranks=ranks)
            message = "no error"
        except ValueError as e:
            message = str(e)
        with open(f"{out}{rank}", "w") as f:
            f.write(message)
    finally:
        dist.destroy_process_group()


def test_mismatched_sequence_lengths_refused_on_every_rank(tmp_path):
    world = 3
    spawn_ranks(_mismatched_rank, world, str(tmp_path / "error"))
    for rank in range(world):
        message = (tmp_path / f"error{rank}").read_text()
        assert message.startswith("data-parallel ranks must run batches of one shape") and "\n" not in message
        assert "rank 1: 1x32 tokens" in message


def packed_rows(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``world`` rows of SEQ tokens packed from documents of other lengths per row: ids, labels, position ids."""
    lengths = [[5, 20, 15], [12, 28], [3, 9, 9, 19]][:world]
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    ids = torch.randint(0, VOCAB, position_ids.shape, generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, 6:14] = -100
    return ids, labels, position_ids


def _weighted_rank(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    dist.init_process_group("gloo")
    try:
        model = tiny_model("qwen2")
        ids, labels, position_ids = (t[rank: rank + 1] for t in packed_rows(world))
        config = ChunkConfig(chunk_size=CHUNK, page_size=PAGE, attention="reference")
        seq = ChunkedSequence(model, ids, labels, config, ranks=DataParallelRanks(torch.device("cpu")),
                              position_ids=position_ids, loss_weights=document_loss_weights(labels, position_ids))
        seq.fill()
        seq.backward()
        seq.release()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world  # as DDP averages
        if rank == 0:
            torch.save({n: p.grad for n, p in model.named_parameters()}, out)
    finally:
        dist.destroy_process_group()


def test_loss_weights_over_ranks_are_one_process_weighted_mean(tmp_path):
    """Per-document loss weights on 3 ranks, a row each: the sum of the weights is agreed over the ranks (a
    float all-reduce), so the averaged gradient is that of one process's weighted mean over all rows."""
    world, out = 3, tmp_path / "grads.pt"
    spawn_ranks(_weighted_rank, world, str(out))
    model = tiny_model("qwen2")
    ids, labels, position_ids = packed_rows(world)
    lightning_oomb.train_step(model, ids, labels, position_ids=position_ids, chunk_size=CHUNK, page_size=PAGE,
                              attention="reference", loss_weights=document_loss_weights(labels, position_ids))
    one_process = {n: p.grad for n, p in model.named_parameters()}
    assert_grads_close(torch.load(out), one_process, 1e-5)


def test_registered_names():
    for name, start_method in (("oomb_ddp", "popen"), ("oomb_ddp_spawn", "spawn")):
        strategy = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy
        assert isinstance(strategy, OOMBDDPStrategy) and strategy._start_method == start_method
    with pytest.raises(TypeError, match="does not wrap the model"):
        OOMBDDPStrategy(find_unused_parameters=True)
