"""PagedKVCallback: owns the page pool for a Trainer run and logs where the memory goes."""

from __future__ import annotations

import time

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from ..core.config import ChunkConfig
from ..core.errors import SetupError
from ..core.host_memory import peak_process_host_bytes, process_host_bytes, reset_peak_process_host_bytes
from ..core.pages import PagePool
from ..core.optimizers import pending_state
from ..core.placement import Placement, place_step
from ..core.ranks import Ranks
from ..core.schedule import ChunkedSequence, check_chunked_forward, new_pool, pool_bytes
from ..integrations.transformers import find_causal_lm
from ..kernels.page_table import StoreSpec

GIB = 2**30


def probe_kv_dtype(
    model: torch.nn.Module, precision_plugin, device: torch.device, run: ChunkConfig, kv_head_split: int = 1,
) -> StoreSpec:
    """Run two tokens through stage 1 under the precision plugin to learn the K/V store's spec (of this rank's
    1/kv_head_split of the KV heads under tensor parallelism) as the steps of a run chunked as ``run`` says
    make it: its chunk and page sizes size the sliding-window layers' gradient ring, its gradient dtype and host
    memory budget are the run's."""
    seen: list[StoreSpec] = []

    def record(spec: StoreSpec, pages: int, with_grads: bool, placement: Placement) -> PagePool:
        seen.append(spec)
        return PagePool(spec, pages, run.page_size, device, with_grads=False)

    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    with precision_plugin.forward_context():
        config = ChunkConfig(chunk_size=run.chunk_size, page_size=run.page_size, attention="reference",
                             grad_dtype=run.grad_dtype, offload="gpu", host_memory=run.host_memory)
        # keep_last: the last layer's forward runs to its end (stage 1 may stop at its K/V store), so that a
        # layer sharded by FSDP is not left gathered, mid-forward, until the first step.
        ChunkedSequence(model, ids, config=config, pools=record, ranks=Ranks(kv_head_split)).fill(
            with_grads=False, keep_last=1)
    return seen[0]


