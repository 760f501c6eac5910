"""The progress bar of ``lightning-oomb`` runs: Lightning's own (rich's where rich is installed, else tqdm's),
with the counts of a run that ``max_steps`` ends, resumed or not, and the logger's version whole."""

from __future__ import annotations

import math
from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks.progress import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from typing_extensions import override


def run_epochs(trainer: pl.Trainer) -> int | None:
    """The epochs a run trains: ``max_epochs``, or fewer when ``max_steps`` ends it first (None: no bound that
    can be counted). An epoch's last batch steps the optimizer even within an accumulation window."""
    epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
    batches = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps > 0 and 0 < batches < math.inf:
        by_steps = math.ceil(trainer.max_steps / math.ceil(batches / trainer.accumulate_grad_batches))
        epochs = by_steps if epochs is None else min(epochs, by_steps)
    return epochs


class RunProgress:
    """In front of Lightning's RichProgressBar or TQDMProgressBar (``run_progress_bar`` makes the one Lightning
    would). Lightning's bars count an epoch's batches from the epoch's start but take their total from the
    steps left (``min(batches per epoch, max_steps - global_step)``), so a run resumed in the middle of an epoch
    ends its bar past the total (60/39); and they show the epoch out of ``max_epochs - 1``, which is -2 when
    ``max_steps`` ends the run, and the version's last four characters ("uiet" for "quiet"). Here the total also
    counts the epoch's batches taken before, the epoch is out of the last one the run reaches, and the version is
    the logger's whole."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        trainer = self.trainer
        batches = trainer.num_training_batches
        if trainer.max_steps is None or trainer.max_steps < 1 or batches == math.inf:
            return batches
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        # Between a batch's start and its end it is counted ready but not completed: the bar is being made during
        # the first batch of a run resumed mid-epoch. Otherwise it is an epoch's start: no batch taken yet.
        taken = current.ready if current.ready > current.completed else 0
        accumulate = trainer.accumulate_grad_batches
        # The steps left include the one the batches of an unfinished accumulation window go to.
        return min(batches, taken - taken % accumulate + (trainer.max_steps - trainer.global_step) * accumulate)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        version = "_".join(dict.fromkeys(str(logger.version) for logger in trainer.loggers))
        return {"version": version, **items} if version not in ("", "None") else items


class RunRichProgressBar(RunProgress, RichProgressBar):
    """Lightning's RichProgressBar with ``RunProgress``'s counts and version."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        epochs = run_epochs(self.trainer)
        description = f"Epoch {current_epoch}" + (f"/{epochs - 1}" if epochs is not None else "")
        # As Lightning's: as wide as "Validation", so that the bars do not move when it shows.
        return description.ljust(len(self.validation_description))


class RunTQDMProgressBar(RunProgress, TQDMProgressBar):
    """Lightning's TQDMProgressBar with ``RunProgress``'s counts and version."""


def run_progress_bar() -> ProgressBar:
    """The bar Lightning would add (rich's where rich is installed), as ``RunProgress``."""
    return RunRichProgressBar() if _RICH_AVAILABLE else RunTQDMProgressBar()
