"""The planner's tensor-parallel rank (``plan(tensor_parallel=2)``) against real tensor-parallel steps over 2 gloo
processes on the CPU: the K/V and KV-gradient pages one rank's pool allocates, the parameters it holds in the
decoder layers and outside them, the all-reduces it issues in a step and the tensors a chunk saves for backward.

Three steps of tiny Qwen2 (2 KV heads, one per rank): OOMBModelParallelStrategy(tensor_parallel_size=2) in a
Lightning Trainer (a served step: stage 1 computes the loss), the same with layer checkpointing, and the engine
alone on a model split by ``parallelize_decoder_layers`` (stage 1 ends at the last layer's K/V store). The
processes are started as tests/test_fsdp.py starts them, and its ``_fit`` runs the Trainers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from lightning.pytorch import Callback
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_oomb.core import schedule
from lightning_oomb.core.config import ChunkConfig
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.core.plan import TP_COLWISE, TP_ROWWISE, plan
from lightning_oomb.core.plan.activations import activation_bytes
from lightning_oomb.core.plan.collectives import step_collectives
from lightning_oomb.core.ranks import DataParallelRanks
from lightning_oomb.core.schedule import ChunkedSequence, cached_pool
from lightning_oomb.lightning.model_parallel import TENSOR_PARALLEL_PLAN, parallelize_decoder_layers
from test_ddp import CHUNK, PAGE, SEQ
from test_fsdp import TP, TP_ITEMS, WORLD, _fit
from test_plan_activations import FUSED, saved_bytes_of_one_chunk
from tiny_models import as_torchrun_rank, spawn_ranks, tiny_model

WIDE_MLP, SAVED_CHUNK = 192, 64  # tiny Qwen2 with 4 x its MLP width, and the chunk whose saved tensors are counted
# Bytes of the tensors each kind of all-reduce sent in the step being recorded: DTensor's (tensor parallel's
# activations and their gradients) and the float32 ones of torch.distributed (the whole weights' gradients).
SEEN: dict[str, list[int]] = {"tensor parallel": [], "float32": []}
# The placements the engine gave its steps.
PLACED = []


def _record_collectives_and_placements() -> None:
    functional, c10d, place = funcol.all_reduce, dist.all_reduce, schedule.place_step

    def functional_counted(tensor, *args, **kwargs):
        SEEN["tensor parallel"].append(tensor.numel() * tensor.element_size())
        return functional(tensor, *args, **kwargs)

    def c10d_counted(tensor, *args, **kwargs):
        if tensor.dtype == torch.float32:  # not the label counts (int64) nor which gradients exist (int32)
            SEEN["float32"].append(tensor.numel() * 4)
        return c10d(tensor, *args, **kwargs)

    funcol.all_reduce, dist.all_reduce = functional_counted, c10d_counted
    schedule.place_step = lambda *args, **kwargs: PLACED.append(place(*args, **kwargs)) or PLACED[-1]


def _observed(lm: torch.nn.Module, pool) -> dict:
    """What this rank holds (the causal LM ``lm``'s parameters, the step's page ``pool``) and exchanged in the
    step just run."""
    in_layers = {id(p) for layer in lm.get_decoder().layers for p in layer.parameters()}
    local = {id(p): (p.to_local() if isinstance(p, DTensor) else p).numel() for p in lm.parameters()}
    placed = PLACED[-1]
    return {
        "kv": sum(t.numel() * t.element_size() for t in (pool.k, pool.v)),
        "kv grads": sum(t.numel() * t.element_size() for t in (pool.dk, pool.dv)),
        "layers": sum(n for i, n in local.items() if i in in_layers),
        "root": sum(n for i, n in local.items() if i not in in_layers),
        "placed": dict(graph_chunks=placed.graph_chunks, kept_chunks=placed.kept_chunks,
                       host_kept_chunks=placed.host_kept_chunks),
        # The engine's own placement planned this rank's part (its memory check counts this rank's pages).
        "placed kv": next(v for k, v in placed.plan.gpu_lines.items() if k.startswith("K/V pages")),
        **{kind: list(sizes) for kind, sizes in SEEN.items()},
    }


class Observe(Callback):
    """Rank 0 saves what the first step held and exchanged, from the batch's start to the optimizer step."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for sizes in SEEN.values():
            sizes.clear()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0 and trainer.global_rank == 0:
            torch.save(_observed(pl_module.model, trainer.strategy.kv_callback.pool), self.path)


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    _record_collectives_and_placements()
    for name, kwargs in (("served", TP), ("checkpointed", {**TP, "checkpoint_layers": True})):
        _fit(f"{out}/{name}", "qwen2", TP_ITEMS[:1], 1, kwargs, callbacks=[Observe(f"{out}/{name}.pt")])
    # The engine alone (not served: stage 1 ends at the last layer's K/V store), on the process group the
    # Trainers left, split as the strategy splits it.
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ranks = DataParallelRanks(torch.device("cpu"), kv_head_split=WORLD)

    def split(model: torch.nn.Module) -> torch.nn.Module:
        parallelize_decoder_layers(model, init_device_mesh("cpu", (WORLD,)))
        return model

    model = split(tiny_model("qwen2"))
    item = TP_ITEMS[0]
    for sizes in SEEN.values():
        sizes.clear()
    seq = ChunkedSequence(model, item["input_ids"][None], item["labels"][None],
                          ChunkConfig(chunk_size=CHUNK, page_size=PAGE, attention="reference"), ranks=ranks)
    seq.fill()
    seq.backward()
    seq.release()
    observed = _observed(model, cached_pool(model))
    # The tensors one stage-2 chunk saves for backward, on a model whose MLP outweighs its attention.
    observed["saved"] = {
        fused_ops: saved_bytes_of_one_chunk(split(tiny_model("qwen2", intermediate_size=WIDE_MLP)), SAVED_CHUNK,
                                            "32-true", fused_ops, ranks=ranks)
        for fused_ops in FUSED
    }
    if rank == 0:
        torch.save(observed, f"{out}/direct.pt")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-plan")
    spawn_ranks(_ranks, WORLD, str(out))
    return lambda name: torch.load(out / f"{name}.pt")


