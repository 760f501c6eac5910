"""train_step / eval_loss against transformers' own full-sequence autograd, float32 on CPU."""

import pytest
import torch

import lightning_oomb
from tiny_models import (BACKENDS, VOCAB, assert_grads_close, full_sequence_grads, grads_of, probed, rel_err,
                         tiny_model)

TOL = 1e-5


def check_against_full(model, ids, labels=None, **kwargs):
    want_loss, want = full_sequence_grads(model, ids, labels)
    loss = lightning_oomb.train_step(model, ids, labels, **kwargs)
    assert not loss.requires_grad
    assert_matches_full(model, ids, loss, grads_of(model), labels, want=(want_loss, want))


def assert_matches_full(model, ids, loss, grads, labels=None, want=None):
    """A step's loss and gradients against transformers' full-sequence ones (``want``, else computed)."""
    want_loss, want_grads = want or full_sequence_grads(model, ids, labels)
    assert rel_err(loss, want_loss) <= TOL, (loss.item(), want_loss.item())
    assert_grads_close(grads, want_grads, TOL)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2-tied", "qwen3", "mistral"])
def test_families_match_full_sequence(family):
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (1, 45))
    check_against_full(model, ids, chunk_size=8, page_size=4, attention="reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "seq_len,chunk_size,page_size",
    [(37, 8, 4), (9, 1, 128), (20, 64, 16), (20, 20, 3), (33, 10, 7)],
    ids=["uneven-last-chunk", "chunk-1", "chunk-longer-than-seq", "one-chunk", "page-not-dividing-chunk"],
)
def test_chunkings(seq_len, chunk_size, page_size, backend):
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, seq_len))
    check_against_full(model, ids, chunk_size=chunk_size, page_size=page_size, attention=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_with_ignored_labels(backend):
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (3, 29))
    labels = ids.clone()
    labels[0, :11] = -100  # prompt masked
    labels[1, 20:] = -100  # padding at the end
    labels[2, ::3] = -100
    if backend == "triton":  # the interpreter's steps are slow: the prompt and the scattered labels
        ids, labels = ids[::2], labels[::2]
    check_against_full(model, ids, labels, chunk_size=6, page_size=4, attention=backend)


@pytest.mark.parametrize("family", ["qwen2", "qwen2-tied"])
def test_output_layer_runs_once_per_chunk(family, monkeypatch):
    """The loss's output layer runs once per chunk: in stage 2 for train_step, in stage 1 for a served forward
    (which must return the loss before its backward, so it keeps each chunk's dL/dh for stage 2). Both give
    the full-sequence loss and gradient, with ignored labels and with the output layer tied to the input
    embedding."""
    from lightning_oomb.core import schedule

    calls = []
    loss_fn = schedule.linear_cross_entropy
    monkeypatch.setattr(schedule, "linear_cross_entropy", lambda *a, **k: calls.append(1) or loss_fn(*a, **k))
    model = probed(tiny_model(family))
    calls.clear()  # the probe's own loss
    ids = torch.randint(0, VOCAB, (2, 37))  # 5 chunks of 8
    labels = ids.clone()
    labels[0, :11] = -100
    want_loss, want = full_sequence_grads(model, ids, labels)
    config = lightning_oomb.ChunkConfig(chunk_size=8, page_size=4, attention="reference", keep_graphs=0)

    loss = lightning_oomb.train_step(model, ids, labels, chunk_size=8, page_size=4, attention="reference")
    assert len(calls) == 5
    assert rel_err(loss, want_loss) <= TOL
    assert_grads_close(grads_of(model), want, TOL)

    model.zero_grad(set_to_none=True)
    calls.clear()
    with lightning_oomb.serve(model, config):
        out = model(input_ids=ids, labels=labels)
    assert len(calls) == 5 and out.loss.requires_grad
    assert rel_err(out.loss.detach(), want_loss) <= TOL
    (0.5 * out.loss).backward()  # the incoming gradient scales every parameter's gradient
    assert len(calls) == 5
    assert_grads_close(grads_of(model), {name: 0.5 * g for name, g in want.items()}, TOL)


