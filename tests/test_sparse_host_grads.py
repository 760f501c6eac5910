"""Sparse attention with KV-gradient pages in host memory (``PagePool(host_grad_layers=N)``).

The sparse kernels add into those pages in place; on a CPU device the "host" tensors are ordinary memory,
so these tests check the bookkeeping (which layer lives where, zeroing, reuse, moves into dead K/V pages in
stage 2, planning); the GPU tests at the end check the host-mapped access itself.
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_oomb
from lightning_oomb.core.config import ChunkConfig, SparseConfig
from lightning_oomb.core.pages import PagePool, movable_host_layers
from lightning_oomb.core.placement import Placement, place_step
from lightning_oomb.core.plan import PLACEMENT_HEADROOM_SHARE, PlanConfig, plan, plan_placed
from lightning_oomb.core.schedule import ChunkedSequence, cached_pool, new_pool, release_cached_pool
from lightning_oomb.kernels.page_table import StoreSpec
from tiny_models import (VOCAB, assert_grads_close, full_sequence_grads, grads_of, needs_interpreter, rel_err,
                         tiny_model)

# One selection per query tile whatever the placement (offload="host" would select per chunk): the tests compare
# the same step with its pages in different places.
SPARSE = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1, per_query_tile=True)
EVERY_PAGE = SparseConfig(budget_pages=64, sink_pages=1, local_pages=1, per_query_tile=True)  # sparse is dense


def _step(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    release_cached_pool(model)
    loss = lightning_oomb.train_step(model, ids, chunk_size=8, page_size=3, sparse=SPARSE, **kwargs)
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return loss, grads


# The interpreter's steps are slow: the Triton kernels run packed only (the documents' -1 entries and masks the
# harder case); without documents and with moves, on a GPU: tests/test_gpu_end_to_end.py.
@pytest.mark.parametrize("attention, packed", [
    ("reference", False), ("reference", True), pytest.param("triton", True, marks=needs_interpreter)])
def test_every_gradient_layer_on_the_host_gives_the_same_gradient(attention, packed):
    """packed: documents of 2, 12, 7 and 10, 11 tokens (pages staged for the host with -1 entries and
    document masks, rows that see no past)."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 21))  # the last chunk's past (16 tokens, 6 pages) exceeds the budget
    docs = {}
    if packed:
        docs["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in lengths])
                                            for lengths in ([2, 12, 7], [10, 11])])
    want_loss, want = _step(model, ids, attention=attention, offload="gpu", **docs)
    model.zero_grad(set_to_none=True)
    loss = lightning_oomb.train_step(model, ids, chunk_size=8, page_size=3, sparse=SPARSE, attention=attention,
                                     offload="host", **docs)
    pool = cached_pool(model)
    # offload="host": K/V pages too (tests/test_host_kv.py); the gradient path is this file's subject.
    assert pool.placement == "gpu" and pool.host_grad_layers == 2 and pool.dk.shape[0] == 0
    assert pool.host_kv_layers == 2 and pool.k.shape[0] == 0
    assert pool.host_grads_moved == []  # a batch of two keeps its host pages
    summaries = 2 * pool.host_k[0, :, 0].numel()  # a float32 mean key per page, KV head and host K/V layer
    assert pool.host_nbytes == (2 * (pool.host_dk.numel() + pool.host_k.numel()) + summaries) * 4
    if attention == "triton":  # the staged additions round exactly as the in-place kernel does
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(g, want[name]) for name, g in grads_of(model).items())
    assert rel_err(loss, want_loss) <= 1e-6
    assert_grads_close(grads_of(model), want, 1e-6)


