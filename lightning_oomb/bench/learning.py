"""Does a bf16-true run learn like float32? Weight changes and losses of each optimizer against a 32-true run.

    python -m lightning_oomb.bench.learning --out docs/bench/learning-cpu [--steps 100] [--lr 1e-5]
        [--optimizers adamw,adamw-sr,adamw8bit,adamw-kahan,adamw8bit-kahan] [--accelerator cpu]

A Qwen2-shaped model, warmed up in float32 on a synthetic bigram language and rounded to bf16, takes the same
steps once in ``32-true`` with torch AdamW and once per optimizer in ``bf16-true``, through a Lightning
``Trainer`` with ``OOMBStrategy``. docs/optimizers.md, "How close to float32 each trains", has the method.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import shlex
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from ..core.optimizers import OPTIMIZERS
from ..lightning import OOMBStrategy
from ..lightning.module import CausalLMModule

DEFAULT_OPTIMIZERS = ("adamw", "adamw-sr", "adamw8bit", "adamw-kahan", "adamw8bit-kahan")


@dataclass
class Setup:
    """The model, data and schedule of one comparison."""

    hidden: int = 128
    layers: int = 2
    vocab: int = 256
    seq_len: int = 256
    chunk_size: int = 64
    batch: int = 2
    warm_steps: int = 100
    warm_lr: float = 1e-3
    steps: int = 100
    lr: float = 1e-5
    eval_batches: int = 4
    seed: int = 0
    accelerator: str = "cpu"

    def model_config(self) -> dict:
        return dict(model_type="qwen2", vocab_size=self.vocab, hidden_size=self.hidden,
                    intermediate_size=4 * self.hidden, num_hidden_layers=self.layers, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=self.seq_len, tie_word_embeddings=False)


@dataclass
class Run:
    """One run's result: weights at the end, training losses, held-out loss before and after."""

    name: str
    precision: str
    weights: dict[str, torch.Tensor]
    losses: list[float]
    eval_before: float
    eval_after: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


def bigram_batches(setup: Setup, count: int, seed: int) -> torch.Tensor:
    """``count`` sequences (count, seq_len) of a fixed random bigram language (the table from setup.seed,
    the sequences from ``seed``): each token follows from the previous by a sharply peaked distribution."""
    table_gen = torch.Generator().manual_seed(setup.seed)
    logits = torch.randn(setup.vocab, setup.vocab, generator=table_gen) * 3.0
    probs = torch.softmax(logits, dim=-1)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(count, setup.seq_len, dtype=torch.long)
    ids[:, 0] = torch.randint(setup.vocab, (count,), generator=gen)
    for t in range(1, setup.seq_len):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]], 1, generator=gen).squeeze(1)
    return ids


def _loader(ids: torch.Tensor, batch: int) -> DataLoader:
    def collate(rows):
        stacked = torch.stack([r[0] for r in rows])
        return {"input_ids": stacked, "labels": stacked.clone()}

    return DataLoader(TensorDataset(ids), batch_size=batch, shuffle=False, collate_fn=collate)


class _Losses(Callback):
    def __init__(self):
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss))


def _fit(setup: Setup, start: dict[str, torch.Tensor] | None, precision: str, optimizer: str, lr: float,
         steps: int, data: torch.Tensor) -> tuple[CausalLMModule, list[float]]:
    module = CausalLMModule(config=setup.model_config(), optimizer=optimizer, learning_rate=lr, seed=setup.seed,
                            schedule_steps=1_000_000_000)  # a constant rate: the cosine barely starts
    module.materialize("cpu")
    if start is not None:
        module.model.load_state_dict(start)
    losses = _Losses()
    trainer = Trainer(
        accelerator=setup.accelerator, devices=1, precision=precision, max_steps=steps,
        strategy=OOMBStrategy(chunk_size=setup.chunk_size, page_size=16), callbacks=[losses], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )
    with warnings.catch_warnings():  # no validation here, on purpose: the held-out loss is eval_loss's
        warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")
        trainer.fit(module, train_dataloaders=_loader(data, setup.batch))
    return module, losses.values


