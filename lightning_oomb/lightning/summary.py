"""Lightning's model summary without its FLOPs where it counted none. Lightning counts FLOPs only by running the
module's ``example_input_array`` (which a model of a million-token context is not run on just to be summarised);
without one it prints a FLOPs column of zeros and "Total FLOPs: 0". ``OOMBStrategy`` puts these in place of
Lightning's ``ModelSummary`` and ``RichModelSummary`` (``in_place_of``), with their settings; where FLOPs were
counted they print what Lightning's do."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)
from typing_extensions import override

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's summary is logged


def _without_flops(summary_data: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(name, values) for name, values in summary_data if name != "FLOPs"]


class CountedFlopsSummary(ModelSummary):
    """Lightning's ``ModelSummary``, its FLOPs column and total left out where none were counted."""

    @override
    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int,
                  trainable_parameters: int, model_size: float, total_training_modes: dict[str, int],
                  total_flops: int, **summarize_kwargs: Any) -> None:
        if total_flops:
            return super().summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                     total_training_modes, total_flops, **summarize_kwargs)
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *_without_flops(summary_data))
        log.info("\n" + table.rsplit("\n", 1)[0])  # the table's last line is the total FLOPs


class CountedFlopsRichSummary(RichModelSummary):
    """Lightning's ``RichModelSummary``, its FLOPs column and total left out where none were counted."""

    @override
    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int,
                  trainable_parameters: int, model_size: float, total_training_modes: dict[str, int],
                  total_flops: int, **summarize_kwargs: Any) -> None:
        if total_flops:
            return super().summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                     total_training_modes, total_flops, **summarize_kwargs)
        from rich import get_console
        from rich.table import Table

        data = _without_flops(summary_data)
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in data:  # as Lightning's columns
            right = name.startswith("Params") or name.endswith("sizes")
            table.add_column(name, justify="right" if right else "left", no_wrap=name == "Name",
                             style="dim" if name == " " else "white" if name.endswith("sizes") else None)
        for row in zip(*(values for _, values in data)):
            table.add_row(*row)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)


def in_place_of(callbacks: list) -> None:
    """Replaces, in ``callbacks``, each of Lightning's own ``ModelSummary`` and ``RichModelSummary`` (the one the
    Trainer adds, or one a user named) by the summary above with its settings. Subclasses are left as they are."""
    for i, callback in enumerate(callbacks):
        kind = {ModelSummary: CountedFlopsSummary, RichModelSummary: CountedFlopsRichSummary}.get(type(callback))
        if kind is not None:
            callbacks[i] = kind(callback._max_depth, **callback._summarize_kwargs)
