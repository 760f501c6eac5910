"""Page-level sparse attention (lightning_oomb.core.sparse, kernels/sparse_attention.py), CPU.

The oracle is autograd of a dense float64 softmax attention over the whole past plus the chunk with the
block mask the selection stands for, built explicitly. Stores hold NaN wherever nothing was written, so a
stray read shows up.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lightning_oomb
from lightning_oomb.core import sparse
from lightning_oomb.core.attention import chunk_attention, resolve_backend
from lightning_oomb.core.config import SparseConfig
from lightning_oomb.core.sparse import select_pages, update_summaries
from lightning_oomb.kernels import sparse_attention as tri
from test_triton_attention import DEVICE, make_problem
from tiny_models import BACKENDS, VOCAB, full_sequence_grads, grads_of, needs_interpreter, rel_err, tiny_model

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def random_selection(batch, h_sel, t, start, page_size, budget, seed=0):
    """Sorted random subsets of min(P, budget) past pages per (batch, head, query tile)."""
    g = torch.Generator().manual_seed(seed)
    n_past = -(-start // page_size)
    n_tiles = -(-t // page_size)
    k = min(n_past, budget)
    sel = torch.stack([torch.randperm(n_past, generator=g)[:k] for _ in range(batch * h_sel * n_tiles)])
    return sel.view(batch, h_sel, n_tiles, k).sort(-1).values.int().to(DEVICE)


def oracle(p, selection, doc_start=None, softcap=None):
    """Dense float64 attention with the selection's block mask (entries of -1: no page) and, with doc_start
    (B, T), each query's document mask: out, dq, dk, dv, and dK, dV of the past. softcap: scores capped as
    transformers' eager attention caps them, before the mask."""
    b, hq, t, d = p.q.shape
    h = p.k.shape[1]
    g = hq // h
    ps = p.store.page_size
    kp, vp = p.store.read(0, p.start)
    leaves = [x.detach().double().requires_grad_() for x in (p.q, p.k, p.v, kp, vp)]
    q, k, v, kp, vp = leaves
    keys, vals = torch.cat([kp, k], 2), torch.cat([vp, v], 2)  # (B, H, start + T, D)
    allowed = torch.zeros(b, h, t, p.start + t, dtype=torch.bool)
    tile = torch.arange(t) // ps
    sel = selection.cpu().expand(b, h, *selection.shape[2:]).long()
    for bi in range(b):
        for hi in range(h):
            for i in range(t):
                for page in sel[bi, hi, tile[i]][sel[bi, hi, tile[i]] >= 0]:
                    allowed[bi, hi, i, page * ps : min((page + 1) * ps, p.start)] = True
    allowed[..., p.start :] = torch.ones(t, t).tril().bool()
    if doc_start is not None:
        allowed &= (torch.arange(p.start + t) >= doc_start.cpu()[:, None, :, None].long())
    s = torch.einsum("bhgtd,bhnd->bhgtn", q.view(b, h, g, t, d), keys) * p.scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed[:, :, None].to(s.device), float("-inf"))
    out = torch.einsum("bhgtn,bhnd->bhgtd", s.softmax(-1), vals).reshape(b, hq, t, -1)
    out.backward(p.dout.double())
    return out.detach(), *(x.grad for x in leaves)


def run_op(p, selection, forward, backward, doc_start=None, **options):
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    before = p.store.read(0, p.start + p.q.shape[2], grads=True)
    out, lse = forward(p.q, p.k, p.v, p.store, p.start, p.scale, selection, doc_start, **options)
    dq, dk, dv = backward(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, selection, doc_start, **options)
    after = p.store.read(0, p.start, grads=True)
    p.pool.dk.copy_(saved[0])
    p.pool.dv.copy_(saved[1])
    # What the op added to the past's gradient pages, and the chunk's dk, dv minus what was stored for them.
    t0 = p.start
    return (out, lse, dq, dk - before[0][:, :, t0:].to(dk.dtype), dv - before[1][:, :, t0:].to(dv.dtype),
            after[0] - before[0][:, :, :t0], after[1] - before[1][:, :, :t0])


NAMES = ["out", "dq", "dk", "dv", "store dk", "store dv"]


def assert_matches(got, want, tol, names=NAMES):
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.isfinite(a).all(), f"{name}: non-finite"
        err = rel_err(a.cpu(), b.cpu())
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# == options ================================================================================================


def test_config_validation():
    assert lightning_oomb.SparseConfig is SparseConfig
    with pytest.raises(ValueError, match="budget_pages"):
        SparseConfig(budget_pages=0)
    with pytest.raises(ValueError, match="must not exceed"):
        SparseConfig(budget_pages=4, sink_pages=2, local_pages=3)
    with pytest.raises(ValueError, match="score"):
        SparseConfig(score="max")
    with pytest.raises(ValueError, match="unknown option"):
        SparseConfig.coerce({"budget": 3})
    assert SparseConfig.coerce({"budget_pages": 8}) == SparseConfig(budget_pages=8)
    from lightning_oomb.core.config import ChunkConfig

    assert ChunkConfig(sparse={"budget_pages": 8, "score": "minmax"}).sparse == SparseConfig(
        budget_pages=8, score="minmax", per_query_tile=True)


# == the reference against the masked dense oracle =========================================================