@pytest.mark.parametrize("family", ["qwen2", "qwen2-tied"])
def test_served_step_without_room_for_dlh_runs_the_output_layer_again(family, monkeypatch):
    """Where the placement leaves no room to keep every chunk's dL/dh (``loss_grads="recomputed"``), a served
    step's stage 1 computes the loss alone and stage 2 runs the output layer again: the loss and every
    gradient are the full sequence's."""
    import dataclasses

    from lightning_oomb.core import schedule

    calls = []
    loss_fn = schedule.linear_cross_entropy
    monkeypatch.setattr(schedule, "linear_cross_entropy",
                        lambda *a, **k: calls.append(k["with_grad_hidden"]) or loss_fn(*a, **k))
    place = schedule.place_step
    monkeypatch.setattr(schedule, "place_step",
                        lambda *a, **k: dataclasses.replace(place(*a, **k), loss_grads="recomputed"))
    model = probed(tiny_model(family))
    calls.clear()  # the probe's own loss
    ids = torch.randint(0, VOCAB, (2, 37))  # 5 chunks of 8
    labels = ids.clone()
    labels[1, 20:] = -100
    want_loss, want = full_sequence_grads(model, ids, labels)
    config = lightning_oomb.ChunkConfig(chunk_size=8, page_size=4, attention="reference", keep_graphs=0)
    with lightning_oomb.serve(model, config):
        out = model(input_ids=ids, labels=labels)
    assert calls == [False] * 5 and rel_err(out.loss.detach(), want_loss) <= TOL
    (0.5 * out.loss).backward()
    assert calls == [False] * 5 + [True] * 5
    assert_grads_close(grads_of(model), {name: 0.5 * g for name, g in want.items()}, TOL)


def test_served_step_training_only_the_output_layer_runs_the_decoder_once(monkeypatch):
    """With the decoder frozen, a served step's stage 1 already holds the output layer's gradient: stage 2
    runs no chunk again, and the gradient is the full-sequence one."""
    from lightning_oomb.core import schedule

    model = probed(tiny_model("qwen2"))
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    ids = torch.randint(0, VOCAB, (1, 29))
    _, want = full_sequence_grads(model, ids)
    runs = []
    chunk_hidden = schedule.ChunkedSequence._chunk_hidden
    monkeypatch.setattr(schedule.ChunkedSequence, "_chunk_hidden", lambda *a: runs.append(1) or chunk_hidden(*a))
    with lightning_oomb.serve(model, lightning_oomb.ChunkConfig(chunk_size=8, page_size=4, attention="reference")):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert len(runs) == 4  # stage 1 only
    assert_grads_close(grads_of(model), {"lm_head.weight": want["lm_head.weight"]}, TOL)