def _line(p, prefix: str) -> int:
    (value,) = [v for k, v in p.gpu_lines.items() if k.startswith(prefix)]
    return value


@pytest.mark.parametrize("name", ["served", "checkpointed", "direct"])
def test_planned_rank_is_what_a_tensor_parallel_step_holds_and_exchanges(steps, name):
    """Per rank: the planner's K/V and KV-gradient pages are the pool's bytes (half of one process's), its
    decoder-layer and root weights the parameters the rank holds (q/k/v and gate/up rows with their biases and
    o/down columns split, norms and the root whole), its tensor-parallel all-reduces the DTensor all-reduces
    of the step, call for call and byte for byte (a shorter last chunk included), and its whole weights'
    gradient all-reduce the strategy's float32 all-reduces (the engine alone averages nothing)."""
    got = steps(name)
    shape = ModelShape.resolve(tiny_model("qwen2"))
    options = dict(chunk_size=CHUNK, page_size=PAGE, precision="32-true", fused_ops=False, checkpoint_layers=name ==
                   "checkpointed", stage_1_loss=name != "direct", gpu_memory=2**40, host_memory=2**40, **got["placed"])
    rank, whole = plan(shape, SEQ, tensor_parallel=WORLD, **options), plan(shape, SEQ, **options)
    for prefix, key in (("K/V pages", "kv"), ("KV-gradient pages", "kv grads")):
        assert _line(rank, prefix) == got[key] == _line(whole, prefix) // WORLD
    assert got["placed kv"] == got["kv"]
    assert _line(rank, "weights: decoder layers") == 4 * got["layers"]  # float32
    assert _line(rank, "weights: root") == 4 * got["root"]
    forward, backward, gradients = step_collectives(rank.shape, rank.config)
    ring = 2 * (WORLD - 1) / WORLD  # bus bytes per byte of buffer
    assert len(got["tensor parallel"]) == forward.calls + backward.calls
    assert ring * sum(got["tensor parallel"]) == pytest.approx(forward.calls * forward.bus_bytes
                                                               + backward.calls * backward.bus_bytes)
    assert ring * sum(got["float32"]) == (0 if name == "direct" else gradients.bus_bytes)


@pytest.mark.parametrize("fused_ops", FUSED, ids=["hf-ops", "fused-ops"][: len(FUSED)])
def test_planned_activations_are_what_a_tensor_parallel_chunk_saves(steps, fused_ops):
    """One rank's stage-2 chunk saves the attention and MLP tensors of its heads and hidden units and the
    hidden-size ones whole; with the fused ops its down projection, a DTensor shard, saves its input (one
    process's swiglu_linear recomputes it). Equal to the byte with the transformers this was written with; the
    tolerance is for other versions (the one-process formula is a third to two thirds above)."""
    counted = steps("direct")["saved"][fused_ops]
    shape = ModelShape.resolve(tiny_model("qwen2", intermediate_size=WIDE_MLP))
    planned = activation_bytes(shape.tensor_parallel_part(WORLD), SAVED_CHUNK, "32-true", fused_ops=fused_ops)
    assert planned == pytest.approx(counted, rel=0.02)


def test_collectives_follow_the_strategys_plan():
    """TP_ROWWISE and TP_COLWISE are the modules TENSOR_PARALLEL_PLAN makes RowwiseParallel and ColwiseParallel."""
    kinds = [type(style) for style in TENSOR_PARALLEL_PLAN.values()]
    assert (kinds.count(RowwiseParallel), kinds.count(ColwiseParallel)) == (TP_ROWWISE, TP_COLWISE)
