"""Packed documents (position ids restarting at 0, lightning_oomb.core.documents), float32 on CPU.

The oracle: every document run separately through plain transformers (full sequence, autograd), its loss
summed over its own labels and divided by the label count of the whole batch. A packed step with document
masking must give that loss and every parameter's gradient within 1e-5 (relative, norm-wise), for documents
that start mid-chunk, mid-page and at a chunk border, of 1 and 2 tokens, batches with other packings per row.
"""

import pytest
import torch

import lightning_oomb
from lightning_oomb.core.config import ChunkConfig
from lightning_oomb.core.documents import document_loss_weights
from tiny_models import (BACKENDS, TRITON_ON_CPU, VOCAB, assert_grads_close, assert_served_matches, grads_of,
                         probed, rel_err, separate_documents_grads, tiny_model)

TOL = 1e-5
# With chunks of 8 and pages of 4: starts at 7 (mid-chunk, mid-page), 16 (chunk border), 17 (mid-page, a
# 1-token document), 18 (2 tokens), 20 (page border mid-chunk), 24 (chunk border), 45 tokens in all.
LENGTHS = [7, 9, 1, 2, 5, 21]


def packed_positions(*rows: list[int]) -> torch.Tensor:
    """position_ids (len(rows), L) restarting at 0 for documents of the given lengths per row."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def check_packed(model, ids, position_ids, labels=None, per_document=False, **kwargs):
    want_loss, want = separate_documents_grads(model, ids, position_ids, labels, per_document)
    if per_document:
        kwargs["loss_weights"] = document_loss_weights(ids if labels is None else labels, position_ids)
    loss = lightning_oomb.train_step(model, ids, labels, position_ids=position_ids, **kwargs)
    assert rel_err(loss, want_loss) <= TOL, (loss.item(), want_loss.item())
    assert_grads_close(grads_of(model), want, TOL)
    model.zero_grad(set_to_none=True)


# The Triton kernels on packed rows: the batch below, the sparse and host-page cases (the interpreter's steps are slow).
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_documents_match_separate_documents(family):
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (1, sum(LENGTHS)))
    check_packed(model, ids, packed_positions(LENGTHS), chunk_size=8, page_size=4, attention="reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_rows_with_other_borders_and_ignored_labels(backend):
    model = tiny_model("qwen2")
    position_ids = packed_positions([3, 10, 1, 16], [12, 2, 5, 11])  # 30 tokens per row
    ids = torch.randint(0, VOCAB, position_ids.shape)
    labels = ids.clone()
    labels[0, 4:8] = -100
    labels[1, 20:] = -100
    check_packed(model, ids, position_ids, labels, chunk_size=8, page_size=4, attention=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_of_one_over_each_documents_labels_give_the_mean_over_documents(backend):
    """loss_weights = document_loss_weights: each document's own mean loss, averaged over the documents with a
    label (a 1-token document, one whose labels are all -100 and the first token's label count for nothing)."""
    model = tiny_model("qwen2")
    position_ids = packed_positions([3, 10, 1, 16], [12, 2, 5, 11])  # 30 tokens per row
    ids = torch.randint(0, VOCAB, position_ids.shape)
    labels = ids.clone()
    labels[0, 3:13] = -100  # the second document of row 0 trains nothing
    labels[1, 20:25] = -100
    weights = document_loss_weights(labels, position_ids)
    assert weights[0, 3:14].sum() == 0 and weights[1, 12] == 0  # no labels; a document's first token
    assert weights[1, 1:12].sum() == pytest.approx(1.0) and weights.sum() == pytest.approx(6.0)
    check_packed(model, ids, position_ids, labels, per_document=True, chunk_size=8, page_size=4, attention=backend)
    # the served forward (OOMBStrategy's route, loss_weights beside transformers' inputs) and eval_loss
    want_loss, want = separate_documents_grads(model, ids, position_ids, labels, per_document=True)
    config = ChunkConfig(chunk_size=8, page_size=4, attention=backend)
    assert_served_matches(model, config, want_loss, want, TOL, input_ids=ids, labels=labels,
                          position_ids=position_ids, loss_weights=weights)
    with torch.no_grad():
        loss = lightning_oomb.eval_loss(model, ids, labels, position_ids=position_ids, loss_weights=weights,
                                        config=config)
    assert rel_err(loss, want_loss) <= TOL


def test_page_not_dividing_chunk_and_layer_checkpoints():
    """Reference attention; the kernels' page and tile borders with documents: test_triton_attention."""
    model = tiny_model("qwen3")
    position_ids = packed_positions([5, 14, 2, 12])  # chunks of 10, pages of 7
    ids = torch.randint(0, VOCAB, position_ids.shape)
    check_packed(model, ids, position_ids, chunk_size=10, page_size=7, attention="reference", checkpoint_layers=True)


@pytest.mark.parametrize("backend, checkpoint_layers", [(b, False) for b in BACKENDS] + [("reference", True)])
def test_pages_in_host_memory(backend, checkpoint_layers):
    """Segments before a chunk's documents are skipped (test_host_pages_skip_the_segments_before_a_chunks_documents);
    with layer checkpointing the loads sent ahead for the next layer's backward go unused."""
    model = tiny_model("llama")
    position_ids = packed_positions([9, 1, 17, 10])
    ids = torch.randint(0, VOCAB, position_ids.shape)
    check_packed(model, ids, position_ids, chunk_size=8, page_size=4, attention=backend, offload="host",
                 segment_tokens=8, checkpoint_layers=checkpoint_layers)


def test_eval_loss_and_served_forward():
    """Reference attention (the Triton forward kernels are those of the training steps above)."""
    backend = "reference"
    model = tiny_model("qwen2")
    position_ids = packed_positions([6, 19, 2], [13, 14])
    ids = torch.randint(0, VOCAB, position_ids.shape)
    want_loss, want = separate_documents_grads(model, ids, position_ids)
    config = ChunkConfig(chunk_size=8, page_size=4, attention=backend)
    loss = lightning_oomb.eval_loss(model, ids, position_ids=position_ids, chunk_size=8, page_size=4,
                                    attention=backend)
    assert rel_err(loss, want_loss) <= TOL
    assert_served_matches(model, config, want_loss, want, TOL, input_ids=ids, labels=ids, position_ids=position_ids)


def test_one_document_per_row_is_the_unpacked_step_bitwise():
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 21))
    loss = lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4, attention="reference")
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    same = lightning_oomb.train_step(model, ids, position_ids=packed_positions([21], [21]), chunk_size=8,
                                     page_size=4, attention="reference")
    assert torch.equal(loss, same)
    assert all(torch.equal(g, want[n]) for n, g in grads_of(model).items())


