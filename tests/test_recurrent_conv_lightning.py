"""LFM2's gated short convolutions and MiniMax's lightning attention, carried across chunk borders
(lightning_oomb.recurrent.short_conv, .lightning_attention): train_step against transformers' full-sequence
training in float32 on the CPU, generate against its greedy search, and what is refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.lfm2.modeling_lfm2")
minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax")

from test_recurrent import assert_trains_as_full_sequence, chunks_of  # noqa: E402

from lightning_oomb.recurrent import border_state_bytes  # noqa: E402
from lightning_oomb.recurrent.lightning_attention import initial_state, lightning_attention_chunk  # noqa: E402

BLOCK = 16  # MiniMax's lightning-attention blocks, which chunks of 8 and 5 tokens do not align with


def tiny_lfm2(seed: int = 0, family: str = "lfm2"):
    """A tiny LFM2 (or LFM2-MoE: experts in its last layer): short convolution over 4 tokens, full attention,
    short convolution, biases in the convolutions, float32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=2) \
        if family == "lfm2_moe" else {}
    config = AutoConfig.for_model(
        family, vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4, conv_bias=True,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    return _perturbed(AutoModelForCausalLM.from_config(config).float(), seed)


def tiny_minimax(seed: int = 0):
    """A tiny MiniMax: lightning attention in blocks of 16 tokens, full attention, lightning attention (experts
    in every layer), residuals scaled otherwise than 1, float32."""
    from transformers import AutoModelForCausalLM, MiniMaxConfig

    config = MiniMaxConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=BLOCK,
        layer_types=["linear_attention", "full_attention", "linear_attention"], max_position_embeddings=128,
        linear_attn_alpha_factor=0.8, linear_attn_beta_factor=1.3, mlp_alpha_factor=1.1, mlp_beta_factor=0.9,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _perturbed(AutoModelForCausalLM.from_config(config).float(), seed)


def _perturbed(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():  # attention far from uniform, convolutions far from their initialisation
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


TINY = {"lfm2": tiny_lfm2, "minimax": tiny_minimax}


def batch_with_masked_labels(tokens: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    ids = torch.randint(3, 101, (2, tokens))
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, 30:] = -100
    return ids, labels


@pytest.mark.parametrize("family,chunk", [("lfm2", 8), ("lfm2", 5), ("lfm2", 2), ("lfm2_moe", 5)])
def test_lfm2_train_step_equals_full_sequence_training(family, chunk):
    """The short convolutions' last 3 inputs carried across chunks of 8 (dividing 40 tokens), 5 and 2 (shorter
    than the convolution's window of 4 tokens: a chunk's tail reaches into the chunk before the last), batch of
    two with masked labels: the loss and every gradient within 1e-5 of transformers' full-sequence training."""
    ids, labels = batch_with_masked_labels()
    assert_trains_as_full_sequence(tiny_lfm2(family=family), ids, labels, chunk_size=chunk, page_size=4)


@pytest.mark.parametrize("chunk", [8, 5, 24])
def test_minimax_train_step_equals_full_sequence_training(chunk):
    """MiniMax's lightning-attention state carried across chunks of 8, 5 and 24 tokens over 40 (its blocks are
    16: chunk borders inside its blocks, and a chunk of a whole block and a part), batch of two with masked
    labels: the loss and every gradient within 1e-5 of transformers' full-sequence training."""
    ids, labels = batch_with_masked_labels()
    assert_trains_as_full_sequence(tiny_minimax(), ids, labels, chunk_size=chunk, page_size=4)


def test_lightning_attention_chunks_keep_transformers_dtype_and_blocks():
    """A bfloat16 lightning-attention layer: its state stays bfloat16 (the values' dtype, as transformers keeps
    it); chunks of one block each are transformers' own forward bit for bit, and chunks of 5 tokens (borders inside
    the blocks) within bfloat16's rounding of it."""
    model = tiny_minimax().to(torch.bfloat16)
    layer = model.model.layers[0].self_attn
    torch.manual_seed(3)
    x = torch.randn(2, 40, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        want, _ = type(layer).forward(layer, x, position_embeddings=None, attention_mask=None)
        for chunk, tol in ((BLOCK, 0.0), (5, 3e-2)):
            state, outputs = initial_state(layer, 2), []
            for start, end in chunks_of(40, chunk):
                out, state = lightning_attention_chunk(layer, x[:, start:end], state)
                outputs.append(out)
            assert state.recurrent.dtype == torch.bfloat16 and state.conv is None
            got = torch.cat(outputs, dim=1)
            assert float((got - want).abs().max()) <= tol * float(want.abs().max()), chunk


@pytest.mark.parametrize("family", ["lfm2", "minimax"])
def test_lora_on_carried_and_attention_projections(family):
    """LoRA adapters (peft) on the carried layers' projections (LFM2's in_proj and out_proj; MiniMax's qkv_proj,
    output_gate and out_proj) and on the attention projections: every adapter's gradient within 1e-5 of
    transformers' full-sequence training, chunks of 8 over 33 tokens."""
    peft = pytest.importorskip("peft")
    targets = (["in_proj", "out_proj", "q_proj", "k_proj", "v_proj"] if family == "lfm2" else
               ["qkv_proj", "output_gate", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"])
    model = peft.get_peft_model(TINY[family](), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                target_modules=targets))
    carried = "conv.in_proj" if family == "lfm2" else "self_attn.qkv_proj"
    assert any(f"{carried}.lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    torch.manual_seed(4)
    assert_trains_as_full_sequence(model, torch.randint(3, 101, (1, 33)), None, chunk_size=8, page_size=4)


@pytest.mark.parametrize("family", ["lfm2", "minimax"])
def test_generate_equals_transformers_greedy_search(family):
    """lightning_oomb.generate over carried states (the prompt in chunks of 8, then one token at a time): the
    tokens of transformers' own greedy search with its cache, batch of two."""
    from lightning_oomb import generate

    model = TINY[family]().eval()
    torch.manual_seed(3)
    ids = torch.randint(3, 101, (2, 29))
    want = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=10, eos_token_id=-1, chunk_size=8, page_size=4), want)


@pytest.mark.parametrize("family", ["lfm2", "minimax"])
def test_packed_documents_are_refused_in_one_line(family):
    """Document masking restarts attention at each document; a convolution's window and a lightning-attention
    state would run on across the start: refused before any compute, in one line."""
    from lightning_oomb import train_step

    ids = torch.randint(3, 101, (1, 24))
    position_ids = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with pytest.raises(ValueError, match="across the starts of packed documents") as refused:
        train_step(TINY[family]().train(), ids, position_ids=position_ids, chunk_size=8, page_size=4)
    assert "\n" not in str(refused.value)


def test_a_layer_kind_left_uncarried_is_refused_in_one_line(monkeypatch):
    """A MiniMax whose lightning attention were not in CARRIED: its config's linear_attention layers are refused
    before any compute, in one line, though its conv-free layers hold nothing support.py would see otherwise."""
    from lightning_oomb import recurrent, train_step

    monkeypatch.delitem(recurrent.CARRIED, "MiniMaxLightningAttention")
    with pytest.raises(NotImplementedError, match="layers of kind linear_attention") as refused:
        train_step(tiny_minimax().train(), torch.randint(3, 101, (1, 16)), chunk_size=8, page_size=4)
    assert "\n" not in str(refused.value)


def test_border_state_bytes_are_the_convolution_tails_and_the_lightning_states():
    """Per chunk, sequence and carried layer: LFM2's convolution tail of 3 inputs of 32 channels, float32, and
    nothing more (no recurrence); MiniMax's 4 heads' 8 x 8 state in the values' dtype (float32 here)."""
    assert border_state_bytes(tiny_lfm2(), batch=2, chunks=5) == 5 * 2 * 2 * (32 * 3 * 4)
    assert border_state_bytes(tiny_minimax(), batch=2, chunks=5) == 5 * 2 * 2 * (4 * 8 * 8 * 4)