@needs_interpreter
def test_add_staged_pages_adds_the_chosen_rows_only():
    """The side stream's addition: every distinct chosen (page, KV head), rows up to the chunk start."""
    from lightning_oomb.kernels.host_pages import AddLaunch, add_staged_pages

    torch.manual_seed(0)
    pages_total, ps, h, d = 6, 4, 2, 16
    dst_k, dst_v = torch.randn(pages_total, ps, h, d), torch.randn(pages_total, ps, h, d)
    slots = torch.tensor([[5, 0, 3, 1, 2, 4]], dtype=torch.int32)
    pages = torch.tensor([[[0, 2, 3], [1, 3, 0]]], dtype=torch.int32)  # (B, H, NP); page 3 is cut at start 14
    counts = torch.tensor([[[2, 1, 1], [1, 3, 0]]], dtype=torch.int32)  # head 1's third entry: nobody chose it
    src_k, src_v = torch.randn(1, h, 4, ps, d), torch.randn(1, h, 4, ps, d)  # staged with room for 4
    want_k, want_v = dst_k.clone(), dst_v.clone()
    for hk in range(h):
        for i in range(3):
            if counts[0, hk, i]:
                page = int(pages[0, hk, i])
                rows = min(ps, 14 - page * ps)
                want_k[slots[0, page], :rows, hk] += src_k[0, hk, i, :rows]
                want_v[slots[0, page], :rows, hk] += src_v[0, hk, i, :rows]
    # Fewer programs than entries and pages of several row blocks; the default launch (one block per page).
    for launch in (AddLaunch(programs=3, block_rows=2, num_warps=1), None):
        got_k, got_v = dst_k.clone(), dst_v.clone()
        add_staged_pages(got_k, got_v, src_k, src_v, slots, pages, counts, start=14, launch=launch)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert AddLaunch.parse("16X128x8") == AddLaunch(16, 128, 8)


def _split_step(model, ids, host_layers: int, config: ChunkConfig, garbage: bool = False):
    """One step through a pool whose last ``host_layers`` layers keep their gradient pages apart."""
    pools = {}

    def provide(spec, pages, with_grads, placement):
        if "pool" not in pools:
            pools["pool"] = new_pool(spec, pages + 5, config.page_size, torch.device("cpu"), with_grads,
                                     Placement("gpu", 8, 1, host_layers))
            if garbage:  # what a previous step left: allocate() must zero the pages it hands out
                pools["pool"].host_dk.fill_(math.nan)
                pools["pool"].host_dv.fill_(math.nan)
        return pools["pool"]

    model.zero_grad(set_to_none=True)
    seq = ChunkedSequence(model, ids, config=config, pools=provide)
    seq.fill()
    loss = seq.backward()
    return loss, grads_of(model), pools["pool"]


def test_host_layers_spread_over_the_depth_give_the_gpu_gradient():
    """Layers 1 and 3 of 4 on the host, 0 and 2 not; stage 2 moves them into dead K/V pages one after
    another, as soon as those hold them. (The Triton kernels' staged additions: the packed case above on CPU;
    with moves, bitwise, tests/test_gpu_end_to_end.py on a GPU.)"""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (1, 30))
    config = ChunkConfig(chunk_size=6, page_size=3, attention="reference", sparse=SPARSE)
    want_loss, want, _ = _split_step(model, ids, 0, config)
    loss, got, pool = _split_step(model, ids, 2, config, garbage=True)
    assert pool.host_layers == [1, 3] and pool.dk.shape[0] == 2
    assert pool.host_grads_moved == [(1, 24), (3, 18)]  # (layer, live tokens): before chunks [18, 24), [12, 18)
    assert rel_err(loss, want_loss) <= 1e-6
    assert_grads_close(got, want, 1e-6)


