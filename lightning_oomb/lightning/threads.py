"""The CPU threads a run computes on: torch's intra-op threads, set for the run."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from typing_extensions import override

from ..core.errors import SetupError


class TorchThreads(Callback):
    """Sets ``torch.set_num_threads(num_threads)`` when the run is set up.

    torch's threads wait for each other at every operation; on a CPU that another process also uses, each
    operation then waits for the slowest thread's turn on a core, and a small model's step slows tens of times
    (the CPU examples: 0.15 steps/s with both threads of a busy 2-core machine, 13 with one). One thread keeps
    the share of the CPU it has; a large model on an idle many-core CPU wants more.
    """

    def __init__(self, num_threads: int = 1):
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise SetupError(f"TorchThreads: num_threads must be an integer >= 1, got {num_threads!r}")
        self.num_threads = num_threads

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        torch.set_num_threads(self.num_threads)
