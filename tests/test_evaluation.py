"""lightning_oomb.evaluation against transformers, float32 on CPU: ``generate`` against ``model.generate(do_sample=
False)`` (tokens equal, chosen tokens' log-probabilities within 1e-5) over GPU-placed, host-streamed and sparse
pages; ``loglikelihood`` and ``loglikelihood_rolling`` against log_softmax of the whole sequence's logits."""

import pytest
import torch

import lightning_oomb
from lightning_oomb.evaluation import loglikelihood, loglikelihood_rolling
from tiny_models import BACKENDS, CONFIGS, VOCAB, tiny_model

TOL = 1e-5
# Chunks of 4 over pages of 3: the prompt's chunks cut pages, and every decoded token lands inside a page.
CUTS = dict(chunk_size=4, page_size=3)


def prompt(batch: int = 1, length: int = 11, seed: int = 1) -> torch.Tensor:
    """Token ids above the special ones (pad 0, bos 1, eos 2), so that no prompt holds padding."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, new: int, eos=None):
    """transformers' greedy search: (sequences, the chosen tokens' log-probabilities (B, new))."""
    out = model.generate(ids, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences, model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)


def check_generate(model, ids, new: int, eos=None, **options):
    want, want_logprobs = greedy(model, ids, new, eos)
    got = lightning_oomb.generate(model, ids, max_new_tokens=new, eos_token_id=eos, pad_token_id=0,
                                  output_logprobs=True, **options)
    assert torch.equal(got.sequences, want), (got.sequences.tolist(), want.tolist())
    assert got.logprobs.shape == want_logprobs.shape
    assert (got.logprobs - want_logprobs).abs().max().item() <= TOL


@pytest.mark.parametrize("family", list(CONFIGS))
def test_generate_matches_transformers_greedy(family):
    """Every family the training path serves; gpt_oss's window of 9 cuts the decoded tokens' past."""
    model = tiny_model(family).eval()
    check_generate(model, prompt(), 8, **CUTS)


@pytest.mark.parametrize("options", [
    dict(offload="host", segment_tokens=4),  # streamed in segments that cut pages and chunks
    dict(sparse={"budget_pages": 64}),  # a budget over every page: dense attention
    dict(sparse={"budget_pages": 64}, offload="host"),  # every layer's K/V pages in host memory, gathered
], ids=["host", "sparse-full-budget", "sparse-full-budget-host"])
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_generate_over_host_and_sparse_pages(family, options):
    check_generate(tiny_model(family).eval(), prompt(), 8, **CUTS, **options)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_generate_with_the_triton_kernels(backend):
    check_generate(tiny_model("qwen2").eval(), prompt(length=7), 4, attention=backend, **CUTS)


def test_generate_over_a_cut_sparse_budget_is_the_sparse_models_own_prediction():
    """With fewer pages than the past, each decoded token selects its own pages, as a chunk of one token does:
    the decoded tokens' log-probabilities are those the scoring computes in chunks of one token, and the
    budget does cut (the tokens differ from dense decoding's)."""
    model = tiny_model("qwen2").eval()
    ids = prompt(length=24)
    sparse = dict(chunk_size=1, page_size=3, sparse={"budget_pages": 3, "sink_pages": 1, "local_pages": 1})
    got = lightning_oomb.generate(model, ids, max_new_tokens=4, eos_token_id=[], output_logprobs=True, **sparse)
    dense = lightning_oomb.generate(model, ids, max_new_tokens=4, eos_token_id=[], **CUTS)
    assert not torch.equal(got.sequences, dense)
    scored = loglikelihood(model, [(ids[0], got.sequences[0, 24:])], **sparse)[0]
    assert abs(scored[0] - got.logprobs.sum().item()) <= TOL * abs(scored[0])
    assert scored[1]  # the decoded tokens are the sparse model's greedy ones


def test_generate_stops_at_eos_and_pads_a_finished_sequence():
    """A batch of two: the first produces the EOS token early and is padded after it, the second runs on to
    max_new_tokens; a batch of one stops at its EOS."""
    model = tiny_model("qwen2").eval()
    ids = prompt(batch=2)
    free = lightning_oomb.generate(model, ids, max_new_tokens=6, eos_token_id=[], **CUTS)
    eos = free[0, ids.shape[1] + 2].item()  # the first sequence's third new token
    assert eos not in free[1, ids.shape[1]:].tolist()
    check_generate(model, ids, 6, eos=eos, **CUTS)
    got = lightning_oomb.generate(model, ids[:1], max_new_tokens=6, eos_token_id=eos, **CUTS)
    assert got.shape == (1, ids.shape[1] + 3) and got[0, -1].item() == eos


def test_generate_ends_where_stop_says():
    """``stop`` sees the new tokens after each step; where it answers True the decoding ends, its tokens those
    of the decoding that ran on."""
    model = tiny_model("qwen2").eval()
    ids = prompt()
    free = lightning_oomb.generate(model, ids, max_new_tokens=6, eos_token_id=[], **CUTS)
    seen = []
    got = lightning_oomb.generate(model, ids, max_new_tokens=6, eos_token_id=[],
                                  stop=lambda new: seen.append(new.shape[1]) or new.shape[1] == 3, **CUTS)
    assert seen == [1, 2, 3] and torch.equal(got, free[:, :ids.shape[1] + 3])


def test_generate_refuses_what_it_cannot_do_in_one_line():
    model = tiny_model("qwen2").eval()
    for call, match in [
        (lambda: lightning_oomb.generate(model, prompt(), eos_token_id=2), "needs max_new_tokens"),
        (lambda: lightning_oomb.generate(model, prompt()[0], max_new_tokens=2), "batch, prompt_len"),
        (lambda: lightning_oomb.generate(model, prompt(), max_new_tokens=0), "max_new_tokens must be"),
        (lambda: lightning_oomb.generate(model, prompt(length=4090), max_new_tokens=8), "max_position_embeddings"),
        (lambda: lightning_oomb.generate(model, prompt(2), max_new_tokens=2, attention_mask=torch.ones(2, 11)),
         "unpadded prompts of one length"),
    ]:
        with pytest.raises(ValueError, match=match) as caught:
            call()
        assert "\n" not in str(caught.value)
    with pytest.raises(TypeError, match="token ids"):
        lightning_oomb.generate(model, prompt().float(), max_new_tokens=2)


def whole_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """(T - 1,) log p(ids[t + 1] | ids[:t + 1]) from transformers' logits of the whole sequence."""
    with torch.no_grad():
        scores = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].float(), dim=-1)
    return scores.gather(1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text", "gpt_oss"])
def test_loglikelihood_matches_whole_sequence_logits(family):
    """Continuations of 1 and 5 tokens, one of them the greedy one, after a context of 13 tokens in chunks of
    4 (the context's last token and the continuation in one chunk or across chunks)."""
    model = tiny_model(family).eval()
    context = prompt(length=13)
    greedy_tokens = lightning_oomb.generate(model, context, max_new_tokens=5, eos_token_id=[], **CUTS)[0, 13:]
    requests = [(context[0], greedy_tokens), (context[0].tolist(), [7]), (context[0, :1], prompt(length=5)[0])]
    got = loglikelihood(model, requests, **CUTS)
    for (ctx, cont), (logprob, is_greedy) in zip(requests, got):
        ids = torch.cat([torch.as_tensor(ctx), torch.as_tensor(cont)])
        scores = whole_logprobs(model, ids)[-len(cont):]
        with torch.no_grad():
            argmax = model(input_ids=ids[None]).logits[0, -len(cont) - 1:-1].argmax(-1)
        assert abs(logprob - scores.sum().item()) <= TOL * max(1.0, abs(logprob))
        assert is_greedy == bool((argmax == torch.as_tensor(cont)).all())
    assert got[0][1]


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_loglikelihood_rolling_is_the_full_context_value(family):
    """A text of 30 tokens in chunks of 8: with lm-eval's prefix token every token is scored, without it all
    but the first."""
    model = tiny_model(family).eval()
    text = prompt(length=30)[0]
    with_prefix, without = (loglikelihood_rolling(model, [text], prefix_token_id=prefix, chunk_size=8,
                                                  page_size=3)[0] for prefix in (2, None))
    want_prefix = whole_logprobs(model, torch.cat([torch.tensor([2]), text])).sum().item()
    want = whole_logprobs(model, text).sum().item()
    assert abs(with_prefix - want_prefix) <= TOL * abs(want_prefix)
    assert abs(without - want) <= TOL * abs(want)
    assert with_prefix < without  # the first token's log-probability is counted too


def test_scoring_refuses_empty_requests_in_one_line():
    model = tiny_model("qwen2").eval()
    for call in (lambda: loglikelihood(model, [([], [5])]), lambda: loglikelihood(model, [([5], [])]),
                 lambda: loglikelihood_rolling(model, [[5]])):
        with pytest.raises(ValueError) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_extend_continues_its_own_stage_1_only():
    """ChunkedSequence.extend, the engine's hook for decoding: spans after the stored tokens, never after fill()."""
    from lightning_oomb.core.schedule import ChunkedSequence

    model = tiny_model("qwen2").eval()
    ids = prompt(length=9)
    seq = ChunkedSequence(model, ids, config=lightning_oomb.ChunkConfig(**CUTS))
    try:
        assert seq.extend(5) is None
        with pytest.raises(ValueError, match="after 5 stored tokens"):
            seq.extend(5)
        with pytest.raises(ValueError, match="keep_last"):
            seq.extend(7, keep_last=3)
        with torch.no_grad():
            want = model(input_ids=ids).logits[:, 7:9]
        assert (seq.extend(9, keep_last=2) - want).abs().max().item() <= TOL
    finally:
        seq.release()
    seq = ChunkedSequence(model, ids, config=lightning_oomb.ChunkConfig(**CUTS), stage_1_loss=True)
    try:
        seq.fill(with_grads=False)
        with pytest.raises(RuntimeError, match="not after fill"):
            seq.extend(9)
    finally:
        seq.release()


def test_windows_shorter_than_chunks_in_decoding_and_spans_that_cross_chunks():
    """A window of 3 in chunks of 8: a window layer keeps only the pages a later chunk's window reaches, and
    scratch pages that the next chunk takes over. Greedy decoding across chunk borders is transformers'; a span
    after stored tokens that crosses chunk borders is written piece by piece, each within one chunk, and
    gives the whole sequence's logits."""
    from lightning_oomb.core.schedule import ChunkedSequence

    types = ["sliding_attention", "full_attention"]
    model = tiny_model("gemma3_text", sliding_window=3, layer_types=types).eval()
    check_generate(model, prompt(length=11), 14, chunk_size=8, page_size=3)
    ids = prompt(length=40)
    seq = ChunkedSequence(model, ids, config=lightning_oomb.ChunkConfig(chunk_size=8, page_size=3))
    try:
        seq.extend(5)
        with torch.no_grad():
            want = model(input_ids=ids).logits[:, 5:40]
        assert seq.pool.window_k.shape[1] < -(-40 // 3)
        assert (seq.extend(40, keep_last=35) - want).abs().max().item() <= TOL
    finally:
        seq.release()


def test_a_forward_alone_is_placed_without_what_training_keeps():
    """generate, eval_loss and scoring place their sequence for a forward alone: weights, K/V pages and one
    layer's working set; no gradients, optimizer state, KV-gradient pages, dL/dh or stage-1 results kept for a
    stage 2. The Qwen2.5-7B shape's 1M-token sparse forward with its pages on the host then pins its K/V pages
    alone, where a training step's placement (which refused it on an 80 GB card) pinned their gradients too."""
    from lightning_oomb.core.config import ChunkConfig, SparseConfig
    from lightning_oomb.core.plan import plan
    from lightning_oomb.core.schedule import ChunkedSequence

    options = dict(chunk_size=4096, gpu_memory=79 * 2**30, host_memory=112 * 2**30, offload="host",
                   sparse=SparseConfig(budget_pages=64, per_query_tile=False), host_grad_layers=28, host_kv_layers=28,
                   optimizer="none")
    training, forward = plan("qwen2.5-7b", 2**20, **options), plan("qwen2.5-7b", 2**20, training=False, **options)
    trained_only = ("gradients", "optimizer state", "backward", "loss: dL/dh", "loss: dL/dW", "autograd graphs",
                    "attention outputs kept")
    assert not [k for k in forward.gpu_lines if k.startswith(trained_only) or "KV-gradient" in k]
    assert not [k for k in forward.host_lines if "KV-gradient" in k or "kept" in k]
    assert "forward only (no gradients)" in str(forward)
    pinned = lambda p: sum(v for k, v in p.host_lines.items() if k.startswith("pinned"))  # noqa: E731
    kv_pages = 2**20 * 28 * 2 * 4 * 128 * 2  # tokens x layers x (K, V) x KV heads x head_dim x bf16
    assert pinned(forward) < 1.01 * kv_pages < 1.01 * pinned(training) / 2
    assert forward.fits and not training.fits

    model = tiny_model("llama").eval()
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    seq = ChunkedSequence(model, ids, config=ChunkConfig(chunk_size=8, page_size=4, attention="reference"),
                          training=False)
    try:
        assert (seq.placement.graph_chunks, seq.placement.kept_chunks) == (0, 0)
        assert not [k for k in seq.placement.plan.gpu_lines if "KV-gradient" in k]
        with pytest.raises(RuntimeError, match="placed for a forward alone"):
            seq.fill(with_grads=True)
    finally:
        seq.release()
