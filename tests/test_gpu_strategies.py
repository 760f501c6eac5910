"""On a CUDA GPU, one process (NCCL, world 1): OOMBDDPStrategy and OOMBModelParallelStrategy (zero2, zero3 with
layer checkpointing) in bf16 with the Triton kernels take the steps OOMBStrategy takes: the DDP gradient and
weights bit for bit (its float32 all-reduce bucket over one rank changes nothing); the sharded modes within the
bf16 error that OOMBStrategy's own bf16 step has against its float32 step (FSDP2 accumulates each chunk's
reduced gradient into the sharded one, a different rounding)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Qwen2Config

from lightning_oomb import OOMBDDPStrategy, OOMBModelParallelStrategy, OOMBStrategy
from test_fsdp import _whole
from tiny_models import as_torchrun_rank, rel_err, spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ, CHUNK, PAGE, STEPS = 2048, 512, 128, 2
TRAINER = dict(accelerator="gpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


class Module(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Record(Callback):
    """The first step's gradients and the final weights, whole, in float32 (every rank joins the gathers)."""

    def __init__(self):
        self.grads, self.weights = {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            self.grads = {n: _whole(p.grad).float().cpu() for n, p in pl_module.named_parameters()}

    def on_train_end(self, trainer, pl_module):
        self.weights = {n: _whole(p).float().cpu() for n, p in pl_module.named_parameters()}


def _items() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    items = []
    for _ in range(STEPS):
        ids = torch.randint(0, 4096, (SEQ,), generator=g)
        labels = ids.clone()
        labels[:700] = -100  # the first chunk and part of the second predict nothing
        items.append({"input_ids": ids, "labels": labels})
    return items


def _fit(strategy, precision: str = "bf16-true") -> Record:
    record = Record()
    Trainer(strategy=strategy, precision=precision, callbacks=[record], **TRAINER).fit(
        Module(), DataLoader(_items(), batch_size=1))
    return record


def _runs(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    options = dict(chunk_size=CHUNK, page_size=PAGE)
    runs = {"fp32": _fit(OOMBStrategy(**options), "32-true"),
            "bf16": _fit(OOMBStrategy(**options)),
            "ddp": _fit(OOMBDDPStrategy(**options)),
            "zero2": _fit(OOMBModelParallelStrategy(**options)),
            "zero3": _fit(OOMBModelParallelStrategy(sharding="zero3", checkpoint_layers=True, **options))}
    torch.save({name: (r.grads, r.weights) for name, r in runs.items()}, f"{out}/runs.pt")


def test_strategies_on_one_gpu_take_oomb_strategy_steps(tmp_path):
    spawn_ranks(_runs, 1, str(tmp_path))
    runs = torch.load(tmp_path / "runs.pt")
    grads, grads32 = runs["bf16"][0], runs["fp32"][0]
    assert all(torch.isfinite(g).all() for g in grads.values())
    for kind in (0, 1):
        assert all(torch.equal(runs["ddp"][kind][n], runs["bf16"][kind][n]) for n in grads)
    bf16_error = max(rel_err(grads[n], grads32[n]) for n in grads)
    print(f"bf16 step against float32: worst gradient error {bf16_error:.2e}")
    for name in ("zero2", "zero3"):
        worst = max((rel_err(runs[name][0][n], grads[n]), n) for n in grads)
        print(f"{name} against OOMBStrategy in bf16: worst gradient error {worst[0]:.2e} ({worst[1]})")
        assert worst[0] <= bf16_error, f"{name}: {worst[1]} differs by {worst[0]:.2e} (bf16 itself: {bf16_error:.2e})"
