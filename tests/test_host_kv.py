"""Sparse steps with K/V pages in host memory (``PagePool(host_kv_layers=N)``): each attention call gathers
the pages its chunk selected into GPU staging under a remapped page table (``core.pages.HostKVStaging``).

On a CPU device the "host" pages are ordinary memory, so these tests hold the gather and its bookkeeping to
the all-GPU step bit for bit (the staged pages are copies, the kernels read the same values in the same
order); the GPU test at the end checks the host-mapped gather itself.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lightning_oomb
from lightning_oomb.core.config import ChunkConfig, SparseConfig
from lightning_oomb.core.pages import PagePool
from lightning_oomb.core.placement import Placement
from lightning_oomb.core.plan import PlanConfig, plan_placed
from lightning_oomb.core.plan.host_transfers import host_gather_bytes, host_gather_seconds
from lightning_oomb.core.model_shape import ModelShape
from lightning_oomb.core.schedule import ChunkedSequence, cached_pool, new_pool, release_cached_pool
from lightning_oomb.core.sparse import select_pages
from lightning_oomb.kernels.page_table import StoreSpec
from tiny_models import VOCAB, grads_of, needs_interpreter, probed, tiny_model

# One selection per query tile whatever the placement (offload="host" would select per chunk): the tests compare
# the same step with its pages in different places.
SPARSE = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1, per_query_tile=True)


def _step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    release_cached_pool(model)
    loss = lightning_oomb.train_step(model, ids, chunk_size=8, page_size=3, **{"sparse": SPARSE, **kwargs})
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return loss, grads


def _assert_same(got, want):
    loss, grads = got
    want_loss, want_grads = want
    assert torch.equal(loss, want_loss)
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name


@pytest.mark.parametrize("packed, checkpoint", [(False, False), (True, True)])
def test_every_layer_on_the_host_gives_the_gpu_gradient_bitwise(packed, checkpoint):
    """offload='host': K/V and KV-gradient pages of every layer on the host. Batch 2, pages of 3 tokens that
    cut chunks of 8 every way, -100 labels; packed: documents of 2, 12, 7 and 10, 11 tokens (-1 entries).
    The Triton kernels over host pages: tests/test_sparse_host_grads.py (offload='host', packed or not)."""
    attention = "reference"
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 21))  # the last chunk's past (16 tokens, 6 pages) exceeds the budget
    labels = ids.clone()
    labels[0, 5:9] = -100
    options = dict(attention=attention, labels=labels, checkpoint_layers=checkpoint)
    if packed:
        options["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in lengths])
                                               for lengths in ([2, 12, 7], [10, 11])])
    want = _step(model, ids, offload="gpu", **options)
    got = _step(model, ids, offload="host", **options)
    pool = cached_pool(model)
    assert (pool.host_kv_layers, pool.host_grad_layers) == (2, 2) and pool.k.shape[0] == 0
    summaries = [pool.summaries("mean", layer)[0] for layer in (0, 1)]  # with the pages: the GPU holds none
    assert pool.host_nbytes == sum(t.numel() * t.element_size()
                                   for t in (pool.host_k, pool.host_v, pool.host_dk, pool.host_dv, *summaries))
    assert pool.kv_staging.pages_staged > 0
    _assert_same(got, want)


def test_lora_with_every_page_on_the_host_gives_the_gpu_gradient_bitwise():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen2"), peft.LoraConfig(r=4, lora_alpha=8,
                                                                     target_modules=["q_proj", "k_proj", "v_proj"]))
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, VOCAB, (2, 29))
    want = _step(model, ids, offload="gpu", attention="reference")
    got = _step(model, ids, offload="host", attention="reference")
    assert cached_pool(model).host_kv_layers == 2 and want[1] and all("lora" in name for name in want[1])
    _assert_same(got, want)


def _split_step(model, ids, config: ChunkConfig, grad_layers: int, kv_layers: int):
    """One step through a pool with ``grad_layers`` host gradient and ``kv_layers`` host K/V layers."""
    pools = {}

    def provide(spec, pages, with_grads, placement):
        if "pool" not in pools:
            placed = Placement("gpu", 8, 1, grad_layers, host_kv_layers=kv_layers)
            pools["pool"] = new_pool(spec, pages + 5, config.page_size, torch.device("cpu"), with_grads, placed)
            if kv_layers:  # what a previous step left: every page a chunk reads must have been written
                pools["pool"].host_k.fill_(float("nan"))
                pools["pool"].host_v.fill_(float("nan"))
        return pools["pool"]

    model.zero_grad(set_to_none=True)
    seq = ChunkedSequence(model, ids, config=config, pools=provide)
    seq.fill()
    loss = seq.backward()
    return (loss, grads_of(model)), pools["pool"]


@pytest.mark.parametrize("grad_layers, kv_layers", [(0, 2), (4, 1)])
def test_some_layers_on_the_host_give_the_gpu_gradient_bitwise(grad_layers, kv_layers):
    """K/V of some layers on the host with their gradient pages on the GPU, and K/V of one layer on the host
    with every gradient layer there, moved in stage 2 into the dead pages of the GPU K/V layers (batch 1)."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (1, 30))
    config = ChunkConfig(chunk_size=6, page_size=3, attention="reference", sparse=SPARSE)
    want, _ = _split_step(model, ids, config, 0, 0)
    got, pool = _split_step(model, ids, config, grad_layers, kv_layers)
    assert pool.host_kv_layer_ids == ([1, 3] if kv_layers == 2 else [2])
    assert pool.k.shape[0] == 4 - kv_layers
    if grad_layers:
        assert pool.host_grads_moved  # the moves used the GPU K/V layers' dead pages
    _assert_same(got, want)