REF_CASES = {
    # batch, n_kv, group, head_dim, T, start, page_size, budget, per_kv_head
    "gqa2-per-head": (2, 2, 2, 8, 11, 23, 4, 3, True),
    "gqa1-shared-straddle": (1, 2, 1, 8, 9, 13, 5, 2, False),
    "dense-budget": (1, 1, 3, 8, 7, 10, 3, 64, True),
    "empty-past": (1, 2, 2, 8, 6, 0, 4, 2, True),
}


@pytest.mark.parametrize("v_dim", [None, 12], ids=["values-as-keys", "values-12-keys-8"])
@pytest.mark.parametrize("case", list(REF_CASES), ids=list(REF_CASES))
def test_reference_matches_masked_dense(case, v_dim):
    b, h, g, d, t, start, ps, budget, per_head = REF_CASES[case]
    p = make_problem(b, h, g, d, t, start, ps, torch.float32, device="cpu", v_dim=v_dim)
    sel = random_selection(b, h if per_head else 1, t, start, ps, budget).cpu()
    got = run_op(p, sel, sparse.attention_forward, sparse.attention_backward)
    want = oracle(p, sel)
    assert_matches([got[0], *got[2:]], want, 1e-5)


def test_selection_rules():
    """Sinks, local window and the top scores; dense when the past fits the budget; shared = one list."""
    p = make_problem(2, 2, 2, 8, 10, 37, 4, torch.float32, device="cpu")  # 10 past pages, the last partial
    pool, store = p.pool, p.store
    for score in ("mean", "minmax"):
        summaries = pool.summaries(score, 1)
        update_summaries(store, summaries, score, 0, p.start)
        config = SparseConfig(budget_pages=5, sink_pages=1, local_pages=2, score=score)
        sel = select_pages(p.q, store, summaries, config, p.start)
        assert sel.dtype == torch.int32 and sel.shape == (2, 2, 3, 5)
        scores = sparse.page_scores(p.q, store, summaries, config, p.start)
        for row, sc in zip(sel.view(-1, 5), scores.reshape(-1, 10)):
            assert row.tolist() == sorted(row.tolist())
            assert {0, 8, 9} <= set(row.tolist())
            middle = sc[1:8]
            assert set(row.tolist()) - {0, 8, 9} == set((middle.topk(2).indices + 1).tolist())
        shared = select_pages(p.q, store, summaries, SparseConfig(budget_pages=5, sink_pages=1, local_pages=2, score=score, per_kv_head=False), p.start)
        assert shared.shape == (2, 1, 3, 5)
        dense = select_pages(p.q, store, summaries, SparseConfig(budget_pages=10), p.start)
        assert (dense == torch.arange(10, dtype=torch.int32)).all()
    # The summaries themselves: mean of the past keys of page 9 (tokens 36..36), min/max of page 3.
    kp, _ = store.read(0, p.start)
    mean = pool.summaries("mean", 1)[0][p.store.table.slots[:, 9].long()]
    assert torch.allclose(mean, kp[:, :, 36:37].mean(2).float())
    lo, hi = (s[p.store.table.slots[:, 3].long()] for s in pool.summaries("minmax", 1))
    assert torch.equal(lo, kp[:, :, 12:16].amin(2)) and torch.equal(hi, kp[:, :, 12:16].amax(2))


def test_minmax_bounds_the_mean_query_logit():
    p = make_problem(1, 1, 2, 8, 8, 24, 4, torch.float32, device="cpu")
    summaries = p.pool.summaries("minmax", 1)
    update_summaries(p.store, summaries, "minmax", 0, p.start)
    bound = sparse.page_scores(p.q, p.store, summaries, SparseConfig(budget_pages=2, sink_pages=0, local_pages=0, score="minmax"), p.start)  # (1,1,2,6)
    qbar = sparse.tile_queries(p.q, 4).mean(1)  # (1, n_tiles, D)
    kp, _ = p.store.read(0, p.start)
    logits = torch.einsum("bnd,bpd->bnp", qbar, kp[:, 0].float()).view(1, 2, 6, 4)
    assert (bound[0, 0] >= logits[0].amax(-1) - 1e-6).all()


# == packed documents =======================================================================================


def doc_starts(lengths, start, t):
    """Document starts (B, T) int32 of the chunk [start, start + t) of rows packed from documents of the given
    lengths (one list per row)."""
    rows = [torch.cat([torch.full((n,), sum(lens[:i])) for i, n in enumerate(lens)]) for lens in lengths]
    return torch.stack(rows)[:, start:start + t].int()


def documents_problem(b, h, g, d, t, start, ps, dtype, lengths, config, device=DEVICE, v_dim=None):
    """A random problem, its chunk's document starts and the selection select_pages makes with them."""
    p = make_problem(b, h, g, d, t, start, ps, dtype, device=device, v_dim=v_dim)
    summaries = p.pool.summaries(config.score, 1)
    update_summaries(p.store, summaries, config.score, 0, start)
    doc = doc_starts(lengths, start, t).to(p.q.device)
    return p, doc, select_pages(p.q, p.store, summaries, config, start, doc)


