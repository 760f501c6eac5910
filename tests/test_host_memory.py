"""One host memory budget: every host block a step makes is counted (core.host_memory.HostLedger), refused
past its limit before it is allocated, and equal to what the plan of the placed step says, byte for byte."""

import pytest
import torch

import lightning_oomb
from lightning_oomb.core.host_memory import (
    GIB, HostLedger, HostMemoryError, host_budget, host_headroom, pinned_empty, process_host_bytes,
)
from lightning_oomb.core.config import ChunkConfig
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.core.placement import place_step
from lightning_oomb.core.plan.memory import loss_grad_bytes
from lightning_oomb.core.schedule import cached_pool
from tiny_models import VOCAB, tiny_model


def pinned_lines(plan) -> int:
    return sum(v for k, v in plan.host_lines.items() if k.startswith("pinned"))


def test_ledger_counts_blocks_while_they_live_and_refuses_past_its_limit():
    ledger = HostLedger(limit=10_000)
    a = pinned_empty((100, 10), torch.float32, pin=False, ledger=ledger, what="pages")  # 4,000 bytes
    b = pinned_empty((1000,), torch.bfloat16, pin=False, ledger=ledger, what="outputs")  # 2,000 bytes
    assert ledger.held == {"pages": 4000, "outputs": 2000} and ledger.total == 6000
    with pytest.raises(HostMemoryError, match="past the 0.00 GiB the step was placed with"):
        pinned_empty((1001,), torch.float32, pin=False, ledger=ledger, what="pages")  # 4,004 more: 10,004
    assert ledger.total == 6000  # nothing counted for the refused block
    del a
    assert ledger.held == {"outputs": 2000}
    del b
    assert ledger.total == 0


def test_default_budget_is_the_process_plus_available_less_the_headroom():
    assert host_headroom(64 * GIB, 40 * GIB) == 8 * GIB and host_headroom(200 * GIB, 100 * GIB) == 20 * GIB
    # a small or busy machine: half of what is free, not a headroom larger than all of it
    assert host_headroom(23 * GIB, 6 * GIB) == 3 * GIB and host_headroom(23 * GIB, 0) == 0
    assert host_budget(123) == 123
    budget = host_budget()
    assert 0 < budget < process_host_bytes() + 2**50


def test_the_planners_default_budget_is_the_one_a_run_started_now_gets(monkeypatch):
    """lightning-oomb plan without --host-memory plans against the budget a fit computes at placement (the
    process plus MemAvailable, less the headroom), not the machine's RAM less the headroom: on the H200 machine
    the two differ by 2.2 GiB, enough for a fit to refuse the longest context the planner names."""
    from lightning_oomb.core import host_memory
    from lightning_oomb.core.plan import plan

    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 100 * GIB)
    monkeypatch.setattr(host_memory, "process_host_bytes", lambda: GIB)
    monkeypatch.setattr(host_memory, "machine_host_memory", lambda: 128 * GIB)
    assert host_budget() == 101 * GIB - int(0.1 * 128 * GIB)
    p = plan("qwen2.5-0.5b", 65536, gpu_memory=80 * GIB)
    assert p.host_memory == host_budget()


def test_pages_of_a_mapped_file_are_not_held_host_memory(tmp_path):
    """A checkpoint is loaded memory-mapped (AtomicCheckpointIO); its pages, read into the resident set, are
    page cache the kernel can take back, so the budget's process bytes leave them out."""
    import mmap

    path = tmp_path / "checkpoint"
    path.write_bytes(b"\1" * (64 << 20))
    before, rss_before = process_host_bytes(), _resident_set()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(mapped), 4096)) == len(mapped) // 4096  # read every page
        assert _resident_set() - rss_before >= 60 << 20
        assert abs(process_host_bytes() - before) < 8 << 20