@torch.no_grad()
def eval_loss(setup: Setup, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> float:
    """Mean next-token loss of ``weights`` (computed in float32, whatever they were trained in) on ``ids``."""
    module = CausalLMModule(config=setup.model_config(), seed=setup.seed)
    module.materialize("cpu")
    module.model.load_state_dict({k: v.float() for k, v in weights.items()})
    module.model.eval()
    return float(module.model(input_ids=ids, labels=ids).loss)


def compare(setup: Setup, optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS,
            progress=lambda line: None) -> tuple[Run, list[Run]]:
    """(the 32-true reference run, one bf16-true run per optimizer), each with its metrics."""
    total = setup.warm_steps + setup.steps
    data = bigram_batches(setup, total * setup.batch, seed=setup.seed + 1)
    held_out = bigram_batches(setup, setup.eval_batches * setup.batch, seed=setup.seed + 2)
    warm, _ = _fit(setup, None, "32-true", "adamw", setup.warm_lr, setup.warm_steps,
                   data[: setup.warm_steps * setup.batch])
    start = {k: v.detach().to(torch.bfloat16).float() for k, v in warm.model.state_dict().items()}
    before = eval_loss(setup, start, held_out)
    progress(f"start: {setup.warm_steps} float32 steps at lr {setup.warm_lr:g}, held-out loss {before:.4f}")
    rest = data[setup.warm_steps * setup.batch:]

    def run(name: str, precision: str) -> Run:
        began = time.perf_counter()
        module, losses = _fit(setup, start, precision, name, setup.lr, setup.steps, rest)
        weights = {k: v.detach().cpu().clone() for k, v in module.model.state_dict().items()}
        result = Run(name, precision, weights, losses, before, eval_loss(setup, weights, held_out),
                     time.perf_counter() - began)
        progress(f"{name} {precision}: held-out loss {result.eval_after:.5f} ({result.seconds:.1f} s)")
        return result

    reference = run("adamw", "32-true")
    want = _change(reference.weights, start)
    runs = []
    for name in optimizers:
        r = run(name, "bf16-true")
        got = _change(r.weights, start)
        r.metrics = {
            "changed": float((got != 0).float().mean()),
            "cosine": float(torch.nn.functional.cosine_similarity(got, want, dim=0)),
            "norm_ratio": float(got.norm() / want.norm()),
            "loss_decrease_ratio": (r.eval_before - r.eval_after) / (reference.eval_before - reference.eval_after),
        }
        runs.append(r)
    reference.metrics = {"changed": float((want != 0).float().mean()), "cosine": 1.0, "norm_ratio": 1.0,
                         "loss_decrease_ratio": 1.0}
    return reference, runs


def _change(weights: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(weights[k].float() - start[k]).flatten() for k in sorted(start)]).double()


def write_report(out: Path, setup: Setup, reference: Run, runs: list[Run], command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    everything = [reference, *runs]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["optimizer", "precision", "changed", "cosine", "norm_ratio", "eval_before", "eval_after",
                         "loss_decrease_ratio", "seconds", "train_losses"])
        for r in everything:
            writer.writerow([r.name, r.precision, f"{r.metrics['changed']:.4f}", f"{r.metrics['cosine']:.4f}",
                             f"{r.metrics['norm_ratio']:.4f}", f"{r.eval_before:.6f}", f"{r.eval_after:.6f}",
                             f"{r.metrics['loss_decrease_ratio']:.4f}", f"{r.seconds:.1f}",
                             " ".join(f"{v:.5f}" for v in r.losses)])
    device = torch.cuda.get_device_name() if setup.accelerator == "gpu" else platform.processor() or "CPU"
    lines = [
        "# Learning quality: bf16-true optimizers against a 32-true run", "",
        f"- machine: {device}, {platform.node()}; torch {torch.__version__}; "
        f"{datetime.date.today().isoformat()}",
        f"- command: `{command}`",
        f"- model: Qwen2-shaped, hidden {setup.hidden}, {setup.layers} layers, vocab {setup.vocab}; "
        f"{setup.warm_steps} float32 warm-up steps at lr {setup.warm_lr:g}, then {setup.steps} steps at lr "
        f"{setup.lr:g}, batch {setup.batch} x {setup.seq_len} tokens (chunks of {setup.chunk_size})",
        f"- held-out loss at the start: {reference.eval_before:.5f}", "",
        "| optimizer | precision | weights changed | cosine to 32-true | norm ratio | held-out loss after | "
        "loss decrease vs 32-true |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in everything:
        m = r.metrics
        lines.append(f"| {r.name} | {r.precision} | {m['changed']:.1%} | {m['cosine']:.3f} | {m['norm_ratio']:.3f} "
                     f"| {r.eval_after:.5f} | {m['loss_decrease_ratio']:.3f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in everything:
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=f"{r.name} ({r.precision})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{setup.steps} steps at lr {setup.lr:g} from a briefly trained state")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "results.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_oomb.bench.learning", description=__doc__.split("\n")[0])
    defaults = Setup()
    for name in ("hidden", "layers", "seq_len", "chunk_size", "batch", "warm_steps", "steps", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warm-lr", type=float, default=defaults.warm_lr)
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default=defaults.accelerator)
    parser.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                        help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.md, results.csv, results.png")
    args = parser.parse_args(argv)
    names = tuple(n for n in args.optimizers.split(",") if n)
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        parser.error(f"--optimizers: unknown {', '.join(unknown)}; choose from {', '.join(OPTIMIZERS)}")
    setup = Setup(**{k: getattr(args, k) for k in ("hidden", "layers", "seq_len", "chunk_size", "batch",
                                                   "warm_steps", "steps", "seed", "lr", "warm_lr", "accelerator")})
    reference, runs = compare(setup, names, progress=lambda line: print(line, flush=True))
    write_report(args.out, setup, reference, runs, "python -m lightning_oomb.bench.learning " + shlex.join(sys.argv[1:] if argv is None else argv))
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