def test_selection_in_documents():
    """Pages wholly before a tile's earliest document start are never chosen (-1 fills the list, sorted
    first); sink pages are that document's first pages, local pages the last before the chunk; a tile that
    sees at most the budget takes every page it sees; a tile whose documents all start in the chunk none."""
    # Chunk [40, 52) of pages of 4 (10 past pages), tiles [40, 44), [44, 48), [48, 52).
    # Row 0: documents at 0, 5, 30 (page 7, mid-page), 46 (in the chunk): tiles 0, 1 see pages 7..9 (3 <= budget
    # 5), tile 2 only from 46 on: none. Row 1: one document at 0, another at 41: tile 0 sees all 10 pages.
    config = SparseConfig(budget_pages=5, sink_pages=2, local_pages=1)
    p, doc, sel = documents_problem(2, 2, 1, 8, 12, 40, 4, torch.float32, [[5, 25, 16, 6], [41, 11]], config,
                                    device="cpu")
    assert sel.shape == (2, 2, 3, 5)
    assert (sel[0, :, 0] == torch.tensor([-1, -1, 7, 8, 9], dtype=torch.int32)).all()
    assert (sel[0, :, 1] == sel[0, :, 0]).all() and (sel[0, :, 2] == -1).all()
    assert (sel[1, :, 1:] == -1).all()
    # Row 1's tile 0 is scored by its one row of the document that started before the chunk (40): the rows of
    # the document at 41 see no past page, and whatever they hold leaves the selection as it is.
    summaries = p.pool.summaries("mean", 1)
    scores = sparse.page_scores(p.q, p.store, summaries, config, 40, rows=doc < 40)
    for row, sc in zip(sel[1, :, 0], scores[1, :, 0]):
        assert row[:2].tolist() == [0, 1] and row[-1] == 9
        assert set(row[2:4].tolist()) == set((sc[2:9].topk(2).indices + 2).tolist())
    later = p.q.clone()
    later[1, :, 1:4] = torch.randn_like(later[1, :, 1:4]) * 100
    assert torch.equal(select_pages(later, p.store, summaries, config, 40, doc), sel)
    # Sinks at the document's first page, not the sequence's: documents at 0 and 9 (page 2, mid-page).
    p, doc, sel = documents_problem(1, 1, 2, 8, 8, 40, 4, torch.float32, [[9, 39]], config, device="cpu")
    assert (sel[..., :2] == torch.tensor([2, 3], dtype=torch.int32)).all() and (sel[..., -1] == 9).all()
    assert (sel[..., 2:4] > 3).all() and (sel[..., 2:4] < 9).all()
    # No past at all, and a shared list.
    _, _, sel = documents_problem(1, 2, 1, 8, 8, 0, 4, torch.float32, [[3, 5]], config, device="cpu")
    assert sel.shape == (1, 2, 2, 0)
    shared = SparseConfig(budget_pages=5, sink_pages=2, local_pages=1, per_kv_head=False)
    _, _, sel = documents_problem(2, 2, 1, 8, 12, 40, 4, torch.float32, [[5, 25, 16, 6], [41, 11]], shared,
                                  device="cpu")
    assert sel.shape == (2, 1, 3, 5) and (sel[0, 0, 0] == torch.tensor([-1, -1, 7, 8, 9], dtype=torch.int32)).all()


# batch, n_kv, group, head_dim, T, start, page_size, budget, per_kv_head, document lengths per row
DOC_CASES = {
    # starts mid-page in the past (29), on a page (36), mid-page in the chunk (45): 64 tokens, chunk [41, 64)
    "pages-of-5": (2, 2, 2, 16, 23, 41, 5, 3, True, [[29, 7, 9, 19], [3, 50, 11]]),
    # whole pages of 32 (descriptor reads), a start mid-page in the past and one in the chunk
    "whole-pages": (1, 1, 2, 16, 40, 96, 32, 2, True, [[10, 60, 50, 16]]),
}


@pytest.mark.parametrize("case", list(DOC_CASES), ids=list(DOC_CASES))
def test_reference_with_documents_matches_masked_dense(case):
    b, h, g, d, t, start, ps, budget, per_head, lengths = DOC_CASES[case]
    config = SparseConfig(budget_pages=budget, sink_pages=1, local_pages=1, per_kv_head=per_head)
    p, doc, sel = documents_problem(b, h, g, d, t, start, ps, torch.float32, lengths, config, device="cpu")
    assert (sel < 0).any()  # some tile has fewer pages than the budget
    got = run_op(p, sel, sparse.attention_forward, sparse.attention_backward, doc)
    want = oracle(p, sel, doc)
    assert_matches([got[0], *got[2:]], want, 1e-5)


# == the engine ============================================================================================


def _grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = lightning_oomb.train_step(model, ids, **kwargs)
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return loss, grads


def _assert_grads(a, b, tol):
    assert a.keys() == b.keys()
    worst = max((rel_err(a[n], b[n]), n) for n in b)
    assert worst[0] <= tol, worst


@pytest.mark.parametrize("score", ["mean", "minmax"])
def test_budget_covering_every_page_is_dense(score):
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 37))
    want_loss, want = _grads(model, ids, chunk_size=8, page_size=3, attention="reference")
    loss, got = _grads(model, ids, chunk_size=8, page_size=3, attention="reference",
                       sparse=SparseConfig(budget_pages=13, score=score))
    assert rel_err(loss, want_loss) <= 1e-5
    _assert_grads(got, want, 1e-5)
    with torch.no_grad():
        ev = lightning_oomb.eval_loss(model, ids, chunk_size=8, page_size=3, sparse={"budget_pages": 13})
    assert rel_err(ev, want_loss) <= 1e-5