def _resident_set() -> int:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("offload,sparse", [("host", None), ("host", {"budget_pages": 2, "local_pages": 1})])
def test_pool_host_bytes_equal_the_placed_plan(offload, sparse):
    """Dense pages in host memory, and sparse K/V and KV-gradient pages (and page summaries) of every layer there:
    the pool's ledger holds what its tensors take, which is what the plan of the placed step lists as pinned."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 37))
    kwargs = dict(chunk_size=8, page_size=4, offload=offload, sparse=sparse, segment_tokens=8)
    lightning_oomb.train_step(model, ids, **kwargs)
    pool = cached_pool(model)
    host = [t for t in (pool.k, pool.v, pool.dk, pool.dv) if pool.on_host] + [pool.host_dk, pool.host_dv,
                                                                                pool.host_k, pool.host_v]
    host += [pool.summaries("mean", layer)[0] for layer in pool.host_kv_layer_ids]  # with their K/V pages
    assert pool.host.total == sum(t.numel() * t.element_size() for t in host if t is not None) > 0
    placement = place_step(model, 2, 37, ChunkConfig(**kwargs), torch.device("cpu"))
    assert pinned_lines(placement.plan) == pool.host.total


def test_kept_loss_gradients_are_one_counted_block_of_the_planned_size():
    model = tiny_model("llama")
    lightning_oomb.train_step(model, torch.randint(0, VOCAB, (1, 20)), chunk_size=8, page_size=4, offload="host",
                              segment_tokens=8)
    pool = cached_pool(model)
    before = pool.host.total
    shape = ModelShape.resolve(model)
    block = pool.loss_grad_buffer(3, 2 * 8 * shape.hidden, torch.float32)  # 3 chunks of 8 tokens x batch 2
    assert pool.host.total - before == block.numel() * 4 == loss_grad_bytes(shape, 16, 3, "32-true")
    assert pool.loss_grad_buffer(2, 16 * shape.hidden, torch.float32) is block  # reused when it holds enough


def test_a_step_past_the_budget_is_refused_before_anything_is_allocated():
    """On a CPU device nothing is checked but the ledger; with a budget smaller than what the pinned pages need
    the pool refuses them at its construction, naming the budget."""
    from lightning_oomb.core.pages import PagePool
    from lightning_oomb.kernels.page_table import StoreSpec

    spec = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(HostMemoryError, match="Raise host_memory"):
        PagePool(spec, 16, 4, "cpu", placement="host", segment_tokens=8, host_limit=1000)


def test_pending_optimizer_state_is_counted():
    """At fit start torch's optimizers have no state yet: their first update creates it (AdamW two buffers per
    trainable parameter, SGD with momentum one), and the placement must leave room for it."""
    from lightning_oomb.core.optimizers import pending_state

    model = tiny_model("qwen2")
    params = [p for p in model.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    adamw = torch.optim.AdamW(params)
    assert pending_state([adamw]) == ("adamw", 2 * nbytes, 0)
    assert pending_state([torch.optim.SGD(params, lr=0.1, momentum=0.9)]) == ("sgd", nbytes, 0)
    assert pending_state([torch.optim.SGD(params, lr=0.1)]) == ("none", 0, 0)
    for p in params:
        p.grad = torch.zeros_like(p)
    adamw.step()
    assert pending_state([adamw]) == ("adamw", 0, 0)  # the state exists now: nothing more to come


def test_a_step_given_its_optimizer_leaves_room_for_its_state():
    """train_step(optimizer=...) and OOMBStrategy's steps place the step with the optimizer state still to
    come (a 1M-token step placed without it filled the GPU, and AdamW's first update ran out of memory)."""
    from lightning_oomb.core.config import ChunkConfig
    from lightning_oomb.core.schedule import ChunkedSequence

    model = tiny_model("qwen2")
    ids = torch.randint(0, model.config.vocab_size, (1, 32))
    adamw = torch.optim.AdamW(model.parameters())
    for optimizers, counted in (((adamw,), True), ((), False)):
        seq = ChunkedSequence(model, ids, config=ChunkConfig(chunk_size=16, page_size=8), optimizers=optimizers)
        assert ("optimizer state (adamw" in str(seq.placement.plan)) == counted
        seq.release()


def test_a_step_reusing_a_pool_keeps_the_runs_budget_and_growth_allowance():
    """One budget per run: a step that reuses the pool PagedKVCallback placed at fit start places itself
    against that placement's budget, and its growth allowance counts from the process as it was at fit start
    (on the H200 a fresh reading after pinning 97 GiB is 1.8 GiB lower, and a second allowance on top of what
    the process grew refuses the step the fit placed)."""
    from lightning_oomb.core.placement import HOST_GROWTH_BYTES, Placement, run_host_budget

    assert run_host_budget(5 * GIB, 3 * GIB, None) == (5 * GIB, 3 * GIB)  # a pool of its own: as it is now
    placed = Placement("gpu", 8, host_budget=100 * GIB, host_process=GIB)
    assert run_host_budget(None, GIB + GIB // 2, placed) == (100 * GIB, GIB)  # grown within the allowance
    grown = GIB + HOST_GROWTH_BYTES + GIB
    assert run_host_budget(None, grown, placed) == (100 * GIB, 2 * GIB)  # past it: the excess counts
    assert run_host_budget(7 * GIB, 2 * GIB, Placement("gpu", 8)) == (7 * GIB, 2 * GIB)  # placed on a CPU device
    # The fit-start placement set 2.5 GiB aside for the optimizer's first update (host_process 1 + 2.5 GiB);
    # the first step, placed before that update, counts the same 2.5 GiB as pending: counted once, not twice.
    compile_bytes = 5 * GIB // 2
    fit_start = Placement("gpu", 8, host_budget=100 * GIB, host_process=GIB + compile_bytes)
    assert run_host_budget(None, GIB, fit_start, compile_bytes) == (100 * GIB, GIB)
    assert run_host_budget(None, GIB + compile_bytes, fit_start) == (100 * GIB, GIB + compile_bytes)  # after it


def test_pages_are_touched_before_they_are_pinned():
    """touch_pages writes one byte of every 4 KiB page (the kernel maps them on torch's threads, not inside
    cudaHostRegister) and nothing else."""
    from lightning_oomb.core.host_memory import touch_pages

    t = torch.full((3, 5000), 7.0)
    touch_pages(t)
    flat = t.view(-1).view(torch.uint8)
    touched = torch.zeros_like(flat, dtype=torch.bool)
    touched[::4096] = True
    assert (flat[touched] == 0).all() and torch.equal(flat[~touched], torch.full((3, 5000), 7.0).view(-1).view(torch.uint8)[~touched])


def free_memory(monkeypatch, nbytes: int) -> None:
    """This machine as one with ``nbytes`` of MemAvailable and no cgroup limit."""
    from lightning_oomb.core import host_memory

    real = host_memory.proc_field_bytes
    monkeypatch.setattr(host_memory, "proc_field_bytes",
                        lambda path, field: nbytes if field == "MemAvailable" else real(path, field))
    monkeypatch.setattr(host_memory, "cgroup_memory", lambda: None)


def test_a_busy_machine_trains_a_small_model_and_a_full_one_says_what_is_free(monkeypatch):
    """6 GiB free of 23: the 8 GiB headroom left a negative budget and every step was refused as bad input. Now
    the headroom is at most half of what is free; with too little free the step is refused with one line that
    says how much is free and how much the run needs, unless host_memory (honoured as given) says otherwise."""
    from lightning_oomb.core.plan import PlanError

    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 16))
    free_memory(monkeypatch, 6 * GIB)
    assert host_budget() == process_host_bytes() + 3 * GIB
    lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4)
    free_memory(monkeypatch, GIB)
    with pytest.raises(PlanError, match=r"^this CPU run needs \d+\.\d\d GiB of host memory .* but this machine has "
                                        r"1\.00 GiB free and the run's host memory budget is"):
        lightning_oomb.train_step(tiny_model("qwen2"), ids, chunk_size=8, page_size=4)
    lightning_oomb.train_step(tiny_model("qwen2"), ids, chunk_size=8, page_size=4, host_memory=4 * GIB)


def test_a_cgroup_limit_is_what_the_machine_has(monkeypatch, tmp_path):
    """In a container or a job limited to 2.5 GB MemAvailable is the host's: what the process may still take is
    what the limit leaves (page cache the kernel can reclaim not counted as used)."""
    from lightning_oomb.core import host_memory

    (tmp_path / "memory.max").write_text("2500000000\n")
    (tmp_path / "memory.current").write_text("1500000000\n")
    (tmp_path / "memory.stat").write_text("anon 900000000\ninactive_file 500000000\n")
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", str(tmp_path))
    assert host_memory.cgroup_memory() == (2_500_000_000, 1_000_000_000)
    assert host_memory.available_host_memory() <= 1_500_000_000
    assert host_memory.machine_host_memory() == 2_500_000_000
