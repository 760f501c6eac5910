"""What stage 1 keeps for stage 2 and where a served step's dL/dh go: the planner and ``place_step`` decide
alike (``core.plan.placement``)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from lightning_oomb.core.config import ChunkConfig, SparseConfig
from lightning_oomb.core.plan import PlanError, plan
from lightning_oomb.core.units import parse_tokens

H200 = dict(gpu_memory=141e9, host_memory=128e9, checkpoint_auto=True)


def test_host_kept_attention_outputs_are_pinned_and_fill_what_the_budget_leaves():
    """host_kept_chunks: a pinned host line of the GPU-kept outputs' size per chunk, no GPU memory; by default
    the whole chunks stage 2 would recompute that fit in what the host memory budget leaves, none when
    keep_attention is given."""
    from lightning_oomb.core.plan.placement import host_kept_for_stage_2
    from lightning_oomb.core.plan.memory import kept_chunk_bytes

    base = plan("qwen2.5-7b", parse_tokens("1M"), optimizer="none", sparse={"budget_pages": 64}, **H200)
    kept = plan("qwen2.5-7b", parse_tokens("1M"), optimizer="none", sparse={"budget_pages": 64},
                host_kept_chunks=90, **H200)
    line = next(k for k in kept.host_lines if k.startswith("pinned attention outputs kept"))
    per_chunk = kept_chunk_bytes(kept.shape, 4096, torch.bfloat16)
    assert "90 of 256 chunks" in line and kept.host_lines[line] == 90 * per_chunk == 90 * 28 * 4096 * (3584 * 2 + 4 * 28)
    assert kept.peak_gpu_bytes == base.peak_gpu_bytes
    assert host_kept_for_stage_2(base, 10.5 * per_chunk, 0, 0) == 10
    assert host_kept_for_stage_2(base, 1000 * per_chunk, 0, 0) == 256
    assert host_kept_for_stage_2(base, 1000 * per_chunk, 6, 1) == 249  # the chunks kept on the GPU need none
    assert host_kept_for_stage_2(base, 1000 * per_chunk, 0, 0, keep_attention=0) == 0
    short = plan("qwen2.5-7b", parse_tokens("1M") - 100, optimizer="none", sparse={"budget_pages": 64}, **H200)
    assert host_kept_for_stage_2(short, 1000 * per_chunk, 0, 0) == 255  # whole chunks only


def test_a_streamed_step_keeps_attention_outputs_of_its_first_chunks_on_the_host(monkeypatch):
    """With its pages streamed from the host (dense, offload="host") the GPU holds only staging: place_step keeps
    stage 1's attention outputs of as many first whole chunks as the host memory budget has room for, counts
    them as a pinned line and in the step's time (stage 2 skips their attention forward), none with
    keep_attention=0."""
    from lightning_oomb.core import placement
    from lightning_oomb.core.plan.memory import kept_chunk_bytes

    gib = 1 << 30
    monkeypatch.setattr(placement, "gpu_room", lambda device, gpu_memory=None: (8 * gib, 8 * gib))
    monkeypatch.setattr(placement, "process_host_bytes", lambda: gib)
    model = tiny_model("qwen2")
    cuda = torch.device("cuda", 0)

    def placed(host_memory: int, **options) -> placement.Placement:
        config = ChunkConfig(chunk_size=8, offload="host", attention="reference", host_memory=host_memory, **options)
        return placement.place_step(model, 1, 37, config, cuda)  # 4 whole chunks of 8, then 5 tokens

    roomy = placed(8 * gib)
    assert roomy.where == "host" and roomy.host_kept_chunks == 4
    per_chunk = kept_chunk_bytes(roomy.plan.shape, 8, torch.float32)
    assert roomy.plan.host_lines["pinned attention outputs kept from stage 1 (4 of 5 chunks)"] == 4 * per_chunk
    none = placed(8 * gib, keep_attention=0)
    assert none.host_kept_chunks == 0 and not any("attention outputs" in k for k in none.plan.host_lines)
    assert roomy.plan.time.attention_flops < none.plan.time.attention_flops
    pinned = sum(v for k, v in none.plan.host_lines.items() if k.startswith("pinned"))
    tight = placed(gib + placement.HOST_GROWTH_BYTES + pinned + int(2.5 * per_chunk))
    assert tight.host_kept_chunks == 2


def test_kept_attention_outputs_are_planned_per_chunk_and_refused_with_host_pages():
    """keep_attention: a plan line of n_layers x tokens x (q_width bf16 + fp32 lse) per chunk; place_step
    keeps what is asked on a CPU device (nothing by default), and refuses it when pages go to the host."""
    from lightning_oomb.core.placement import place_step

    base = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", **H200)
    kept = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=3, **H200)
    line = next(k for k in kept.gpu_lines if k.startswith("attention outputs kept"))
    assert "3 of 8 chunks" in line
    assert kept.gpu_lines[line] == 3 * 28 * 4096 * (3584 * 2 + 4 * 28)
    assert kept.peak_gpu_bytes - base.peak_gpu_bytes == kept.gpu_lines[line]
    model = tiny_model("qwen2")
    cpu = torch.device("cpu")
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8), cpu).kept_chunks == 0
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=3), cpu).kept_chunks == 3
    # At most the chunks before those whose graphs stage 1 keeps (the last one's by default).
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=9), cpu).kept_chunks == 3
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=9, keep_graphs=0), cpu).kept_chunks == 4
    with pytest.raises(PlanError, match="keep_attention=2 keeps stage 1's results on the GPU"):
        place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_attention=2, offload="host"), cpu)
    with pytest.raises(ValueError, match="keep_attention must be None or an integer >= 0"):
        ChunkConfig(keep_attention=-1)


def test_kept_graphs_cost_a_chunks_activations_except_the_last():
    """keep_graphs: the last chunk's graph is free; each other one costs a chunk's activations plus what the
    loss computes ahead, and replaces that chunk's kept attention outputs. place_step keeps the last chunk's
    by default, none with layer checkpointing or host pages."""
    from lightning_oomb.core.placement import place_step
    from lightning_oomb.core.plan.memory import graph_chunk_bytes

    base = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=8, **H200)
    one = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=8, graph_chunks=1, **H200)
    three = plan("qwen2.5-7b", parse_tokens("32K"), optimizer="none", kept_chunks=8, graph_chunks=3, **H200)
    per_output = 28 * 4096 * (3584 * 2 + 4 * 28)
    per_graph = graph_chunk_bytes(three.shape, three.config)
    activations = next(v for k, v in three.gpu_lines.items() if k.startswith("activations"))
    assert per_graph == activations + 4096 * 3584 * 2
    assert one.peak_gpu_bytes == base.peak_gpu_bytes - per_output
    assert three.peak_gpu_bytes == base.peak_gpu_bytes - 3 * per_output + 2 * per_graph
    assert "3 of 8 chunks, one counted above" in " ".join(three.gpu_lines)
    model = tiny_model("qwen2")
    cpu = torch.device("cpu")
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8), cpu).graph_chunks == 1
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_graphs=9), cpu).graph_chunks == 4
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, checkpoint_layers=True), cpu).graph_chunks == 0
    assert place_step(model, 1, 32, ChunkConfig(chunk_size=8, offload="host"), cpu).graph_chunks == 0
    with pytest.raises(PlanError, match="keep_graphs=2 keeps stage 1's results on the GPU"):
        place_step(model, 1, 32, ChunkConfig(chunk_size=8, keep_graphs=2, offload="host"), cpu)
    with pytest.raises(ValueError, match="keep_graphs keeps whole chunks' activations"):
        ChunkConfig(keep_graphs=2, checkpoint_layers=True)


def test_placed_plan_says_how_many_graphs_and_attention_outputs_a_step_keeps():
    from lightning_oomb.core.plan.search import plan_placed

    roomy = plan_placed("qwen2.5-7b", parse_tokens("32K"), optimizer="none", **H200)
    # As place_step chose on the H200 at 32K (docs/benchmarks.md: 3 graphs, then 5 chunks' outputs), and one
    # graph more since the down projection recomputes its input (kernels.linear.swiglu_linear).
    assert any("autograd graphs of the last 4 and the attention outputs of 4 more of 8 chunks" in n
               for n in roomy.notes), roomy.notes
    assert not any("pinned host memory (keep" in n for n in roomy.notes)  # every chunk is kept on the GPU
    # Streamed pages leave the GPU only staging: the outputs of every whole chunk wait in pinned host memory.
    offloaded = plan_placed("qwen2.5-7b", parse_tokens("32K"), offload="host", optimizer="none", **H200)
    assert offloaded.config.streamed and offloaded.config.host_kept_chunks == 8
    assert not any("autograd graphs" in n for n in offloaded.notes)
    assert any("attention outputs of the first 8 chunks in pinned host memory" in n for n in offloaded.notes)


def test_a_cpu_runs_plan_prints_only_lines_that_hold_something():
    """A CPU run's plan (printed at fit start) leaves out lines of nothing and counts a small step in MiB."""
    from lightning_oomb.core.placement import place_step

    model = tiny_model("qwen2")
    text = str(place_step(model, 1, 64, ChunkConfig(chunk_size=16), torch.device("cpu"), stage_1_loss=True,
                          optimizer="adamw").plan)
    assert "Step memory (this CPU run: host RAM)" in text and "MiB" in text and "GiB" not in text.split("Note:")[0]
    assert not any(line.rstrip().endswith(" 0.00") for line in text.splitlines())