def test_sparse_changes_the_model_and_selection_is_reused(monkeypatch):
    """A small budget gives another loss than dense; stage 2 gets stage 1's selection tensors, per layer
    and chunk, in the forward and in the backward."""
    from lightning_oomb.core import schedule

    made, calls = {}, []
    select, fwd, bwd = schedule.select_pages, sparse.attention_forward, sparse.attention_backward

    def record_select(q, store, summaries, config, start, doc_start):
        made[(start, store.layer)] = selection = select(q, store, summaries, config, start, doc_start)
        return selection

    def record_fwd(q, k, v, store, start, scale, selection, doc_start, softcap=None):
        calls.append(("fwd", start, store.layer, selection))
        return fwd(q, k, v, store, start, scale, selection, doc_start, softcap)

    def record_bwd(dout, q, k, v, out, lse, store, start, scale, selection, doc_start, softcap=None):
        calls.append(("bwd", start, store.layer, selection))
        return bwd(dout, q, k, v, out, lse, store, start, scale, selection, doc_start, softcap)

    monkeypatch.setattr(schedule, "select_pages", record_select)
    monkeypatch.setattr(sparse, "attention_forward", record_fwd)
    monkeypatch.setattr(sparse, "attention_backward", record_bwd)
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 40))
    config = SparseConfig(budget_pages=2, sink_pages=1, local_pages=0, score="mean")
    # keep_graphs=0: stage 2 runs every chunk's forward again (a kept graph's chunk has none).
    loss, _ = _grads(model, ids, chunk_size=8, page_size=2, attention="reference", sparse=config, keep_graphs=0)
    sparse_made, sparse_calls = dict(made), list(calls)
    dense_loss, _ = _grads(model, ids, chunk_size=8, page_size=2, attention="reference")
    assert rel_err(loss, dense_loss) > 1e-4
    # Stage 1 selects for every (chunk, layer), the last layer too (whose attention it skips).
    assert sorted(sparse_made) == [(start, layer) for start in (0, 8, 16, 24, 32) for layer in (0, 1)]
    stage_2 = sparse_calls[5:]  # stage 1's forwards: layer 0 of each of the 5 chunks
    assert [(c[0], c[2]) for c in sparse_calls[:5]] == [("fwd", 0)] * 5
    for kind in ("fwd", "bwd"):
        used = {(c[1], c[2]): c[3] for c in stage_2 if c[0] == kind}
        assert sorted(used) == sorted(sparse_made)
        for key, selection in sparse_made.items():
            assert used[key] is selection, (kind, key)
    for (start, _), selection in sparse_made.items():
        if start >= 2 * 2:
            assert selection.shape[-1] == 2  # budget-limited past


# == sliding windows ========================================================================================


def test_selection_in_a_window():
    """A window is each query's first visible key, as a document start is: no page wholly before a tile's
    earliest window start is chosen; a window within the budget is taken whole; one selection per chunk
    chooses among the pages its first query sees."""
    # Chunk [40, 52) of pages of 4 (10 past pages), a window of 15: tile 0's first query (40) sees from 26
    # (page 6), tile 2's (48) from 34 (page 8).
    config = SparseConfig(budget_pages=5, sink_pages=1, local_pages=1)
    p = make_problem(1, 2, 1, 8, 12, 40, 4, torch.float32, device="cpu")
    summaries = p.pool.summaries("mean", 1)
    update_summaries(p.store, summaries, "mean", 0, 40)
    window = (torch.arange(40, 52) - 14).clamp_min(0).int()[None]
    sel = select_pages(p.q, p.store, summaries, config, 40, window)
    assert (sel[0, :, 0] == torch.tensor([-1, 6, 7, 8, 9], dtype=torch.int32)).all()
    assert (sel[0, :, 2] == torch.tensor([-1, -1, -1, 8, 9], dtype=torch.int32)).all()
    per_chunk = select_pages(p.q, p.store, summaries, dataclasses.replace(config, per_query_tile=False), 40, window)
    assert per_chunk.stride(2) == 0 and (per_chunk[0, :, 2] == sel[0, :, 0]).all()
    # A wider window (27: from page 3 for tile 0) than the budget: sink at the window's first page, the local
    # page, and the top scores between.
    wide = (torch.arange(40, 52) - 26).clamp_min(0).int()[None]
    sel = select_pages(p.q, p.store, summaries, config, 40, wide)
    assert (sel[0, :, 0, 0] == 3).all() and (sel[0, :, 0, -1] == 9).all() and (sel[0, :, 0] >= 3).all()


WINDOWED_SPARSE = {
    # every layer windowed, the window (11 tokens: at most 5 pages of 3) within the budget: dense in the window
    "within-budget": (dict(sliding_window=11), SparseConfig(budget_pages=6, sink_pages=1, local_pages=1)),
    "within-budget-per-chunk": (dict(sliding_window=11),
                                SparseConfig(budget_pages=6, sink_pages=1, local_pages=1, per_query_tile=False)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WINDOWED_SPARSE), ids=list(WINDOWED_SPARSE))