def test_gather_brings_the_union_of_the_selection_under_a_remapped_table():
    """Pages of every sequence's selection, once each whatever the number of tiles and heads naming them; the
    remapped table reads the host pages' values; the count is what the selection implies."""
    torch.manual_seed(0)
    spec = StoreSpec(n_layers=1, n_kv_heads=2, head_dim=4, dtype=torch.float32)
    pool = PagePool(spec, 24, 3, "cpu", host_kv_layers=1, host_grad_layers=1)
    table = pool.allocate(2, 33)  # 11 pages per sequence
    pool.host_k.normal_()
    pool.host_v.normal_()
    store = pool.layer(0, table)
    selection = torch.tensor([[[[0, 4, 7], [-1, 4, 9]], [[0, 1, 7], [-1, -1, 2]]],
                              [[[3, 5, 8], [3, 5, 8]], [[0, 5, 6], [-1, 0, 8]]]], dtype=torch.int32)
    staged = store.kv_stager.stage(store, selection, start=30)  # 10 past pages
    for b in range(2):
        picked = sorted({int(p) for p in selection[b].flatten() if p >= 0})
        for page in picked:
            host_slot, staged_slot = table.slots[b, page], staged.table.slots[b, page]
            assert torch.equal(staged.k[staged_slot], pool.host_k[0, host_slot])
            assert torch.equal(staged.v[staged_slot], pool.host_v[0, host_slot])
    assert pool.kv_staging.pages_staged == 6 + 5  # {0, 1, 2, 4, 7, 9} and {0, 3, 5, 6, 8}
    assert staged.grad_slots.data_ptr() == table.slots.data_ptr()  # gradients go to the layer's own pages
    assert staged.kv_stager is None and store.kv_stager is pool.kv_staging


@needs_interpreter
def test_gpu_side_page_copies_skip_negative_slots_and_write_rows():
    """The kernels a CUDA step uses on host-mapped pages, in Triton's interpreter: the gather's fixed-length
    page list (-1: stays), and a chunk's K/V rows written into host pages."""
    from lightning_oomb.kernels.host_pages import copy_pages, write_rows

    torch.manual_seed(2)
    src = torch.randn(5, 3, 2, 4)
    for programs in (None, 1, 3):  # one program per entry, or a few persistent ones sharing them
        dst = torch.zeros(4, 3, 2, 4)
        copy_pages(src, torch.tensor([4, -1, 0, 1]), dst, torch.tensor([0, 1, 2, 3]), programs)
        assert torch.equal(dst[0], src[4]) and torch.equal(dst[2], src[0]) and torch.equal(dst[3], src[1])
        assert not dst[1].any()
    rows = torch.tensor([[7, 2], [0, 11]])
    values = torch.randn(2, 2, 2, 4)
    pages = torch.zeros(12, 2, 4)
    write_rows(pages, rows, values)
    want = torch.zeros(12, 2, 4)
    want[rows.reshape(-1)] = values.reshape(-1, 2, 4)
    assert torch.equal(pages, want)


