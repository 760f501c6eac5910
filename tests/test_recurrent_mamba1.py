"""Mamba-1 mixers (Jamba's: lightning_oomb.recurrent.mamba1) and Falcon-H1's Mamba-2 mixers with its multipliers
run chunk by chunk against transformers' own model over the whole sequence, float32 on the CPU, where transformers
runs its torch scans (no mamba-ssm kernel on the CPU, use_mambapy off): the loss and every gradient, generation,
and what stays refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.jamba.modeling_jamba")

from test_recurrent import assert_trains_as_full_sequence, chunks_of  # noqa: E402

from lightning_oomb.recurrent import border_state_bytes  # noqa: E402
from lightning_oomb.recurrent.mamba1 import initial_state, mamba1_chunk  # noqa: E402


def jamba_config():
    """Mamba, attention, Mamba with 4 experts (top 2): hidden 32, the mixer 64 wide, SSM state 8, convolution
    window 4, dt rank 4."""
    from transformers import JambaConfig

    return JambaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=101, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, attn_layer_period=3,
        attn_layer_offset=1, expert_layer_period=3, expert_layer_offset=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False, use_mambapy=False,
    )


def tiny_jamba(seed: int = 0):
    """A tiny Jamba (``jamba_config``), float32, weights widened so the scan's gates and the attention matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(jamba_config()).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("chunk", [5, 2])
def test_mamba1_chunks_give_the_whole_sequence_output_in_bfloat16(chunk):
    """A bfloat16 Jamba mixer chained over chunks of 5 and 2 tokens (2: shorter than the convolution's 3 inputs
    before a token) from its zero state: transformers' whole-sequence output bit for bit (the scan's casts are
    transformers': a float32 state, each token's output from it in bfloat16)."""
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    torch.manual_seed(0)
    layer = JambaMambaMixer(jamba_config(), 0).to(torch.bfloat16)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        x = torch.randn(2, 21, 32, dtype=torch.bfloat16)
        want = layer(x)
        state, outputs = initial_state(layer, 2), []
        for start, end in chunks_of(21, chunk):
            out, state = mamba1_chunk(layer, x[:, start:end], state)
            outputs.append(out)
    got = torch.cat(outputs, dim=1)
    assert got.dtype == torch.bfloat16 and state.recurrent.dtype == torch.float32
    assert torch.equal(got, want)


@pytest.mark.parametrize(("chunk", "tokens"), [(8, 40), (2, 21)])
def test_jamba_train_step_equals_full_sequence_training(chunk, tokens):
    """The Mamba state (the convolution's last inputs and the SSM state) carried across chunks of 8 (dividing 40
    tokens) and 2 (not dividing 21, shorter than the convolution's window of 3 inputs before a token), beside
    attention and experts, batch of two with masked labels: the loss and every gradient of transformers'
    full-sequence training within 1e-5."""
    torch.manual_seed(2)
    ids = torch.randint(3, 101, (2, tokens))
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, tokens - 6:] = -100
    assert_trains_as_full_sequence(tiny_jamba(), ids, labels, chunk_size=chunk, page_size=4)


def test_jamba_lora_on_the_mixers_and_attention_projections():
    """LoRA adapters (peft) on the mixers' in, x and out projections and on the attention projections: every
    adapter's gradient as in transformers' full-sequence training, within 1e-5."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_jamba(), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False,
        target_modules=["in_proj", "x_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"]))
    assert any("x_proj.lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    torch.manual_seed(4)
    ids = torch.randint(3, 101, (1, 33))
    assert_trains_as_full_sequence(model, ids, None, chunk_size=8, page_size=4)


def test_jamba_generate_equals_transformers_greedy_search():
    """lightning_oomb.generate over carried states (the prompt in chunks of 8, then one token at a time): the
    tokens of transformers' own greedy search with its cache, batch of two."""
    from lightning_oomb import generate

    model = tiny_jamba().eval()
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (2, 29))
    want = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=10, eos_token_id=-1, chunk_size=8, page_size=4), want)


def test_jamba_packed_documents_are_refused_in_one_line():
    """Document masking restarts attention at each document; the Mamba state would run on across the start:
    refused before any compute, in one line."""
    from lightning_oomb import train_step

    model = tiny_jamba().train()
    ids = torch.randint(3, 101, (1, 24))
    position_ids = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with pytest.raises(ValueError, match="across the starts of packed documents") as refused:
        train_step(model, ids, position_ids=position_ids, chunk_size=8, page_size=4)
    assert "\n" not in str(refused.value)