def test_window_within_the_budget_matches_full_sequence(case, backend):
    """A sliding window that fits the budget leaves sparse attention exact: transformers' own full-sequence
    training of the windowed model, within 1e-5."""
    window, config = WINDOWED_SPARSE[case]
    model = tiny_model("mistral", **window)
    ids = torch.randint(0, VOCAB, (2, 37))
    want_loss, want = full_sequence_grads(model, ids)
    loss, got = _grads(model, ids, chunk_size=8, page_size=3, attention=backend, sparse=config)
    assert rel_err(loss, want_loss) <= 1e-5
    _assert_grads(got, want, 1e-5)


@needs_interpreter
@pytest.mark.parametrize("per_query_tile", [True, False], ids=["per-tile", "per-chunk"])
def test_windows_wider_than_the_budget_triton_matches_reference(per_query_tile):
    """Gemma 3's local layers (a 16-token window over pages of 2: more pages than the budget of 3) beside its
    global ones, each layer selecting in its own window: the Triton step equals the reference step."""
    model = tiny_model("gemma3_text", sliding_window=16)
    ids = torch.randint(0, VOCAB, (1, 40))
    config = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1, per_query_tile=per_query_tile)
    want_loss, want = _grads(model, ids, chunk_size=8, page_size=2, attention="reference", sparse=config)
    loss, got = _grads(model, ids, chunk_size=8, page_size=2, attention="triton", sparse=config)
    dense_loss, _ = _grads(model, ids, chunk_size=8, page_size=2, attention="reference")
    assert rel_err(want_loss, dense_loss) > 1e-4  # the budget cuts the windows
    assert rel_err(loss, want_loss) <= 1e-5
    _assert_grads(got, want, 1e-5)


# == Triton kernels against the reference (interpreter on CPU) =============================================