def test_selection_over_host_pages_equals_the_selection_over_gpu_pages():
    """A host K/V layer's page summaries live in host memory with its pages (counted there, not on the GPU),
    written from the chunk's keys read back from the host pages: the same selection as GPU pages give."""
    torch.manual_seed(1)
    spec = StoreSpec(n_layers=1, n_kv_heads=2, head_dim=4, dtype=torch.float32)
    stores = []
    for kv_layers in (0, 1):
        pool = PagePool(spec, 12, 3, "cpu", host_kv_layers=kv_layers)
        table = pool.allocate(1, 30)
        stores.append((pool, pool.layer(0, table)))
    k, v, q = torch.randn(1, 2, 30, 4), torch.randn(1, 2, 30, 4), torch.randn(1, 4, 6, 4)
    from lightning_oomb.core.sparse import update_summaries

    chosen = []
    for pool, store in stores:
        store.write(k, v, 0)
        summaries = pool.summaries("mean", 0)
        update_summaries(store, summaries, "mean", 0, 24)
        chosen.append(select_pages(q, store, summaries, SPARSE, 24))
    assert torch.equal(*chosen)
    gpu_pool, host_pool = (pool for pool, _ in stores)
    summary_bytes = 12 * 2 * 4 * 4  # pages x KV heads x head_dim x float32
    assert host_pool.host.held["page summaries"] == summary_bytes and "page summaries" not in gpu_pool.host.held
    assert gpu_pool.gpu_nbytes - host_pool.gpu_nbytes == 2 * 12 * 3 * 2 * 4 * 4 + summary_bytes  # K, V and summaries


def test_host_kv_layers_are_refused_where_they_cannot_work(monkeypatch):
    spec = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="host_kv_layers"):
        PagePool(spec, 4, 2, "cpu", placement="host", segment_tokens=4, host_kv_layers=1)
    with pytest.raises(ValueError, match="host_kv_layers"):
        PagePool(spec, 4, 2, "cpu", host_kv_layers=3)
    # A dense step placed with host K/V layers (only a pool every step must use could ask for it) is refused
    # before any page is taken.
    import lightning_oomb.core.schedule as schedule

    model = probed(tiny_model("qwen2"))  # the probe of its first step placed as place_step places it
    monkeypatch.setattr(schedule, "place_step", lambda *args, **kwargs: Placement("gpu", 8, 1, host_kv_layers=2))
    with pytest.raises(ValueError, match="need sparse attention"):
        ChunkedSequence(model, torch.randint(0, VOCAB, (1, 16)), config=ChunkConfig(chunk_size=8))


