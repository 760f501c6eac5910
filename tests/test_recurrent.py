"""State-carrying layers run chunk by chunk (lightning_oomb.recurrent) against transformers' own layer over the
whole sequence, float32 on the CPU: the outputs, and every gradient when the chunks' backward runs in reverse
from the border states stage 1 stored, each chunk handing its initial state's gradient to the chunk before it."""

from __future__ import annotations

import pytest
import torch

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from lightning_oomb.recurrent import border_state_bytes  # noqa: E402
from lightning_oomb.recurrent.carried_state import CarriedState  # noqa: E402
from lightning_oomb.recurrent.gated_delta import gated_delta_chunk, initial_state  # noqa: E402

TOL = 1e-5  # relative, float32


def tiny_gated_delta(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, vocab_size=101,
        layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1],
    )
    torch.manual_seed(seed)
    layer = qwen3_next.Qwen3NextGatedDeltaNet(config, 0)
    with torch.no_grad():  # weights of a trained model's scale, and gates that keep part of the state
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.A_log.uniform_(-2, 1)
    return layer


def chunks_of(tokens: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, tokens)) for s in range(0, tokens, chunk)]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max()) <= TOL * max(float(want.abs().max()), 1e-30)


@pytest.mark.parametrize("chunk", [8, 5, 2])
def test_gated_delta_chunks_equal_the_whole_sequence_forward_and_every_gradient(chunk):
    """Chunks of 8 (dividing 24 tokens), 5 and 2 (not dividing, 2 shorter than the convolution's window of 3
    inputs before a token), batch of two: stage 1 runs the chunks forward without gradients and keeps the state
    at each border; stage 2 runs them in reverse, each from its stored state, backpropagating the output's
    gradient and the gradient of its final state that the next chunk handed back."""
    layer = tiny_gated_delta()
    torch.manual_seed(1)
    x = torch.randn(2, 24, 32)
    upstream = torch.randn(2, 24, 32)

    whole_x = x.clone().requires_grad_()
    whole = layer(whole_x)
    torch.autograd.backward(whole, upstream)
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    want_x = whole_x.grad
    layer.zero_grad()

    borders = chunks_of(24, chunk)
    stored: list[CarriedState] = []
    outputs = []
    with torch.no_grad():  # stage 1
        state = initial_state(layer, 2)
        for start, end in borders:
            stored.append(state)
            out, state = gated_delta_chunk(layer, x[:, start:end], state)
            outputs.append(out)
    assert close(torch.cat(outputs, dim=1), whole)

    got_x = torch.zeros_like(x)
    handed_back: tuple[torch.Tensor, torch.Tensor] | None = None
    for index in reversed(range(len(borders))):  # stage 2
        start, end = borders[index]
        piece = x[:, start:end].clone().requires_grad_()
        begin = stored[index].detach().requires_grad_()
        out, final = gated_delta_chunk(layer, piece, begin)
        tensors, grads = [out], [upstream[:, start:end]]
        if handed_back is not None:
            tensors += final.tensors()
            grads += handed_back
        torch.autograd.backward(tensors, grads)
        handed_back = (begin.conv.grad, begin.recurrent.grad)
        got_x[:, start:end] = piece.grad
    assert close(got_x, want_x)
    for name, p in layer.named_parameters():
        assert close(p.grad, want[name]), name


def test_border_states_bytes_are_the_convolution_tails_and_the_float32_matrices():
    """A step's border states: per chunk and linear-attention layer, the convolution's last 3 inputs of its
    2 * 2 * 8 + 4 * 8 channels (float32 here) and 4 heads' 8 x 8 float32 matrices, for each of 2 sequences."""
    model = tiny_qwen3_next()
    assert border_state_bytes(model, batch=2, chunks=5) == 5 * 2 * (2 * 64 * 3 * 4 + 2 * 4 * 8 * 8 * 4)