class PagedKVCallback(Callback):
    """Allocates the KV page pool once at fit start, hands it to OOMBStrategy, frees it at teardown, and logs
    the memory each step (``memory/...``, with host pages ``offload/...``: docs/guide.md, "What you see"). Host
    pages are pinned once, in one block per tensor (pinning 100 GB takes about a minute).

    Args:
        max_seq_len, max_batch_size: the largest batch the pool must hold. By default they are read from
            the DataModule's ``seq_len`` (or its longest ``val_lengths``) and ``batch_size``; without them the
            pool is sized by the first batch, and a larger batch later is refused with a message. Where the
            pages live follows the strategy's ``offload``, decided once, for the largest batch.
        trace_step: a global step whose memory after every chunk of stage 1 and stage 2 is logged as
            ``memory_trace/allocated_gib`` (x axis: position in the trace, stage 1's chunks first),
            ``memory_trace/host_gib`` (the process's resident host memory, pinned pages included) and
            ``memory_trace/stage``: the flat profile the method promises, or where it is not flat.
        print_plan: print the plan of the step as placed at fit start (memory by line against the GPU and the
            host memory budget, predicted time) and how long pinning the host pages took.
    """

    def __init__(
        self, max_seq_len: int | None = None, max_batch_size: int | None = None, trace_step: int | None = None,
        print_plan: bool = True,
    ):
        for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.trace_step = trace_step
        self.print_plan = print_plan
        self.placement: Placement | None = None
        self._trace: list[tuple[int, float, float]] | None = None
        self.pool: PagePool | None = None
        self._page_size = 1
        self._device = torch.device("cpu")
        self._fitting = True

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        config = getattr(trainer.strategy, "chunk_config", None)
        if config is None:
            raise RuntimeError("PagedKVCallback works with OOMBStrategy (Trainer(strategy=OOMBStrategy(...)))")
        self._page_size = config.page_size
        self._device = trainer.strategy.root_device
        self._fitting = stage == "fit"  # only training steps need gradient pages
        shape = self._largest_batch(trainer)
        self._largest_pages = shape[0] * -(-shape[1] // self._page_size) if shape else 0

    def _largest_batch(self, trainer: Trainer) -> tuple[int, int] | None:
        dm = trainer.datamodule
        seq_len = self.max_seq_len or getattr(dm, "seq_len", None)
        if seq_len and not self.max_seq_len:  # held-out sequences may be longer (PasskeyTextDataModule)
            seq_len = max([seq_len, *getattr(dm, "val_lengths", ())])
        batch = self.max_batch_size or getattr(dm, "batch_size", None) or 1
        return (batch, seq_len) if seq_len else None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = find_causal_lm(pl_module)
        try:  # the weights are made now: the model's chunked forward against its whole one, in the run's precision
            with trainer.precision_plugin.forward_context():
                check_chunked_forward(model, trainer.strategy.chunk_config.host_memory)
        except NotImplementedError as e:
            raise SetupError(f"this model cannot be trained by lightning_oomb: {e}") from None
        shape = self._largest_batch(trainer)
        if shape is None:
            return
        config = trainer.strategy.chunk_config
        optimizer, pending, pending_host = pending_state(trainer.optimizers)
        with trainer.precision_plugin.forward_context():  # the precision decides the K/V dtype
            # OOMBStrategy's steps are served: they keep each chunk's dL/dh from stage 1 to stage 2
            self.placement = place_step(model, *shape, config, self._device, stage_1_loss=True,
                                        optimizer=optimizer, pending_gpu_bytes=pending,
                                        pending_host_bytes=pending_host,
                                        document_length=getattr(trainer.datamodule, "document_length", None),
                                        agree=trainer.strategy.ranks.least,
                                        kv_head_split=trainer.strategy.ranks.kv_head_split)
        spec = probe_kv_dtype(model, trainer.precision_plugin, self._device, config,
                              trainer.strategy.ranks.kv_head_split)
        pages = shape[0] * -(-shape[1] // self._page_size)
        started = time.perf_counter()
        self.pool = new_pool(spec, pages, self._page_size, self._device, True, self.placement)
        if self.print_plan and trainer.is_global_zero:
            print(f"{self.placement.plan}\n")
            if self.pool.host.total:
                print(f"pinned {self.pool.host.total / GIB:.2f} GiB of host memory for the page pool in "
                      f"{time.perf_counter() - started:.1f} s\n")

    def __call__(self, spec: StoreSpec, pages: int, with_grads: bool, placement: Placement) -> PagePool:
        """The engine's pool provider: the pool for a step that needs ``pages`` pages of ``spec``. The pool
        keeps the placement decided when it was built (for the largest batch)."""
        if self.pool is None:  # a step outside fit (validate, test): sized for the largest batch all the same
            grads = self._fitting or with_grads
            pages = max(pages, getattr(self, "_largest_pages", 0))
            self.pool = new_pool(spec, pages, self._page_size, self._device, grads, placement)
            self.placement = placement
        if self.pool.spec != spec:
            raise RuntimeError(f"the page pool was built for {self.pool.spec} but this step stores {spec}")
        if with_grads and not self.pool.with_grads:
            raise RuntimeError("the page pool was built for evaluation (no gradient pages) but a training step needs them")
        if pages > self.pool.num_pages:
            raise RuntimeError(
                f"this batch needs {pages} KV pages of {self.pool.page_size} tokens but the pool was sized for "
                f"{self.pool.num_pages}; pass PagedKVCallback(max_seq_len=..., max_batch_size=...) for the largest batch"
            )
        return self.pool

    def held_bytes(self) -> tuple[int, int]:
        """(GPU, host) bytes of the pool already allocated, which the engine's memory check counts as available."""
        return (0, 0) if self.pool is None else pool_bytes(self.pool)

    def host_grad_layers(self) -> int | None:
        """KV-gradient layers in host memory of the pool every step uses (None before there is one)."""
        return None if self.pool is None else self.pool.host_grad_layers

    def pool_placement(self) -> Placement | None:
        """The placement the pool every step uses was made with (its host memory budget is the run's)."""
        return None if self.pool is None else self.placement

    def host_kv_layers(self) -> int | None:
        """K/V layers in host memory of the pool every step uses (None before there is one)."""
        return None if self.pool is None else self.pool.host_kv_layers

    def observe(self, stage: int, index: int, start: int, end: int) -> None:
        """The engine's chunk observer: records memory after each chunk of a traced step."""
        if self._trace is not None:
            host = process_host_bytes()
            used = torch.cuda.memory_allocated(self._device) if self._device.type == "cuda" else host
            self._trace.append((stage, used / GIB, host / GIB))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.trace_step and trainer.logger is not None:
            self._trace = []
        if self.pool is not None:
            self.pool.peak_pages_in_use = self.pool.pages_in_use
        reset_peak_process_host_bytes()
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        metrics = {"memory/host_gib": process_host_bytes() / GIB,
                   "memory/host_peak_gib": peak_process_host_bytes() / GIB}
        if self.placement is not None and self.placement.plan is not None:
            metrics["memory/host_budget_gib"] = self.placement.plan.host_memory / GIB
        if self.pool is not None:
            gpu_bytes, host_bytes = pool_bytes(self.pool)
            metrics["memory/pool_gib"] = gpu_bytes / GIB
            metrics["memory/pool_host_gib"] = host_bytes / GIB
            metrics["memory/pages_in_use"] = float(self.pool.peak_pages_in_use)
            metrics["memory/pages_total"] = float(self.pool.num_pages)
            if self.pool.on_host:
                stats = self.pool.streamer.take_stats()
                metrics["offload/h2d_gib"] = stats.h2d_bytes / GIB
                metrics["offload/d2h_gib"] = stats.d2h_bytes / GIB
                metrics["offload/h2d_s"] = stats.h2d_s
                metrics["offload/d2h_s"] = stats.d2h_s
        if self._device.type == "cuda":
            metrics["memory/gpu_allocated_gib"] = torch.cuda.memory_allocated(self._device) / GIB
            metrics["memory/gpu_peak_gib"] = torch.cuda.max_memory_allocated(self._device) / GIB
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        if self._trace:
            for i, (stage, gib, host_gib) in enumerate(self._trace):
                trainer.logger.log_metrics({"memory_trace/allocated_gib": gib, "memory_trace/host_gib": host_gib,
                                            "memory_trace/stage": stage}, step=i)
            self._trace = None

    def release_pool(self) -> None:
        """Give the pool's GPU and pinned host memory back (a later step builds a new one)."""
        self.pool = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.release_pool()