def test_planner_moves_gradient_pages_first_then_kv_pages():
    """offload='auto' on an H200 (140 GiB, 112 GiB host budget): Qwen2.5-7B sparse, bf16 KV-gradients, no
    optimizer, layer checkpointing. 1M keeps 8 layers' gradient pages on the host, 1.75M all of them and the
    K/V pages of 2 layers (the bench's step, placed against the GPU's measured free memory, needed
    none: the planner counts 1.75 GiB of CUDA context and first-step workspaces, what a fit measured); without
    layer checkpointing 1.75M needs K/V pages of 5 layers there (and then the host budget is 8 GiB short). With 'host' every page and its summary is there; past the point where one gather's staging stops
    growing (every tile's selection distinct), the GPU grows by the selections only; with one selection per
    chunk (what offload='host' selects unless told otherwise) it does not grow."""
    common = dict(optimizer="none", grad_dtype=torch.bfloat16, sparse=SparseConfig(budget_pages=64),
                  gpu_memory=140 * 2**30, host_memory=112 * 2**30, checkpoint_layers=True)
    one = plan_placed("qwen2.5-7b", 1 << 20, **common)
    assert one.fits and (one.config.host_grad_layers, one.config.host_kv_layers) == (8, 0)
    long = plan_placed("qwen2.5-7b", 1_835_008, **common)
    assert long.fits and (long.config.host_grad_layers, long.config.host_kv_layers) == (28, 2)
    eager = plan_placed("qwen2.5-7b", 1_835_008, **{**common, "checkpoint_layers": False})
    assert (eager.config.host_grad_layers, eager.config.host_kv_layers) == (28, 5) and not eager.fits
    assert any(k.startswith("pinned K/V pages") for k in eager.host_lines)
    assert eager.time.host_gather_s > 0 and "gathering the host K/V layers" in str(eager)
    per_tile = {**common, "host_memory": 1 << 41, "sparse": SparseConfig(budget_pages=64, per_query_tile=True)}
    small, big = (plan_placed("qwen2.5-7b", n, offload="host", **per_tile) for n in (1 << 20, 1 << 21))
    assert (small.config.host_kv_layers, big.config.host_kv_layers) == (28, 28)
    assert big.gpu_lines[next(k for k in big.gpu_lines if k.startswith("K/V pages"))] == 0
    per_10k = (big.peak_gpu_bytes - small.peak_gpu_bytes) / (1 << 20) * 10_000
    # the selections (28 layers x 4 KV heads x 64 int32 entries per query tile), and the two gathers' staging
    # growing by their last 32 pages (8,160 past pages at 1M, all 8,192 a chunk's tiles can name at 2M)
    assert 2.2e6 < per_10k < 2.5e6
    small, big = (plan_placed("qwen2.5-7b", n, offload="host", **{**common, "host_memory": 1 << 41})
                  for n in (1 << 20, 1 << 21))
    assert not big.config.sparse.per_query_tile and "one selection per chunk" in str(big)
    assert (big.peak_gpu_bytes - small.peak_gpu_bytes) / (1 << 20) * 10_000 < 0.1e6  # the summaries are on the host