@pytest.mark.parametrize("attention", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_window_layers_keep_their_own_pages_beside_host_gradient_layers(attention):
    """Gemma 3's window layer (5 tokens, chunks of 8) keeps its K/V pages apart, only where the next chunk's
    window reaches, and its gradient pages in a ring, while the global layer's gradient pages live on the host
    and move into the dead pages of its own K and of nothing else: the gradient is transformers' own (the
    Triton kernels read K/V and stage gradients through two page tables)."""
    model = tiny_model("gemma3_text", sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(0, VOCAB, (1, 36))
    want_loss, want = full_sequence_grads(model, ids)
    config = ChunkConfig(chunk_size=8, page_size=2, attention=attention, sparse=EVERY_PAGE)
    loss, got, pool = _split_step(model, ids, 1, config, garbage=True)
    assert pool.window_layers == pool.ring_layers == [0] and pool.host_layers == [1]
    assert pool.window_k.shape[1] < 18 and pool.k.shape[0] == 1 and pool.dk.shape[0] == 0
    assert pool.page_layers == 1 and pool.host_grads_moved  # the global layer's K pages only
    assert rel_err(loss, want_loss) <= 1e-5
    assert_grads_close(got, want, 1e-5)


def test_moved_layers_give_back_their_dead_gradient_pages():
    """Both layers on the host, 20 pages: the first moves at 12 live pages into 16 dead K/V slots; at 10 live
    pages the second needs 10 slots, and the 4 K/V slots left plus 4 new ones hold only 8 without the 2
    pages of the first layer's gradients that died with the chunk just done. The same gradient."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 60))
    config = ChunkConfig(chunk_size=6, page_size=3, attention="reference", sparse=SPARSE)
    want_loss, want, _ = _split_step(model, ids, 0, config)
    loss, got, pool = _split_step(model, ids, 2, config, garbage=True)
    assert pool.host_grads_moved == [(0, 36), (1, 30)]  # (layer, live tokens)
    assert rel_err(loss, want_loss) <= 1e-6
    assert_grads_close(got, want, 1e-6)


@pytest.mark.parametrize("cross_chunk", [True, False], ids=["exact", "ablation"])
def test_one_layer_on_the_host_matches_all_on_the_gpu(cross_chunk):
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 41))
    config = ChunkConfig(chunk_size=8, page_size=3, attention="reference", sparse=SPARSE,
                         cross_chunk_gradients=cross_chunk)
    want_loss, want, _ = _split_step(model, ids, 0, config)
    loss, got, pool = _split_step(model, ids, 1, config, garbage=True)
    assert pool.dk.shape[0] == 1 and pool.host_dk.shape[0] == 1
    assert pool.host_grads_moved == [(1, 24)]  # the ablation zeroes its rows in the K/V pages it moved into
    assert rel_err(loss, want_loss) <= 1e-6
    assert_grads_close(got, want, 1e-6)


def test_moves_also_take_the_gpu_layers_dead_gradient_pages():
    """4 layers, layer 2 on the host, 20 pages, a page per chunk. At 17 live pages the K/V pages of the 3 dead
    ones (12 slots) cannot hold its 17 live gradient pages; with the 3 GPU layers' dead gradient pages (21
    slots) they can: it moves at 51 live tokens, not at 48. The same gradient."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (1, 60))
    config = ChunkConfig(chunk_size=3, page_size=3, attention="reference", sparse=SPARSE)
    want_loss, want, _ = _split_step(model, ids, 0, config)
    loss, got, pool = _split_step(model, ids, 1, config, garbage=True)
    assert pool.page_layers == 7 and pool.host_grads_moved == [(2, 51)]
    assert rel_err(loss, want_loss) <= 1e-6
    assert_grads_close(got, want, 1e-6)


def test_gradient_pages_in_another_dtype_than_k_stay_on_the_host():
    """Moves put gradient pages into K/V pages: only where they have K's dtype (here float32 K, bf16 grads)."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (1, 48))
    config = ChunkConfig(chunk_size=6, page_size=3, attention="reference", sparse=SPARSE, grad_dtype=torch.bfloat16)
    want_loss, want, _ = _split_step(model, ids, 0, config)
    loss, got, pool = _split_step(model, ids, 2, config, garbage=True)
    assert pool.host_grads_moved == []
    assert torch.equal(loss, want_loss)
    for name, g in got.items():
        assert torch.equal(g, want[name]), name


def test_movable_host_layers_counts_dead_pages_of_every_layer():
    # 4 layers of 20 pages, 16 live: 4 x 4 dead pages hold one layer's 16 live pages, not two.
    assert movable_host_layers(4, 20, 16, 0) == 1
    assert movable_host_layers(4, 20, 16, 1) == 0
    assert movable_host_layers(4, 20, 12, 1) == 1  # 32 dead slots, the moved layer holds 12: 20 left hold one more
    assert movable_host_layers(4, 20, 8, 1) == 5  # 48 dead slots, 8 held: 40 left hold five layers' 8
    assert movable_host_layers(28, 8192, 4096, 0) == 28
    assert movable_host_layers(4, 20, 20, 0) == 0 and movable_host_layers(4, 20, 0, 0) == 0


def test_cached_pool_with_more_host_layers_serves_a_step_placed_with_fewer():
    """Free GPU memory drifts between steps (the CUDA runtime's first-step growth): a pool holding more host
    gradient layers than a step is placed with is reused, not replaced; one with fewer, or all-GPU, is not."""
    from lightning_oomb.core.schedule import cached_pool_provider

    model = tiny_model("llama", num_hidden_layers=4)
    provide = cached_pool_provider(model, 3, torch.device("cpu"))
    spec = StoreSpec(n_layers=4, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    first = provide(spec, 10, True, Placement("gpu", 8, 1, 2))
    assert provide(spec, 10, True, Placement("gpu", 8, 1, 1)) is first
    assert provide(spec, 10, True, Placement("gpu", 8, 1, 2)) is first
    assert provide(spec, 10, True, Placement("gpu", 8, 1, 3)) is not first
    assert provide(spec, 10, True, Placement("gpu", 8, 1, 0)).host_grad_layers == 0


def test_pool_refuses_impossible_splits():
    spec = StoreSpec(n_layers=2, n_kv_heads=1, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="host_grad_layers"):
        PagePool(spec, 4, 2, "cpu", host_grad_layers=3)
    with pytest.raises(ValueError, match="host_grad_layers"):
        PagePool(spec, 4, 2, "cpu", placement="host", segment_tokens=4, host_grad_layers=1)
    with pytest.raises(ValueError, match="host_grad_layers"):
        PagePool(spec, 4, 2, "cpu", with_grads=False, host_grad_layers=1)


def test_eval_loss_sparse_with_offload_host_holds_no_gradient_pages():
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 30))
    release_cached_pool(model)
    want = lightning_oomb.eval_loss(model, ids, chunk_size=8, page_size=3, sparse=SPARSE, offload="gpu")
    got = lightning_oomb.eval_loss(model, ids, chunk_size=8, page_size=3, sparse=SPARSE, offload="host")
    assert cached_pool(model).host_grad_layers == 0 and not cached_pool(model).with_grads
    assert rel_err(got, want) <= 1e-6
    # After a training step with host gradient pages, evaluation reuses that pool.
    lightning_oomb.train_step(model, ids, chunk_size=8, page_size=3, sparse=SPARSE, offload="host")
    trained = cached_pool(model)
    assert trained.host_grad_layers == 2
    again = lightning_oomb.eval_loss(model, ids, chunk_size=8, page_size=3, sparse=SPARSE, offload="host")
    assert cached_pool(model) is trained and rel_err(again, want) <= 1e-6


def test_place_step_on_cpu_puts_sparse_gradients_on_the_host_only_when_asked():
    model = tiny_model("qwen2")
    for offload, layers in (("auto", 0), ("gpu", 0), ("host", 2)):
        config = ChunkConfig(sparse=SPARSE, offload=offload)
        placement = place_step(model, 1, 64, config, torch.device("cpu"))
        assert (placement.where, placement.host_grad_layers) == ("gpu", layers)


def test_zero_pages_zeroes_the_taken_slots_of_every_host_layer():
    from lightning_oomb.core.pages import HostGradStaging

    pages = torch.ones(3, 10, 4, 2, 8)
    HostGradStaging(torch.device("cpu")).zero_pages((pages, pages[:, :, :2]), [0, 2, 5], [7, 2, 3, 9, 4, 5])
    zeroed = torch.zeros(10, dtype=torch.bool)
    zeroed[[2, 3, 4, 5, 7, 9]] = True
    assert (pages[:, zeroed] == 0).all() and (pages[:, ~zeroed] == 1).all()


@needs_interpreter
def test_host_page_kernels_in_the_interpreter():
    """The kernels that reach host pages from the GPU, run on CPU tensors in Triton's interpreter."""
    from lightning_oomb.kernels.host_pages import copy_pages, read_rows

    pages = torch.randn(3, 10, 4, 2, 8)
    flat = pages[1].reshape(-1, 2, 8)
    rows = torch.tensor([[5, 0, 39], [12, 12, 1]])
    assert torch.equal(read_rows(flat, rows), flat[rows])
    dst = torch.randn(30, 4, 2, 8)
    want = dst.clone()
    src_slots, dst_slots = torch.tensor([7, 2, 9], dtype=torch.int32), torch.tensor([29, 0, 11], dtype=torch.int32)
    want[dst_slots.long()] = pages[2, src_slots.long()]
    copy_pages(pages[2], src_slots, dst, dst_slots)
    assert torch.equal(dst, want)


def test_trainer_with_callback_and_host_gradient_pages(tmp_path):
    """OOMBStrategy(sparse, offload="host") with PagedKVCallback: the callback's pool keeps every layer's
    gradient pages on the host, TensorBoard shows them, and training ends with the all-GPU run's weights."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_oomb import OOMBStrategy, PagedKVCallback
    from test_strategy import UserModule, fit, weights

    runs = {}
    for offload in ("gpu", "host"):
        module = UserModule(tiny_model("qwen2"))
        logger = TensorBoardLogger(tmp_path, name=offload)
        callback = PagedKVCallback(max_seq_len=27, max_batch_size=2)
        strategy = OOMBStrategy(chunk_size=8, page_size=3, sparse=SPARSE, offload=offload)
        fit(module, strategy, logger=logger, log_every_n_steps=1, callbacks=[callback], max_steps=2)
        runs[offload] = weights(module)
        events = EventAccumulator(logger.log_dir)
        events.Reload()
        host_gib = [e.value for e in events.Scalars("memory/pool_host_gib")]
        assert all(v > 0 for v in host_gib) if offload == "host" else all(v == 0 for v in host_gib)
    for name, want in runs["gpu"].items():
        assert rel_err(runs["host"][name], want) <= 1e-6, name


# == the planner =============================================================================================

H200 = dict(gpu_memory=143771 * 2**20, host_memory=128e9, optimizer="none", grad_dtype=torch.bfloat16)


def test_planner_moves_the_fewest_gradient_layers_that_fit():
    """1M tokens of Qwen2.5-7B with sparse attention, bf16 KV-gradients, layer checkpointing: K/V (56 GiB)
    and all gradient pages (56 GiB) do not fit next to the weights; a few layers' gradients go to the host."""
    kwargs = dict(H200, sparse=SparseConfig(), checkpoint_layers=True)
    on_gpu = plan("qwen2.5-7b", 1 << 20, **kwargs)
    assert not on_gpu.fits
    chosen = plan_placed("qwen2.5-7b", 1 << 20, offload="auto", **kwargs)  # the fewest layers that fit
    n = chosen.config.host_grad_layers
    assert chosen.fits and 0 < n < 28
    fewer = plan("qwen2.5-7b", 1 << 20, host_grad_layers=n - 1, **kwargs)
    assert fewer.peak_gpu_bytes > fewer.gpu_memory * (1 - PLACEMENT_HEADROOM_SHARE)  # place_step's reserve
    grad_lines = [v for k, v in {**chosen.gpu_lines, **chosen.host_lines}.items() if "KV-gradient" in k]
    assert sum(grad_lines) == 56 * 2**30
    assert any(k.startswith("pinned KV-gradient") for k in chosen.host_lines)
    assert f"KV-gradient pages of {n} of 28 layers in pinned host memory" in str(chosen)
    # The suggestion list offers it too (not the dense streaming offload, which sparse does not use).
    assert any("KV-gradient pages of" in s.change for s in on_gpu.suggestions)
    assert not any(s.change.startswith("K/V and KV-gradient pages") for s in on_gpu.suggestions)


def test_plan_placed_places_like_a_step():
    """plan_placed (the plan CLI and the fit CLI's printout) places pages as place_step would."""
    kwargs = dict(H200, checkpoint_layers=True)
    dense = plan_placed("qwen2.5-7b", 1 << 20, offload="auto", **kwargs)
    assert dense.config.streamed and dense.fits and any("pinned host memory" in n for n in dense.notes)
    sparse = {o: plan_placed("qwen2.5-7b", 1 << 20, offload=o, sparse=SparseConfig(), **kwargs).config
              for o in ("gpu", "auto", "host")}
    assert sparse["gpu"].host_grad_layers == 0 and sparse["host"].host_grad_layers == 28
    # 8 layers with the fused ops' activations, the 2 GiB of float32 staging buffers that keep the host traffic
    # off the attention kernel and each layer's attention output kept for the checkpoint's recompute.
    assert sparse["auto"].host_grad_layers == 8
    assert not any(c.streamed for c in sparse.values())


def test_plan_config_refuses_host_gradients_without_sparse():
    with pytest.raises(ValueError, match="for sparse attention"):
        PlanConfig.build(1024, host_grad_layers=2)
    with pytest.raises(ValueError, match="does not stream"):
        PlanConfig.build(1024, sparse=SparseConfig(), streamed=True)
    dense = plan_placed("qwen2.5-7b", 1 << 20, offload="auto", **H200).config
    assert dense.streamed and dense.host_grad_layers == 0  # dense steps stream every page, not layers
    with pytest.raises(ValueError, match="exceeds"):
        plan("qwen2.5-0.5b", 1024, sparse=SparseConfig(), host_grad_layers=99, **H200)


def test_plan_cli_sparse(capsys):
    from lightning_oomb.planner_cli import main

    args = ["--model", "qwen2.5-7b", "--context", "1M", "--optimizer", "none", "--grad-dtype", "bfloat16",
            "--checkpoint-layers", "on", "--budget-pages", "64", "--gpu-memory", "143771MiB", "--host-memory", "128GB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sparse attention: 64 pages per query tile" in out and "in pinned host memory" in out
    assert main([*args, "--offload", "gpu"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


# == GPU: the host-mapped pages themselves ===================================================================


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zero_pages_zeroes_pinned_host_pages_from_the_side_stream():
    from lightning_oomb.core.host_memory import pinned_empty
    from lightning_oomb.core.pages import HostGradStaging

    staging = HostGradStaging(torch.device("cuda"))
    staging.ZERO_PAGES = 2  # runs longer than one copy
    pages = pinned_empty((3, 10, 4, 2, 8), torch.bfloat16, pin=True)
    pages.fill_(1.0)
    staging.zero_pages((pages,), [0, 2, 5], [7, 2, 3, 9, 4, 5])
    staging.wait_for_layer(2)
    torch.cuda.current_stream().synchronize()
    zeroed = torch.zeros(10, dtype=torch.bool)
    zeroed[[2, 3, 4, 5, 7, 9]] = True
    assert (pages[:, zeroed] == 0).all() and (pages[:, ~zeroed] == 1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sparse_step_with_host_gradient_pages_equals_gpu_pages():
    """bf16, GQA, pages of 16: the same kernels on host-mapped gradient pages give bitwise the same result."""
    model = tiny_model("qwen2", dtype=torch.bfloat16, head_dim=16, hidden_size=64).cuda()
    ids = torch.randint(0, VOCAB, (2, 300), device="cuda")
    # Per-tile selection on both: with host pages the default would select once per chunk, another result.
    config = SparseConfig(budget_pages=4, sink_pages=1, local_pages=1, per_query_tile=True)
    results = {}
    for offload in ("gpu", "host"):
        model.zero_grad(set_to_none=True)
        release_cached_pool(model)
        loss = lightning_oomb.train_step(model, ids, chunk_size=64, page_size=16, sparse=config, offload=offload)
        pool = cached_pool(model)
        assert pool.host_grad_layers == (2 if offload == "host" else 0)
        results[offload] = (loss, grads_of(model))
        # A second step on the same pool: its pages must be zeroed again.
        model.zero_grad(set_to_none=True)
        again = lightning_oomb.train_step(model, ids, chunk_size=64, page_size=16, sparse=config, offload=offload)
        assert torch.equal(again, loss)
        for name, g in grads_of(model).items():
            assert torch.equal(g, results[offload][1][name]), name
    (loss_gpu, gpu), (loss_host, host) = results["gpu"], results["host"]
    assert torch.equal(loss_gpu, loss_host)
    for name in gpu:
        assert torch.equal(gpu[name], host[name]), name
