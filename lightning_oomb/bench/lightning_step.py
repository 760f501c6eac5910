"""Does the Lightning route cost more than train_step? One model, one context, timed three ways.

    python -m lightning_oomb.bench.lightning_step --model qwen2.5-7b --context 32k [--steps 3]

(a) ``train_step`` alone; (b) ``torch.optim.SGD.step`` alone; (c) a full Lightning step
(``Trainer(strategy=OOMBStrategy(), precision="bf16-true")`` around an unchanged LightningModule with plain
SGD), timed from batch start to batch end by a callback. Each is the median of ``--steps`` after one
warm-up. Target: (c) <= (a) + (b), up to noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from .. import OOMBStrategy, train_step
from ..cli_flags import add_chunk
from ..core.model_shape import ModelShape
from ..core.schedule import release_cached_pool
from ..core.units import parse_tokens
from .config import BenchConfig
from .sweep import build_model


class _Module(LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class _StepTimer(Callback):
    def __init__(self):
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)


def _timed(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--context", default="32k")
    add_chunk(parser)
    parser.add_argument("--steps", type=int, default=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark times CUDA steps; run it on a GPU machine")
    context = parse_tokens(args.context)
    device = torch.device("cuda")
    model = build_model(BenchConfig(model=args.model), device, torch.bfloat16)
    ids = torch.randint(0, ModelShape.resolve(args.model).vocab, (1, context), device=device)

    def plain_step():
        model.zero_grad(set_to_none=False)
        train_step(model, ids, chunk_size=args.chunk)

    t_step = _timed(plain_step, args.steps)
    release_cached_pool(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    t_sgd = _timed(sgd.step, args.steps)

    timer = _StepTimer()
    trainer = Trainer(
        accelerator="gpu", devices=1, strategy=OOMBStrategy(chunk_size=args.chunk), precision="bf16-true",
        max_steps=args.steps + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer],
    )
    trainer.fit(_Module(model), DataLoader([ids[0]] * (args.steps + 1), batch_size=1))
    t_lightning = statistics.median(timer.times[1:])
    print(f"{args.model}, context {context:,}, chunk {args.chunk}, {torch.cuda.get_device_name()}")
    print("| train_step | SGD step | Lightning step | Lightning / (train_step + SGD) |")
    print("|---|---|---|---|")
    print(f"| {t_step:.2f} s | {t_sgd * 1e3:.0f} ms | {t_lightning:.2f} s | {t_lightning / (t_step + t_sgd):.3f} |")


if __name__ == "__main__":
    main()