def test_before_chunk_hook_runs_before_every_chunk_and_changes_no_bit():
    """The hook a sharded strategy uses sees stage 1's chunks in order and stage 2's in reverse, each before the
    chunk's observer; the gradients are bitwise those of a step without it."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 29))
    config = lightning_oomb.ChunkConfig(chunk_size=8, page_size=4, attention="reference")
    with lightning_oomb.serve(model, config):
        model(input_ids=ids, labels=ids).loss.backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    calls = []
    with lightning_oomb.serve(model, config, observer=lambda stage, index, *_: calls.append(("after", stage, index)),
                              before_chunk=lambda stage, index: calls.append(("before", stage, index))):
        model(input_ids=ids, labels=ids).loss.backward()
    order = [(1, i) for i in range(4)] + [(2, i) for i in reversed(range(4))]
    assert calls == [(when, *chunk) for chunk in order for when in ("before", "after")]
    assert all(torch.equal(g, want[n]) for n, g in grads_of(model).items())


def test_labels_differ_from_inputs():
    model = tiny_model("qwen3")
    ids = torch.randint(0, VOCAB, (2, 24))
    labels = torch.randint(0, VOCAB, (2, 24))
    check_against_full(model, ids, labels, chunk_size=5, page_size=2)


def test_two_calls_accumulate():
    model = tiny_model("qwen2")
    a, b = torch.randint(0, VOCAB, (2, 1, 30))
    _, ga = full_sequence_grads(model, a)
    _, gb = full_sequence_grads(model, b)
    lightning_oomb.train_step(model, a, chunk_size=7, page_size=4)
    lightning_oomb.train_step(model, b, chunk_size=7, page_size=4)
    assert_grads_close(grads_of(model), {n: ga[n] + gb[n] for n in ga}, TOL)


def test_checkpoint_layers():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 26))
    check_against_full(model, ids, chunk_size=8, page_size=4, checkpoint_layers=True)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_model_unchanged_after_call():
    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 30))
    before = model(input_ids=ids).logits.detach()
    impl = model.config._attn_implementation
    state = {k: v.clone() for k, v in model.state_dict().items()}
    lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4, checkpoint_layers=True)
    assert model.config._attn_implementation == impl
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(input_ids=ids).logits.detach(), before)
    assert model.training


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_chunks_build_no_attention_mask(family, monkeypatch):
    """transformers makes no mask for the chunks: its packed-sequence check would make the host wait for the
    GPU at every chunk of both stages (a Python ``if`` on a device tensor)."""
    import transformers.masking_utils as masking

    def refuse(*args, **kwargs):
        raise AssertionError("transformers looked for packed sequences in a chunk's position ids")

    monkeypatch.setattr(masking, "find_packed_sequence_indices", refuse)
    lightning_oomb.train_step(tiny_model(family), torch.randint(0, VOCAB, (1, 20)), chunk_size=8, page_size=4)


def test_lora_adapters():
    peft = pytest.importorskip("peft")
    model = tiny_model("qwen2")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():  # LoRA's B starts at zero; make the adapter matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = torch.randint(0, VOCAB, (2, 31))
    want_loss, want = full_sequence_grads(model, ids)
    assert want and all("lora" in n for n in want)
    loss = lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4)
    assert rel_err(loss, want_loss) <= TOL
    assert_grads_close(grads_of(model), want, TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_loss_matches_full_sequence(backend):
    model = tiny_model("llama").eval()
    ids = torch.randint(0, VOCAB, (2, 41))
    labels = ids.clone()
    labels[1, :5] = -100
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
    got = lightning_oomb.eval_loss(model, ids, labels, chunk_size=9, page_size=4, attention=backend)
    assert rel_err(got, want) <= TOL
    assert all(p.grad is None for p in model.parameters())


def test_pool_is_reused_across_steps():
    from lightning_oomb.core.schedule import cached_pool

    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (1, 30))
    lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4)
    pool = cached_pool(model)
    lightning_oomb.train_step(model, ids[:, :20], chunk_size=8, page_size=4)
    assert cached_pool(model) is pool and pool.pages_in_use == 0


def test_long_sequence_many_chunks():
    model = tiny_model("qwen3")
    ids = torch.randint(0, VOCAB, (1, 300))
    check_against_full(model, ids, chunk_size=16, page_size=8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_gradient_store(backend):
    """bf16 KV-gradients: the store is bf16 and the gradient moves by bf16 rounding only."""
    from lightning_oomb.core.schedule import cached_pool

    model = tiny_model("qwen2")
    ids = torch.randint(0, VOCAB, (2 if backend == "reference" else 1, 40))  # the interpreter's steps are slow
    _, want = full_sequence_grads(model, ids)
    lightning_oomb.train_step(model, ids, chunk_size=8, page_size=4, attention=backend, grad_dtype=torch.bfloat16)
    assert cached_pool(model).dk.dtype == torch.bfloat16
    got = grads_of(model)
    worst = max(rel_err(got[n], want[n]) for n in want)
    assert 1e-6 < worst < 2e-2, worst


SPARSE_2 = {"budget_pages": 2, "sink_pages": 1, "local_pages": 0}


# The kept pair is backend-independent bookkeeping: every combination on the reference; the Triton kernels'
# kept outputs in the interpreter beside kept graphs (test_kept_graphs_give_the_same_gradient).
@pytest.mark.parametrize("checkpoint_layers", [False, True])
@pytest.mark.parametrize("sparse", [None, SPARSE_2], ids=["dense", "sparse"])
def test_kept_attention_outputs_give_the_same_gradient(checkpoint_layers, sparse, monkeypatch):
    """Stage 2 reuses stage 1's attention outputs of the kept chunks: bitwise the same gradient, fewer forwards."""
    from lightning_oomb.core import attention

    model = probed(tiny_model("qwen2"))
    ids = torch.randint(0, VOCAB, (2, 37))  # 5 chunks of 8
    kwargs = dict(chunk_size=8, page_size=4, attention="reference", checkpoint_layers=checkpoint_layers,
                  sparse=sparse, keep_graphs=0)
    calls = []
    forward = attention._forward
    monkeypatch.setattr(attention, "_forward", lambda *args: calls.append(args[5]) or forward(*args))
    results = {}
    for keep in (0, 2, 100):
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = lightning_oomb.train_step(model, ids, keep_attention=keep, **kwargs)
        results[keep] = (loss, grads_of(model), len(calls))
    layers = model.config.num_hidden_layers
    # Stage 1 ends each chunk at the last layer's store: that layer's attention runs (and is kept) in stage 2 only.
    # Stage 2 attends once per layer, checkpointed or not: the recompute takes the forward's outputs.
    expected_calls = {0: 5 * layers, 2: 3 * layers + 2, 100: 5}
    for keep in results:
        assert results[keep][2] == 5 * (layers - 1) + expected_calls[keep], keep
        assert torch.equal(results[keep][0], results[0][0])
        for name, grad in results[0][1].items():
            assert torch.equal(results[keep][1][name], grad), name
    if sparse is None:
        assert_matches_full(model, ids, *results[2][:2])