def test_served_steps_keep_every_chunks_dlh_for_stage_2():
    """A served step keeps every chunk's dL/dh for stage 2 (pinned: one block of the pool, its exact size). On a
    CPU device they stay where the step runs."""
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.core.placement import place_step
    from lightning_oomb.core.plan.memory import loss_grad_bytes

    shape = ModelShape.from_name("qwen2.5-7b")
    assert loss_grad_bytes(shape, 4096, 256, "bf16-true") == 256 * 4096 * 3584 * 2  # 7 GiB at 1M
    assert loss_grad_bytes(shape, 4096, 1, "32-true") == 4096 * 3584 * 4
    model = tiny_model("qwen2")
    placement = place_step(model, 1, 32, ChunkConfig(chunk_size=8), torch.device("cpu"), stage_1_loss=True)
    assert placement.loss_grads == "gpu"


def test_served_steps_recompute_dlh_only_where_keeping_it_fits_nowhere():
    """A served step keeps every chunk's dL/dh where it fits (here pinned on the host, with the pages of some
    layers); past the context where it fits nowhere, stage 2 computes it again, which lets 8-bit AdamW's
    smaller state hold more than 10% more tokens than plain AdamW's kept-dL/dh limit of 1,490,944."""
    from lightning_oomb.core.plan.search import max_context, plan_placed

    sparse = dict(sparse=SparseConfig(budget_pages=64), grad_dtype=torch.bfloat16, stage_1_loss=True,
                  gpu_memory=140 * 2**30, host_memory=112 * 2**30, checkpoint_auto=True)  # as `plan --max-context` in docs/optimizers.md
    kept = plan_placed("qwen2.5-7b", 1_490_944, **sparse)
    assert kept.fits and kept.config.loss_grads == "host"
    assert any(k.startswith("pinned loss: dL/dh of every chunk") for k in kept.host_lines)
    limit = max_context("qwen2.5-7b", optimizer="adamw8bit", **sparse)
    assert limit.context >= 1.1 * 1_490_944 and limit.plan.config.loss_grads == "recomputed"
    assert not any("dL/dh of every chunk" in k for k in [*limit.plan.gpu_lines, *limit.plan.host_lines])
    assert "dL/dh computed again in stage 2" in str(limit.plan)
    assert not plan_placed("qwen2.5-7b", limit.context, loss_grads="host", optimizer="adamw8bit", **sparse).fits