@pytest.mark.parametrize("position_ids, match", [
    (torch.arange(20)[None], "shape of input_ids"),
    (torch.arange(1, 21)[None].expand(2, -1), "start every row at 0"),
    (torch.cat([torch.arange(10), torch.arange(3, 13)])[None].expand(2, -1), "restarting at 0"),
    (torch.cat([torch.arange(10), torch.arange(10, 0, -1)])[None].expand(2, -1), "count up by 1"),
    (torch.zeros(2, 20), "int64 or int32"),
])
def test_position_ids_of_another_form_are_refused(position_ids, match):
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2, 20))
    with pytest.raises((ValueError, TypeError), match=match):
        lightning_oomb.train_step(model, ids, position_ids=position_ids, chunk_size=8, page_size=4)


@pytest.mark.parametrize("backend, per_kv_head", [("reference", True), ("reference", False)]
                         + [("triton", True)] * TRITON_ON_CPU)
def test_sparse_with_a_budget_covering_every_page_is_exact(backend, per_kv_head):
    """Sparse attention whose budget covers every page of the sequence sees exactly the dense pattern: the
    packed step equals the separate documents (the selection's "no page" entries and the document masks of
    the page loops)."""
    model = tiny_model("qwen2")
    # The interpreter's steps are slow: one row there (tests/test_sparse.py runs the kernels on rows packed
    # differently).
    rows = [LENGTHS, [12, 2, 5, 26]] if backend == "reference" else [LENGTHS]
    position_ids = packed_positions(*rows)
    ids = torch.randint(0, VOCAB, position_ids.shape)
    check_packed(model, ids, position_ids, chunk_size=8, page_size=4, attention=backend,
                 sparse=dict(budget_pages=12, sink_pages=1, local_pages=1, per_kv_head=per_kv_head))


