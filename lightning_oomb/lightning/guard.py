"""NonFiniteGuard: a step whose loss or gradients are not finite does not update the weights, a run whose steps
keep being so stops with one line, and no checkpoint or export is made of weights that are not finite."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor
from typing_extensions import override

from ..core.errors import SetupError


class NonFiniteError(RuntimeError):
    """Training stopped: steps in a row with a loss or gradient that is not finite, or weights that are not
    finite where a checkpoint or the export would have saved them. Nothing was saved from them; the command
    line prints it as one line (exit status 1)."""


def _hint(trainer: Trainer) -> str:
    """What to try, in the options of ``lightning-oomb fit``."""
    hint = ("lower the learning rate (model.learning_rate) or warm it up longer (model.warmup_steps), clip the "
            "gradients (trainer.gradient_clip_val 1.0)")
    return hint + ("" if "32" in str(trainer.precision) else ", or train in 32-true")


class NonFiniteGuard(Callback):
    """Checks every optimizer step's loss and gradients before the update, and the weights before every
    checkpoint and at the end of training (before ``lightning-oomb fit`` exports them).

    A step whose loss or gradient is nan or inf has its update skipped: its gradients are dropped before the
    optimizer runs, so the weights and the optimizer state stay as they were (the batch is used up and the
    learning-rate schedule moves on, as for any step). At ``stop_after`` such steps in a row the run stops with
    ``NonFiniteError`` before that step's update and before its checkpoint, so the last checkpoint stays the
    last one written from finite weights. The check costs one read of the loss and of the gradients' largest
    magnitude per step (one device synchronisation; on several ranks one all-reduce of a flag), and one pass
    over the trained weights per checkpoint.

    Args:
        stop_after: steps in a row with a non-finite loss or gradient at which the run stops (1: at the first).
            The default, 3, skips up to two in a row: a single non-finite step is often one batch overflowing, which
            losing that batch survives; three in a row mean the weights or the learning rate are broken and
            more steps would only spend compute.
        divergence_factor: print one warning per run when a step's loss exceeds this many times the lowest
            step loss of the run so far (the loss is rising by orders of magnitude: the run is diverging);
            None: never.
    """

    def __init__(self, stop_after: int = 3, divergence_factor: float | None = 100.0):
        if stop_after < 1:
            raise SetupError(f"NonFiniteGuard: stop_after must be >= 1, got {stop_after}")
        if divergence_factor is not None and divergence_factor <= 1:
            raise SetupError(f"NonFiniteGuard: divergence_factor must be > 1 or None, got {divergence_factor}")
        self.stop_after = stop_after
        self.divergence_factor = divergence_factor
        self._loss: torch.Tensor | None = None
        self._in_a_row = 0
        self._lowest: tuple[float, int] | None = None  # (loss, step)
        self._warned = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._loss, self._in_a_row, self._lowest, self._warned = None, 0, None, False

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # Under gradient accumulation each micro-batch's loss comes here already divided: their sum is the step's.
        loss = loss.detach().float()
        self._loss = loss if self._loss is None else self._loss + loss

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        loss, self._loss = self._loss, None
        grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else pl_module.device
        # The largest magnitude (the inf-norm) is nan or inf exactly when a gradient is; a 2-norm could overflow.
        largest = (torch.nn.utils.get_total_norm(grads, norm_type=math.inf, foreach=None) if grads
                   else torch.zeros((), device=device))
        loss_value, largest = torch.stack([
            torch.zeros((), device=device) if loss is None else loss.to(device), largest.float(),
        ]).tolist()
        bad = [what for what, value in (("loss", loss_value), ("gradient", largest)) if not math.isfinite(value)]
        step = trainer.global_step + 1
        if not trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
            self._in_a_row = 0
            if loss is not None:
                self._watch_divergence(trainer, loss_value, step)
            return
        self._in_a_row += 1
        if len(bad) == 2:
            what = f"the loss is {loss_value} and a gradient is {largest}"
        elif bad == ["loss"]:
            what = f"the loss is {loss_value}"
        elif bad:
            what = f"a gradient is {largest} (the loss {loss_value:.4g})"
        else:
            what = "another rank's loss or gradient is not finite"
        what += f" at learning rate {float(optimizer.param_groups[0]['lr']):.3g}"
        if self._in_a_row >= self.stop_after:
            in_a_row = f", the {_nth(self._in_a_row)} step in a row" if self._in_a_row > 1 else ""
            raise NonFiniteError(
                f"training stopped at step {step}: {what}{in_a_row}; the step was not applied and "
                f"{_last_checkpoint(trainer)}. Try: {_hint(trainer)}"
            )
        optimizer.zero_grad(set_to_none=True)  # optimizers skip a parameter without a gradient: nothing changes
        _print_rank_zero(trainer, f"step {step}: {what}: its update was skipped (weights and optimizer state "
                                  f"unchanged); the run stops at the {_nth(self.stop_after)} such step in a row. "
                                  f"If it recurs: {_hint(trainer)}")

    def _watch_divergence(self, trainer: Trainer, loss: float, step: int) -> None:
        if self._lowest is None or loss < self._lowest[0]:
            self._lowest = (loss, step)
        lowest, at = self._lowest
        if self.divergence_factor is None or self._warned or lowest <= 0 or loss <= self.divergence_factor * lowest:
            return
        self._warned = True
        _print_rank_zero(trainer, f"warning: step {step}: the loss {loss:.4g} is {loss / lowest:,.0f} times the "
                                  f"run's lowest ({lowest:.4g} at step {at}): training is diverging. "
                                  f"Try: {_hint(trainer)}")

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # Called while the checkpoint is put together, before anything is written: raising here keeps the file.
        self._check_weights(trainer, pl_module, "this checkpoint was not written")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._check_weights(trainer, pl_module, "nothing was exported")

    def _check_weights(self, trainer: Trainer, pl_module: LightningModule, outcome: str) -> None:
        trained = [_local(p.detach()) for p in pl_module.parameters() if p.requires_grad]
        finite = torch.stack([torch.isfinite(p).all() for p in trained]).all().item() if trained else True
        if trainer.strategy.reduce_boolean_decision(not finite, all=False):
            raise NonFiniteError(
                f"training stopped after step {trainer.global_step}: the weights are not finite (an update with "
                f"finite gradients overflowed them); {outcome} and {_last_checkpoint(trainer)}. Try: {_hint(trainer)}"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard): what the rank checks."""
    return t.to_local() if isinstance(t, DTensor) else t


def _last_checkpoint(trainer: Trainer) -> str:
    """Where the run can go on from, in words: the last checkpoint it wrote, if any."""
    path = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
    if not path or not Path(path).is_file():
        return "no checkpoint was written"
    return f"{path} holds the last finite weights (resume with --ckpt_path last)"


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _print_rank_zero(trainer: Trainer, line: str) -> None:
    if trainer.is_global_zero:
        print(line, file=sys.stderr, flush=True)