KERNEL_CASES = {
    # batch, n_kv, group, head_dim, T, start, page_size, budget, per_kv_head
    "gqa2-pages-of-5": (2, 2, 2, 16, 23, 41, 5, 3, True),
    "gqa1-shared-pages-of-16": (1, 2, 1, 16, 37, 50, 16, 2, False),
    "page-larger-than-block": (1, 1, 2, 16, 20, 70, 24, 2, True),
    "dense-budget-odd-dim": (1, 2, 2, 8, 13, 17, 4, 64, True),
    "empty-past": (1, 1, 2, 16, 9, 0, 4, 2, True),
    # whole pages of 32 (the chunk starts on a page boundary): page blocks read through descriptors
    "whole-pages-gqa7": (1, 1, 7, 16, 40, 96, 32, 2, True),
    # every query tile a whole page of whole blocks: the page dK/dV loop's unmasked (EVEN) row terms
    "whole-query-tiles": (1, 2, 2, 16, 64, 96, 32, 2, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(KERNEL_CASES), ids=list(KERNEL_CASES))
def test_kernels_match_reference(case, dtype):
    b, h, g, d, t, start, ps, budget, per_head = KERNEL_CASES[case]
    p = make_problem(b, h, g, d, t, start, ps, dtype)
    sel = random_selection(b, h if per_head else 1, t, start, ps, budget, seed=1)
    got = run_op(p, sel, tri.attention_forward, tri.attention_backward)
    want = run_op(p, sel, sparse.attention_forward, sparse.attention_backward)
    assert_matches(got, want, TOL[dtype], ["out", "lse", *NAMES[1:]])


# Values of another width than the keys (DeepSeek's MLA): batch, n_kv, group, head_dim, T, start, page_size, budget,
# per_kv_head, v_dim
VALUE_WIDTH_CASES = {
    "values-twice-as-wide-pages-of-5": (2, 2, 2, 16, 23, 41, 5, 3, True, 32),
    "mla-keys-24-values-16-shared": (1, 2, 3, 24, 37, 50, 16, 2, False, 16),
    "whole-pages-values-narrower": (1, 2, 2, 16, 64, 96, 32, 2, True, 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(VALUE_WIDTH_CASES), ids=list(VALUE_WIDTH_CASES))
def test_kernels_with_values_of_another_width_match_reference(case, dtype):
    """Forward, dQ, the chunk's dK/dV and the selected pages' dK/dV with V, dV, out and dO D_v wide."""
    b, h, g, d, t, start, ps, budget, per_head, v_dim = VALUE_WIDTH_CASES[case]
    p = make_problem(b, h, g, d, t, start, ps, dtype, v_dim=v_dim)
    sel = random_selection(b, h if per_head else 1, t, start, ps, budget, seed=1)
    got = run_op(p, sel, tri.attention_forward, tri.attention_backward)
    want = run_op(p, sel, sparse.attention_forward, sparse.attention_backward)
    assert got[0].shape[-1] == v_dim
    assert_matches(got, want, TOL[dtype], ["out", "lse", *NAMES[1:]])


@pytest.mark.parametrize("v_dim", [None, 24], ids=["values-as-keys", "values-24-keys-16"])
@pytest.mark.parametrize("case", list(DOC_CASES), ids=list(DOC_CASES))
def test_kernels_match_reference_with_documents(case, v_dim):
    """Packed documents: -1 entries skipped, document masks in the page loops, the chunk and the page dK/dV."""
    b, h, g, d, t, start, ps, budget, per_head, lengths = DOC_CASES[case]
    config = SparseConfig(budget_pages=budget, sink_pages=1, local_pages=1, per_kv_head=per_head)
    p, doc, sel = documents_problem(b, h, g, d, t, start, ps, torch.float32, lengths, config, v_dim=v_dim)
    got = run_op(p, sel, tri.attention_forward, tri.attention_backward, doc)
    want = run_op(p, sel, sparse.attention_forward, sparse.attention_backward, doc)
    assert_matches(got, want, TOL[torch.float32], ["out", "lse", *NAMES[1:]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ["gqa2-pages-of-5", "page-larger-than-block", "whole-query-tiles"])
def test_soft_capped_scores(case, dtype):
    """Soft-capped scores (softcap * tanh(q.k * scale / softcap)): the reference against the masked dense
    oracle of transformers' formula (float32), the kernels against the reference; packed documents once."""
    b, h, g, d, t, start, ps, budget, per_head = KERNEL_CASES[case]
    p = dataclasses.replace(make_problem(b, h, g, d, t, start, ps, dtype), scale=0.5)
    sel = random_selection(b, h if per_head else 1, t, start, ps, budget, seed=1)
    want = run_op(p, sel, sparse.attention_forward, sparse.attention_backward, softcap=2.0)
    if dtype == torch.float32:
        assert_matches([want[0], *want[2:]], oracle(p, sel, softcap=2.0), 1e-5)
        assert rel_err(want[0], oracle(p, sel)[0].to(want[0].dtype)) > 0.1  # the cap bends these scores
    got = run_op(p, sel, tri.attention_forward, tri.attention_backward, softcap=2.0)
    assert_matches(got, want, TOL[dtype], ["out", "lse", *NAMES[1:]])
    if case == "gqa2-pages-of-5" and dtype == torch.float32:
        b, h, g, d, t, start, ps, budget, per_head, lengths = DOC_CASES[list(DOC_CASES)[0]]
        config = SparseConfig(budget_pages=budget, sink_pages=1, local_pages=1, per_kv_head=per_head)
        p, doc, sel = documents_problem(b, h, g, d, t, start, ps, torch.float32, lengths, config)
        p = dataclasses.replace(p, scale=0.5)
        want = run_op(p, sel, sparse.attention_forward, sparse.attention_backward, doc, softcap=2.0)
        assert_matches([want[0], *want[2:]], oracle(p, sel, doc, softcap=2.0), 1e-5)
        got = run_op(p, sel, tri.attention_forward, tri.attention_backward, doc, softcap=2.0)
        assert_matches(got, want, TOL[torch.float32], ["out", "lse", *NAMES[1:]])


def test_soft_capped_scores_with_values_of_another_width():
    """Soft-capped scores over values of another width than the keys: the reference against the masked dense oracle
    of transformers' formula, the kernels (selected pages, chunk, page dK/dV) against the reference, fp32."""
    b, h, g, d, t, start, ps, budget, per_head, v_dim = VALUE_WIDTH_CASES["values-twice-as-wide-pages-of-5"]
    p = dataclasses.replace(make_problem(b, h, g, d, t, start, ps, torch.float32, v_dim=v_dim), scale=0.5)
    sel = random_selection(b, h if per_head else 1, t, start, ps, budget, seed=1)
    want = run_op(p, sel, sparse.attention_forward, sparse.attention_backward, softcap=2.0)
    assert want[0].shape[-1] == v_dim
    assert_matches([want[0], *want[2:]], oracle(p, sel, softcap=2.0), 1e-5)
    assert rel_err(want[0], oracle(p, sel)[0].to(want[0].dtype)) > 0.1  # the cap bends these scores
    got = run_op(p, sel, tri.attention_forward, tri.attention_backward, softcap=2.0)
    assert_matches(got, want, TOL[torch.float32], ["out", "lse", *NAMES[1:]])


def test_page_gradient_programs_start_with_the_most_chosen_pages():
    """invert_selection lists each head's distinct pages by how many query tiles chose them (ties by page
    number): the page dK/dV kernel launches them in that order, so the pages every tile attends (sink and
    local) are not its last, longest programs. Unchosen entries come last with count 0."""
    # 3 query tiles, 6 past pages. Head 0: every tile picks pages 0 and 5. Head 1: pages 1, 2, 4 by two tiles each.
    selection = torch.tensor([[[[0, 3, 5], [0, 1, 5], [0, 4, 5]],
                               [[1, 2, 4], [2, 3, 4], [0, 1, 5]]]], dtype=torch.int32)
    pages, tiles, counts = tri.invert_selection(selection, 2, 6)
    assert pages[0, 0].tolist() == [0, 5, 1, 3, 4, 2] and counts[0, 0].tolist() == [3, 3, 1, 1, 1, 0]
    assert pages[0, 1].tolist() == [1, 2, 4, 0, 3, 5] and counts[0, 1].tolist() == [2, 2, 2, 1, 1, 1]
    assert tiles[0, 0, 1, :3].tolist() == [0, 1, 2] and tiles[0, 1, 1, :2].tolist() == [0, 1]


def test_kernel_autograd_wiring():
    p = make_problem(1, 1, 2, 16, 12, 10, 4, torch.float32)
    sel = random_selection(1, 1, 12, 10, 4, 2)
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    grads = []
    for impl in ("triton", "reference"):
        p.pool.dk.copy_(saved[0])
        p.pool.dv.copy_(saved[1])
        q, k, v = (x.clone().requires_grad_() for x in (p.q, p.k, p.v))
        backend = resolve_backend(impl, q.device, sparse=True)
        out = chunk_attention(q, k, v, p.store, p.start, p.scale, backend, sel)
        out.backward(p.dout)
        grads.append((out.detach(), q.grad, k.grad, v.grad, *p.store.read(0, p.start, grads=True)))
    for a, b in zip(*grads):
        assert rel_err(a, b) <= 1e-5


@needs_interpreter
def test_train_step_triton_matches_reference():
    """One selection shared by the KV heads, Quest's scores. (Per KV head, in the interpreter: the packed and
    host-page Triton steps of tests/test_documents.py and tests/test_sparse_host_grads.py.)"""
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 30))
    config = SparseConfig(budget_pages=2, sink_pages=1, local_pages=1, score="minmax", per_kv_head=False)
    want_loss, want = _grads(model, ids, chunk_size=8, page_size=3, attention="reference", sparse=config)
    loss, got = _grads(model, ids, chunk_size=8, page_size=3, attention="triton", sparse=config)
    assert rel_err(loss, want_loss) <= 1e-5
    _assert_grads(got, want, 1e-5)


# == Lightning: the mixin and the strategy ================================================================


def test_mixin_trains_sparse_through_a_trainer(tmp_path, monkeypatch):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_oomb import OOMBStrategy, SparseCausalLMModule
    from lightning_oomb.core import schedule

    made = []
    select = schedule.select_pages
    monkeypatch.setattr(schedule, "select_pages", lambda *a: made.append(a[3]) or select(*a))
    config = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    module = SparseCausalLMModule(config=config, budget_pages=3, sink_pages=1, local_pages=1, sparse_score="minmax",
                                  per_kv_head=False, learning_rate=1e-2)
    want = SparseConfig(budget_pages=3, sink_pages=1, local_pages=1, score="minmax", per_kv_head=False)
    assert module.sparse_config == want
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, VOCAB, (1, 40), generator=g)), "labels": ids} for _ in range(2)]
    strategy = OOMBStrategy(chunk_size=8, page_size=4, sparse={"budget_pages": 50})  # the module's wins
    trainer = Trainer(max_steps=2, accelerator="cpu", strategy=strategy, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    module.materialize()  # the weights, which the Trainer would build in configure_model
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer.fit(module, DataLoader(data, batch_size=None), DataLoader(data, batch_size=None))  # validated sparse too
    assert trainer.global_step == 2
    decided = dataclasses.replace(want, per_query_tile=True)  # offload "auto": one selection per query tile
    assert strategy.chunk_config.sparse == decided
    assert made and all(c == decided for c in made)
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters())
    ckpt = torch.load(next(tmp_path.rglob("*.ckpt")), weights_only=False)
    hp = ckpt["hyper_parameters"]
    assert (hp["budget_pages"], hp["sink_pages"], hp["local_pages"], hp["sparse_score"], hp["per_kv_head"]) == (
        3, 1, 1, "minmax", False)
    with pytest.raises(ValueError, match="must not exceed"):
        SparseCausalLMModule(config=config, budget_pages=2, sink_pages=1, local_pages=2)


