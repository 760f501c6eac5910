"""The data-parallel ranks a training step agrees with (docs/architecture.md, "Several GPUs").

Every rank runs the two stages on its own sequences. Three things are decided for all ranks together, each
with one collective that every rank issues at the same point of the step: the batch shape (refused when the
ranks differ, before anything else waits on them), the loss's normaliser (the valid labels of all ranks) and
the memory a step is placed against (the least any rank has), so that every rank keeps the same graphs and
attention outputs, puts the same layers' pages in host memory and issues the same collectives after it.
``Ranks`` is one process, whose decisions are its own; ``DataParallelRanks`` the default process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

GRADIENT_BUCKET_BYTES = 25 * 2**20  # float32 gradients per all-reduce: large enough to run at the link's bandwidth


class Ranks:
    """One process: nothing to agree on. ``step_gpu_bytes``: GPU memory a step of this run allocates beyond
    what the planner counts for one process (a sharded strategy's gathered weights and unsharded gradients),
    which the placement reserves. ``kv_head_split``: the tensor-parallel size; each rank computes attention
    for 1/kv_head_split of the KV heads (and their query heads), so its K/V pages hold only those."""

    world_size = 1
    step_gpu_bytes = 0

    def __init__(self, kv_head_split: int = 1):
        self.kv_head_split = kv_head_split

    def check_batch(self, shape: tuple[int, int], chunk_size: int, page_size: int) -> None:
        """Refuse a step whose (batch, seq_len) or chunking differs between ranks."""

    def items(self, count: int | float) -> float:
        """The loss's normaliser for this rank, given its count of valid labels (or the sum of their loss
        weights): the mean per rank."""
        return count

    def least(self, values: list[int]) -> list[int]:
        """Each of ``values`` (ints, such as free bytes) at its least over the ranks."""
        return values


class DataParallelRanks(Ranks):
    """The ranks of torch.distributed's default process group; collectives run on ``device`` (the GPU for NCCL,
    the CPU for gloo).

    The loss of each rank is normalised by the mean valid-label count per rank, so that the gradients averaged
    over the ranks (the strategy's all-reduce) are one process's gradient of all ranks' batches together, and
    each rank's loss, averaged over the ranks, is the loss of that whole batch. Under tensor parallelism the
    ranks of one tensor-parallel group run the same batch: the mean count per rank is still that of the data-
    parallel batches, and their identical gradients of the whole weights average to themselves."""

    def __init__(self, device: torch.device, step_gpu_bytes: int = 0, kv_head_split: int = 1):
        super().__init__(kv_head_split)
        self.device = device
        self.world_size = dist.get_world_size()
        self.step_gpu_bytes = step_gpu_bytes

    def check_batch(self, shape: tuple[int, int], chunk_size: int, page_size: int) -> None:
        mine = torch.tensor([*shape, chunk_size, page_size], dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        seen = [tuple(t.tolist()) for t in every]
        if len(set(seen)) > 1:
            ranks = ", ".join(f"rank {r}: {b}x{n} tokens in chunks of {c}, pages of {p}"
                              for r, (b, n, c, p) in enumerate(seen))
            raise ValueError(f"data-parallel ranks must run batches of one shape and chunking, got {ranks}; "
                             "pad every rank's sequences to one length (label -100) and batch them alike")

    def items(self, count: int | float) -> float:
        exact = torch.float64 if isinstance(count, float) else torch.int64  # counts sum exactly in int64
        total = torch.tensor(count, dtype=exact, device=self.device)
        dist.all_reduce(total)
        return total.item() / self.world_size

    def least(self, values: list[int]) -> list[int]:
        agreed = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return agreed.tolist()