def test_host_pages_select_per_chunk_unless_told_otherwise():
    """offload='host' with per_query_tile left open is the per-chunk step (bitwise), whose gathers are bounded."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    open_choice = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1)
    want = _step(model, ids, offload="host", sparse=dataclasses.replace(open_choice, per_query_tile=False))
    got = _step(model, ids, offload="host", sparse=open_choice)
    _assert_same(got, want)


def test_gather_time_counts_every_attention_call():
    """One host layer (14 of 28) gathers twice per chunk: stage 1, then stage 2's forward, whose gather its
    backward (and a layer checkpoint's recompute) reuses; with four, each but the top one is gathered again
    in stage 2's backward, after the layers above it."""
    shape = ModelShape.resolve("qwen2.5-7b")
    c = PlanConfig.build(1 << 20, sparse=SparseConfig(budget_pages=64), host_grad_layers=28, host_kv_layers=1,
                         grad_dtype=torch.bfloat16)
    one = host_gather_seconds(shape, c)
    four = host_gather_seconds(shape, c.replace(host_kv_layers=4))
    assert four == pytest.approx((4 + 4 + 3) / 2 * one, rel=1e-2)  # the last chunk: stage 2 reuses stage 1's gather
    assert host_gather_seconds(shape, c.replace(checkpoint_layers=True)) == pytest.approx(one)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_host_kv_pages_give_the_gpu_gradient():
    model = tiny_model("qwen2", dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, VOCAB, (2, 300), device="cuda")
    sparse = SparseConfig(budget_pages=4, sink_pages=1, local_pages=1, per_query_tile=True)
    options = dict(chunk_size=64, page_size=16, sparse=sparse, grad_dtype=torch.bfloat16)
    results = []
    for offload in ("gpu", "host"):
        model.zero_grad(set_to_none=True)
        release_cached_pool(model)
        loss = lightning_oomb.train_step(model, ids, offload=offload, **options)
        results.append((loss, grads_of(model)))
    assert cached_pool(model).host_kv_layers == 2
    _assert_same(results[1], results[0])


def test_one_selection_per_chunk_bounds_what_a_chunk_gathers():
    """SparseConfig(per_query_tile=False): every tile of a chunk gets the selection of the chunk's mean query,
    so a host K/V layer gathers at most budget pages per KV head for it; the gradient over host pages equals
    the GPU pages' bitwise, and with a budget covering every page it is the dense gradient."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 40))
    per_chunk = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1, per_query_tile=False)
    q = torch.randn(1, 4, 8, 4)
    spec = StoreSpec(n_layers=1, n_kv_heads=2, head_dim=4, dtype=torch.float32)
    pool = PagePool(spec, 20, 3, "cpu")
    store = pool.layer(0, pool.allocate(1, 40))
    store.write(torch.randn(1, 2, 32, 4), torch.randn(1, 2, 32, 4), 0)
    summaries = pool.summaries("mean", 0)
    from lightning_oomb.core.sparse import update_summaries

    update_summaries(store, summaries, "mean", 0, 32)
    chosen = select_pages(q, store, summaries, per_chunk, 32)
    assert chosen.shape == (1, 2, 3, 3) and all(torch.equal(chosen[:, :, i], chosen[:, :, 0]) for i in range(3))
    want = _step(model, ids, offload="gpu", sparse=per_chunk)
    got = _step(model, ids, offload="host", sparse=per_chunk)
    _assert_same(got, want)
    # 5 chunks of 8: the past of chunks 1..4 has 3, 6, 8, 11 pages; 3 attention calls per chunk and layer.
    calls = 3 * 2  # per chunk: stage 1, stage 2's forward and backward; 2 layers
    assert cached_pool(model).kv_staging.pages_staged <= calls * sum(min(p, 2 * 3) for p in (3, 6, 8, 11))
    covering = SparseConfig(budget_pages=16, sink_pages=1, local_pages=1, per_query_tile=False)
    dense = _step(model, ids, sparse=None)
    loss, grads = _step(model, ids, sparse=covering)
    assert torch.allclose(loss, dense[0], rtol=1e-6)
    for name, g in grads.items():
        assert torch.allclose(g, dense[1][name], rtol=1e-5, atol=1e-7), name
    with pytest.raises(ValueError, match="per_query_tile"):
        _step(model, ids, sparse=per_chunk, position_ids=torch.cat([torch.arange(20), torch.arange(20)])[None])
    shape = ModelShape.resolve("qwen2.5-7b")
    c = PlanConfig.build(1 << 20, sparse=SparseConfig(budget_pages=64), host_grad_layers=28, host_kv_layers=4,
                         grad_dtype=torch.bfloat16)
    bounded = c.replace(sparse=SparseConfig(budget_pages=64, per_query_tile=False))
    assert host_gather_seconds(shape, bounded) < host_gather_seconds(shape, c) / 10


@pytest.mark.parametrize("checkpoint, host_kept, graphs", [(False, 0, 0), (True, 0, 0), (True, 2, 0), (False, 5, 0),
                                                            (False, 1, 2)])
def test_planned_gathers_are_the_gathers_a_step_makes(monkeypatch, checkpoint, host_kept, graphs):
    """With a budget covering every past page the union is the whole past, so the planner's expected pages
    are exact: one gather per attention call of a host layer (none in stage 2's forward and recompute for a
    chunk whose attention outputs stage 1 kept, none in stage 1 for the last layer of a chunk whose hidden
    state stage 1 does not need), less the calls that reuse the gather just made for the same layer and chunk
    (a forward and its backward, a checkpoint's recompute and its backward)."""
    from lightning_oomb.core import schedule

    model = probed(tiny_model("qwen2"))  # the probe of its first step placed as place_step places it
    ids = torch.randint(0, VOCAB, (1, 40))  # 5 chunks of 8, pages of 3
    covering = SparseConfig(budget_pages=16, sink_pages=1, local_pages=1)
    placed = Placement("gpu", 8, 1, 2, graph_chunks=graphs, host_kept_chunks=host_kept, host_kv_layers=2)
    monkeypatch.setattr(schedule, "place_step", lambda *args, **kwargs: placed)
    _step(model, ids, sparse=covering, checkpoint_layers=checkpoint)
    shape = ModelShape.resolve(model)
    c = PlanConfig.build(40, chunk_size=8, page_size=3, sparse=covering, checkpoint_layers=checkpoint,
                         precision="32-true", host_grad_layers=2, host_kv_layers=2, graph_chunks=graphs,
                         host_kept_chunks=host_kept)
    page_bytes = 3 * shape.kv_bytes_per_token(torch.float32) // shape.n_layers
    assert host_gather_bytes(shape, c) == cached_pool(model).kv_staging.pages_staged * page_bytes


@needs_interpreter
def test_triton_kernels_read_one_list_per_chunk_as_its_copy_per_tile():
    """The per-chunk selection is a stride-0 view over the tiles; the Triton kernels (interpreter) read it as
    they read the same lists copied for every tile."""
    from lightning_oomb.kernels import sparse_attention

    torch.manual_seed(3)
    spec = StoreSpec(n_layers=1, n_kv_heads=2, head_dim=16, dtype=torch.float32)
    results = []
    for contiguous in (False, True):
        pool = PagePool(spec, 12, 4, "cpu")
        store = pool.layer(0, pool.allocate(1, 40))
        torch.manual_seed(3)
        store.k.normal_()
        store.v.normal_()
        q, k, v, dout = (torch.randn(1, h, 8, 16) for h in (4, 2, 2, 4))
        one = torch.tensor([[[[0, 5, 7]], [[1, 2, 7]]]], dtype=torch.int32)  # (B, H_kv, 1, K); start 32: 8 pages
        selection = one.expand(-1, -1, 2, -1)
        if contiguous:
            selection = selection.contiguous()
        out, lse = sparse_attention.attention_forward(q, k, v, store, 32, 0.25, selection)
        grads = sparse_attention.attention_backward(dout, q, k, v, out, lse, store, 32, 0.25, selection)
        results.append((out, lse, *grads, store.dk.clone(), store.dv.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("checkpoint, host_kept, graphs", [(False, 0, 0), (True, 0, 0), (True, 2, 0), (False, 1, 2)])
def test_stage_2_gathers_run_ahead_of_their_calls(monkeypatch, checkpoint, host_kept, graphs):
    """Stage 2 announces each chunk's host K/V calls (``stage_2_gather_order``): every gather it makes ran ahead
    (on CUDA, on the side stream behind the compute before its call), none was made where its call came; stage 1
    gathers where the selection was just made. The gradient is the GPU pages' bitwise."""
    from lightning_oomb.core import schedule
    from lightning_oomb.core.pages import HostKVStaging

    made = []
    gather = HostKVStaging._gather

    def recorded(self, store, selection, start, ahead):
        made.append((sequences[-1]._stage, ahead))
        return gather(self, store, selection, start, ahead)

    sequences = []
    init = ChunkedSequence.__init__

    def tracked(self, *args, **kwargs):
        sequences.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(HostKVStaging, "_gather", recorded)
    monkeypatch.setattr(ChunkedSequence, "__init__", tracked)
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 40))  # 5 chunks of 8, pages of 3
    options = dict(checkpoint_layers=checkpoint, attention="reference")
    want = _step(model, ids, offload="gpu", **options)
    placed = Placement("gpu", 8, 1, 2, graph_chunks=graphs, host_kept_chunks=host_kept, host_kv_layers=2)
    monkeypatch.setattr(schedule, "place_step", lambda *args, **kwargs: placed)
    got = _step(model, ids, **options)
    _assert_same(got, want)
    stages = {stage: [ahead for s, ahead in made if s == stage] for stage in ("fill", "recompute")}
    assert stages["fill"] and not any(stages["fill"])
    assert stages["recompute"] and all(stages["recompute"])
    assert cached_pool(model).kv_staging.prefetched == len(stages["recompute"])


@pytest.mark.parametrize("per_query_tile", [True, False], ids=["per-tile", "per-chunk"])
def test_window_layers_stay_on_the_gpu_beside_host_layers_bitwise(per_query_tile):
    """Gemma 3's local layer (a window of 7 over pages of 3) and its global one, offload='host': the global
    layer's K/V and KV-gradient pages go to the host, the local layer keeps its own K/V pages and gradient ring
    on the GPU; the gradient is that of every page on the GPU, bitwise."""
    model = tiny_model("gemma3_text", sliding_window=7, layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(0, VOCAB, (2, 29))
    config = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1, per_query_tile=per_query_tile)
    want = _step(model, ids, offload="gpu", sparse=config)
    got = _step(model, ids, offload="host", sparse=config)
    pool = cached_pool(model)
    assert (pool.host_kv_layer_ids, pool.host_layers, pool.window_layers, pool.ring_layers) == ([1], [1], [0], [0])
    _assert_same(got, want)


def test_host_layers_are_global_ones_and_the_plan_counts_the_pool(monkeypatch):
    """Gemma 3 with local (a window of 5) and global layers alternating, sparse, batch 1: the KV-gradient pages
    of one layer and the K/V pages of one on the host, as a placement asks. Both are global layers; the local
    ones keep their gradient ring and their own K/V pages on the GPU; the gradient is that of every page on
    the GPU, bitwise; the planner's page lines, GPU and host, are the pool's bytes."""
    from lightning_oomb.core import schedule
    from lightning_oomb.core.plan import plan

    layers = ["sliding_attention", "full_attention"] * 2
    model = tiny_model("gemma3_text", sliding_window=5, num_hidden_layers=4, layer_types=layers)
    ids = torch.randint(0, VOCAB, (1, 37))
    options = dict(sparse=SparseConfig(budget_pages=3, sink_pages=1, local_pages=1, per_query_tile=True))
    want = _step(model, ids, offload="gpu", **options)
    placed = Placement("gpu", 8, 1, 1, host_kv_layers=1)
    monkeypatch.setattr(schedule, "place_step", lambda *args, **kwargs: placed)
    got = _step(model, ids, **options)
    _assert_same(got, want)
    pool = cached_pool(model)
    assert pool.host_layers == pool.host_kv_layer_ids == [3] and pool.window_layers == pool.ring_layers == [0, 2]
    step = plan(model, 37, chunk_size=8, page_size=3, optimizer="none", precision="32-true", sparse=options["sparse"],
                host_grad_layers=1, host_kv_layers=1, gpu_memory=1 << 40, host_memory=1 << 40)
    pages = ("K/V pages", "KV-gradient pages", "pinned K/V pages", "pinned KV-gradient pages")
    planned = sum(v for lines in (step.gpu_lines, step.host_lines) for k, v in lines.items() if k.startswith(pages))
    # The pool holds spare pages beyond the step's: its page tensors counted by the step's pages, each layer's.
    n_pages = -(-37 // 3)
    per_step = sum(t.shape[0] * n_pages * t[0, 0].numel() * t.element_size() for t in (
        pool.k, pool.v, pool.dk, pool.dv, pool.host_k, pool.host_v, pool.host_dk, pool.host_dv))
    apart = sum(t.numel() * t.element_size() for t in (pool.ring_dk, pool.ring_dv, pool.window_k, pool.window_v))
    assert planned == per_step + apart


def test_the_planner_puts_only_global_layers_on_the_host():
    """Gemma 3 12B (8 global layers of 48), LoRA, sparse, on 79 GiB and a 112 GiB host budget: 256K keeps the 8
    global layers' KV-gradient pages on the host, 384K their K/V pages too, the 40 local layers' pages on the
    GPU; asking for more host layers than global ones is refused in one line."""
    from lightning_oomb.core.errors import SetupError
    from lightning_oomb.core.plan import plan

    common = dict(lora_rank=16, grad_dtype=torch.bfloat16, checkpoint_layers=True, gpu_memory=79 * 2**30,
                  host_memory=112 * 2**30, sparse=SparseConfig(budget_pages=64))
    placed = [plan_placed("gemma-3-12b", n * 1024, **common) for n in (256, 384)]
    assert [(p.fits, p.config.host_grad_layers, p.config.host_kv_layers) for p in placed] == [(True, 8, 0),
                                                                                             (True, 8, 8)]
    assert any("40 sliding-window layers" in k for k in placed[1].gpu_lines)
    with pytest.raises(SetupError, match="host_kv_layers \\(9\\) exceeds the model's 8 layers without a sliding"):
        plan("gemma-3-12b", 1 << 20, host_kv_layers=9, **common)