def test_strategy_takes_a_dict():
    from lightning_oomb import OOMBStrategy

    assert OOMBStrategy(sparse={"budget_pages": 8}).chunk_config.sparse == SparseConfig(budget_pages=8,
                                                                                          per_query_tile=True)
    assert OOMBStrategy().chunk_config.sparse is None


# == planner and bench ====================================================================================


def test_planner_counts_sparse_attention():
    from lightning_oomb.core.plan import plan, step_time

    kw = dict(gpu_memory=141e9, host_memory=128e9, checkpoint_auto=True)
    dense = plan("qwen2.5-7b", 131072, **kw)
    sp = plan("qwen2.5-7b", 131072, sparse={"budget_pages": 64}, **kw)
    assert sp.time.linear_flops == dense.time.linear_flops
    # 32 chunks of 4096: chunk c attends min(4096 c, 8192) past tokens + its causal half.
    pairs = sum(4096 * (min(4096 * c, 8192) + 2048) for c in range(32))
    assert sp.time.attention_flops == pytest.approx(4.5 * 4 * 3584 * 28 * pairs)
    assert any(k.startswith("sparse:") for k in sp.gpu_lines) and "sparse attention: 64 pages" in str(sp)
    suggestion = next(s for s in dense.suggestions if "sparse" in s.change)
    assert suggestion.cli == "--budget-pages 64" and suggestion.plan.time.attention_flops == sp.time.attention_flops
    assert not any("sparse" in s.change for s in sp.suggestions)
    # A budget covering the whole past is dense.
    big = step_time("qwen2.5-7b", 32768, sparse=SparseConfig(budget_pages=1024))
    assert big.attention_flops == step_time("qwen2.5-7b", 32768).attention_flops


def test_bench_sparse_mode(tmp_path):
    import json

    from lightning_oomb.bench import run as bench
    from test_bench import TINY_QWEN2, read_rows

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_QWEN2))
    out = tmp_path / "out"
    argv = ["--model", str(path), "--lengths", "96", "--modes", "oomb,sparse", "--repeats", "1", "--warmup", "0",
            "--chunk", "32", "--page-size", "8", "--budget-pages", "6", "--out", str(out)]
    assert bench.main(argv) == 0
    _, rows = read_rows(out / "results.csv")
    assert [r["mode"] for r in rows] == ["oomb", "sparse"] and all(r["status"] == "ok" for r in rows)
    assert float(rows[1]["floor_s"]) < float(rows[0]["floor_s"])
    assert float(rows[0]["loss"]) != float(rows[1]["loss"])