def test_trainer_step_on_packed_documents_is_one_sgd_step_on_separate_documents():
    """A LightningModule that passes position_ids to self.model under OOMBStrategy in a real Trainer: one SGD
    step moves every weight as the gradient of the documents taken separately through transformers says."""
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_oomb import OOMBStrategy

    class PackedModule(LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"],
                              position_ids=batch["position_ids"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    model = tiny_model("qwen2")
    position_ids = packed_positions(LENGTHS, [30, 15])
    ids = torch.randint(0, VOCAB, position_ids.shape, generator=torch.Generator().manual_seed(3))
    _, grads = separate_documents_grads(model, ids, position_ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in grads}
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      strategy=OOMBStrategy(chunk_size=8, page_size=4, attention="reference"))
    trainer.fit(PackedModule(model), DataLoader([{"input_ids": ids, "position_ids": position_ids}], batch_size=None))
    moved = {n: (before[n] - p.detach()) / 0.5 for n, p in model.named_parameters() if n in before}
    assert_grads_close(moved, grads, 1e-4)  # the update divided back by the learning rate: float32 rounding


def test_host_pages_skip_the_segments_before_a_chunks_documents():
    """Pages in host memory: the past before the page of a chunk's earliest document start is neither copied
    nor computed, and gradient pages that no later chunk wrote are staged as zeros, not read. Every host page
    is NaN before each step (a stale page read would show), and the traffic is what the documents imply (64
    bytes per token of K, V, dK or dV of one layer; 2 layers; chunks of 8 = one segment; pages of 4):

    documents start at 0, 4, 10, 24: chunks [8, 16) and [16, 24) see the past from tokens 4 and 10, so from
    the pages at 4 and 8 ([4, 8) and [8, 16): 12 tokens), chunk [24, 32) none. K, V in: those 12 past tokens
    in stage 1, in stage 2's forward and in its backward (x 3), plus the chunks' stored dK, dV: none for
    [16, 24) (the chunk after it sees no key before 24), [8, 16) and [4, 8) from the passes of [16, 24) and
    [8, 16). The past's dK, dV staged for [16, 24) and [8, 16) lie before what any later chunk wrote: zeros,
    no copy. Out: every token's K, V, and dK, dV of the 12 past tokens computed. The unpacked step moves 3.9
    times as much in, 1.8 out."""
    from lightning_oomb.core.placement import Placement
    from lightning_oomb.core.schedule import ChunkedSequence, new_pool
    from lightning_oomb.kernels.page_table import StoreSpec

    model = tiny_model("qwen2")
    position_ids = packed_positions([4, 6, 14, 8])
    ids = torch.randint(0, VOCAB, position_ids.shape)
    config = ChunkConfig(chunk_size=8, page_size=4, offload="host", segment_tokens=8, attention="reference")
    spec = StoreSpec(n_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.float32)
    pool = new_pool(spec, 8, 4, torch.device("cpu"), True, Placement("host", 8, 1))
    want_loss, want = separate_documents_grads(model, ids, position_ids)
    row, layers = 64, 2
    traffic = {}
    for packed in (True, False):
        for pages in (pool.k, pool.v, pool.dk, pool.dv):
            pages.fill_(float("nan"))
        seq = ChunkedSequence(model, ids, config=config, pools=lambda *args: pool,
                              position_ids=position_ids if packed else None)
        seq.fill()
        loss = seq.backward()
        stats = pool.streamer.take_stats()
        traffic[packed] = stats.h2d_bytes, stats.d2h_bytes
        if packed:
            assert rel_err(loss, want_loss) <= TOL
            assert_grads_close(grads_of(model), want, TOL)
        else:
            assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads_of(model).values())
        model.zero_grad(set_to_none=True)
    assert traffic[True] == (layers * row * (3 * 2 * 12 + 2 * 12), layers * row * (2 * 32 + 2 * 12))
    assert traffic[False] == (48128, 20480)  # test_offload.test_copy_statistics_count_every_byte's count


def test_chunk_documents_name_each_chunks_first_key_and_its_one_document():
    """Chunks of 8 over rows with documents starting at 0, 5, 20 and at 0, 5, 24: the first key a chunk's
    queries see over both rows, and the one document of the chunks whose queries, in both rows, all belong
    to the same one ([8, 16) only: [0, 8) and [16, 24) hold a border, [24, 32) two documents)."""
    from lightning_oomb.core.documents import chunk_documents

    position_ids = packed_positions([5, 15, 12], [5, 19, 8])
    chunks = [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert chunk_documents(position_ids, chunks) == ({0: 0, 8: 5, 16: 5, 24: 20}, {8: 5})
    # One row: every chunk inside a document is named, a chunk starting one too.
    first_keys, one_document = chunk_documents(position_ids[:1], chunks)
    assert first_keys == {0: 0, 8: 5, 16: 5, 24: 20} and one_document == {8: 5, 24: 20}


def test_dense_chunks_attend_from_their_first_keys_page(monkeypatch):
    """The engine hands the dense backend the store from the page of each chunk's first key on (positions
    counted from there), so no kernel launches a program for an earlier document's keys: documents start at
    0, 5, 20 (chunks of 8, pages of 4), so chunk [16, 24) sees the store from page 1 (token 4) and [24, 32)
    from page 5 (token 20), as starts 12 and 4 with documents at 1 and 0; the gradient stays exact."""
    from lightning_oomb.core import reference_attention

    calls = []
    forward = reference_attention.attention_forward

    def recorded(q, k, v, store, start, scale, doc_start=None, one_document=None, softcap=None):
        calls.append((start, store.table.seq_len, int(doc_start.min()), one_document))
        return forward(q, k, v, store, start, scale, doc_start, one_document, softcap)

    model = probed(tiny_model("qwen2"))  # the probe's chunks, none of a document, before the recording
    monkeypatch.setattr(reference_attention, "attention_forward", recorded)
    position_ids = packed_positions([5, 15, 12])
    ids = torch.randint(0, VOCAB, position_ids.shape)
    check_packed(model, ids, position_ids, chunk_size=8, page_size=4, attention="reference")
    # (start, tokens in the store's view, the chunk's first document start, its one document) of each chunk in
    # stage 1's order (chunk [8, 16) belongs to the document at 5, chunk [24, 32) to the one at 20); stage 2
    # calls again with the same.
    want = [(0, 32, 0, None), (4, 28, 1, 1), (12, 28, 1, None), (4, 12, 0, 0)]
    assert calls[:4] == want and set(calls) == set(want)