def _steps_keeping_outputs_on_the_host(monkeypatch, model, ids, counts, **options) -> list[tuple]:
    """One train_step of ``model`` on ``ids`` per entry of ``counts``, each placed as place_step places it but for
    host_kept_chunks (the entry): (loss, gradients, attention forwards run, the pool, its host-kept outputs and
    its GPU bytes after the step) of each."""
    import dataclasses

    from lightning_oomb.core import attention, schedule
    from lightning_oomb.core.schedule import cached_pool

    calls = []
    forward = attention._forward
    monkeypatch.setattr(attention, "_forward", lambda *args: calls.append(args[5]) or forward(*args))
    place = schedule.place_step
    results = []
    for on_host in counts:
        monkeypatch.setattr(schedule, "place_step", lambda *a, **k: dataclasses.replace(
            place(*a, **k), host_kept_chunks=on_host))
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = lightning_oomb.train_step(model, ids, **options)
        pool = cached_pool(model)
        results.append((loss, grads_of(model), len(calls), pool, pool._host_kept, pool.gpu_nbytes))
    return results


# Where the kept outputs wait is the engine's bookkeeping: the reference here; the Triton kernels' outputs kept
# above, and on the host on a GPU (tests/test_gpu_end_to_end.py).
@pytest.mark.parametrize("checkpoint_layers,sparse", [(False, None), (True, SPARSE_2)])
def test_attention_outputs_kept_on_the_host_give_the_same_gradient(checkpoint_layers, sparse, monkeypatch):
    """Stage 1 copies the attention outputs of the first chunks to (pinned) host memory and stage 2 brings
    them back instead of recomputing: bitwise the same gradient, the buffer kept with the pool for the next
    step, beside outputs kept on the GPU."""
    model = probed(tiny_model("qwen2"))
    ids = torch.randint(0, VOCAB, (1, 37))  # 5 chunks of 8, the last one short
    # the third step reuses the second one's buffer
    results = _steps_keeping_outputs_on_the_host(monkeypatch, model, ids, (0, 2, 2), chunk_size=8, page_size=4,
                                                 attention="reference", checkpoint_layers=checkpoint_layers,
                                                 sparse=sparse, keep_graphs=0, keep_attention=1)
    pool = results[-1][3]
    layers = model.config.num_hidden_layers
    # Stage 1 skips the last layer's attention (its output feeds nothing there), so stage 2 computes that one;
    # chunk 3's outputs are kept on the GPU.
    stage_1 = 5 * (layers - 1)
    assert results[0][2] == stage_1 + (4 * layers + 1)
    assert {r[2] for r in results[1:]} == {stage_1 + (2 * layers + 3)}
    kept = results[-1][4]
    assert kept is results[1][4]  # a later step reuses the first one's pinned buffer
    assert kept.out.shape[:2] == (2, layers) and kept.saved == {(c, i) for c in (0, 1) for i in range(layers - 1)}
    assert pool.host_nbytes == kept.nbytes and results[0][5] == results[1][5] == pool.gpu_nbytes > 0
    for loss, grads, *_ in results[1:]:
        assert torch.equal(loss, results[0][0])
        for name, grad in results[0][1].items():
            assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("checkpoint_layers", [False, True])