# == a GPU memory budget (ChunkConfig.gpu_memory) ================================================================


def test_a_gpu_memory_budget_caps_the_room_a_step_is_placed_in(monkeypatch):
    """gpu_room: the device's free memory plus the allocator's unused reserve; with a budget, at most the
    budget less what is allocated, against a device of the budget's size."""
    from lightning_oomb.core.placement import gpu_room

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 20 * gib)
    device = torch.device("cuda", 0)
    assert gpu_room(device) == (110 * gib, 140 * gib)
    assert gpu_room(device, 24 * gib) == (4 * gib, 24 * gib)
    assert gpu_room(device, 200 * gib) == (110 * gib, 140 * gib)


def test_a_gpu_memory_budget_is_the_planned_card():
    """plan() without a machine's gpu_memory plans for ChunkConfig.gpu_memory's card; a bad size is one line."""
    from lightning_oomb.core.errors import SetupError
    from lightning_oomb.core.plan import PlanConfig

    assert ChunkConfig(gpu_memory="24GiB").gpu_memory == 24 << 30
    card = plan("qwen2.5-7b", 65536, optimizer="none", lora_rank=16, host_memory=128e9, gpu_memory=24 << 30)
    budgeted = plan("qwen2.5-7b", PlanConfig.build(65536, optimizer="none", lora_rank=16, host_memory=128e9,
                                                   gpu_memory=24 << 30))
    assert budgeted.gpu_memory == card.gpu_memory == 24 << 30 and budgeted.peak_gpu_bytes == card.peak_gpu_bytes
    for bad in ("-3GiB", "lots", 0):
        with pytest.raises(SetupError, match="gpu_memory"):
            ChunkConfig(gpu_memory=bad)