def tiny_qwen3_next(seed: int = 0, family: str = "qwen3_next"):
    """A tiny Qwen3-Next (or Qwen3.5's text model, ``family="qwen3_5_text"``): linear attention, full attention,
    linear, full (dense MLPs), float32."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

    sizes = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, vocab_size=101, max_position_embeddings=256,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    config = (Qwen3NextConfig(**sizes, mlp_only_layers=[0, 1, 2, 3]) if family == "qwen3_next"
              else Qwen3_5TextConfig(**sizes))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                p.uniform_(-2, 1)
    return model


def assert_trains_as_full_sequence(model, ids, labels, **options) -> None:
    """train_step's loss and every gradient against transformers' full-sequence training of ``model``: within
    TOL, or within twice what transformers' own gradient moves by at another internal chunk size of its delta
    rule where that is larger (tiny_models.delta_rule_spread: A_log and dt_bias, about 1.5e-5)."""
    from tiny_models import delta_rule_spread, full_sequence_grads, grads_of, rel_err

    from lightning_oomb import train_step

    want_loss, want = full_sequence_grads(model, ids, labels)
    spread = delta_rule_spread(model, ids, labels, want)
    model.train()
    loss = train_step(model, ids, labels, **options)
    assert rel_err(loss.detach(), want_loss) <= TOL
    got = grads_of(model)
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) <= max(TOL, 2 * spread[name]), (name, spread[name])


@pytest.mark.parametrize("chunk", [8, 5])
@pytest.mark.parametrize("checkpoint_layers", [False, True])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_gated_delta_models_train_step_equals_full_sequence_training(family, chunk, checkpoint_layers):
    """train_step on a tiny Qwen3-Next and Qwen3.5 (their linear-attention layers' states carried across the chunk
    borders): the loss and every gradient of transformers' own full-sequence training within 1e-5 (norm-wise relative),
    or within twice what transformers' own gradient moves by at another internal chunk size of its delta rule
    where that is larger (A_log and dt_bias, about 1.5e-5); chunks that divide the 40 tokens and chunks that do
    not, with and without layer checkpointing, batch of two with masked labels."""
    from lightning_oomb import ChunkConfig

    model = tiny_qwen3_next(family=family)
    torch.manual_seed(2)
    ids = torch.randint(3, 101, (2, 40))
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, 30:] = -100
    assert_trains_as_full_sequence(model, ids, labels, config=ChunkConfig(chunk_size=chunk, page_size=4,
                                                                          checkpoint_layers=checkpoint_layers))


def test_qwen3_next_lora_on_linear_attention_and_attention_projections():
    """LoRA adapters (peft) on the linear-attention layers' input and output projections and on the attention
    projections: every adapter's gradient as in transformers' full-sequence training (same bound as above)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_qwen3_next(), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False,
        target_modules=["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]))
    assert any("in_proj_qkvz.lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    torch.manual_seed(4)
    ids = torch.randint(3, 101, (1, 33))
    assert_trains_as_full_sequence(model, ids, None, chunk_size=8, page_size=4)


def test_qwen3_next_generate_equals_transformers_greedy_search():
    """lightning_oomb.generate over carried states (the prompt in chunks of 8, then one token at a time): the
    tokens of transformers' own greedy search with its cache, batch of two."""
    from lightning_oomb import generate

    model = tiny_qwen3_next().eval()
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (2, 37))
    want = model.generate(ids, do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    got = generate(model, ids, max_new_tokens=12, eos_token_id=-1, chunk_size=8, page_size=4)
    assert torch.equal(got, want)


def test_qwen3_next_packed_documents_are_refused_in_one_line():
    """Document masking restarts attention at each document; a linear-attention state would run on across the
    start: refused before any compute, in one line."""
    from lightning_oomb import train_step

    model = tiny_qwen3_next().train()
    ids = torch.randint(3, 101, (1, 24))
    position_ids = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with pytest.raises(ValueError, match="across the starts of packed documents") as refused:
        train_step(model, ids, position_ids=position_ids, chunk_size=8, page_size=4)
    assert "\n" not in str(refused.value)


def test_kept_border_states_hold_their_own_bytes_not_the_chunks_inputs():
    """Stage 1 keeps each layer's state at every chunk border until stage 2: those states hold what
    border_state_bytes counts and no more. A convolution's tail sliced from the chunk's input would keep the whole
    input alive (at Qwen3-Next's width 64 MiB per layer and chunk of 4096 tokens, every chunk of the step)."""
    from lightning_oomb.core.config import ChunkConfig
    from lightning_oomb.core.schedule import ChunkedSequence

    model = tiny_qwen3_next()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    seq = ChunkedSequence(model, ids, config=ChunkConfig(chunk_size=8, page_size=4, attention="reference"))
    try:
        seq.fill()
        kept = [t for state in seq.states.borders.values() for t in state.tensors()]
        current = [t for state in seq.states.current.values() for t in state.tensors()]
        assert sum(t.untyped_storage().nbytes() for t in kept) == border_state_bytes(model, batch=2, chunks=5)
        assert sum(t.untyped_storage().nbytes() for t in current) == border_state_bytes(model, batch=2, chunks=1)
    finally:
        seq.release()


def test_plan_of_a_hybrid_counts_pages_of_its_attention_layers_and_the_border_states():
    """The plan of a Qwen3-Next with 2 linear-attention and 2 attention layers: K/V pages for the 2 attention
    layers (half a same-sized model's with attention in all 4), and the border states a bf16 step keeps (5 chunks:
    what border_state_bytes counts on the bf16 model), with a note on what it plans approximately."""
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.core.plan import plan

    model = tiny_qwen3_next()
    shape = ModelShape.from_config(model.config)
    dense = ModelShape.from_config(type(model.config)(**{**model.config.to_dict(), "layer_types": ["full_attention"] * 4}))
    assert (shape.kv_layers, dense.kv_layers) == (2, 4)
    options = dict(chunk_size=8, page_size=4, gpu_memory=79 * 2**30)
    got, like_dense = plan(shape, 40, **options), plan(dense, 40, **options)
    pages = lambda p: next(v for k, v in p.gpu_lines.items() if k.startswith("K/V pages"))  # noqa: E731
    assert pages(got) * 2 == pages(like_dense)
    borders = next(v for k, v in got.gpu_lines.items() if k.startswith("border states of 2"))
    assert borders == border_state_bytes(model.to(torch.bfloat16), batch=1, chunks=5)
    assert any("2 of 4 layers carry a state across chunk borders (qwen3_next): K/V pages for the other 2" in n
               for n in got.notes)


def test_plan_counts_the_delta_rules_flops_per_chunk_pass():
    """The step's token-mixing FLOPs of the tiny Qwen3-Next: per value head and token the chunked delta rule's
    2*64*(3*d_k + 2*d_v) + 6*d_k*d_v (4 heads of 8, 2 layers), four passes a chunk, one fewer for a chunk whose
    stage-1 graph is kept and one more under layer checkpointing."""
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.core.plan.timing import step_time

    shape = ModelShape.from_config(tiny_qwen3_next().config)
    per_token = 2 * 4 * (2 * 64 * (3 * 8 + 2 * 8) + 6 * 8 * 8)
    assert shape.carried_mixing_flops == per_token
    options = dict(chunk_size=8, page_size=4)
    assert step_time(shape, 40, checkpoint_layers=False, graph_chunks=0, **options).mixing_flops == per_token * 40 * 4
    assert step_time(shape, 40, checkpoint_layers=False, graph_chunks=2, **options).mixing_flops == per_token * (
        24 * 4 + 16 * 3)
    assert step_time(shape, 40, checkpoint_layers=True, **options).mixing_flops == per_token * 40 * 5


def test_the_page_pool_holds_the_attention_layers_only():
    """A training step of the hybrid allocates pages for its 2 attention layers, not its 4 layers."""
    from lightning_oomb import ChunkConfig
    from lightning_oomb.core.schedule import ChunkedSequence

    model = tiny_qwen3_next().train()
    seq = ChunkedSequence(model, torch.randint(3, 101, (1, 16)), config=ChunkConfig(chunk_size=8, page_size=4))
    seq.fill()
    seq.backward()
    assert seq.pool.spec.n_layers == 2 and seq.kv_slots == {1: 0, 3: 1}


@pytest.mark.parametrize("pages", ["sparse, every page", "host"])
def test_qwen3_next_composes_with_sparse_attention_and_host_pages(pages):
    """The carried states beside the attention layers' options: sparse attention over a budget that holds every
    page (then equal to dense), and K/V pages in host memory streamed through: the same bound as above."""
    from lightning_oomb import ChunkConfig, SparseConfig

    options = ({"sparse": SparseConfig(budget_pages=64, sink_pages=1, local_pages=1)} if pages != "host"
               else {"offload": "host"})
    torch.manual_seed(2)
    ids = torch.randint(3, 101, (2, 40))
    assert_trains_as_full_sequence(tiny_qwen3_next(), ids, None, config=ChunkConfig(chunk_size=8, page_size=4,
                                                                                      **options))


def test_qwen3_next_through_a_lightning_trainer_moves_the_weights_as_plain_training():
    """A real Trainer with OOMBStrategy around the user's own LightningModule, three SGD steps: every weight's
    update as plain Lightning training's, within test_strategy's bound for three steps."""
    from test_strategy import STEPS_TOL, UserModule, compare

    compare(lambda: UserModule(tiny_qwen3_next()), STEPS_TOL)


def tiny_mamba2(family: str = "bamba", seed: int = 0):
    """A tiny Bamba or Granite 4 hybrid (``granitemoehybrid``): a Mamba-2 mixer, then full attention (dense MLPs),
    float32, scan chunks of 16 tokens."""
    from transformers import AutoModelForCausalLM, BambaConfig, GraniteMoeHybridConfig

    sizes = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=101, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=128,
    )
    config = (BambaConfig(**sizes, attn_layer_indices=[1]) if family == "bamba" else
              GraniteMoeHybridConfig(**sizes, layer_types=["mamba", "attention"], num_local_experts=0,
                                     shared_intermediate_size=48, position_embedding_type="rope"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("chunk", [8, 5])
@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid"])
def test_mamba2_train_step_equals_full_sequence_training(family, chunk):
    """The Mamba-2 state (the convolution's last inputs and the SSM state) of Bamba and Granite 4 carried across
    chunks of 8 and 5 tokens (their scan's own chunks are 16), batch of two with masked labels: the loss and every
    gradient of transformers' full-sequence training within 1e-5 (Nemotron-H: tests/test_every_family.py)."""
    torch.manual_seed(2)
    ids = torch.randint(3, 101, (2, 40))
    labels = ids.clone()
    labels[1, :9] = -100
    assert_trains_as_full_sequence(tiny_mamba2(family), ids, labels, chunk_size=chunk, page_size=4)


def test_bamba_generate_equals_transformers_greedy_search():
    from lightning_oomb import generate

    model = tiny_mamba2().eval()
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (2, 29))
    want = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=10, eos_token_id=-1, chunk_size=8, page_size=4), want)



def test_a_transformers_without_the_scan_is_refused_in_one_line(monkeypatch):
    """Where the layer's modeling module has no chunked scan (transformers releases before it), the model is
    refused before any compute, in one line naming the function, not failed inside the step."""
    from transformers.models.bamba import modeling_bamba

    from lightning_oomb import train_step

    model = tiny_mamba2()
    monkeypatch.delattr(modeling_bamba, "mamba2_chunk_scan")
    with pytest.raises(NotImplementedError, match="mamba2_chunk_scan, which transformers .* lacks") as refused:
        train_step(model.train(), torch.randint(3, 101, (1, 16)), chunk_size=8, page_size=4)
    assert "\n" not in str(refused.value)