def test_streamed_pages_with_attention_outputs_kept_on_the_host_give_the_same_gradient(checkpoint_layers,
                                                                                          monkeypatch):
    """A dense step whose pages are streamed from the host keeps stage 1's attention outputs of its first chunks
    in host memory (its GPU holds only staging): stage 2 skips their attention forward and its streaming, and the
    gradient is bitwise the one without, which is transformers' full-sequence gradient."""
    model = probed(tiny_model("qwen2"))
    ids = torch.randint(0, VOCAB, (1, 37))  # 5 chunks of 8, the last one short
    results = _steps_keeping_outputs_on_the_host(monkeypatch, model, ids, (0, 4), chunk_size=8, page_size=4,
                                                 attention="reference", checkpoint_layers=checkpoint_layers,
                                                 offload="host", segment_tokens=8)
    assert all(r[3].on_host for r in results)
    layers = model.config.num_hidden_layers
    stage_1 = 5 * (layers - 1)  # the last layer's attention runs in stage 2 only
    assert results[0][2] == stage_1 + 5 * layers
    assert results[1][2] == stage_1 + 4 + layers  # the kept chunks' last layer, and the last chunk's every layer
    assert torch.equal(results[1][0], results[0][0])
    for name, grad in results[0][1].items():
        assert torch.equal(results[1][1][name], grad), name
    assert_matches_full(model, ids, *results[1][:2])


@pytest.mark.parametrize(
    "backend,sparse", [("reference", None), ("reference", SPARSE_2)] + ([("triton", None)] if "triton" in BACKENDS else [])
)
def test_kept_graphs_give_the_same_gradient(backend, sparse, monkeypatch):
    """Stage 1 keeps the autograd graphs of the last chunks (the last one by default) and stage 2 starts with
    their backward: no stage-2 forward of those chunks, bitwise the same loss and gradient but for the
    output layer's, whose float32 sum over chunks then adds the kept chunks first (summation order only);
    kept attention outputs serve the chunks before them."""
    from lightning_oomb.core import attention

    model = probed(tiny_model("qwen2"))
    ids = torch.randint(0, VOCAB, (2 if backend == "reference" else 1, 37))  # 5 chunks of 8
    kwargs = dict(chunk_size=8, page_size=4, attention=backend, sparse=sparse)
    calls = []
    forward = attention._forward
    monkeypatch.setattr(attention, "_forward", lambda *args: calls.append(args[5]) or forward(*args))
    results = {}
    # The interpreter's steps are slow: there, no graph against two graphs beside two kept outputs.
    settings = ((0, 0), (None, 0), (2, 2), (5, 0)) if backend == "reference" else ((0, 0), (2, 2))
    for graphs, keep in settings:
        model.zero_grad(set_to_none=True)
        calls.clear()
        loss = lightning_oomb.train_step(model, ids, keep_graphs=graphs, keep_attention=keep, **kwargs)
        results[graphs] = (loss, grads_of(model), len(calls))
    layers = model.config.num_hidden_layers
    kept = {0: (0, 0), None: (1, 0), 2: (2, 2), 5: (5, 0)}  # (graphs, outputs); None on a CPU device: the last graph
    for graphs, (_, _, n_calls) in results.items():
        n_graphs, n_outputs = kept[graphs]
        # Stage 1 stops at the last layer's store unless it keeps the chunk's graph; stage 2 recomputes the
        # chunks without a graph, of the chunks with kept outputs only the last layer's attention (not kept).
        stage_1 = 5 * (layers - 1) + n_graphs
        stage_2 = (5 - n_graphs - n_outputs) * layers + n_outputs
        assert n_calls == stage_1 + stage_2, graphs
    for graphs in results.keys() - {0}:
        assert torch.equal(results[graphs][0], results[0][0])
        for name, grad in results[0][1].items():
            if name == "lm_head.weight":
                torch.testing.assert_close(results[graphs][1][name], grad, rtol=1e-6, atol=1e-9)
            else:
                assert torch.equal(results[graphs][1][name], grad), name
    if sparse is None:
        assert_matches_full(model, ids, *results[2][:2])


