"""Triton chunk attention against the plain-PyTorch reference (CPU: Triton interpreter, fp32 and fp16).

Every case runs forward and backward of both implementations from identical store contents and compares
out, lse, dq, the returned dk/dv, and what each added into the store's gradient pages. Stores are filled
with NaN wherever the kernels must not read, so a stray load shows up as NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lightning_oomb.core import reference_attention as ref
from lightning_oomb.core import sparse as sparse_ref
from lightning_oomb.core.attention import AttentionBackend, SparseAttentionBackend, chunk_attention, resolve_backend
from lightning_oomb.core.pages import PagePool
from lightning_oomb.kernels import chunk_attention as tri
from lightning_oomb.kernels import sparse_attention as sparse_tri
from lightning_oomb.kernels.page_table import LayerStore, StoreSpec
from tiny_models import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 1e-3}
# On a GPU box the same cases run compiled on the GPU; otherwise in the interpreter (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend, protocol", [
    (ref, AttentionBackend), (tri, AttentionBackend), (sparse_ref, SparseAttentionBackend),
    (sparse_tri, SparseAttentionBackend),
])
def test_backends_implement_their_protocol(backend, protocol):
    """Each backend module has every function of its Protocol, taking the Protocol's parameters in its order
    (a backend may add trailing parameters with defaults, such as the reference's tile size)."""
    import inspect

    for name, want in inspect.getmembers(protocol, inspect.isfunction):
        if name.startswith("_"):
            continue
        wanted = [p for p in inspect.signature(want).parameters if p != "self"]
        got = inspect.signature(getattr(backend, name)).parameters
        assert list(got)[: len(wanted)] == wanted, f"{backend.__name__}.{name}"
        assert all(p.default is not inspect.Parameter.empty for p in list(got.values())[len(wanted):]), name


@dataclass
class Problem:
    pool: PagePool
    store: LayerStore
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    start: int
    scale: float


def make_problem(
    batch: int, n_kv: int, group: int, head_dim: int, t: int, start: int, page_size: int, dtype: torch.dtype,
    device: str = DEVICE, seed: int = 0, transposed: bool = False, v_dim: int | None = None,
) -> Problem:
    """A random chunk at [start, start + t) over a random past, pages in random pool slots (layer 1 of 2); values
    ``v_dim`` wide (None: ``head_dim``)."""
    torch.manual_seed(seed)
    spec = StoreSpec(n_layers=2, n_kv_heads=n_kv, head_dim=head_dim, dtype=dtype, v_head_dim=v_dim)
    v_dim = spec.v_dim
    n_pages = -(-(start + t) // page_size)
    pool = PagePool(spec, num_pages=batch * n_pages + 3, page_size=page_size, device=device)
    table = pool.allocate(batch, start + t)
    table.slots = torch.randperm(pool.num_pages, device=device)[: batch * n_pages].view(batch, n_pages).int()
    store = pool.layer(1, table)
    for x in (pool.k, pool.v, pool.dk, pool.dv):
        x.fill_(float("nan"))
    rand = lambda *shape: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
    store.write(rand(batch, n_kv, start, head_dim), rand(batch, n_kv, start, v_dim), 0)
    # Gradients already stored for the past and for the chunk's own tokens (as later chunks leave them).
    store.dk.view(-1, n_kv, head_dim)[table.rows(0, start + t)] = torch.randn(batch, start + t, n_kv, head_dim, device=device)
    store.dv.view(-1, n_kv, v_dim)[table.rows(0, start + t)] = torch.randn(batch, start + t, n_kv, v_dim, device=device)
    if transposed:  # what a model hands over: (B, T, H, D) viewed as (B, H, T, D)
        q = rand(batch, t, n_kv * group, head_dim).transpose(1, 2)
        k = rand(batch, t, n_kv, head_dim).transpose(1, 2)
        v = rand(batch, t, n_kv, v_dim).transpose(1, 2)
    else:
        q = rand(batch, n_kv * group, t, head_dim)
        k, v = rand(batch, n_kv, t, head_dim), rand(batch, n_kv, t, v_dim)
    return Problem(pool, store, q, k, v, rand(batch, n_kv * group, t, v_dim), start, head_dim**-0.5)


def run_both(p: Problem, forward=tri.attention_forward, backward=tri.attention_backward, **options):
    """(kernel results, reference results): out, lse, dq, dk, dv, and the store's dK, dV of [0, start + T).
    options: keyword arguments of both (softcap)."""
    t = p.q.shape[2]
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    results = []
    for fwd, bwd in ((forward, backward), (ref.attention_forward, ref.attention_backward)):
        p.pool.dk.copy_(saved[0])
        p.pool.dv.copy_(saved[1])
        out, lse = fwd(p.q, p.k, p.v, p.store, p.start, p.scale, **options)
        dq, dk, dv = bwd(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, **options)
        results.append((out, lse, dq, dk, dv, *p.store.read(0, p.start + t, grads=True)))
    return results


def assert_close(got, want, tol: float) -> None:
    names = ["out", "lse", "dq", "dk", "dv", "store dk", "store dv"]
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err = rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


CASES = {
    # batch, n_kv, group, head_dim, T, start, page_size
    "pages-of-5-cross-tiles": (2, 2, 2, 16, 33, 21, 5),
    "empty-past-gqa7": (2, 1, 7, 16, 7, 0, 4),
    "one-query-short-past": (1, 2, 1, 16, 1, 3, 5),
    "d64-gqa7": (2, 1, 7, 64, 33, 50, 16),
    "page-size-1": (1, 2, 2, 16, 20, 37, 1),
    "whole-query-tiles": (1, 2, 2, 16, 32, 40, 8),  # T a multiple of every query tile: unmasked row terms
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case, dtype):
    got, want = run_both(make_problem(*CASES[case], dtype=dtype))
    assert_close(got, want, TOL[dtype])


def test_store_gradients_are_added():
    """The store's past rows receive exactly this chunk's dK, dV on top of what was there."""
    p = make_problem(1, 2, 2, 16, 9, 30, 7, torch.float32)
    before = p.store.read(0, p.start, grads=True)
    got, want = run_both(p)
    for i, name in ((5, "dk"), (6, "dv")):
        added = got[i][:, :, : p.start] - before[i - 5]
        expected = want[i][:, :, : p.start] - before[i - 5]
        assert rel_err(added, expected) <= 1e-5, name


@pytest.mark.parametrize("chunk_split", [1, 2])
def test_other_tiles_and_strided_inputs(chunk_split):
    """Unequal query/key tiles (the causal split inside a tile), (B, T, H, D)-strided q, k, v, and the
    chunk's dK/dV tiles computed whole (split 1) or by two programs of two query heads each."""
    tiles = tri.KernelTiles(fwd=tri.Tiles(32, 16), dkdv=tri.Tiles(16, 32), dq=tri.Tiles(32, 16), chunk_split=chunk_split)

    def forward(q, k, v, store, start, scale):
        return tri._forward(q, k, v, store, start, scale, tiles.fwd)

    def backward(dout, q, k, v, out, lse, store, start, scale):
        return tri._backward(dout, q, k, v, out, lse, store, start, scale, tiles)

    p = make_problem(2, 2, 4, 16, 45, 29, 7, torch.float32, transposed=True)
    got, want = run_both(p, forward, backward)
    assert_close(got, want, TOL[torch.float32])


def test_unaligned_queries_take_pointer_loads():
    """Query rows the copy engine cannot take (a base off 16 bytes) are read by pointer loads instead:
    the same results. (Aligned inputs, as in the other cases, take the descriptors.)"""
    p = make_problem(1, 2, 2, 16, 33, 32, 16, torch.float32)
    assert tri.query_descriptors(16, p.q, p.dout) is not None

    def shifted(x):
        flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        return flat[1:].view(x.shape).copy_(x)

    p.q, p.dout = shifted(p.q), shifted(p.dout)
    assert tri.query_descriptors(16, p.q, p.dout) is None
    got, want = run_both(p)
    assert_close(got, want, TOL[torch.float32])


def test_warp_specialized_kernels_take_only_what_they_support():
    """Which launches the Hopper Gluon kernels (past_attention_sm90) may run: the conditions checked here, the
    kernels themselves by the GPU tests below. Off any sm_90 GPU the Triton kernels run everything."""
    from lightning_oomb.kernels import past_attention_sm90 as ws

    p = make_problem(1, 2, 7, 128, 256, 1024, 128, torch.bfloat16, device="cpu")
    assert ws.supported(p.q, p.store, 1024)
    assert not ws.supported(p.q, p.store, 1000)  # not whole key tiles
    assert not ws.supported(p.q, p.store, 0)  # no past
    assert not ws.supported(p.q.float(), p.store, 1024)  # fp32: the Triton kernels' exact products
    small_pages = make_problem(1, 2, 7, 128, 256, 1024, 64, torch.bfloat16, device="cpu")
    assert not ws.supported(small_pages.q, small_pages.store, 1024)  # a page smaller than a key tile
    d96 = make_problem(1, 1, 2, 96, 64, 256, 128, torch.bfloat16, device="cpu")
    assert not ws.supported(d96.q, d96.store, 256)  # head dims 64 and 128 only
    v64 = make_problem(1, 2, 7, 128, 256, 1024, 128, torch.bfloat16, device="cpu", v_dim=64)
    assert not ws.supported(v64.q, v64.store, 1024)  # values of another width than the keys
    selection = torch.arange(8, dtype=torch.int32).view(1, 1, 1, 8).expand(1, 2, 2, 8)
    assert ws.supported_pages(p.q, p.store, 1024, selection)
    assert not ws.supported_pages(p.q, p.store, 1000, selection)  # the chunk must start on a page
    assert not ws.supported_pages(p.q, p.store, 1024, selection[..., :0])  # nothing selected
    assert tri._warp_specialized_past(p.q, p.store, 1024, None) == (0, 0)  # a CPU tensor


def test_odd_head_dim_runs_padded():
    """Head dims that are not a power of two >= 16 (the tiny test models use 8) run on padded tiles."""
    got, want = run_both(make_problem(1, 2, 2, 8, 11, 13, 3, torch.float32))
    assert_close(got, want, TOL[torch.float32])


def test_autograd_wiring():
    """attention='triton' through ChunkAttention gives the reference's gradients."""
    p = make_problem(1, 1, 2, 16, 12, 10, 4, torch.float32)
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    grads = []
    for impl in ("triton", "reference"):
        p.pool.dk.copy_(saved[0])
        p.pool.dv.copy_(saved[1])
        q, k, v = (x.clone().requires_grad_() for x in (p.q, p.k, p.v))
        out = chunk_attention(q, k, v, p.store, p.start, p.scale, resolve_backend(impl, q.device))
        out.backward(p.dout)
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        assert rel_err(a, b) <= 1e-5


# --------------------------------------------------------------------------------------------------------
# Values of another width than the keys (DeepSeek's MLA; DiffLlama's values of both halves side by side)
# --------------------------------------------------------------------------------------------------------


VALUE_WIDTH_CASES = {
    # batch, n_kv, group, head_dim, T, start, page_size, v_dim
    "values-twice-as-wide": (2, 2, 2, 16, 33, 21, 5, 32),
    "mla-keys-24-values-16": (1, 2, 3, 24, 29, 40, 8, 16),  # keys on padded tiles of 32, values not
    "values-narrower-empty-past": (2, 1, 4, 16, 11, 0, 4, 8),
    "values-12-keys-8-pages-of-1": (1, 2, 2, 8, 9, 14, 1, 12),  # both padded, to 16
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(VALUE_WIDTH_CASES), ids=list(VALUE_WIDTH_CASES))
def test_values_of_another_width_match_reference(case, dtype):
    """Out and dO, V and dV D_v wide, q, K and dK D wide: forward and backward, the store's pages of both."""
    *shape, v_dim = VALUE_WIDTH_CASES[case]
    p = make_problem(*shape, dtype=dtype, v_dim=v_dim)
    got, want = run_both(p)
    assert got[0].shape[-1] == got[4].shape[-1] == got[6].shape[-1] == v_dim
    assert_close(got, want, TOL[dtype])


@pytest.mark.parametrize("chunk_split", [1, 2])
def test_values_of_another_width_on_other_tiles_strided(chunk_split):
    """(B, T, H, D)-strided inputs, unequal tiles and the chunk's dK/dV split over query heads (float32 partial
    sums of both widths), values wider than keys; the output laid out like q, as transformers reads it."""
    tiles = tri.KernelTiles(fwd=tri.Tiles(32, 16), dkdv=tri.Tiles(16, 32), dq=tri.Tiles(32, 16),
                            chunk_split=chunk_split)

    def forward(q, k, v, store, start, scale):
        out, lse = tri._forward(q, k, v, store, start, scale, tiles.fwd)
        assert out.stride(1) < out.stride(2)  # (B, T, H_q, D_v) rows
        return out, lse

    def backward(dout, q, k, v, out, lse, store, start, scale):
        return tri._backward(dout, q, k, v, out, lse, store, start, scale, tiles)

    p = make_problem(2, 2, 4, 16, 45, 29, 7, torch.float32, transposed=True, v_dim=24)
    p.dout = p.dout.transpose(1, 2).contiguous().transpose(1, 2)
    got, want = run_both(p, forward, backward)
    assert_close(got, want, TOL[torch.float32])


def test_values_of_another_width_with_documents_in_key_ranges():
    """Packed documents, and forward_state / backward_part over key ranges (what host pages stream), with values
    of another width: the kernels as the reference."""
    p = make_problem(2, 2, 2, 16, 45, 37, 5, torch.float32, v_dim=8)
    doc_start = chunk_doc_start(([0, 9, 40, 41, 43, 70], [0, 50, 51, 60]), p.start, p.q.shape[2])
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    results = []
    for backend in (tri, ref):
        p.pool.dk.copy_(saved[0])
        p.pool.dv.copy_(saved[1])
        state = backend.forward_state(p.q, p.k, p.v, p.store, 0, 0, p.scale, True, doc_start=doc_start,
                                      chunk_start=p.start)
        for lo, hi in ((0, 16), (16, 30), (30, p.start)):
            backend.forward_state(p.q, p.k, p.v, p.store, lo, hi, p.scale, False, state, doc_start=doc_start)
        out, lse = state
        dq = torch.zeros(p.q.shape, dtype=torch.float32, device=p.q.device)
        delta = backend.backward_delta(out, p.dout)
        dk, dv = backend.backward_part(p.dout, p.q, p.k, p.v, lse, delta, p.store, 0, 0, p.start, p.scale, True, dq,
                                       doc_start)
        for lo, hi in ((0, 16), (16, 30), (30, p.start)):
            backend.backward_part(p.dout, p.q, p.k, p.v, lse, delta, p.store, lo, hi, p.start, p.scale, False, dq,
                                  doc_start)
        results.append((out, lse, dq, dk, dv, *p.store.read(0, p.start + p.q.shape[2], grads=True)))
    assert_close(*results, TOL[torch.float32])
    p.pool.dk.copy_(saved[0])
    p.pool.dv.copy_(saved[1])
    want, skipped = reference_then_unread(p, doc_start)
    out, lse = tri.attention_forward(p.q, p.k, p.v, p.store, p.start, p.scale, doc_start)
    dq, dk, dv = tri.attention_backward(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, doc_start)
    got = [out, lse, dq, dk, dv, *p.store.read(0, p.start + p.q.shape[2], grads=True)]
    assert_unread_then_close(got, want, skipped, TOL[torch.float32])


# --------------------------------------------------------------------------------------------------------
# Packed documents: each query sees only keys from its document's start on (doc_start)
# --------------------------------------------------------------------------------------------------------


DOC_CASES = {
    # batch, n_kv, group, head_dim, T, start, page_size; the document starts of each row (token positions)
    "borders-mid-page-and-tile": (2, 2, 2, 16, 45, 37, 5, ([0, 9, 40, 41, 43, 70], [0, 50, 51, 60])),
    "document-from-the-past-into-the-chunk": (1, 2, 2, 16, 33, 64, 8, ([0, 35, 70],)),
    "chunk-starts-a-document": (1, 1, 4, 16, 32, 48, 16, ([0, 48, 60],)),
    "short-documents-no-past": (2, 1, 2, 16, 40, 0, 4, ([0, 1, 3, 20], [0, 17, 18, 19])),
}


def chunk_doc_start(starts: tuple[list[int], ...], start: int, t: int) -> torch.Tensor:
    """(B, T) int32: for each token of the chunk [start, start + T), its document's start."""
    tok = torch.arange(start, start + t)
    rows = [torch.tensor(s)[torch.searchsorted(torch.tensor(s), tok, right=True) - 1] for s in starts]
    return torch.stack(rows).int().to(DEVICE)


def reference_then_unread(p: Problem, doc_start: torch.Tensor | None) -> tuple[tuple, list[int]]:
    """The reference's out, lse, dq, dk, dv and store dK, dV with ``doc_start``, the gradient pages then put
    back; K, V, dK, dV of each row's key tiles (the forward kernel's) that end before the row's earliest document
    start set to NaN for the kernels. Returns (those results, per row where its NaN rows end)."""
    t = p.q.shape[2]
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    out, lse = ref.attention_forward(p.q, p.k, p.v, p.store, p.start, p.scale, doc_start)
    dq, dk, dv = ref.attention_backward(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, doc_start)
    want = (out, lse, dq, dk, dv, *p.store.read(0, p.start + t, grads=True))
    p.pool.dk.copy_(saved[0])
    p.pool.dv.copy_(saved[1])
    block_n = tri.default_tiles(p.q.shape[-1], p.q.dtype).fwd.block_n
    ends = [0 if doc_start is None else int(doc_start[b, 0]) // block_n * block_n for b in range(p.q.shape[0])]
    for b, end in enumerate(ends):
        rows = p.store.table.rows(0, end)[b]
        for x in (p.pool.k, p.pool.v, p.pool.dk, p.pool.dv):
            x[1].view(-1, *x.shape[-2:])[rows] = float("nan")
    return want, ends


def assert_unread_then_close(got: list, want: tuple, ends: list[int], tol: float) -> None:
    """The NaN gradient rows of ``reference_then_unread`` were not written; the rest as ``assert_close``."""
    for b, end in enumerate(ends):
        for i in (5, 6):
            assert got[i][b, :, :end].isnan().all(), "a skipped key tile's gradient rows were written"
            got[i][b, :, :end] = want[i][b, :, :end]
    assert_close(got, want, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(DOC_CASES), ids=list(DOC_CASES))
def test_documents_match_reference_and_skip_other_documents(case, dtype):
    """The kernels against the reference with document starts; K, V, dK, dV of the key tiles that end before
    a row's earliest document start in the chunk are NaN for the kernels: they must be neither read (the
    outputs stay finite) nor written (they stay NaN)."""
    *shape, starts = DOC_CASES[case]
    p = make_problem(*shape, dtype=dtype)
    t = p.q.shape[2]
    doc_start = chunk_doc_start(starts, p.start, t)
    want, skipped = reference_then_unread(p, doc_start)
    out, lse = tri.attention_forward(p.q, p.k, p.v, p.store, p.start, p.scale, doc_start)
    dq, dk, dv = tri.attention_backward(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, doc_start)
    got = [out, lse, dq, dk, dv, *p.store.read(0, p.start + t, grads=True)]
    assert_unread_then_close(got, want, skipped, TOL[dtype])


def test_documents_in_key_ranges():
    """forward_state / backward_part over key ranges (host pages stream the past this way) with documents
    give what one call over the whole past gives."""
    *shape, starts = DOC_CASES["borders-mid-page-and-tile"]
    p = make_problem(*shape, dtype=torch.float32)
    doc_start = chunk_doc_start(starts, p.start, p.q.shape[2])
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    results = []
    for backend in (tri, ref):
        p.pool.dk.copy_(saved[0])
        p.pool.dv.copy_(saved[1])
        state = backend.forward_state(p.q, p.k, p.v, p.store, 0, 0, p.scale, True, doc_start=doc_start,
                                      chunk_start=p.start)
        for lo, hi in ((0, 16), (16, 30), (30, p.start)):
            backend.forward_state(p.q, p.k, p.v, p.store, lo, hi, p.scale, False, state, doc_start=doc_start)
        out, lse = state
        dq = torch.zeros(p.q.shape, dtype=torch.float32, device=p.q.device)
        delta = backend.backward_delta(out, p.dout)
        dk, dv = backend.backward_part(p.dout, p.q, p.k, p.v, lse, delta, p.store, 0, 0, p.start, p.scale, True, dq,
                                       doc_start)
        for lo, hi in ((0, 16), (16, 30), (30, p.start)):
            backend.backward_part(p.dout, p.q, p.k, p.v, lse, delta, p.store, lo, hi, p.start, p.scale, False, dq,
                                  doc_start)
        results.append((out, lse, dq, dk, dv, *p.store.read(0, p.start + p.q.shape[2], grads=True)))
    assert_close(*results, TOL[torch.float32])


ONE_DOCUMENT_CASES = {
    # batch, n_kv, group, head_dim, T, start, page_size; the start of the chunk's one document (None: no
    # documents); the stored keys [lo, hi) the Hopper kernels take
    "document-mid-page": (1, 2, 2, 64, 64, 700, 128, 300, (384, 640)),
    "document-on-a-page-batch-2": (2, 1, 2, 64, 48, 520, 128, 256, (256, 512)),
    "pages-of-256": (1, 1, 2, 64, 40, 1000, 256, 100, (256, 896)),
    "no-documents": (1, 2, 2, 64, 64, 700, 128, None, (0, 640)),
    "document-without-a-whole-tile": (1, 1, 2, 64, 64, 700, 128, 600, (0, 0)),
}


def _triton_plays_the_hopper_kernels(monkeypatch) -> list[tuple[str, int, int]]:
    """Make the Triton backend split a chunk as on an sm_90 GPU, the Hopper kernels' contract (the whole
    tiles [0, past_end) of a store, past_attention_sm90's forward_past, dq_past, dkdv_past) played by the
    Triton launches themselves: the interpreter then checks the split (the document's head, the page view,
    the tail, the carried state) on any machine; the GPU tests run the Gluon kernels. Returns the calls
    (kernel, past_end, pages in the view)."""
    from lightning_oomb.kernels import past_attention_sm90 as ws

    calls = []

    def tiles(q):
        return tri.default_tiles(q.shape[-1], q.dtype)

    def kv_unread(q, store):  # the chunk's own K, V: never read by launches without the chunk
        return q[:, : store.k.shape[2]], q[:, : store.k.shape[2]]

    def forward_past(q, store, scale, state, out, past_end=0, selection=None):
        calls.append(("forward", past_end, store.table.slots.shape[1]))
        tri.launch_forward(q, *kv_unread(q, store), store, 0, past_end, scale, tiles(q).fwd, False, *state, carry=True)
        return out.copy_(state[0])

    def dq_past(dout, q, lse, delta, store, scale, partial, dq, past_end=0, selection=None):
        calls.append(("dq", past_end, store.table.slots.shape[1]))
        tri.launch_dq(dout, q, *kv_unread(q, store), lse, delta, store, 0, past_end, scale, tiles(q).dq, False,
                      partial, accumulate=True)
        return dq.copy_(partial)

    def dkdv_past(dout, q, lse2, sdelta, store, scale, past_end=0, pages=None, staging=None):
        calls.append(("dkdv", past_end, store.table.slots.shape[1]))
        tri.launch_dkdv(dout, q, *kv_unread(q, store), lse2, sdelta, store, 0, past_end, 0, scale, tiles(q),
                        chunk=False)

    monkeypatch.setattr(tri, "is_sm90", lambda q: True)
    for kernel in (forward_past, dq_past, dkdv_past):
        monkeypatch.setattr(ws, kernel.__name__, kernel)
    return calls


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the Gluon kernels themselves run (test_16_bit_gpu_*)")
@pytest.mark.parametrize("case", list(ONE_DOCUMENT_CASES), ids=list(ONE_DOCUMENT_CASES))
def test_hopper_split_of_a_chunk_in_one_document(case, monkeypatch):
    """A chunk whose queries all belong to one document (``one_document``) runs the document's whole past
    pages in the Hopper kernels, its keys before them and the chunk in Triton: out, lse and every gradient
    as the reference with per-query document starts gives them, the other document's tiles not read."""
    *shape, one_document, keys = ONE_DOCUMENT_CASES[case]
    p = make_problem(*shape, dtype=torch.float16)
    b, t = p.q.shape[0], p.q.shape[2]
    doc_start = None if one_document is None else torch.full((b, t), one_document, dtype=torch.int32)
    want, unread = reference_then_unread(p, doc_start)

    calls = _triton_plays_the_hopper_kernels(monkeypatch)
    assert tri._warp_specialized_past(p.q, p.store, p.start, doc_start, one_document) == keys
    out, lse = tri.attention_forward(p.q, p.k, p.v, p.store, p.start, p.scale, doc_start, one_document)
    dq, dk, dv = tri.attention_backward(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, doc_start,
                                        one_document)
    got = [out, lse, dq, dk, dv, *p.store.read(0, p.start + t, grads=True)]
    lo, hi = keys
    pages = p.store.table.slots.shape[1] - lo // p.store.page_size
    assert calls == ([("forward", hi - lo, pages), ("dkdv", hi - lo, pages), ("dq", hi - lo, pages)] if hi else [])
    assert_unread_then_close(got, want, unread, TOL[torch.float16])


# --------------------------------------------------------------------------------------------------------
# Soft-capped scores (Gemma 2's attn_logit_softcapping): softcap * tanh(q.k * scale / softcap)
# --------------------------------------------------------------------------------------------------------

# With scale 0.5 the scores of these random problems spread over about +-2 standard deviations of 2: a cap of 2
# bends most of them (the outputs move by 25-80% against uncapped ones).
SOFTCAP, SOFTCAP_SCALE = 2.0, 0.5


def dense_soft_capped(p: Problem, softcap: float) -> tuple[torch.Tensor, ...]:
    """transformers' eager formula in float64 autograd over the stored past plus the chunk, causal: out, lse,
    dq, the chunk's dk, dv, and the past's dK, dV."""
    b, hq, t, d = p.q.shape
    h = p.k.shape[1]
    kp, vp = p.store.read(0, p.start)
    q, k, v, kp, vp = (x.detach().double().requires_grad_() for x in (p.q, p.k, p.v, kp, vp))
    keys, values = torch.cat([kp, k], 2), torch.cat([vp, v], 2)
    s = torch.einsum("bhgtd,bhnd->bhgtn", q.view(b, h, hq // h, t, d), keys) * p.scale
    s = torch.tanh(s / softcap) * softcap
    seen = torch.arange(p.start + t)[None, :] <= p.start + torch.arange(t)[:, None]
    s = s.masked_fill(~seen.to(s.device), float("-inf"))
    out = torch.einsum("bhgtn,bhnd->bhgtd", s.softmax(-1), values).reshape(b, hq, t, d)
    out.backward(p.dout.double())
    return out.detach(), s.logsumexp(-1).reshape(b, hq, t).detach(), q.grad, k.grad, v.grad, kp.grad, vp.grad


def test_reference_soft_cap_is_transformers_formula():
    """The reference's soft-capped attention and its gradients (tanh's derivative included) against autograd of
    transformers' eager formula, past and chunk, in float64; the cap changes the result."""
    import dataclasses

    p = dataclasses.replace(make_problem(2, 2, 2, 16, 13, 21, 5, torch.float32, device="cpu"), scale=SOFTCAP_SCALE)
    t = p.q.shape[2]
    before = p.store.read(0, p.start + t, grads=True)
    out, lse = ref.attention_forward(p.q, p.k, p.v, p.store, p.start, p.scale, softcap=SOFTCAP)
    dq, dk, dv = ref.attention_backward(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, softcap=SOFTCAP)
    after = p.store.read(0, p.start, grads=True)
    got = (out, lse, dq, dk - before[0][:, :, p.start:], dv - before[1][:, :, p.start:],
           after[0] - before[0][:, :, : p.start], after[1] - before[1][:, :, : p.start])
    want = dense_soft_capped(p, SOFTCAP)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "store dk", "store dv"], got, want):
        assert rel_err(a, b) <= 1e-5, name
    assert rel_err(want[0], dense_soft_capped(p, 1e9)[0]) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ["pages-of-5-cross-tiles", "empty-past-gqa7", "page-size-1", "whole-query-tiles"])
def test_soft_capped_scores_match_reference(case, dtype):
    """The Triton forward, dQ and dK/dV (chunk and past tiles, masked and whole) against the reference."""
    import dataclasses

    p = dataclasses.replace(make_problem(*CASES[case], dtype=dtype), scale=SOFTCAP_SCALE)
    got, want = run_both(p, softcap=SOFTCAP)
    assert_close(got, want, TOL[dtype])


@pytest.mark.parametrize("case", ["values-twice-as-wide", "mla-keys-24-values-16"])
def test_soft_capped_scores_with_values_of_another_width_match_reference(case):
    """Soft-capped scores over values of another width than the keys (the tanh terms and the V_DIM loads in one
    kernel, V_SAME off): the Triton forward, dQ and dK/dV against the reference, fp32; the cap bends the output."""
    import dataclasses

    *shape, v_dim = VALUE_WIDTH_CASES[case]
    p = dataclasses.replace(make_problem(*shape, dtype=torch.float32, v_dim=v_dim), scale=SOFTCAP_SCALE)
    got, want = run_both(p, softcap=SOFTCAP)
    assert got[0].shape[-1] == got[4].shape[-1] == got[6].shape[-1] == v_dim
    assert_close(got, want, TOL[torch.float32])
    uncapped, _ = ref.attention_forward(p.q, p.k, p.v, p.store, p.start, p.scale)
    assert rel_err(want[0], uncapped) > 0.1


def test_soft_capped_scores_with_documents_in_key_ranges():
    """Packed documents and the key ranges of streamed host pages (forward_state, backward_part), soft-capped:
    the kernels as the reference, and the ranges as one call over the whole past."""
    import dataclasses

    *shape, starts = DOC_CASES["borders-mid-page-and-tile"]
    p = dataclasses.replace(make_problem(*shape, dtype=torch.float32), scale=SOFTCAP_SCALE)
    t = p.q.shape[2]
    doc_start = chunk_doc_start(starts, p.start, t)
    saved = p.pool.dk.clone(), p.pool.dv.clone()
    whole, ranges = [], []
    for backend in (tri, ref):
        p.pool.dk.copy_(saved[0])
        p.pool.dv.copy_(saved[1])
        out, lse = backend.attention_forward(p.q, p.k, p.v, p.store, p.start, p.scale, doc_start, softcap=SOFTCAP)
        dq, dk, dv = backend.attention_backward(p.dout, p.q, p.k, p.v, out, lse, p.store, p.start, p.scale, doc_start,
                                                softcap=SOFTCAP)
        whole.append((out, lse, dq, dk, dv, *p.store.read(0, p.start + t, grads=True)))
        p.pool.dk.copy_(saved[0])
        p.pool.dv.copy_(saved[1])
        state = backend.forward_state(p.q, p.k, p.v, p.store, 0, 0, p.scale, True, doc_start=doc_start,
                                      chunk_start=p.start, softcap=SOFTCAP)
        for lo, hi in ((0, 16), (16, 30), (30, p.start)):
            backend.forward_state(p.q, p.k, p.v, p.store, lo, hi, p.scale, False, state, doc_start=doc_start,
                                  softcap=SOFTCAP)
        out, lse = state
        dq = torch.zeros(p.q.shape, dtype=torch.float32, device=p.q.device)
        delta = backend.backward_delta(out, p.dout)
        dk, dv = backend.backward_part(p.dout, p.q, p.k, p.v, lse, delta, p.store, 0, 0, p.start, p.scale, True, dq,
                                       doc_start, softcap=SOFTCAP)
        for lo, hi in ((0, 16), (16, 30), (30, p.start)):
            backend.backward_part(p.dout, p.q, p.k, p.v, lse, delta, p.store, lo, hi, p.start, p.scale, False, dq,
                                  doc_start, softcap=SOFTCAP)
        ranges.append((out.to(p.q.dtype), lse, dq.to(p.q.dtype), dk, dv, *p.store.read(0, p.start + t, grads=True)))
    assert_close(*whole, TOL[torch.float32])
    assert_close(ranges[0], whole[1], TOL[torch.float32])
    assert_close(ranges[1], whole[1], TOL[torch.float32])


def test_soft_capped_scores_skip_the_hopper_kernels(monkeypatch):
    """The warp-specialised Gluon kernels compute plain scores: a soft-capped chunk runs wholly in Triton."""
    p = make_problem(*ONE_DOCUMENT_CASES["no-documents"][:7], dtype=torch.float16, device="cpu")
    monkeypatch.setattr(tri, "is_sm90", lambda q: True)
    monkeypatch.setattr(sparse_tri, "is_sm90", lambda q: True)
    assert tri._warp_specialized_past(p.q, p.store, p.start, None) == (0, 640)
    assert tri._warp_specialized_past(p.q, p.store, p.start, None, softcap=SOFTCAP) == (0, 0)
    selection = torch.zeros(1, 2, 1, 1, dtype=torch.int32)
    assert not sparse_tri._warp_specialized_pages(p.q, p.store, p.start, selection, None, softcap=SOFTCAP)


# --------------------------------------------------------------------------------------------------------
# GPU: bf16 at a real head size (the interpreter's bf16 tl.dot is wrong, so bf16 is only tested here)
# --------------------------------------------------------------------------------------------------------


def _fp32_copy(p: Problem) -> Problem:
    """The same problem (same bf16 values, same slots) with fp32 inputs and store."""
    spec = StoreSpec(n_layers=2, n_kv_heads=p.k.shape[1], head_dim=p.q.shape[-1], dtype=torch.float32,
                     v_head_dim=p.v.shape[-1])
    pool = PagePool(spec, num_pages=p.pool.num_pages, page_size=p.pool.page_size, device=p.q.device)
    for dst, src in ((pool.k, p.pool.k), (pool.v, p.pool.v), (pool.dk, p.pool.dk), (pool.dv, p.pool.dv)):
        dst.copy_(src)
    store = pool.layer(1, p.store.table)
    f = lambda x: x.float()  # noqa: E731
    return Problem(pool, store, f(p.q), f(p.k), f(p.v), f(p.dout), p.start, p.scale)


GPU_CASES = {
    # batch, n_kv, group, head_dim, T, start, page_size, the start of the chunk's one document (None: no
    # documents): on an H200 the first six run the past's whole tiles in the warp-specialised forward, dQ and
    # dK/dV (past_attention_sm90; the documents' from their first whole page), the last two do not (pages of
    # 64, a past shorter than one tile)
    "d128-partial-past-tile": (1, 2, 7, 128, 512, 1000, 128, None),
    "d128-pages-of-256-batch-2": (2, 1, 7, 128, 300, 2048, 256, None),
    "d64-gqa-2": (1, 2, 2, 64, 200, 640, 128, None),
    "d128-long-past": (1, 1, 4, 128, 256, 16384, 128, None),
    "d128-one-document-mid-page": (1, 2, 7, 128, 512, 4096, 128, 1000),
    "d128-one-document-pages-of-256-batch-2": (2, 1, 7, 128, 300, 2048, 256, 300),
    "d128-pages-of-64": (1, 2, 7, 128, 256, 1000, 64, None),
    "d128-short-past": (1, 2, 7, 128, 256, 100, 128, None),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_gpu_against_fp32_reference(case, dtype):
    """bf16 and fp16, GQA, the past in random page slots; a chunk in one document (the kernels told so, the
    reference masking per query).

    The oracle is the fp32 reference on the same 16-bit values. The kernel's error must stay within twice
    the error a 16-bit computation cannot avoid (the 16-bit reference's own error, or rounding the fp32
    result to 16 bits, whichever is larger) plus 1e-3.
    """
    *shape, one_document = GPU_CASES[case]
    p = make_problem(*shape, dtype, device="cuda")
    t = p.q.shape[2]
    doc_start = None if one_document is None else torch.full((p.q.shape[0], t), one_document, dtype=torch.int32,
                                                             device="cuda")
    if torch.cuda.get_device_capability() == (9, 0):
        warp_specialized = list(GPU_CASES)[:6]
        lo, hi = tri._warp_specialized_past(p.q, p.store, p.start, doc_start, one_document)
        assert bool(hi) == (case in warp_specialized)
    p32 = _fp32_copy(p)
    saved = p.pool.dk.clone(), p.pool.dv.clone()

    def run(prob: Problem, fwd, bwd, *documents):
        prob.pool.dk.copy_(saved[0])
        prob.pool.dv.copy_(saved[1])
        out, lse = fwd(prob.q, prob.k, prob.v, prob.store, prob.start, prob.scale, *documents)
        dq, dk, dv = bwd(prob.dout, prob.q, prob.k, prob.v, out, lse, prob.store, prob.start, prob.scale, *documents)
        return [x.float() for x in (out, lse, dq, dk, dv, *prob.store.read(0, prob.start + t, grads=True))]

    kernel = run(p, tri.attention_forward, tri.attention_backward, doc_start, one_document)
    ref_bf16 = run(p, ref.attention_forward, ref.attention_backward, doc_start)
    ref_fp32 = run(p32, ref.attention_forward, ref.attention_backward, doc_start)
    names = ["out", "lse", "dq", "dk", "dv", "store dk", "store dv"]
    for name, a, b, want in zip(names, kernel, ref_bf16, ref_fp32):
        err = rel_err(a, want)
        floor = max(rel_err(b, want), rel_err(want.to(dtype), want))
        print(f"{name}: kernel {err:.2e}, 16-bit floor {floor:.2e}")
        assert torch.isfinite(a).all(), name
        assert err <= 2 * floor + 1e-3, f"{name}: kernel error {err:.2e} vs 16-bit floor {floor:.2e}"


# batch, n_kv, group, head_dim, T, start, page_size, v_dim: DeepSeek's widths (keys 192, padded to 256; values 128),
# values wider than keys, both at 256; the Gluon kernels take none of them (one width of 64 or 128 only)
GPU_VALUE_WIDTH_CASES = {
    "mla-192-128": (1, 8, 1, 192, 512, 1000, 128, 128),
    "mla-192-128-batch-2-pages-of-64": (2, 4, 1, 192, 300, 2048, 64, 128),
    "keys-64-values-128-gqa-4": (1, 2, 4, 64, 256, 777, 128, 128),
    "keys-256-values-256": (1, 2, 2, 256, 256, 640, 128, 256),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_VALUE_WIDTH_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_gpu_values_of_another_width_against_fp32_reference(case, dtype):
    """As test_16_bit_gpu_against_fp32_reference, values of their own width: the kernel's error within twice the
    16-bit floor plus 1e-3, against the fp32 reference on the same 16-bit values."""
    *shape, v_dim = GPU_VALUE_WIDTH_CASES[case]
    p = make_problem(*shape, dtype, device="cuda", v_dim=v_dim)
    assert tri._warp_specialized_past(p.q, p.store, p.start, None) == (0, 0) or v_dim == shape[3]
    t = p.q.shape[2]
    p32 = _fp32_copy(p)
    saved = p.pool.dk.clone(), p.pool.dv.clone()

    def run(prob: Problem, fwd, bwd):
        prob.pool.dk.copy_(saved[0])
        prob.pool.dv.copy_(saved[1])
        out, lse = fwd(prob.q, prob.k, prob.v, prob.store, prob.start, prob.scale)
        dq, dk, dv = bwd(prob.dout, prob.q, prob.k, prob.v, out, lse, prob.store, prob.start, prob.scale)
        return [x.float() for x in (out, lse, dq, dk, dv, *prob.store.read(0, prob.start + t, grads=True))]

    kernel = run(p, tri.attention_forward, tri.attention_backward)
    ref_16 = run(p, ref.attention_forward, ref.attention_backward)
    ref_fp32 = run(p32, ref.attention_forward, ref.attention_backward)
    names = ["out", "lse", "dq", "dk", "dv", "store dk", "store dv"]
    for name, a, b, want in zip(names, kernel, ref_16, ref_fp32):
        err = rel_err(a, want)
        floor = max(rel_err(b, want), rel_err(want.to(dtype), want))
        print(f"{name}: kernel {err:.2e}, 16-bit floor {floor:.2e}")
        assert torch.isfinite(a).all(), name
        assert err <= 2 * floor + 1e-3, f"{name}: kernel error {err:.2e} vs 16-bit floor {floor:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["d128-partial-past-tile", "d128-one-document-mid-page", "d128-short-past"])
def test_16_bit_gpu_soft_capped_against_fp32_reference(case):
    """bf16 soft-capped scores (Gemma 2's cap of 50, at a scale that makes it bend): the Triton kernels (the
    Gluon ones take no cap) within twice the 16-bit floor of the fp32 reference, as above."""
    import dataclasses

    *shape, one_document = GPU_CASES[case]
    p = dataclasses.replace(make_problem(*shape, torch.bfloat16, device="cuda"), scale=4.0)
    t = p.q.shape[2]
    doc_start = None if one_document is None else torch.full((p.q.shape[0], t), one_document, dtype=torch.int32,
                                                             device="cuda")
    p32 = _fp32_copy(p)
    saved = p.pool.dk.clone(), p.pool.dv.clone()

    def run(prob: Problem, fwd, bwd, *documents, softcap=50.0):
        prob.pool.dk.copy_(saved[0])
        prob.pool.dv.copy_(saved[1])
        out, lse = fwd(prob.q, prob.k, prob.v, prob.store, prob.start, prob.scale, *documents, softcap=softcap)
        dq, dk, dv = bwd(prob.dout, prob.q, prob.k, prob.v, out, lse, prob.store, prob.start, prob.scale, *documents,
                         softcap=softcap)
        return [x.float() for x in (out, lse, dq, dk, dv, *prob.store.read(0, prob.start + t, grads=True))]

    kernel = run(p, tri.attention_forward, tri.attention_backward, doc_start, one_document)
    ref_bf16 = run(p, ref.attention_forward, ref.attention_backward, doc_start)
    ref_fp32 = run(p32, ref.attention_forward, ref.attention_backward, doc_start)
    uncapped = run(p32, ref.attention_forward, ref.attention_backward, doc_start, softcap=None)
    assert rel_err(ref_fp32[0], uncapped[0]) > 0.05
    names = ["out", "lse", "dq", "dk", "dv", "store dk", "store dv"]
    for name, a, b, want in zip(names, kernel, ref_bf16, ref_fp32):
        err = rel_err(a, want)
        floor = max(rel_err(b, want), rel_err(want.to(torch.bfloat16), want))
        print(f"{name}: kernel {err:.2e}, 16-bit floor {floor:.2e}")
        assert torch.isfinite(a).all(), name
        assert err <= 2 * floor + 1e-3, f"{name}: kernel error {err:.2e} vs 16-bit floor {floor:.2e}"