# == GPU: bf16 at a real head size (the interpreter's bf16 tl.dot is wrong, so bf16 is only tested here) ==


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("per_kv_head", [True, False], ids=["per-head", "shared"])
@pytest.mark.parametrize("start", [3000, 3072], ids=["partial-page", "whole-pages"])
@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "packed"])
def test_bf16_gpu_against_fp32_reference(per_kv_head, start, documents):
    """bf16 at D=128, T=512, 24 past pages of 128 (start 3000: the last partial; 3072: all whole, which on
    an H200 runs forward and dQ in the warp-specialised kernels), budget 6, GQA 7. Packed: documents from 0,
    1000 (mid-page) and 3200 (in the chunk), selected by select_pages (sink pages from page 7; rows from 3200
    see no past), in the Triton kernels (not the warp-specialised ones).

    Oracle: the fp32 reference on the same bf16 values. The kernel's error must stay within twice the error
    a bf16 computation cannot avoid (the bf16 reference's own, or rounding the fp32 result) plus 1e-3.
    """
    from test_triton_attention import _fp32_copy

    p = make_problem(1, 2, 7, 128, 512, start, 128, torch.bfloat16, device="cuda")
    p32 = _fp32_copy(p)
    doc = None
    if documents:
        config = SparseConfig(budget_pages=6, sink_pages=1, local_pages=1, per_kv_head=per_kv_head)
        summaries = p.pool.summaries(config.score, 1)
        update_summaries(p.store, summaries, config.score, 0, start)
        doc = doc_starts([[1000, 2200, start - 2688]], start, 512).cuda()
        sel = select_pages(p.q, p.store, summaries, config, start, doc)
    else:
        sel = random_selection(1, 2 if per_kv_head else 1, 512, start, 128, 6, seed=3).cuda()
    if torch.cuda.get_device_capability() == (9, 0):
        assert tri._warp_specialized_pages(p.q, p.store, start, sel, doc) == (start % 128 == 0 and not documents)
    kernel = [x.float() for x in run_op(p, sel, tri.attention_forward, tri.attention_backward, doc)]
    ref_bf16 = [x.float() for x in run_op(p, sel, sparse.attention_forward, sparse.attention_backward, doc)]
    ref_fp32 = run_op(p32, sel, sparse.attention_forward, sparse.attention_backward, doc)
    for name, a, b, want in zip(["out", "lse", *NAMES[1:]], kernel, ref_bf16, ref_fp32):
        err = rel_err(a, want)
        floor = max(rel_err(b, want), rel_err(want.bfloat16(), want))
        print(f"{name}: kernel {err:.2e}, bf16 floor {floor:.2e}")
        assert torch.isfinite(a).all(), name
        assert err <= 2 * floor + 1e-3, f"{name}: kernel error {err:.2e} vs bf16 floor {floor:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("start", [3000, 3072], ids=["partial-page", "whole-pages"])
@pytest.mark.parametrize("widths", [(192, 128), (64, 128)], ids=["mla-192-128", "keys-64-values-128"])
def test_bf16_gpu_values_of_another_width_against_fp32_reference(widths, start):
    """As test_bf16_gpu_against_fp32_reference without documents, values of their own width (DeepSeek's keys of
    192 on tiles padded to 256, values 128; values wider than keys): the Triton kernels (the Gluon ones take one
    width only), within twice the bf16 floor plus 1e-3."""
    from test_triton_attention import _fp32_copy

    key_dim, v_dim = widths
    p = make_problem(1, 4, 2, key_dim, 512, start, 128, torch.bfloat16, device="cuda", v_dim=v_dim)
    p32 = _fp32_copy(p)
    sel = random_selection(1, 4, 512, start, 128, 6, seed=3).cuda()
    assert not tri._warp_specialized_pages(p.q, p.store, start, sel, None)
    kernel = [x.float() for x in run_op(p, sel, tri.attention_forward, tri.attention_backward)]
    ref_bf16 = [x.float() for x in run_op(p, sel, sparse.attention_forward, sparse.attention_backward)]
    ref_fp32 = run_op(p32, sel, sparse.attention_forward, sparse.attention_backward)
    for name, a, b, want in zip(["out", "lse", *NAMES[1:]], kernel, ref_bf16, ref_fp32):
        err = rel_err(a, want)
        floor = max(rel_err(b, want), rel_err(want.bfloat16(), want))
        print(f"{name}: kernel {err:.2e}, bf16 floor {floor:.2e}")
        assert torch.isfinite(a).all(), name
        assert err <= 2 * floor + 1e-3, f"{name}: kernel error {err:.2e} vs bf16 floor {floor:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_page_gradients_are_deterministic_on_gpu():
    """Tiles that share pages (sinks, locals) are summed in one program: two runs are bitwise equal."""
    p = make_problem(1, 4, 7, 128, 4096, 16384, 128, torch.bfloat16, device="cuda")
    sel = random_selection(1, 4, 4096, 16384, 128, 64, seed=4).cuda()
    first = run_op(p, sel, tri.attention_forward, tri.attention_backward)
    second = run_op(p, sel, tri.attention_forward, tri.attention_backward)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