def test_triton_steps_swap_in_the_fused_ops_and_restore_the_model(monkeypatch):
    """attention='triton' runs RMSNorm (also Qwen3's per-head norms), RoPE and SwiGLU as the fused Triton
    ops during the step; afterwards the model's modules and modeling module are as they were."""
    if "triton" not in BACKENDS:
        pytest.skip("no Triton")
    import transformers.models.qwen3.modeling_qwen3 as modeling

    from lightning_oomb.kernels import rms_norm, rope, swiglu

    calls = {"rms_norm": 0, "silu_mul_forward": 0, "apply_rope": 0}
    for module, name in ((rms_norm, "rms_norm"), (swiglu, "silu_mul_forward"), (rope, "apply_rope")):
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    model = tiny_model("qwen3")
    rope_before = modeling.apply_rotary_pos_emb
    ids = torch.randint(0, VOCAB, (1, 12))
    lightning_oomb.train_step(model, ids, chunk_size=12, page_size=4, attention="reference")
    assert calls == {"rms_norm": 0, "silu_mul_forward": 0, "apply_rope": 0}
    from lightning_oomb.integrations.fused_ops import fused_ops

    with fused_ops(model):  # the first swap probes each op once on a small input (integrations/fused_ops.py)
        pass
    calls.update({name: 0 for name in calls})
    check_against_full(model, ids, chunk_size=12, page_size=4, attention="triton", keep_graphs=0)
    layers = model.config.num_hidden_layers
    # One chunk, two forwards (stage 1 and 2; no kept graph): per layer 2 norms + q_norm + k_norm, and the
    # final norm; stage 1 ends at the last layer's K/V (no post-attention norm, MLP or final norm there). The
    # down projection's backward takes the SwiGLU product from the SwiGLU backward's pass, not a forward.
    assert calls == {"rms_norm": 2 * (4 * layers + 1) - 2, "silu_mul_forward": 2 * layers - 1,
                     "apply_rope": 2 * layers}
    assert modeling.apply_rotary_pos_emb is rope_before
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def test_page_rows_are_computed_once_per_chunk_and_again_after_the_slots_change():
    """Every layer of a chunk asks its page table for the same rows: the table computes them once, and again
    when its slots are modified in place or replaced."""
    from lightning_oomb.kernels.page_table import PageTable

    table = PageTable(torch.tensor([[2, 0, 1]], dtype=torch.int32), seq_len=12, page_size=4)
    first = table.rows(3, 9)
    assert first.tolist() == [[11, 0, 1, 2, 3, 4]]
    assert table.rows(3, 9) is first
    table.slots[0, 1] = 5
    assert table.rows(3, 9).tolist() == [[11, 20, 21, 22, 23, 4]]
    assert table.rows(0, 4).tolist() == [[8, 9, 10, 11]]
    table.slots = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    assert table.rows(3, 9).tolist() == [[3, 4, 5, 6, 7, 8]]
    with torch.inference_mode():  # no version counter there: computed every time
        frozen = PageTable(torch.tensor([[1, 0]], dtype=torch.int32), seq_len=8, page_size=4)
        assert frozen.rows(2, 6).tolist() == [[6, 7, 0, 1]] and frozen.rows(2, 6) is not frozen.rows(2, 6)