def test_jamba_border_state_bytes_are_the_convolution_tails_and_the_float32_ssm_states():
    """Per chunk and Mamba layer (2 of 3): the convolution's last 3 inputs of its 64 channels and the 64 x 8
    float32 SSM state, for each of 2 sequences."""
    assert border_state_bytes(tiny_jamba(), batch=2, chunks=5) == 5 * 2 * 2 * (64 * 3 * 4 + 64 * 8 * 4)


def test_plan_of_jamba_counts_its_mamba_layers(tmp_path, capsys):
    """lightning-oomb plan on a Jamba directory: K/V pages for its one attention layer (Jamba's layer_types names
    the Mamba layers linear_attention), and the Mamba layers' border states a bf16 step keeps (4K tokens in one
    chunk: what border_state_bytes counts on the bf16 model)."""
    from lightning_oomb.cli import main
    from lightning_oomb.core.model_shape import ModelShape

    jamba_config().save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--context", "4K", "--gpu-memory", "79GiB"]) in (0, None)
    out = capsys.readouterr().out
    out = " ".join(out.split())
    assert ("Note: 2 of 3 layers carry a state across chunk borders (jamba): K/V pages for the other 1 only" in out
            and "their border states are counted" in out and "border states of 2 state-carrying layers" in out)
    shape = ModelShape.from_path(tmp_path)
    assert shape.carried_state_bytes == border_state_bytes(tiny_jamba().to(torch.bfloat16), batch=1, chunks=1)


def tiny_falcon_h1(rms_norm: bool, seed: int = 0):
    """A tiny Falcon-H1: two layers each of attention and a Mamba-2 mixer side by side (4 heads of 16, SSM state 8,
    scan chunks of 16), its mixer's gated norm on or off, and every muP multiplier away from 1: on the embedding,
    the logits, the attention's input, keys and output, the MLP's gate and down projection, the mixer's input and
    output and each part of its projection (gate, x, B, C, dt)."""
    from transformers import AutoModelForCausalLM, FalconH1Config

    config = FalconH1Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=101, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=rms_norm, max_position_embeddings=128,
        tie_word_embeddings=False, lm_head_multiplier=0.75, embedding_multiplier=3.0, mlp_multipliers=[0.5, 1.5],
        key_multiplier=0.8, attention_in_multiplier=1.25, attention_out_multiplier=0.6,
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0], ssm_in_multiplier=0.9, ssm_out_multiplier=1.1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize(("chunk", "rms_norm"), [(8, False), (5, True)])
def test_falcon_h1_train_step_equals_full_sequence_training(chunk, rms_norm):
    """Falcon-H1's Mamba-2 state carried across chunks of 8 and 5 tokens (its scan's own chunks are 16) with every
    multiplier as transformers applies it, the mixer gated by silu alone or by its gated norm, batch of two with
    masked labels: the loss and every gradient of transformers' full-sequence training within 1e-5."""
    torch.manual_seed(2)
    ids = torch.randint(3, 101, (2, 40))
    labels = ids.clone()
    labels[1, :9] = -100
    assert_trains_as_full_sequence(tiny_falcon_h1(rms_norm), ids, labels, chunk_size=chunk, page_size=4)


def test_falcon_h1_generate_equals_transformers_greedy_search():
    from lightning_oomb import generate

    model = tiny_falcon_h1(rms_norm=False).eval()
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (2, 29))
    want = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=10, eos_token_id=-1, chunk_size=8, page_size=4), want)


def test_falcon_h1_plan_counts_a_mixer_beside_every_layers_attention():
    """Falcon-H1 names no layer kinds: each layer attends and runs a Mamba-2 mixer beside it. The plan keeps K/V
    pages for both layers, counts both mixers' border states (what a step keeps: border_state_bytes of the model)
    and what their token mixing saves, and its parameters are the model's own."""
    from lightning_oomb.core.model_shape import ModelShape
    from lightning_oomb.core.plan import plan
    from lightning_oomb.core.plan.activations import carried_mixing_bytes
    from lightning_oomb.recurrent import border_state_bytes

    model = tiny_falcon_h1(rms_norm=False).to(torch.bfloat16)
    shape = ModelShape.from_config(model.config)
    assert (shape.carried_layers, shape.kv_layers) == (2, 2)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    got = plan(shape, 40, chunk_size=8, page_size=4, gpu_memory=79 * 2**30)
    borders = next(v for k, v in got.gpu_lines.items() if k.startswith("border states of 2"))
    assert borders == border_state_bytes(model, batch=1, chunks=5)
    assert carried_mixing_bytes(shape, 8) > 0
    assert any("every layer runs a state-space mixer beside its attention (falcon_h1)" in n for n in got.notes)
